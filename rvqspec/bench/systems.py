"""Whole upstream qwen-tts systems with random weights at chosen sizes, for the benchmarks: upstream's own
`Qwen3TTSModel` (talker, code predictor, 12 Hz speech tokenizer, a character-level text tokenizer), the code predictor's
heads controlled to the paper's acceptance (rvqspec.bench.controlled), and the request every benchmark times.

`SIZES["0.6b"]` is Qwen3-TTS-12Hz-0.6B: a 28-layer talker (hidden 1024, 16 / 8 heads of 128, MLP 3072), the 5-layer
code predictor (QWEN3_TTS_0_6B) and the released 12 Hz decoder (RELEASED_DECODER). `SIZES["1.7b"]` is
Qwen3-TTS-12Hz-1.7B (the talker_config of Qwen/Qwen3-TTS-12Hz-1.7B-{Base,CustomVoice,VoiceDesign}'s config.json): a
28-layer talker of hidden 2048 (16 / 8 heads of 128, MLP 6144) and the same code predictor (1024 wide, 5 layers, MLP
3072, QWEN3_TTS_1_7B) behind upstream's `small_to_mtp_projection` (a Linear 2048 -> 1024 with a bias, on every input
of every predictor call), its code tables 2048 wide (upstream makes them at the talker's width); the same decoder.
`SIZES["smoke"]` keeps the vocabularies and the structure and shrinks every width and depth: a benchmark's `--smoke`
run builds it in a second; `SIZES["smoke-1.7b"]` is the same with a talker wider than the predictor (the projection).
Timing does not depend on weight values (docs/design.md, section 5). qwen-tts is imported when a builder runs.
"""

from dataclasses import dataclass, field, replace

import torch

from rvqspec.bench.controlled import PAPER_ACCEPTANCE, calibrate_strength, controlled_predictor
from rvqspec.bench.upstream import CODEBOOK, tiny_text_processor, tiny_tts_config_dict, upstream_config_dict
from rvqspec.core.checkpoint import TALKER_C0_TABLE, official_state_dict
from rvqspec.core.config import QWEN3_TTS_0_6B, QWEN3_TTS_1_7B, PredictorConfig
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import default_tree
from rvqspec.integrations.qwen_tts import import_qwen_tts

# The released Qwen3-TTS-Tokenizer-12Hz's decoder: the "decoder_config" of its config.json (Hugging Face hub,
# Qwen/Qwen3-TTS-Tokenizer-12Hz; the same file is the `speech_tokenizer/config.json` of every Qwen3-TTS-12Hz
# checkpoint). qwen-tts's `Qwen3TTSTokenizerV2DecoderConfig` defaults differ in the transformer: hidden_size 1024 and
# intermediate_size 3072 where the release has 512 and 1024 (with 16 heads of head_dim 64): building from the
# defaults overstates the decoder's cost. The convolution stack (latent_dim 1024, decoder_dim 1536, upsample_rates,
# upsampling_ratios) equals the defaults.
RELEASED_DECODER = dict(codebook_size=2048, codebook_dim=512, hidden_size=512, intermediate_size=1024, latent_dim=1024,
                        num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, head_dim=64,
                        sliding_window=72, max_position_embeddings=8000, rope_theta=10000, rms_norm_eps=1e-5,
                        layer_scale_initial_scale=0.01, num_quantizers=16, decoder_dim=1536,
                        upsample_rates=(8, 5, 4, 3), upsampling_ratios=(2, 2))
VOCAB = 2048  # codes per codebook, at every size: the specials and EOS sit above it
TINY_ENCODER = dict(hidden_size=32, num_filters=4, num_residual_layers=1, codebook_size=VOCAB, codebook_dim=16,
                    num_quantizers=16, num_semantic_quantizers=1, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=16, intermediate_size=64, frame_rate=12.5, upsample_groups=32,
                    vector_quantization_hidden_dimension=16)  # never run: only the decoder decodes


