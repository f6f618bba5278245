"""`rvqspec tune` on the shipped stand-in: does a drafter trained on the model's own speech beat the reused heads
and the shipped offsets (trained on recorded speech)? Tokens/step on held-out free-running synthesis.

1. `rvqspec tune --model standin` (self-synthesis of the built-in sentences, offsets, trees, latency) into
   --work, timed per stage; on the same corpus, per-position offsets (`--offsets per-position`) and both kinds
   trained with the acceptance objective (`--objective acceptance`);
2. held-out sentences: the first --per-lang sentences of each language in the stand-in corpus's test split
   (Debian fortunes, `rvqspec.standin.speech`; the corpus audio is not needed), never in the built-in list;
3. each drafter decodes them free-running (talker and predictor sampled, temperature 0.9, top-k 50) with the same
   tree (the shipped calibrated tree of 32 nodes), --seeds seeds; tokens/step = codes / predictor calls.

    nice -n 0 .venv/bin/python benchmarks/tune_standin.py   # writes benchmarks/results/tune/tune-standin.{json,md}
    .venv/bin/python benchmarks/tune_standin.py --smoke     # seconds: the held-out sentences picked, the report
                                                            # re-rendered from results/tune/ into a temporary folder
(`--smoke` does not tune: `rvqspec tune` and `train` take minutes; tests/test_tune.py runs them on a tiny stand-in.)
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from rvqspec.bench.timing import (RESULTS, SMOKE_HELP, finish_machine, machine, machine_text, report_folder,
                                  write_reports)
from rvqspec.core.drafters import Offsets, PositionOffsets, ReusedHeads
from rvqspec.core.errors import RvqspecError
from rvqspec.core.tree import Tree
from rvqspec.standin.evaluate import tokens_per_step
from rvqspec.standin.settings import ASSETS, OFFSETS_FILE
from rvqspec.standin.speech import load_sentences, split_of
from rvqspec.standin.synthesis import self_synthesis, synthesize_all
from rvqspec.standin.talker import load_standin
from rvqspec.tuning.train import TrainSettings, train
from rvqspec.tuning.tune import Subject, TuneSettings, tune

ROOT = Path(__file__).resolve().parents[1]


def held_out(langs: list[str], per_lang: int) -> list[dict]:
    picked = []
    for lang in langs:
        test = [text for text in load_sentences(lang) if split_of(lang, text) == "test"][:per_lang]
        picked += [{"id": f"{lang}-test-{i}", "lang": lang, "text": text} for i, text in enumerate(test)]
    return picked


def smoke(out: Path) -> None:
    """What a run needs before its minutes of tuning (the model, the held-out sentences) and its report, rendered
    from the committed results."""
    tts = load_standin(ASSETS / "model")
    try:
        print(f"held out: {len(held_out(list(tts.config.languages)[:1], 1))} sentence(s)")
    except RvqspecError as e:  # the corpus' sentences are Debian fortunes: a system package
        print(f"held out: not here ({e})")
    result = json.loads((RESULTS / "tune" / "tune-standin.json").read_text())
    for path in write_reports(result, report_folder(out, smoke=True), "tune-standin", to_markdown):
        print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--per-lang", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--force", help="redo this tune stage and the later ones (rvqspec tune --force)")
    parser.add_argument("--work", type=Path, default=ROOT / "data" / "standin" / "tune-self")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tune")
    args = parser.parse_args(argv)
    if args.smoke:
        return smoke(args.out)
    torch.set_num_threads(1)
    info = machine()
    tts = load_standin(ASSETS / "model")
    start = time.perf_counter()
    report = tune(Subject("standin", ASSETS / "model", tts.predictor, lambda: self_synthesis(tts)), args.work,
                  TuneSettings(minutes=args.minutes, epochs=args.epochs), force=args.force,
                  log=lambda line: print(line, flush=True))
    tune_seconds = time.perf_counter() - start
    trained = {}  # more drafters on the same corpus: per-position offsets, and the acceptance objective
    for kind, objective in (("position-offsets", "codes"), ("offsets", "acceptance"), ("position-offsets", "acceptance")):
        out = args.work / f"train-{objective}-{kind}"
        start = time.perf_counter()
        if not (out / f"{kind}.safetensors").exists():
            train(ASSETS / "model", args.work / "corpus", out,
                  TrainSettings(drafter=kind, validation_fraction=0.1, objective=objective), epochs=args.epochs,
                  progress=False)
        trained[(kind, objective)] = (out / f"{kind}.safetensors", time.perf_counter() - start)
    sentences = held_out(list(tts.config.languages), args.per_lang)
    tree = Tree.load(ASSETS / "trees" / "tree-N32.json")
    drafters = {"reused heads": ReusedHeads(),
                "offsets, recorded speech (shipped)": Offsets.load(OFFSETS_FILE, tts.predictor),
                "offsets, self-synthesis (tune)": Offsets.load(args.work / "train" / "offsets.safetensors",
                                                               tts.predictor),
                "per-position offsets, self-synthesis": PositionOffsets.load(
                    trained[("position-offsets", "codes")][0], tts.predictor),
                "offsets, self-synthesis, acceptance objective": Offsets.load(
                    trained[("offsets", "acceptance")][0], tts.predictor),
                "per-position offsets, self-synthesis, acceptance objective": PositionOffsets.load(
                    trained[("position-offsets", "acceptance")][0], tts.predictor)}
    rows = {}
    for name, drafter in drafters.items():
        per_seed = []
        for seed in range(args.seeds):
            runs = synthesize_all(tts, sentences, seed, name, drafter, tree)
            per_seed.append(tokens_per_step(runs))
            print(f"{name}, seed {seed}: {per_seed[-1]:.3f} tokens/step over {sum(r.frames for r in runs)} frames",
                  flush=True)
        rows[name] = {"per_seed": per_seed, "mean": statistics.mean(per_seed),
                      "std": statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0}
    result = {"tune": {"minutes": args.minutes, "epochs": args.epochs, "corpus": report["corpus"],
                       "timings_seconds": report["timings_seconds"], "wall_seconds": tune_seconds,
                       "trained": report["train"], "drafter_in_use": report["drafter"],
                       "other_train_seconds": {f"{k}/{o}": t for (k, o), (_, t) in trained.items()}},
              "held_out": {"sentences": len(sentences), "per_lang": args.per_lang, "seeds": args.seeds,
                           "tree_nodes": tree.size},
              "drafters": rows, "machine": finish_machine(info)}
    for path in write_reports(result, args.out, "tune-standin", to_markdown):
        print(f"wrote {path}")


def to_markdown(r: dict) -> str:
    t = r["tune"]
    lines = ["# rvqspec tune on the stand-in: drafters on held-out free-running synthesis", "",
             f"Generated by `benchmarks/tune_standin.py` on {machine_text(r['machine'])}.", "",
             f"Self-synthesis: {t['corpus']['minutes']:.1f} min ({t['corpus']['train_frames']} train + "
             f"{t['corpus']['validation_frames']} held-out frames), {t['epochs']} epochs. The shipped offsets were "
             "trained on ~2.3 h of recorded (Piper) speech, about 9x as many frames.", "",
             f"Held out: {r['held_out']['sentences']} test-split sentences ({r['held_out']['per_lang']} per language), "
             f"{r['held_out']['seeds']} seeds, tree of {r['held_out']['tree_nodes']} nodes for every drafter; "
             "talker and predictor sampled (temperature 0.9, top-k 50).", "",
             "| drafter | tokens/step (mean ± std over seeds) | per seed |", "|---|---|---|"]
    lines += [f"| {name} | {row['mean']:.3f} ± {row['std']:.3f} | {', '.join(f'{v:.3f}' for v in row['per_seed'])} |"
              for name, row in r["drafters"].items()]
    lines += ["", f"`tune` calibrated its trained offsets and the reused heads on held-out frames and uses: "
              f"{t['drafter_in_use']}.", "",
              "Stage times of `tune` on this CPU (1 thread, another job running beside it), seconds: " +
              ", ".join(f"{k} {v:.0f}" for k, v in t["timings_seconds"].items()) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
