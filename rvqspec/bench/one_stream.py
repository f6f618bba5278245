"""`rvqspec bench`: per-call latency of the AR call and of the fused speculative call, the speed-up it
allows (paper Figure 4), acceptance-controlled end-to-end runs, and the tree size N chosen for this device.

Per setting (architecture x dtype x threads), in one process:
1. latency: rounds of [one AR step (q=1), one speculative round per N (q=N+1)], interleaved, medians.
   A step is everything the core does per call: the AR step embeds, calls the model, applies the head and
   samples; the speculative round also drafts, walks the tree and moves the cache (host work included).
   overhead(N) = t(N) / t(AR) - 1, predicted speedup(N) = tokens/step(N) / (1 + overhead(N)).
2. acceptance-controlled frames (`rvqspec.bench.controlled`): at N = 16, 32, 64 the heads' peak strength is
   bisected until tokens/step matches the paper (2.25, 2.47, 2.60); then whole frames are decoded with
   `decode_frame`, AR and speculative alternately: realized speedup = median AR frame / median spec frame.
   A depth decoder with another frame length (CSM-1B: 31 codes) is bisected instead to the per-round
   acceptance that the 0.6B predictor shows at the paper's tokens/step: the same drafts, a longer frame.

Timing does not depend on weight values, so the controlled predictors (real sizes, random layers) serve
both. Ratios are taken within one run; the machine may be shared, so its load is recorded. On a shared
machine run with OMP_WAIT_POLICY=PASSIVE: spinning OpenMP workers that lose their core make 2 threads ~10x
slower than 1 (measured here under load ~9); passive workers sleep instead.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from rvqspec.bench.controlled import (PAPER_ACCEPTANCE, Calibrated, ControlledPredictor, calibrate_to_paper,
                                      controlled_predictor, log_calibration, paper_round_acceptance, round_acceptance)
from rvqspec.bench.timing import finish_machine, machine
from rvqspec.core.config import ARCHITECTURES as ARCHS
from rvqspec.core.decode import decode_frame, tokens_per_step
from rvqspec.core import device_path
from rvqspec.core.device_path import intra_op_threads
from rvqspec.core.drafters import ReusedHeads
from rvqspec.core.errors import RvqspecError
from rvqspec.core.latency import TIMED_K, call_latency, clocks, elapsed_ms, medians
from rvqspec.core.model import MultiCodeDecoder
from rvqspec.core.policy import report_size
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import Tree, default_tree
from rvqspec.tuning.calibrate import load_drafter

REFERENCE_ARCH = "0.6b"  # the paper's model: other frame lengths run at the acceptance it has at the paper's figures


@dataclass(frozen=True)
class Plan:
    """How much to measure; `quick` is sized to finish in under 3 minutes on 2 shared cores."""

    archs: list[str]
    dtypes: list[str]
    threads: list[int]
    sizes: list[int]
    latency_rounds: int = 20
    controlled_sizes: tuple[int, ...] = (16, 32, 64)
    controlled_archs: tuple[str, ...] = ("0.6b", "1.7b", "csm-1b")
    calibration_iterations: int = 9
    frames: int = 32


def quick_plan(archs, dtypes, threads, sizes) -> Plan:
    return Plan(archs, dtypes[:1], threads[:1], sizes, latency_rounds=5, controlled_sizes=(32,),
                controlled_archs=("0.6b", "csm-1b"), calibration_iterations=6, frames=8)


@dataclass
class Run:
    """What every setting of one bench run shares."""

    plan: Plan
    trees: dict[int, Tree]
    tokens: dict[int, float]  # tokens/step per N: the paper's, or a calibration's
    sampler: Sampler
    log: Callable[..., None]


# ---------------------------------------------------------------------------------------------- timing

@torch.inference_mode()
def frame_speedup(model: MultiCodeDecoder, drafter, tree: Tree, frames: list, sampler: Sampler,
                  seed: int = 0) -> dict:
    """Decode each frame AR and speculative (full `decode_frame`, which goes first alternates); medians of
    per-frame times, tokens/step. The speculative decodes draw from their own generator seeded `seed`, as
    `rvqspec.bench.controlled.tokens_per_step` does: on the same frames they repeat its draws (and its acceptance)."""
    decode_frame(model, *frames[0], sampler, drafter=drafter, tree=tree)  # warm-up: plan, packs
    generators = {False: torch.Generator(model.device).manual_seed(seed + 1),
                  True: torch.Generator(model.device).manual_seed(seed)}
    times: dict = {"ar": [], "spec": []}
    speculative = []
    for i, (h, c0) in enumerate(frames):
        for spec in (False, True) if i % 2 == 0 else (True, False):
            start = clocks(model.device)
            result = decode_frame(model, h, c0, sampler, generators[spec], drafter=drafter if spec else None,
                                  tree=tree if spec else None)
            times["spec" if spec else "ar"].append(elapsed_ms(start, model.device))
            if spec:
                speculative.append(result)
    ar_ms, spec_ms = medians(times["ar"]), medians(times["spec"])
    calls, last = sum(result.calls for result in speculative), model.config.num_residual_codes
    return {"frames": len(frames), "tokens_per_step": tokens_per_step(speculative),
            "round_acceptance": round_acceptance(speculative, tree, last),
            "calls_per_frame": calls / len(frames), "ar_frame": ar_ms, "spec_frame": spec_ms,
            "realized_speedup": ar_ms["wall_ms"] / spec_ms["wall_ms"],
            "realized_speedup_cpu": ar_ms["cpu_ms"] / spec_ms["cpu_ms"]}


def predicted(tokens_per_step: float, overhead: float) -> float:
    return tokens_per_step / (1 + overhead)


# ---------------------------------------------------------------------------------------------- runs

def controlled_runs(run: Run, predictor: ControlledPredictor, latency: dict, strengths: dict[int, Calibrated],
                    target_acceptance: Callable[[int], float]) -> list[dict]:
    """At each of the paper's tree sizes N: bisect the peak strength on the frames (once per architecture and
    dtype, cached in `strengths`), then time the same frames, AR vs speculative (with the calibration's draws, so
    at the calibrated acceptance), and set the realized next to the predicted speed-up. Frames of Qwen3-TTS's
    length are bisected to the paper's tokens/step; other lengths to `target_acceptance(N)`, the per-round
    acceptance behind it."""
    plan, trees, sampler, log = run.plan, run.trees, run.sampler, run.log
    drafter, rows = ReusedHeads(predictor.model), []
    frames = predictor.frames(plan.frames, seed=1)
    for n in plan.controlled_sizes:
        if n not in trees:
            continue
        if n not in strengths:
            strengths[n] = calibrate_to_paper(predictor, trees[n], sampler, frames, plan.calibration_iterations,
                                              lambda: target_acceptance(n))
            log_calibration(log, n, strengths[n])
        c = strengths[n]
        predictor.set_strength(c.strength)
        timed = frame_speedup(predictor.model, drafter, trees[n], frames, sampler)  # also the round acceptance
        overhead = latency["spec"][n]["overhead"]
        paper_length = c.metric == "tokens_per_step"
        rows.append({"tree_size": n, "target": {"metric": c.metric, "value": c.target}, "strength": c.strength,
                     "calibrated": c.measured, "target_tokens_per_step": PAPER_ACCEPTANCE[n] if paper_length else None,
                     **timed, "overhead": overhead, "predicted_speedup": predicted(timed["tokens_per_step"], overhead)})
        log(f"    N={n}: {timed['tokens_per_step']:.3f} tokens/step ({timed['round_acceptance']:.3f} accepted per "
            f"round), realized {timed['realized_speedup']:.2f}x (cpu {timed['realized_speedup_cpu']:.2f}x), predicted "
            f"{rows[-1]['predicted_speedup']:.2f}x")
    return rows


def reference_acceptance(plan: Plan, dtype: str, device: str, sampler: Sampler, trees: dict[int, Tree],
                         cache: dict, settings: list[dict]):
    """target_acceptance(N) for `controlled_runs`: the per-round acceptance of the 0.6B predictor at the paper's
    tokens/step, from this run's 0.6B rows of the same dtype, else measured on the spot (and cached)."""
    def target(n: int) -> float:
        if (dtype, n) not in cache:
            rows = [r for s in settings if s["model"] == REFERENCE_ARCH and s["dtype"] == dtype
                    for r in s["controlled"] if r["tree_size"] == n]
            cache[dtype, n] = rows[0]["round_acceptance"] if rows else paper_round_acceptance(
                trees[n], PAPER_ACCEPTANCE[n], sampler, plan.frames, plan.calibration_iterations, dtype, device)
        return cache[dtype, n]

    return target


