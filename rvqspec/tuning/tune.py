"""`rvqspec tune`: a drafter, trees and latency table for one checkpoint, from the model's own speech.

Stages, in order, into one folder (its layout: `rvqspec.integrations.tuned`):
1. synthesize: the model speaks the built-in sentences free-running with its deployed sampling until `minutes` of
   audio exist; per frame the state conditioning its depth decoder and all codes -> corpus/ (split by utterance)
2. train: offsets on that corpus (`rvqspec.tuning.train`, resumable from its checkpoint) -> train/
3. calibrate: trees from the train split's acceptance, measured on the held-out split -> trees/
4. bench: this device's ms per call at (B, N) for the architecture, with the calibrated trees -> latency.json
5. report: report.json and README.md (tokens/step measured and predicted speed-up per batch size)

A stage whose output exists is skipped (its files are written atomically, last of all: an interrupted stage
left nothing that counts as done), so rerunning the same command resumes; a stage whose files are damaged (not
JSON, not the object the next stage reads) or missing is redone. `force` names a stage to redo, and the ones after
it with it. Synthesis and benching need the live model, the caller's `Subject`.
"""

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rvqspec.core.checkpoint import save_json, save_text
from rvqspec.core.config import FRAME_RATE
from rvqspec.core.errors import RvqspecError
from rvqspec.core.files import read_json
from rvqspec.core.model import MultiCodeDecoder
from rvqspec.core.policy import SIZES
from rvqspec.integrations.tuned import IDENTITY, IDENTITY_FIELDS, LATENCY, TREES, identity_of, read_identity
from rvqspec.tuning.calibrate import CalibrationSettings, calibrate
from rvqspec.tuning.corpus import Corpus, CorpusWriter, split_of
from rvqspec.tuning.train import TrainSettings, progress_bar, train

STAGES = ("synthesize", "train", "calibrate", "bench", "report")
DEFAULT_MINUTES = 20.0  # of synthesized audio (15,000 frames): see docs/RESULTS.md (tune) for what it gives


@dataclass
class Subject:
    """The model being tuned: its kind ("qwen-tts", "csm", "standin"), the folder its predictor loads from,
    that predictor as loaded, and its free-running synthesis: an iterator of (id, language, codes, hidden)."""

    kind: str
    model_path: Path
    predictor: MultiCodeDecoder
    utterances: Callable[[], Iterator[tuple]]
    bench: Callable[[Path], dict] | None = None  # writes the latency table, returns what it measured


@dataclass(frozen=True)
class TuneSettings:
    minutes: float = DEFAULT_MINUTES
    epochs: int = 2
    seed: int = 0
    budgets: tuple[int, ...] = SIZES  # the tree sizes N grown (the field keeps its old name)
    validation_fraction: float = 0.1
    offsets: str = "shared"  # or "per-position": one offset per start position and lookahead distance
    objective: str = "codes"  # the trainer's (`train.DraftLoss`): "codes" or "acceptance"
    progress: bool = True
    timings: dict = field(default_factory=dict, compare=False)


OFFSET_KINDS = {"shared": "offsets", "per-position": "position-offsets"}  # --offsets -> the drafter kind trained


def drafter_file(settings: TuneSettings) -> Path:
    return Path("train") / f"{OFFSET_KINDS[settings.offsets]}.safetensors"


def json_object(path: Path, *fields: str) -> dict | None:
    """The JSON object in `path` if it holds `fields`; None where it is missing or damaged (its stage is redone)."""
    try:
        obj = read_json(path, "")
    except (OSError, RvqspecError):
        return None
    return obj if isinstance(obj, dict) and all(f in obj for f in fields) else None


