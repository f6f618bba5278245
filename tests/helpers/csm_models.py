"""Tiny random Sesame CSM models (transformers `CsmForConditionalGeneration`), built from a config alone.

Weights are re-drawn with a large std (norm gains stay at 1), as in `tiny.py`, so that the depth decoder's
distributions are peaked and depend on the prefix; the Mimi codec is built as small as it goes (run by the streaming tests only, `runnable_codec`).
"""

import torch

from rvqspec.core.checkpoint import CSM_DEPTH

LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 4}
TEXT_VOCAB = 100


def tiny_csm(codebooks: int = 8, vocab: int = 35, seed: int = 0, std: float = 0.3, dtype=torch.float64,
             rope_scaling: dict | None = LLAMA3, backbone: int = 32, hidden: int = 24, runnable_codec: bool = False):
    """A CsmForConditionalGeneration: backbone of width `backbone` (1 layer), depth decoder of width `hidden`
    (2 Llama layers, 4 / 2 heads of dim 6), `codebooks` codebooks of `vocab` codes (the last one the padding
    code, 0 the end-of-speech code, as in CSM). `runnable_codec`: a Mimi whose decode runs (other seeds' draws)."""
    from transformers import CsmConfig, CsmForConditionalGeneration

    config = CsmConfig(
        num_codebooks=codebooks, vocab_size=vocab, text_vocab_size=TEXT_VOCAB, hidden_size=backbone,
        intermediate_size=2 * backbone, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, pad_token_id=99, bos_token_id=98, audio_token_id=97, audio_eos_token_id=96,
        codebook_pad_token_id=vocab - 1, codebook_eos_token_id=0,
        depth_decoder_config=dict(num_codebooks=codebooks, vocab_size=vocab, backbone_hidden_size=backbone,
                                  hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=codebooks + 1,
                                  rope_scaling=rope_scaling),
        codec_config=dict(model_type="mimi", codebook_size=32, num_quantizers=codebooks, hidden_size=16,
                          num_filters=4, codebook_dim=16, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=2, intermediate_size=32, head_dim=8, upsample_groups=16,
                          **({"vector_quantization_hidden_dimension": 16} if runnable_codec else {})))
    torch.manual_seed(seed)
    model = CsmForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(CSM_DEPTH) and "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    return model.to(dtype).requires_grad_(False)


def prompts(count: int, length: int = 6, seed: int = 0) -> torch.Tensor:
    """`count` text prompts of `length` random text tokens, [count, length]."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, TEXT_VOCAB - 10, (count, length), generator=generator)