def tokens_per_step_source(calibration: dict | None) -> tuple[dict[int, float], str]:
    """tokens/step per N: measured by `rvqspec calibrate` if a report is given, else the paper's acceptance."""
    if calibration is None:
        return dict(PAPER_ACCEPTANCE), "paper acceptance (section 3.4)"
    return ({report_size(t): float(t["measured_tokens_per_step"]) for t in calibration["trees"]},
            f"measured by rvqspec calibrate ({calibration['path']})")


def load_calibration(path: str | None) -> dict | None:
    if path is None:
        return None
    file = Path(path)
    if file.is_dir():
        file = file / "report.json"
    if not file.is_file():
        raise RvqspecError(f"calibration report {file} does not exist: pass the report.json written by "
                           "`rvqspec calibrate --out DIR`")
    try:
        report = json.loads(file.read_text())
        complete = all(report_size(t) and "measured_tokens_per_step" in t for t in report["trees"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        complete = False
    if not complete:
        raise RvqspecError(f"{file} is not an `rvqspec calibrate` report (expected trees[].size and "
                           "trees[].measured_tokens_per_step): rerun `rvqspec calibrate`")
    # Its paths are relative to its folder (absolute in reports written before that): resolve them from here.
    report = report | {"path": str(file)}
    for key in ("model", "corpus"):
        if report.get(key):
            report[key] = str(file.parent / report[key])
    spec = (report.get("drafter") or {}).get("spec")
    if spec and spec != "reused":
        report["drafter"] = report["drafter"] | {"spec": str(file.parent / spec)}
    return report


def load_trees(sizes: list[int], folder: str | None) -> dict[int, Tree]:
    """tree-N{N}.json from `folder` (as written by `rvqspec calibrate`), else `default_tree(N)`."""
    if folder is None:
        return {n: default_tree(n) for n in sizes}
    missing = [n for n in sizes if not (Path(folder) / f"tree-N{n}.json").is_file()]
    if missing:
        raise RvqspecError(f"no tree-N{missing[0]}.json in {folder}: calibrate these sizes "
                           f"(`rvqspec calibrate --sizes {','.join(map(str, sizes))}`) or pass --sizes")
    return {n: Tree.load(Path(folder) / f"tree-N{n}.json") for n in sizes}


def stand_in_frames(model: MultiCodeDecoder, corpus: str | None, count: int) -> tuple[list, str]:
    if corpus is None:
        generator = torch.Generator().manual_seed(3)
        c = model.config
        hidden = torch.randn(count, c.talker_hidden_size, generator=generator).to(model.dtype)
        return list(zip(hidden, torch.randint(c.talker_vocab_size, (count,), generator=generator).tolist())), \
            "random talker states (no corpus given: acceptance is not representative)"
    from rvqspec.tuning.corpus import Corpus

    codes, hidden = Corpus(corpus).sample("validation", count, seed=3)
    return list(zip(hidden.to(model.dtype), codes[:, 0].tolist())), f"validation split of {corpus}"


def run_bench(plan: Plan, trees: dict[int, Tree], calibration: dict | None, model_path: str | None,
              drafter_spec: str, corpus: str | None, log=print, device: str = "cpu") -> dict:
    tokens, source = tokens_per_step_source(calibration)
    run = Run(plan, trees, tokens, Sampler(), log)
    report = {"machine": machine(), "sampler": {"temperature": run.sampler.temperature, "top_k": run.sampler.top_k},
              "tokens_per_step_source": source, "tokens_per_step_by_size": tokens, "timed_k": TIMED_K,
              "plan": plan.__dict__, "settings": []}
    targets = [(arch, ARCHS[arch]) for arch in plan.archs] + ([("stand-in", model_path)] if model_path else [])
    references: dict = {}  # (dtype, N) -> the 0.6B predictor's per-round acceptance at the paper's tokens/step
    for name, what in targets:
        for dtype in plan.dtypes:
            strengths: dict = {}  # per dtype, whose numerics change the draws: N -> Calibrated
            if name == "stand-in":
                predictor, model = None, MultiCodeDecoder.from_pretrained(what, dtype, device)
                drafter = load_drafter(drafter_spec, model, max(t.max_depth for t in trees.values()))
            else:
                predictor = controlled_predictor(what, dtype=dtype, device=device)
                model, drafter = predictor.model, ReusedHeads(predictor.model)
            target = reference_acceptance(plan, dtype, device, run.sampler, trees, references, report["settings"])
            for threads in plan.threads:
                with intra_op_threads(threads):
                    log(f"{name} {dtype} {threads} thread(s), load {os.getloadavg()[0]:.1f}:")
                    setting = measure_setting(run, name, model, drafter, dtype, threads)
                    if predictor is not None and name in plan.controlled_archs:
                        setting["controlled"] = controlled_runs(run, predictor, setting["latency"], strengths, target)
                    if predictor is None and setting["predicted_speedup"]:
                        frames = stand_in_frames(model, corpus or (calibration or {}).get("corpus"), plan.frames)
                        setting["stand_in"] = stand_in_run(run, model, drafter, setting, *frames)
                    report["settings"].append(setting)
            del model, predictor
    finish_machine(report["machine"])
    summarize(report, tokens)
    return report


def measure_setting(run: Run, name: str, model: MultiCodeDecoder, drafter, dtype: str, threads: int) -> dict:
    """Per-call latency of AR and of a round per tree size, and the speed-up each predicts at `run.tokens`."""
    load = os.getloadavg()[0]
    device_path.prepare(model, name=name)  # its kernel choices at this thread count, as a loaded model has them
    latency = call_latency(model, drafter, run.trees, run.sampler, run.plan.latency_rounds)
    run.log(f"  AR step {latency['ar']['wall_ms']:.2f} ms; overhead " +
            ", ".join(f"N={n} {v['overhead']:+.0%}" for n, v in latency["spec"].items()))
    speedups = {n: predicted(run.tokens[n], latency["spec"][n]["overhead"]) for n in run.trees if n in run.tokens}
    return {"model": name, "dtype": dtype, "threads": threads, "load_before": load, "latency": latency,
            "predicted_speedup": speedups, "controlled": [], "stand_in": None}


def stand_in_run(run: Run, model: MultiCodeDecoder, drafter, setting: dict, frames: list, origin: str) -> dict:
    """A checkpoint at its own acceptance: frames timed AR vs speculative at the N that predicts the most."""
    best = max(setting["predicted_speedup"], key=setting["predicted_speedup"].get)
    timed = frame_speedup(model, drafter, run.trees[best], frames, run.sampler)
    ceiling = predicted(timed["tokens_per_step"], setting["latency"]["spec"][best]["overhead"])
    run.log(f"  stand-in N={best}: {timed['tokens_per_step']:.3f} tokens/step, realized "
            f"{timed['realized_speedup']:.2f}x, ceiling tokens/step/(1+overhead) {ceiling:.2f}x")
    return {"tree_size": best, "frames_from": origin, **timed, "ceiling": ceiling}


def summarize(report: dict, tokens: dict[int, float]) -> None:
    """Chosen N (best predicted speed-up over settings), the realized 0.6B figure, the stand-in's; the
    top-level keys other tools read (`tokens_per_step`, `calls_per_frame`, `speedup`)."""
    settings = report["settings"]
    primary = "stand-in" if any(s["model"] == "stand-in" for s in settings) else "0.6b"
    candidates = [(speedup, n, s) for s in settings if s["model"] == primary
                  for n, speedup in s["predicted_speedup"].items()]
    chosen = None
    if candidates:
        speedup, n, s = max(candidates, key=lambda c: c[0])
        chosen = {"tree_size": n, "model": primary, "dtype": s["dtype"], "threads": s["threads"],
                  "tokens_per_step": tokens[n], "predicted_speedup": speedup}
    runs = [(row, s) for s in settings if s["model"] == "0.6b" for row in s["controlled"]]
    paper = None
    if runs:
        row, s = max(runs, key=lambda rs: rs[0]["realized_speedup"])
        paper = {"model": "0.6b (random weights, acceptance controlled)", "dtype": s["dtype"], "threads": s["threads"],
                 "tree_size": row["tree_size"], "target_tokens_per_step": row["target_tokens_per_step"],
                 "tokens_per_step": row["tokens_per_step"], "calls_per_frame": row["calls_per_frame"],
                 "speedup": row["realized_speedup"], "predicted_speedup": row["predicted_speedup"]}
    stand_in = max((s["stand_in"] for s in settings if s["stand_in"]), key=lambda r: r["realized_speedup"],
                   default=None)
    csm = max(((row, s) for s in settings if s["model"] == "csm-1b" for row in s["controlled"]),
              key=lambda rs: rs[0]["realized_speedup"], default=None)
    if csm:
        row, s = csm
        csm = {"dtype": s["dtype"], "threads": s["threads"], "tree_size": row["tree_size"],
               "round_acceptance": row["round_acceptance"], "tokens_per_step": row["tokens_per_step"],
               "calls_per_frame": row["calls_per_frame"], "speedup": row["realized_speedup"],
               "predicted_speedup": row["predicted_speedup"]}
    headline = ({"tokens_per_step": stand_in["tokens_per_step"], "calls_per_frame": stand_in["calls_per_frame"],
                 "speedup": stand_in["realized_speedup"]} if stand_in else paper) or {}
    report.update({"chosen": chosen, "paper_acceptance": paper,
                   "speedup_at_paper_acceptance": paper["speedup"] if paper else None,
                   "csm_at_paper_acceptance": csm,
                   "stand_in_speedup": stand_in["realized_speedup"] if stand_in else None,
                   **{key: headline.get(key) for key in ("tokens_per_step", "calls_per_frame", "speedup")}})