@dataclass(frozen=True)
class SystemSizes:
    """A Qwen3-TTS system's shapes: the talker's, the code predictor's (a PredictorConfig) and the 12 Hz decoder's."""
    talker_hidden: int
    talker_intermediate: int
    talker_layers: int
    talker_heads: int
    talker_kv_heads: int
    talker_head_dim: int
    text_hidden: int
    predictor: PredictorConfig
    decoder: dict = field(default_factory=lambda: dict(RELEASED_DECODER))

    @property
    def mrope_section(self) -> list[int]:
        half = self.talker_head_dim // 2  # M-RoPE: the sections sum to head_dim / 2 (0.6B: 24, 20, 20)
        return [half - 2 * (5 * half // 16), 5 * half // 16, 5 * half // 16]


def smoke_config(config: PredictorConfig) -> PredictorConfig:
    """`config` at tiny widths and one layer, its vocabularies, codebooks and layout kept: a `--smoke` run's."""
    return replace(config, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, talker_hidden_size=64)


SMOKE_PREDICTOR = smoke_config(QWEN3_TTS_0_6B)
SMOKE = SystemSizes(talker_hidden=64, talker_intermediate=128, talker_layers=2, talker_heads=4, talker_kv_heads=2,
                    talker_head_dim=16, text_hidden=32, predictor=SMOKE_PREDICTOR,
                    decoder=dict(codebook_size=VOCAB, codebook_dim=16, hidden_size=32, latent_dim=32,
                                 num_attention_heads=2, num_key_value_heads=2, head_dim=16, intermediate_size=64,
                                 num_hidden_layers=1, decoder_dim=32))
SIZES = {
    "0.6b": SystemSizes(talker_hidden=1024, talker_intermediate=3072, talker_layers=28, talker_heads=16,
                        talker_kv_heads=8, talker_head_dim=128, text_hidden=2048, predictor=QWEN3_TTS_0_6B),
    "1.7b": SystemSizes(talker_hidden=2048, talker_intermediate=6144, talker_layers=28, talker_heads=16,
                        talker_kv_heads=8, talker_head_dim=128, text_hidden=2048, predictor=QWEN3_TTS_1_7B),
    "smoke": SMOKE,
    "smoke-1.7b": replace(SMOKE, talker_hidden=96, predictor=replace(SMOKE_PREDICTOR, talker_hidden_size=96)),
}
SMOKE_SIZES = {"0.6b": "smoke", "1.7b": "smoke-1.7b"}  # a real size -> the tiny one of its structure


def speech_tokenizer(sizes: SystemSizes, dtype: torch.dtype):
    """Upstream's 12 Hz speech tokenizer with `sizes`' decoder (random weights; a tiny encoder)."""
    qwen_tts = import_qwen_tts()
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model

    codec = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(encoder_config=TINY_ENCODER,
                                                               decoder_config=sizes.decoder))
    tokenizer = qwen_tts.Qwen3TTSTokenizer()
    tokenizer.model, tokenizer.config, tokenizer.device = codec.to(dtype).eval(), codec.config, torch.device("cpu")
    return tokenizer


def system_config(sizes: SystemSizes) -> dict:
    """The Qwen3TTSConfig dict: the tiny system's (its text side and specials) at `sizes`."""
    config, p = tiny_tts_config_dict(), sizes.predictor
    predictor = upstream_config_dict(
        talker_hidden=sizes.talker_hidden, predictor_hidden=p.hidden_size, vocab=VOCAB, groups=p.num_code_groups,
        predictor_layers=p.num_hidden_layers, predictor_heads=p.num_attention_heads,
        predictor_kv_heads=p.num_key_value_heads, predictor_head_dim=p.head_dim,
        predictor_intermediate=p.intermediate_size, talker_vocab=VOCAB + 1024)["talker_config"]["code_predictor_config"]
    specials = {k: v + VOCAB - CODEBOOK for k, v in config["talker_config"].items()
                if k.startswith("codec_") and k.endswith("_id") and isinstance(v, int)}
    config["talker_config"].update(
        code_predictor_config=predictor, vocab_size=VOCAB + 1024, hidden_size=sizes.talker_hidden,
        intermediate_size=sizes.talker_intermediate, num_hidden_layers=sizes.talker_layers,
        num_attention_heads=sizes.talker_heads, num_key_value_heads=sizes.talker_kv_heads,
        head_dim=sizes.talker_head_dim, text_hidden_size=sizes.text_hidden,
        rope_scaling={"rope_type": "default", "mrope_section": sizes.mrope_section, "interleaved": False},
        codec_language_id={"english": specials["codec_pad_id"] + 7}, spk_id={"tiny": specials["codec_pad_id"] + 8},
        **specials)
    return config


def system_tts(sizes: SystemSizes, dtype: torch.dtype, seed: int = 0):
    """Upstream's Qwen3TTSModel at `sizes` (random weights) whose talker never draws EOS: every request decodes its
    max_new_tokens frames."""
    qwen_tts = import_qwen_tts()
    torch.manual_seed(seed)
    models, default = qwen_tts.core.models, torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made at its dtype: a float32 model first doubles the peak (1.7B: 6.4 GB more)
    try:
        model = models.Qwen3TTSForConditionalGeneration(models.Qwen3TTSConfig(**system_config(sizes)))
    finally:
        torch.set_default_dtype(default)
    model = model.to(dtype).eval().requires_grad_(False)
    model.load_speech_tokenizer(speech_tokenizer(sizes, dtype))
    model.config.talker_config.codec_eos_token_id = model.config.talker_config.vocab_size  # out of range: never drawn
    return qwen_tts.Qwen3TTSModel(model, tiny_text_processor(), generate_defaults={})


def controlled_heads(tts, sizes: SystemSizes, dtype: torch.dtype, log, tree_size: int = 32,
                     iterations: int = 6) -> dict:
    """Load acceptance-controlled predictor weights (and their c0 table) into the talker, the heads' strength bisected
    (`iterations` steps) to the paper's tokens/step at N = `tree_size` on random frames; the calibration."""
    predictor, tree = controlled_predictor(sizes.predictor, dtype=dtype), default_tree(tree_size)
    calibrated = calibrate_strength(predictor, tree, PAPER_ACCEPTANCE[tree_size], Sampler(), predictor.frames(12),
                                    iterations=iterations, low=3.0, high=12.0)
    log(f"heads: strength {calibrated.strength:.2f} gives {calibrated.measured:.2f} tokens/step at N={tree_size} "
        f"on random frames (target {PAPER_ACCEPTANCE[tree_size]})")
    state = official_state_dict(predictor.model)
    talker_state = {key.removeprefix("talker."): value for key, value in state.items() if key != TALKER_C0_TABLE}
    missing = tts.model.talker.load_state_dict(talker_state, strict=False)
    assert not missing.unexpected_keys, missing.unexpected_keys
    tts.model.talker.model.codec_embedding.weight.copy_(state[TALKER_C0_TABLE])
    return {"strength": calibrated.strength, "tokens_per_step_random_frames": calibrated.measured}


def utterance_request(frames: int) -> dict:
    """`generate_custom_voice` / `stream_custom_voice` arguments that decode `frames` frames."""
    return dict(text="the quick brown fox jumps over the lazy dog, again and again", speaker="tiny",
                language="english", max_new_tokens=frames + 1,  # the last c0 drawn is never decoded
                eos_token_id=VOCAB + 1024 - 1)  # a special token upstream suppresses (the config's EOS is out of range)
