"""`rvqspec calibrate`: draft acceptance on a corpus, sparse trees per tree size N, predicted vs measured tokens/step."""

import json

import torch

from rvqspec.cli import flags
from rvqspec.core.drafters import DEFAULT_DEPTH
from rvqspec.core.errors import RvqspecError
from rvqspec.core.quantize import SCHEMES
from rvqspec.core.sampling import Sampler
from rvqspec.core.policy import SIZES, report_size
from rvqspec.core.tree import MAX_NODES
from rvqspec.tuning.calibrate import CalibrationSettings, calibrate


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(n) for n in text.split(",") if n.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise RvqspecError(f"--sizes must be a comma-separated list of tree sizes >= 1 (e.g. 4,8,16), got {text!r}")
    if sizes[-1] > MAX_NODES:
        raise RvqspecError(f"--sizes {sizes[-1]} is more nodes than a verify call can use: tree sizes are at most "
                           f"{MAX_NODES} (the paper's devices choose 16-32)")
    return sizes


def run(args) -> int:
    sampler = Sampler(not args.greedy, args.temperature, args.top_k, args.top_p)
    settings = CalibrationSettings(args.frames, args.eval_frames, args.seed, sampler, args.depth,
                                   args.validation_fraction)
    report = calibrate(args.model, args.drafter, args.corpus, parse_sizes(args.sizes), args.out, settings,
                       args.dtype, args.device or ("cuda" if torch.cuda.is_available() else "cpu"), args.weights)
    if args.json:
        print(json.dumps({"trees": report["trees"], "acceptance": report["acceptance"]}))
        return 0
    for t in report["trees"]:
        print(f"N={report_size(t):>3}: tokens/step predicted {t['predicted_tokens_per_step']:.3f}, measured "
              f"{t['measured_tokens_per_step']:.3f} ({t['measured_calls_per_frame']:.2f} calls/frame)")
    print(f"wrote {args.out}/report.md, report.json and tree-N*.json")
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="measure draft acceptance, grow sparse trees, report predicted "
                                                "vs measured tokens/step",
                              parents=[flags.model_flag(), flags.drafter_flag(required=True, default=None)])
    p.add_argument("--corpus", required=True, help="code corpus folder")
    p.add_argument("--sizes", "--budgets", dest="sizes", default=",".join(map(str, SIZES)),
                   help="tree sizes N, comma-separated (--budgets: its former name)")
    p.add_argument("--out", required=True, type=flags.out_folder, help="folder for tree-N*.json and report.{json,md}")
    p.add_argument("--frames", type=flags.positive_int, default=1000, help="frames for the acceptance statistics")
    p.add_argument("--eval-frames", type=flags.positive_int, default=200, help="held-out frames decoded per tree")
    p.add_argument("--seed", type=flags.seed, default=0)
    p.add_argument("--depth", type=flags.positive_int, default=DEFAULT_DEPTH, help="K for 'reused' (files carry their own)")
    p.add_argument("--temperature", type=flags.positive_float, default=0.9)
    p.add_argument("--top-k", type=flags.non_negative_int, default=50)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--greedy", action="store_true", help="do_sample=False")
    p.add_argument("--validation-fraction", type=flags.fraction, default=0.05)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", type=flags.device, default=None, help="default: cuda if available, else cpu")
    p.add_argument("--weights", choices=SCHEMES, help="calibrate the model with int8 weights (rvqspec.quantize, CPU)")
    p.add_argument("--json", action="store_true", help="print the per-tree figures as one JSON object")
    p.set_defaults(run=run)
