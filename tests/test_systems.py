"""rvqspec.bench.systems builds upstream's model at the released Qwen3-TTS-12Hz shapes: every weight has the shape that
the released config.json gives it, and the parameter count is the release's (the text embedding aside: the benchmark
systems have a character-level text side). Built on the meta device: shapes only, no memory, no time."""

import pytest
import torch

from rvqspec.bench.systems import SIZES, system_config
from rvqspec.integrations.qwen_tts import import_qwen_tts

from helpers.upstream_models import upstream_available

if not upstream_available():
    pytest.skip("qwen-tts reference not installed: run `make install`", allow_module_level=True)

# The shape fields of talker_config in the released config.json of Qwen/Qwen3-TTS-12Hz-0.6B-* and -1.7B-* (the
# code predictor is the same in both: 1024 wide behind the 1.7B's 2048-wide talker, upstream adds the projection).
PREDICTOR = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=2048, num_code_groups=16)
RELEASED = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=3072, text_vocab_size=151936, text_hidden_size=2048,
                 num_code_groups=16),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=3072, text_vocab_size=151936, text_hidden_size=2048,
                 num_code_groups=16),
}
# Talker parameters (the code predictor's included) beside the text embedding (151936 x 2048 = 311.2 M in the
# release): 1.7B 1605.5 M + 311.2 M = 1.92 B, the ~3.8 GB of its bfloat16 model.safetensors; 0.6B 594.6 M +
# 311.2 M = 0.91 B, its 1.8 GB.
PARAMETERS = {"0.6b": 594_623_744, "1.7b": 1_605_511_424}
TEXT_EMBEDDING = "model.text_embedding."  # rows: the text vocabulary (ours: a character-level one)


def talker_shapes(config: dict) -> dict[str, torch.Size]:
    models = import_qwen_tts().core.models
    with torch.device("meta"):
        model = models.Qwen3TTSForConditionalGeneration(models.Qwen3TTSConfig(**config))
    return {name: p.shape for name, p in model.talker.named_parameters() if not name.startswith(TEXT_EMBEDDING)}


@pytest.mark.parametrize("size", sorted(RELEASED))
def test_a_built_system_has_the_released_shapes_and_parameter_count(size):
    ours = talker_shapes(system_config(SIZES[size]))
    released = talker_shapes({"talker_config": dict(RELEASED[size], code_predictor_config=PREDICTOR, spk_id={},
                                                    codec_language_id={})})
    assert ours == released
    assert sum(shape.numel() for shape in ours.values()) == PARAMETERS[size]
    projection = "code_predictor.small_to_mtp_projection.weight"
    assert ours.get(projection) == (None if size == "0.6b" else torch.Size([1024, 2048]))  # 0.6B: an Identity