def stage_done(out: Path, stage: str, settings: TuneSettings) -> bool:
    """Whether `stage`'s files exist and hold what the later stages read (training: every epoch of `settings`)."""
    if stage == "synthesize":
        return json_object(out / "corpus" / "index.json", "format", "shards") is not None
    if stage == "train":
        metrics = json_object(out / "train" / "metrics.json", "epochs")
        return (metrics is not None and isinstance(metrics["epochs"], list) and len(metrics["epochs"]) >= settings.epochs
                and (out / drafter_file(settings)).exists())
    if stage == "calibrate":
        return all(json_object(out / folder / "report.json", "trees") for folder in (TREES, "trees-other"))
    if stage == "bench":
        return json_object(out / LATENCY, "key", "ms") is not None
    return json_object(out / "report.json", "trees") is not None and (out / "README.md").exists()


def check_folder(out: Path, identity: dict, force: str | None) -> dict:
    """tune.json of the run before ({} if none, or where everything is redone). A folder already tuned for another
    model is refused, unless everything is redone; so is one that holds files tune did not write (its README.md or
    report.json would be overwritten), and one whose tune.json is damaged (`read_identity` names --force
    synthesize)."""
    if not (out / IDENTITY).exists():
        if out.is_dir() and any(out.iterdir()):
            raise RvqspecError(f"{out} holds files `rvqspec tune` did not write: pick a new or empty --out folder")
        return {}
    if force == "synthesize":
        return {}
    tuned = read_identity(out)
    different = [k for k in IDENTITY_FIELDS if tuned.get(k) != identity[k]]
    if different:
        raise RvqspecError(f"{out} was tuned for another model ({', '.join(f'{k}: {tuned.get(k)}' for k in different)}): "
                           "pick another --out, or pass --force synthesize to redo it all for this one")
    return tuned


def tune(subject: Subject, out: str | Path, settings: TuneSettings | None = None, force: str | None = None,
         log=print) -> dict:
    """Run the stages (module docstring) into `out`; returns the report."""
    out, settings = Path(out), settings or TuneSettings()
    if force is not None and force not in STAGES:
        raise RvqspecError(f"--force takes a stage: {', '.join(STAGES)}; got {force!r}")
    identity = identity_of(subject.predictor, subject.kind) | {"model": str(subject.model_path)}
    if settings.offsets not in OFFSET_KINDS:
        raise RvqspecError(f"offsets must be one of {', '.join(OFFSET_KINDS)}, got {settings.offsets!r}")
    before = check_folder(out, identity, force)
    out.mkdir(parents=True, exist_ok=True)
    training = {"trained": str(drafter_file(settings)), "objective": settings.objective}
    changed = [f"{k} {before[k]}" for k, v in training.items() if before.get(k) not in (None, v)]
    if changed and force not in ("synthesize", "train"):
        raise RvqspecError(f"{out} was tuned with other offsets ({', '.join(changed)}): pass --force train to train "
                           "these instead, or pick another --out")
    save_json(out / IDENTITY, before | identity | training | {"settings": asdict(settings) | {"timings": None}})
    redo = set(STAGES[STAGES.index(force):] if force else ())
    stages = {"synthesize": lambda: synthesize(subject, out, settings),
              "train": lambda: train_stage(subject, out, settings, force="train" in redo),
              "calibrate": lambda: calibrate_stage(subject, out, settings),
              "bench": lambda: subject.bench(out) if subject.bench else None,
              "report": lambda: write_report(subject, out, settings)}
    for stage in STAGES:
        if stage == "bench" and subject.bench is None:
            log("bench: skipped (--no-bench): the policy uses this device's `rvqspec bench --batch` table if any")
            continue
        if stage_done(out, stage, settings) and stage not in redo:
            log(f"{stage}: done before, skipped")
            continue
        start = time.perf_counter()
        log(f"{stage}: ...")
        stages[stage]()
        redo.update(STAGES[STAGES.index(stage) + 1:])  # the later stages read what this one wrote: redone too
        settings.timings[stage] = time.perf_counter() - start
        log(f"{stage}: {settings.timings[stage]:.0f} s")
    return json.loads((out / "report.json").read_text())


