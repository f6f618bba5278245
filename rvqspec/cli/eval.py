"""`rvqspec eval`: the paper's Tables 2-3 and a distribution check on the shipped stand-in."""

import argparse
import json
from pathlib import Path

import torch

from rvqspec.cli import flags
from rvqspec.core.checkpoint import relative_path, save_json, save_text
from rvqspec.core.drafters import KINDS
from rvqspec.core.errors import RvqspecError
from rvqspec.standin.evaluate import (DEFAULT_NODES, DRAFTERS, MANIFEST, MEDUSA_DIR, MEDUSA_STEPS, evaluate,
                                      load_drafters, load_tree, medusa_training, report_markdown, table2_markdown,
                                      table3_markdown)
from rvqspec.standin.quality import WhisperASR, codec_vocoder
from rvqspec.standin.settings import MODEL_DIR, TREES_DIR, Settings
from rvqspec.standin.synthesis import test_sentences


def drafter_list(text: str) -> list[str]:
    """--drafters: comma-separated drafter specs (`rvqspec.cli.flags`), checked at parse time."""
    check = flags.drafter_spec(KINDS + ("file",))
    specs = [check(spec.strip()) for spec in text.split(",") if spec.strip()]
    if not specs:
        raise argparse.ArgumentTypeError("--drafters needs at least one of reused, offsets, medusa or a drafter file")
    return specs


def run(args) -> int:
    from rvqspec.standin.talker import load_standin

    torch.set_num_threads(args.threads)
    quick = args.quick
    langs = [x for x in args.langs.split(",") if x]
    per_lang = 3 if quick else args.sentences or None
    wer_per_lang = 1 if quick else args.wer_sentences or None
    seeds = list(range(1 if quick else args.seeds))
    if not seeds:
        raise RvqspecError("--seeds must be >= 1")
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise RvqspecError(f"no stand-in model in {model_dir}: build it with `rvqspec standin build` or pass --model")
    sentences = test_sentences(Path(args.manifest), langs, per_lang)
    tree = load_tree(args.tree, Path(args.trees) if args.trees else TREES_DIR)
    tts = load_standin(model_dir)
    corpus = None if quick else Path(args.corpus) if args.corpus else Settings().code_corpus("train")
    drafters, missing, files = load_drafters(args.drafters, tts.predictor, model_dir, corpus)
    asr = None if args.no_asr else WhisperASR()
    vocoder = codec_vocoder(Path(args.codec) if args.codec else None) if asr else None
    report = evaluate(tts, sentences, drafters, tree, seeds, vocoder, asr, missing,
                      wer_per_lang)
    report["model"] = str(relative_path(model_dir))
    if "medusa" in drafters:
        report["medusa"] = {"file": files["medusa"], "training": medusa_training(Path(files["medusa"]))}
    report["command"] = "rvqspec eval --quick" if quick else "rvqspec eval"
    report["settings"] = {k: v for k, v in vars(args).items() if k not in ("run", "command", "json")}
    name = "eval-quick" if quick else "eval"
    out = Path(args.out)
    save_json(out / f"{name}.json", report)
    save_text(out / f"{name}.md", report_markdown(report))
    if args.json:
        print(json.dumps({"table2": report["table2"], "table3": report["table3"]}))
    else:
        print(table2_markdown(report), table3_markdown(report), sep="\n\n")
        print(f"\nwrote {out}/{name}.json and {name}.md")
    return 0


def add_cli(subparsers) -> None:

    p = subparsers.add_parser("eval", help="the paper's Tables 2-3 and a distribution check on the stand-in "
                                           "(free-running synthesis of the test sentences)",
                              parents=[flags.model_flag(required=False, default=str(MODEL_DIR), help="stand-in model folder")])
    p.add_argument("--drafters", type=drafter_list, default=list(DRAFTERS),
                   help="comma-separated Table 2 rows, each reused, offsets (the shipped file), medusa (trained, "
                        f"{MEDUSA_STEPS} batches of 32 frames, into {MEDUSA_DIR} when missing or stale) or a trained "
                        "drafter FILE standing for its kind")
    p.add_argument("--corpus", help="code corpus to train Medusa heads on (default: the stand-in's train split)")
    p.add_argument("--tree", default=str(DEFAULT_NODES), help="tree size N of a shipped tree, or a tree file")
    p.add_argument("--trees", help="folder of the calibrated trees (default: the shipped ones)")
    p.add_argument("--codec", help="codec file that decodes the model's codes (default: the shipped one)")
    p.add_argument("--seeds", type=flags.positive_int, default=3)
    p.add_argument("--sentences", type=flags.non_negative_int, default=8, help="test sentences per language (0: all)")
    p.add_argument("--wer-sentences", type=flags.non_negative_int, default=3,
                   help="of those, how many per language are vocoded and transcribed for WER (0: all)")
    p.add_argument("--langs", default="en,de,es,ru")
    p.add_argument("--manifest", default=str(MANIFEST), help="the stand-in corpus manifest (test split)")
    p.add_argument("--out", type=flags.out_folder, default="benchmarks/results")
    p.add_argument("--quick", action="store_true",
                   help="3 sentences per language (WER on 1), one seed, no Medusa training: about 3 minutes")
    p.add_argument("--no-asr", action="store_true", help="skip vocoding and Whisper (no WER)")
    p.add_argument("--threads", type=flags.threads, default=1, help="torch threads")
    p.add_argument("--json", action="store_true", help="print Tables 2 and 3 as one JSON object")
    p.set_defaults(run=run)
