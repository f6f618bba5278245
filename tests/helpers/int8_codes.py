"""What one w8a8 model computes in this process, for comparing CPU classes (tests/test_int8.py): run it natively and
under the AVX2 caps (`python tests/helpers/int8_codes.py OUT`), and the two files must hold the same tensors.

The predictor (tiny, float32 activations, with the 1.7B's input projection): its layer states and logits of one
forward, greedy codes AR and speculative, seeded sampled codes AR and speculative; and `rvqspec.Engine` on a tiny
Qwen3-TTS with int8 predictor and talker: greedy codes, and a seeded request sampled end to end.
"""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from rvqspec import Engine, Sampler, decode_frames, default_tree, quantize  # noqa: E402
from rvqspec.core.drafters import ReusedHeads  # noqa: E402

from helpers.tiny import random_frames, tiny_model  # noqa: E402
from helpers.upstream_tts import tiny_qwen3_tts  # noqa: E402

QWEN = dict(speaker="tiny", language="English")


@torch.inference_mode()
def predictor_codes() -> dict:
    model = tiny_model(seed=3, dtype=torch.float32, hidden=64, talker_hidden=48, layers=2)
    quantized = quantize(model, "w8a8")
    frames = random_frames(model, 6, seed=4)
    hidden, c0 = torch.stack([h for h, _ in frames]), torch.tensor([c for _, c in frames])
    codes, tables = torch.arange(6)[:, None].expand(-1, 3) % 16, torch.arange(3).expand(6, -1)
    x = torch.cat([quantized.embed_talker_hidden(hidden)[:, None], quantized.embed_codes(codes, tables)], 1)
    states = quantized(x, torch.arange(4))
    out = {"states": states, "logits": quantized.head_logits(states, 1)}
    drafter, tree = ReusedHeads(quantized), default_tree(8)
    for name, sampler in (("greedy", Sampler(do_sample=False)), ("sampled", Sampler())):
        for mode, options in (("ar", {}), ("speculative", dict(drafter=drafter, tree=tree))):
            generator = torch.Generator().manual_seed(7)
            out[f"{name} {mode}"] = decode_frames(quantized, hidden, c0, sampler, generator, **options).codes
    return out


def engine_codes() -> dict:
    arguments = dict(text="hello there", max_new_tokens=12, **QWEN)
    with Engine(tiny_qwen3_tts(seed=0), weights="w8a8", talker_weights="w8a8", drafter=ReusedHeads(),
                tree=default_tree(8)) as engine:
        greedy = engine.submit("custom_voice", do_sample=False, subtalker_dosample=False, **arguments).wait(120)
        sampled = engine.submit("custom_voice", seed=5, **arguments).wait(120)
    return {"engine greedy": greedy, "engine sampled": sampled}


def report() -> dict:
    return predictor_codes() | engine_codes()


if __name__ == "__main__":
    torch.save(report(), sys.argv[1])