def synthesize(subject: Subject, out: Path, settings: TuneSettings) -> None:
    """The corpus, written over one there (forced, or damaged: the stage runs only then)."""
    target = int(settings.minutes * 60 * FRAME_RATE)
    config = subject.predictor.config
    frames, utterances = 0, subject.utterances()
    bar = progress_bar(range(target), settings.progress, desc="synthesize (frames)", unit="frame")
    with CorpusWriter(out / "corpus", config.talker_hidden_size, config.num_code_groups, overwrite=True,
                      meta={"source": "rvqspec tune: the model's own free-running synthesis",
                            "kind": subject.kind}) as writer:
        splits: set[str] = set()
        while frames < target or len(splits) < 2:  # both splits: the trees are measured on held-out utterances
            utterance, lang, codes, hidden = next(utterances)
            writer.add(utterance, lang, codes, hidden)
            frames += len(codes)
            splits.add(split_of(utterance, settings.validation_fraction))
            if hasattr(bar, "update"):
                bar.update(min(len(codes), target - bar.n))
    if hasattr(bar, "close"):
        bar.close()


def train_stage(subject: Subject, out: Path, settings: TuneSettings, force: bool) -> None:
    dtype = "float32"  # offsets train in float32 whatever the deployed dtype (the trainer's default)
    train(subject.model_path, out / "corpus", out / "train",
          TrainSettings(drafter=OFFSET_KINDS[settings.offsets], seed=settings.seed,
                        validation_fraction=settings.validation_fraction, objective=settings.objective),
          epochs=settings.epochs, resume=not force and (out / "train").exists(), force=force, dtype=dtype,
          progress=settings.progress)


def calibrate_stage(subject: Subject, out: Path, settings: TuneSettings) -> None:
    """Trees for the trained drafter and for the reused heads, both measured on held-out frames; the one with more
    tokens/step at its best tree is used (trees/, named in tune.json), the other kept in trees-other/. Training
    lowers the loss on the corpus, which does not always mean more accepted drafts (docs/RESULTS.md, tune)."""
    import shutil

    dtype = str(subject.predictor.dtype).removeprefix("torch.")
    corpus = Corpus(out / "corpus", settings.validation_fraction)
    calibration = CalibrationSettings(frames=min(1000, corpus.num_frames("train")),
                                      eval_frames=min(200, corpus.num_frames("validation")), seed=settings.seed,
                                      validation_fraction=settings.validation_fraction)
    reports = {}
    for name, spec in (("trained", str(out / drafter_file(settings))), ("reused", "reused")):
        shutil.rmtree(out / f"trees-{name}", ignore_errors=True)
        reports[name] = calibrate(subject.model_path, spec, out / "corpus", list(settings.budgets),
                                  out / f"trees-{name}", calibration, dtype=dtype, device=str(subject.predictor.device))
    best = {name: max(t["measured_tokens_per_step"] for t in report["trees"]) for name, report in reports.items()}
    chosen = "trained" if best["trained"] > best["reused"] else "reused"
    for folder in (TREES, "trees-other"):
        shutil.rmtree(out / folder, ignore_errors=True)
    (out / f"trees-{'reused' if chosen == 'trained' else 'trained'}").rename(out / "trees-other")
    identity = read_identity(out) | {"drafter": str(drafter_file(settings)) if chosen == "trained" else "reused",
                                     "measured_tokens_per_step": best}
    save_json(out / IDENTITY, identity)
    (out / f"trees-{chosen}").rename(out / TREES)  # last: the stage is done once trees/ exists


