"""Tiny random MultiCodeDecoders for tests: a few ms per frame on one CPU core.

`tiny_model` re-draws every weight with a large std (norm gains stay at 1) so that logits are
peaked and strongly depend on the prefix: with upstream's std 0.02 a random model is close to
uniform, which makes drafts, ties and acceptance uninformative.
"""

import torch

from rvqspec.core.config import PredictorConfig
from rvqspec.core.drafters import Drafter, MedusaHeads, Offsets
from rvqspec.core.model import MultiCodeDecoder


def tiny_config(groups: int = 16, vocab: int = 16, hidden: int = 32, layers: int = 2,
                talker_hidden: int | None = None) -> PredictorConfig:
    """4 heads / 2 kv heads of dim 8; talker_hidden != hidden adds the input projection (1.7B layout)."""
    return PredictorConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=vocab,
                           num_code_groups=groups, talker_hidden_size=talker_hidden or hidden,
                           talker_vocab_size=vocab + 3)


def tiny_csm_config(groups: int = 32, vocab: int = 16, hidden: int = 32, layers: int = 2,
                    talker_hidden: int = 48) -> PredictorConfig:
    """CSM's depth-decoder layout: Llama layers (no q/k norms), llama3 RoPE, one table of groups x vocab rows,
    an input projection without bias."""
    return PredictorConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=vocab,
                           num_code_groups=groups, talker_hidden_size=talker_hidden, talker_vocab_size=vocab,
                           qk_norm=False, always_project=True, projection_bias=False, layout="csm",
                           rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float64, std: float = 0.3, csm: bool = False,
               **config) -> MultiCodeDecoder:
    """A random tiny model (`config`: keyword arguments of `tiny_config`, or of `tiny_csm_config` with csm=True),
    eval mode, weights ~ N(0, std)."""
    generator = torch.Generator().manual_seed(seed)
    model = MultiCodeDecoder((tiny_csm_config if csm else tiny_config)(**config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    return model.to(dtype)


def random_frames(model: MultiCodeDecoder, count: int, seed: int = 0) -> list[tuple[torch.Tensor, int]]:
    """`count` (talker_hidden, c0) inputs in the model's dtype."""
    c = model.config
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(count, c.talker_hidden_size, generator=generator).to(model.dtype)
    codes = torch.randint(c.talker_vocab_size, (count,), generator=generator)
    return [(hidden[i], int(codes[i])) for i in range(count)]


def randomize(drafter: Drafter, seed: int, std: float = 0.5) -> Drafter:
    """Non-zero random drafter parameters, so that drafts differ from ReusedHeads'."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * std)
    return drafter


def random_offsets(model: MultiCodeDecoder, depth: int = 3, seed: int = 0, std: float = 0.5) -> Offsets:
    return randomize(Offsets.for_model(model, depth), seed, std)


def random_medusa(model: MultiCodeDecoder, depth: int = 3, seed: int = 0) -> MedusaHeads:
    return randomize(MedusaHeads.for_model(model, depth), seed, std=0.3)
