"""`rvqspec standin build|quality|diagnose` and `rvqspec corpus speech`: the stand-in model's commands."""

import json
from pathlib import Path

from rvqspec.cli import flags
from rvqspec.core.checkpoint import save_json
from rvqspec.standin.build import STAGES, build, stage_corpus, stage_quality
from rvqspec.standin.settings import Settings

# What each stage imports from the `standin` extra (the others need only the base install).
STAGE_MODULES = {"corpus": ("tqdm", "soundfile", "piper"), "codec": ("faiss", "tqdm", "soundfile"),
                 "encode": ("soundfile",), "quality": ("faster_whisper", "jiwer", "soundfile", "tqdm")}


def run_build(args) -> int:
    stages = list(STAGES)  # names and their order are checked by `build`; here only what the chosen ones import
    chosen = stages[stages.index(args.from_stage):stages.index(args.to_stage) + 1] \
        if {args.from_stage, args.to_stage} <= set(stages) else []
    flags.require_extra("rvqspec standin build", "standin",
                        *sorted({m for stage in chosen for m in STAGE_MODULES.get(stage, ())}))
    s = Settings(work=Path(args.work), hours=args.hours, joint_steps=args.joint_steps,
                 joint_minutes=args.joint_minutes, predictor_steps=args.predictor_steps,
                 predictor_minutes=args.predictor_minutes, offsets_epochs=args.offsets_epochs, seed=args.seed)
    build(s, args.from_stage, args.to_stage, tuple(args.force))
    return 0


def run_corpus(args) -> int:
    flags.require_extra("rvqspec corpus speech", "standin", *STAGE_MODULES["corpus"])
    stage_corpus(Settings(work=Path(args.work), hours=args.hours))
    return 0


def run_quality(args) -> int:
    flags.require_extra("rvqspec standin quality", "standin", *STAGE_MODULES["quality"])
    s = Settings(work=Path(args.work), quality_limit=args.limit or None)
    print(json.dumps(stage_quality(s), indent=1))
    return 0


def run_diagnose(args) -> int:
    from rvqspec.standin.diagnose import diagnose

    flags.require_extra("rvqspec standin diagnose", "standin", *STAGE_MODULES["quality"])
    figures = diagnose(Settings(work=Path(args.work)), args.lang, args.limit or None)
    if args.out:
        save_json(Path(args.out), figures)
    return 0


def add_corpus_cli(corpus) -> None:
    """`rvqspec corpus speech`: the stand-in's offline speech corpus (its build's first stage, alone)."""
    c = corpus.add_parser("speech", help="the stand-in's offline speech corpus (fortunes read by piper and espeak-ng)")
    c.add_argument("--work", default="data/standin", help="build folder (the corpus goes to WORK/corpus)")
    c.add_argument("--hours", type=float, default=3.4, help="corpus size, shared equally by the languages")
    c.set_defaults(run=run_corpus)


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("standin", help="build the stand-in Qwen3-TTS (corpus, codec, model, offsets, trees)")
    sub = p.add_subparsers(dest="standin_command", required=True)
    b = sub.add_parser("build", help="run the whole pipeline from nothing (resumes: finished stages are skipped)")
    b.add_argument("--work", default="data/standin", help="folder for the corpus and intermediate files")
    b.add_argument("--hours", type=float, default=3.4, help="corpus size, shared equally by the languages")
    b.add_argument("--from", dest="from_stage", default="corpus", help=f"first stage ({', '.join(STAGES)})")
    b.add_argument("--to", dest="to_stage", default="quality", help="last stage")
    b.add_argument("--force", action="append", default=[], metavar="STAGE", help="redo this stage even if done")
    b.add_argument("--joint-steps", type=int, default=Settings.joint_steps)
    b.add_argument("--joint-minutes", type=float, default=Settings.joint_minutes, help="wall-time cap")
    b.add_argument("--predictor-steps", type=int, default=Settings.predictor_steps)
    b.add_argument("--predictor-minutes", type=float, default=Settings.predictor_minutes, help="wall-time cap")
    b.add_argument("--offsets-epochs", type=int, default=Settings.offsets_epochs)
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(run=run_build)
    q = sub.add_parser("quality", help="held-out confidence per codebook and Whisper WER/CER of the shipped model")
    q.add_argument("--work", default="data/standin")
    q.add_argument("--limit", type=int, default=Settings.quality_limit, help="test sentences per language for WER (0: all)")
    q.set_defaults(run=run_quality)
    d = sub.add_parser("diagnose", help="where intelligibility is lost: WER of recorded codes, truncated, or "
                                        "completed by the predictor, beside free synthesis")
    d.add_argument("--work", default="data/standin", help="build folder holding the encoded corpus")
    d.add_argument("--lang", default="en")
    d.add_argument("--limit", type=int, default=10, help="test sentences (0: all)")
    d.add_argument("--out", help="also write the figures to this JSON file")
    d.set_defaults(run=run_diagnose)