def write_report(subject: Subject, out: Path, settings: TuneSettings) -> None:
    corpus = Corpus(out / "corpus", settings.validation_fraction)
    trees = json.loads((out / TREES / "report.json").read_text())
    metrics = json.loads((out / "train" / "metrics.json").read_text())
    latency = json_object(out / LATENCY, "key", "ms")  # None with --no-bench (a damaged table left there: ignored)
    identity = read_identity(out)
    # "nodes": the grown tree's size N (a calibration row's "size" is the N asked for; fewer where candidates ran out)
    rows = [{"nodes": t["nodes"], "predicted_tokens_per_step": t["predicted_tokens_per_step"],
             "measured_tokens_per_step": t.get("measured_tokens_per_step")} for t in trees["trees"]]
    other = json.loads((out / "trees-other" / "report.json").read_text())["trees"]
    report = {"identity": identity, "corpus": {"utterances": len(corpus.split("train")) + len(corpus.split("validation")),
                                               "train_frames": corpus.num_frames("train"),
                                               "validation_frames": corpus.num_frames("validation"),
                                               "minutes": (corpus.num_frames("train") + corpus.num_frames("validation"))
                                               / FRAME_RATE / 60},
              "train": {"best": metrics.get("best"), "baseline": metrics.get("baseline")}, "trees": rows,
              "drafter": identity["drafter"],
              "other_drafter_trees": [{"nodes": t["nodes"], "measured_tokens_per_step": t["measured_tokens_per_step"]}
                                      for t in other],
              "speedup": predicted_speedups(subject, out, latency), "latency": latency,
              "timings_seconds": {**read_timings(out), **settings.timings}}
    save_text(out / "README.md", readme(report))
    save_json(out / "report.json", report)  # last: the stage is done once it exists


def read_timings(out: Path) -> dict:
    """Stage times of earlier (resumed) runs, kept in the report ({} where it is missing or damaged)."""
    timings = (json_object(out / "report.json") or {}).get("timings_seconds")
    return timings if isinstance(timings, dict) else {}


def predicted_speedups(subject: Subject, out: Path, latency: dict | None) -> dict:
    """Per batch size of the latency table: the policy's choice and its predicted speed-up over AR."""
    if latency is None:
        return {}
    from rvqspec.core.policy import MEASURED_MARGIN, LatencyTable, Policy

    table = LatencyTable.from_json(latency, "rvqspec tune", MEASURED_MARGIN)
    policy = Policy.for_model(subject.predictor, out / TREES, table)
    return {str(b): {"tree_size": policy.choose(b), "predicted_speedup": policy.predicted_speedup(b, policy.choose(b))
                     if policy.choose(b) else 1.0} for b in sorted(table.ms)}


def readme(report: dict) -> str:
    identity, corpus = report["identity"], report["corpus"]
    lines = [f"# rvqspec tune: {identity['model']}", "",
             f"{identity['kind']} model, architecture {identity['architecture']}, {identity['dtype']}, weights digest "
             f"{identity['weights_digest']}.", "",
             f"Corpus: the model's own free-running synthesis, {corpus['minutes']:.1f} minutes "
             f"({corpus['train_frames']} train + {corpus['validation_frames']} held-out frames).", "",
             f"Drafter in use: {report['drafter']} (the trained offsets and the reused heads were both calibrated; the "
             "one with more tokens/step on held-out frames is used).", "",
             "| tree nodes | tokens/step predicted | tokens/step measured (held-out frames) | the other drafter, measured |",
             "|---|---|---|---|"]
    lines += [f"| {r['nodes']} | {r['predicted_tokens_per_step']:.2f} | {r['measured_tokens_per_step'] or 0:.2f} | "
              f"{o['measured_tokens_per_step']:.2f} |" for r, o in zip(report["trees"], report["other_drafter_trees"])]
    if report["speedup"]:
        lines += ["", "| batch | policy | predicted speed-up over AR |", "|---|---|---|"]
        lines += [f"| {b} | {'AR' if not r['tree_size'] else 'N=' + str(r['tree_size'])} | {r['predicted_speedup']:.2f}x |"
                  for b, r in report["speedup"].items()]
    lines += ["", "Stage times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in report["timings_seconds"].items()), "",
              "Use it: `accelerate(model, tuned=\"THIS_FOLDER\")`, or `rvqspec synth --tuned THIS_FOLDER`.", ""]
    return "\n".join(lines)

