"""`rvqspec train-offsets`: train offsets (or Medusa heads) on a code corpus, under torchrun too."""

import os

from rvqspec.cli import flags
from rvqspec.core.drafters import DEFAULT_DEPTH
from rvqspec.tuning.train import OBJECTIVES, TrainSettings, train


def run(args) -> int:
    settings = TrainSettings(args.drafter, args.depth, args.batch_size, args.lr, args.seed, args.validation_fraction,
                             args.objective)
    metrics = train(args.model, args.corpus, args.out, settings, args.epochs, args.max_steps, args.resume, args.force,
                    args.dtype, args.device, progress=not args.quiet)
    if int(os.environ.get("RANK", "0")) == 0 and metrics["epochs"]:
        last = metrics["epochs"][-1]
        print(f"epoch {last['epoch']}, step {last['step']}: val loss {last['val_loss']:.4f}, top-1 per depth "
              f"{[round(a, 4) for a in last['val_accuracy']]} (reused heads "
              f"{[round(a, 4) for a in metrics['baseline']['accuracy']]}); best: {args.out}/{metrics['best']['file']}")
    return 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("train-offsets", help="train offsets (or Medusa heads) on a code corpus; "
                                                    "works under torchrun for several processes",
                              parents=[flags.model_flag(help="checkpoint folder of the code predictor (frozen)"),
                                       flags.drafter_flag(("offsets", "position-offsets", "medusa"), default="offsets",
                                                    help="the kind to train: offsets (shared by all positions), "
                                                         "position-offsets (one per position) or medusa")])
    p.add_argument("--corpus", required=True, help="code corpus folder (rvqspec.tuning.corpus format)")
    p.add_argument("--out", required=True, type=flags.out_folder, help="output folder for checkpoints and metrics")
    p.add_argument("--depth", type=flags.positive_int, default=DEFAULT_DEPTH, help="K, codes drafted ahead")
    p.add_argument("--epochs", type=flags.positive_int, default=1)
    p.add_argument("--batch-size", type=flags.positive_int, default=32, help="global batch, in frames")
    p.add_argument("--lr", type=flags.positive_float, default=1e-3)
    p.add_argument("--seed", type=flags.seed, default=0, help="data order (and Medusa init)")
    p.add_argument("--validation-fraction", type=flags.fraction, default=0.05, help="share of utterances held out")
    p.add_argument("--objective", choices=OBJECTIVES, default="codes",
                   help="codes: cross entropy of the corpus's codes (the paper's); acceptance: -log P(the verifier "
                        "draws the draft), from the model's own distribution")
    p.add_argument("--max-steps", type=flags.positive_int, default=None, help="stop after this many steps (resumable)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--force", action="store_true", help="start over even if --out holds a run")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="model and drafter dtype")
    p.add_argument("--device", type=flags.device, default=None, help="default: cuda if available, else cpu")
    p.add_argument("--quiet", action="store_true", help="no progress bar or epoch lines")
    p.set_defaults(run=run)
