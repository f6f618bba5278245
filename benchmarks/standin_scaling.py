"""Would more speech make the stand-in's predictor supply the levels that carry the words?

    python benchmarks/standin_scaling.py [--work data/standin] [--fractions 0.125,0.25,0.5,1] [--epochs 6]

For each fraction of the training utterances of a stand-in build's code corpus (the frozen talker's
teacher-forced states and the recorded codes), a predictor is trained from upstream's random init (the
code tables aside: they are the talker's, from the joint training) with the build's own recipe
(`train_predictor`: AdamW, 256-frame batches, the epoch with the best validation loss kept), for `--epochs`
epochs of its data. Reported per fraction: hours of speech, best validation loss (nats per code; uniform is
ln 512 = 6.24) and the greedy accuracy of c1..c15 on the validation frames. `rvqspec standin diagnose` shows
what accuracy the words need. Writes benchmarks/results/standin/scaling.{json,md}. `--smoke` (seconds) trains
nothing (a build folder and minutes of training): it says whether --work holds a build and re-renders the committed
report into a temporary folder; tests/test_standin_model.py trains predictors on tiny corpora.
"""

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from rvqspec.bench.timing import RESULTS, SMOKE_HELP, report_folder
from rvqspec.core.checkpoint import save_json, save_text
from rvqspec.core.model import MultiCodeDecoder
from rvqspec.standin.codec import CodecConfig
from rvqspec.standin.talker import load_standin
from rvqspec.standin.training import train_predictor
from rvqspec.tuning.corpus import Corpus, CorpusWriter

BATCH_FRAMES = 256
FRAME_RATE = CodecConfig().frame_rate  # code frames per second of speech


def subset_corpus(utterances: list, fraction: float, folder: Path, seed: int = 0) -> Corpus:
    """A corpus of `fraction` of the utterances (entry, codes, hidden), picked at random."""
    chosen = random.Random(seed).sample(utterances, round(fraction * len(utterances)))
    with CorpusWriter(folder, chosen[0][2].shape[1], hidden_dtype=torch.float32) as writer:
        for entry, codes, hidden in chosen:
            writer.add(entry["id"], entry["lang"], codes, hidden)
    return Corpus(folder, 0.0)


@torch.no_grad()
def greedy_accuracy(predictor: MultiCodeDecoder, corpus: Corpus) -> list[float]:
    right = sum((predictor.teacher_forced_logits(hidden.float(), codes).argmax(-1) == codes[:, 1:]).sum(0)
                for codes, hidden in corpus.batches("train", 1024))
    return [round(float(x) / corpus.num_frames("train"), 4) for x in right]


def run(work: Path, fractions: list[float], epochs: int) -> dict:
    torch.manual_seed(0)
    joint = load_standin(work / "joint").predictor
    utterances = list(Corpus(work / "code-corpus" / "train", 0.0).utterances_of("train"))
    validation = Corpus(work / "code-corpus" / "validation", 0.0)
    rows = []
    for fraction in fractions:
        with tempfile.TemporaryDirectory() as folder:
            train = subset_corpus(utterances, fraction, Path(folder))
            predictor = MultiCodeDecoder(joint.config)
            predictor.code_embed.weight.data.copy_(joint.code_embed.weight)
            start = time.perf_counter()
            steps = epochs * train.num_batches("train", BATCH_FRAMES, drop_last=True)
            report = train_predictor(predictor, train, validation, steps, batch_frames=BATCH_FRAMES, log=lambda _: None)
            frames = train.num_frames("train")
        losses = [h["validation_loss"]["predictor"] for h in report["history"]]
        rows.append({"fraction": fraction, "frames": frames, "hours": round(frames / FRAME_RATE / 3600, 3),
                     "epochs": report["epochs"], "best_epoch": report["best_epoch"], "validation_loss": losses,
                     "best_validation_loss": min(losses), "accuracy": greedy_accuracy(predictor, validation),
                     "seconds": round(time.perf_counter() - start)})
        print(f"{fraction:g}: {rows[-1]['hours']} h, best loss {min(losses):.4f} (epoch {report['best_epoch']}), "
              f"accuracy c1..c5 {rows[-1]['accuracy'][:5]}", flush=True)
    return {"work": str(work), "epochs": epochs, "batch_frames": BATCH_FRAMES, "threads": torch.get_num_threads(),
            "validation_frames": validation.num_frames("train"), "rows": rows}


def markdown(result: dict) -> str:
    lines = ["# Stand-in predictor: data scaling", "",
             f"Predictor trained from random init on a fraction of the build's training utterances "
             f"({result['epochs']} epochs of each, best validation epoch kept); "
             f"{result['validation_frames']} validation frames. `python benchmarks/standin_scaling.py`.", "",
             "| hours | best validation loss (nats) | best epoch | greedy accuracy c1 | c2 | c3 | c4 | c5 | mean c1..c15 |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        acc = r["accuracy"]
        lines.append(f"| {r['hours']:.2f} | {r['best_validation_loss']:.4f} | {r['best_epoch']} | "
                     + " | ".join(f"{a:.3f}" for a in acc[:5]) + f" | {sum(acc) / len(acc):.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--work", default="data/standin", help="a stand-in build folder (rvqspec standin build)")
    parser.add_argument("--fractions", default="0.125,0.25,0.5,1")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--out", default="benchmarks/results/standin")
    args = parser.parse_args(argv)
    if args.smoke:
        found = (Path(args.work) / "joint").is_dir() and (Path(args.work) / "code-corpus").is_dir()
        print(f"{args.work}: {'a stand-in build' if found else 'no build here (rvqspec standin build makes one)'}")
        result = json.loads((RESULTS / "standin" / "scaling.json").read_text())
    else:
        result = run(Path(args.work), [float(f) for f in args.fractions.split(",")], args.epochs)
    out = report_folder(Path(args.out), args.smoke)
    save_json(out / "scaling.json", result)
    save_text(out / "scaling.md", markdown(result))


if __name__ == "__main__":
    main()
