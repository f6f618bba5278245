"""`rvqspec demo`: decode frames with plain AR and with speculative decoding, side by side.

Until the stand-in TTS model ships, the demo runs on a small random-weight code predictor and says so.
"""

import json
import time

import torch

from rvqspec.config import PredictorConfig
from rvqspec.decode import decode_frame
from rvqspec.drafters import ReusedHeads
from rvqspec.model import MultiCodeDecoder
from rvqspec.sampling import Sampler
from rvqspec.tree import default_tree

RANDOM_DEMO_CONFIG = PredictorConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=5,
                                     num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=256,
                                     talker_hidden_size=256, talker_vocab_size=300)


def run_random_demo(frames: int, nodes: int, seed: int) -> dict:
    torch.manual_seed(seed)
    model = MultiCodeDecoder(RANDOM_DEMO_CONFIG).eval()
    sampler, tree, drafter = Sampler(), default_tree(nodes), ReusedHeads(model)
    inputs = [(torch.randn(RANDOM_DEMO_CONFIG.talker_hidden_size), i % 256) for i in range(frames)]
    timings = {"ar": 0.0, "spec": 0.0}
    calls = {"ar": 0, "spec": 0}
    for h, c0 in inputs:
        for mode in ("ar", "spec"):
            start = time.perf_counter()
            result = decode_frame(model, h, c0, sampler, drafter=drafter if mode == "spec" else None,
                                  tree=tree if mode == "spec" else None)
            timings[mode] += time.perf_counter() - start
            calls[mode] += result.calls
    codes = frames * RANDOM_DEMO_CONFIG.num_residual_codes
    return {"model": "random-weight code predictor (no trained model shipped yet)", "frames": frames,
            "tree_nodes": tree.size, "tokens_per_step": codes / calls["spec"],
            "calls_per_frame": calls["spec"] / frames, "ar_calls_per_frame": calls["ar"] / frames,
            "speedup": timings["ar"] / timings["spec"]}


def run(args) -> int:
    report = run_random_demo(args.frames, args.nodes, args.seed)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"rvqspec demo on a {report['model']}: random weights draft poorly, so expect little gain.")
    print(f"  frames decoded:           {report['frames']} (AR and speculative, tree of {report['tree_nodes']} nodes)")
    print(f"  AR calls per frame:       {report['ar_calls_per_frame']:.2f}")
    print(f"  speculative calls/frame:  {report['calls_per_frame']:.2f}")
    print(f"  tokens per step:          {report['tokens_per_step']:.2f}")
    print(f"  wall-time ratio AR/spec:  {report['speedup']:.2f}x (same run)")
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("demo", help="decode with AR and speculative decoding and compare")
    p.add_argument("--frames", type=int, default=50)
    p.add_argument("--nodes", type=int, default=16, help="tree size N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)
