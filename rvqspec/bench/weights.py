"""`rvqspec bench --weights bfloat16,w8a16,w8a8`: AR and speculative frame times per weights scheme.

The real 0.6B architecture (random layers) with acceptance-controlled heads: the heads are peaked on the float
model until speculation makes the paper's tokens/step at N (`calibrate_strength`), then each scheme quantizes that
model, so every scheme runs at about the paper's acceptance (each at its own, measured: a quantized model is a
different model). For each thread count, every frame is decoded AR and speculative with every scheme in rotating
order (interleaved, so that other jobs on the machine load all of them alike); medians of the frame times.
x_over_y = y's frame time / x's frame time.
"""

import statistics
from dataclasses import dataclass

import torch

from rvqspec.bench.controlled import PAPER_ACCEPTANCE, calibrate_strength, controlled_predictor
from rvqspec.bench.timing import clocks, elapsed_ms, finish_machine, machine, machine_text
from rvqspec.engine.config import ARCHITECTURES
from rvqspec.engine.decode import decode_frame, tokens_per_step
from rvqspec.engine.drafters import ReusedHeads
from rvqspec.engine.errors import RvqspecError
from rvqspec.engine.model import DTYPES, resolve_dtype
from rvqspec.engine.quantize import SCHEMES, quantize
from rvqspec.engine.sampling import Sampler
from rvqspec.engine.tree import default_tree

BASELINE = "bfloat16"  # what every ratio is against: the float model users run on a CPU
MODES = ("ar", "spec")


@dataclass(frozen=True)
class WeightsPlan:
    schemes: list[str]  # float dtypes (the float model) and quantize schemes (of the bfloat16 model)
    threads: list[int]
    tree_size: int = 32
    frames: int = 16
    calibration_frames: int = 12
    calibration_iterations: int = 7
    arch: str = "0.6b"


def quick_weights_plan(schemes: list[str], threads: list[int]) -> WeightsPlan:
    return WeightsPlan(schemes, threads, frames=6, calibration_frames=8, calibration_iterations=6)


def check_schemes(schemes: list[str]) -> list[str]:
    unknown = [s for s in schemes if s not in SCHEMES and s not in DTYPES]
    if unknown:
        raise RvqspecError(f"--weights {','.join(unknown)}: use float dtypes (bfloat16, float32) and schemes of "
                           f"rvqspec.quantize ({', '.join(SCHEMES)})")
    if BASELINE not in schemes:
        raise RvqspecError(f"--weights must include {BASELINE}: every ratio is against its AR frame")
    return schemes


def models_per_scheme(plan: WeightsPlan, sampler: Sampler, log) -> tuple[dict, dict, list]:
    """The float model, heads set to the paper's acceptance at N, and each scheme's model of it; the calibration;
    the frames to time."""
    predictor = controlled_predictor(ARCHITECTURES[plan.arch], dtype=BASELINE)
    tree = default_tree(plan.tree_size)
    calibrated = calibrate_strength(predictor, tree, PAPER_ACCEPTANCE[plan.tree_size], sampler,
                                    predictor.frames(plan.calibration_frames, seed=2), plan.calibration_iterations)
    log(f"heads at strength {calibrated.strength:.3f}: {calibrated.measured:.3f} tokens/step at N={plan.tree_size} "
        f"(target {calibrated.target})")
    models = {}
    for scheme in plan.schemes:
        if scheme in SCHEMES:
            models[scheme] = quantize(predictor.model, scheme)
        else:
            models[scheme] = predictor.model if resolve_dtype(scheme) == resolve_dtype(BASELINE) else \
                controlled_predictor(ARCHITECTURES[plan.arch], calibrated.strength, dtype=scheme).model
    calibration = {"strength": calibrated.strength, "tokens_per_step": calibrated.measured, "target": calibrated.target}
    return models, calibration, predictor.frames(plan.frames, seed=1)


@torch.inference_mode()
def time_frames(models: dict, frames: list, tree, sampler: Sampler) -> dict:
    """Median frame ms and tokens/step of each (scheme, mode), every frame through all of them in rotating order."""
    runs = [(scheme, mode) for scheme in models for mode in MODES]
    drafters = {scheme: ReusedHeads(model) for scheme, model in models.items()}
    generators = {run: torch.Generator().manual_seed(0) for run in runs}
    times, decoded = {run: [] for run in runs}, {run: [] for run in runs}
    for i, (h, c0) in enumerate([frames[0]] + frames):  # the first: warm-up (plans, packs, oneDNN layouts)
        for scheme, mode in runs[i % len(runs):] + runs[:i % len(runs)]:
            spec = mode == "spec"
            start = clocks()
            result = decode_frame(models[scheme], h, c0, sampler, generators[scheme, mode],
                                  drafter=drafters[scheme] if spec else None, tree=tree if spec else None)
            if i:
                times[scheme, mode].append(elapsed_ms(start)[0])
                decoded[scheme, mode].append(result)
    return {run: {"frame_ms": statistics.median(times[run]), "tokens_per_step": tokens_per_step(decoded[run])}
            for run in runs}


def ratios(timed: dict, schemes: list[str]) -> dict:
    """The report's figures per scheme, x_over_y = y's frame time / x's."""
    base = timed[BASELINE, "ar"]["frame_ms"]
    out = {}
    for scheme in schemes:
        ar, spec = timed[scheme, "ar"]["frame_ms"], timed[scheme, "spec"]["frame_ms"]
        out[scheme] = {"ar_frame_ms": ar, "spec_frame_ms": spec, "ar_over_bf16_ar": base / ar,
                       "spec_over_bf16_ar": base / spec, "spec_over_ar": ar / spec,
                       "tokens_per_step": timed[scheme, "spec"]["tokens_per_step"]}
    return out


def run_weights_bench(plan: WeightsPlan, log=print) -> dict:
    sampler, threads_before = Sampler(), torch.get_num_threads()
    report = {"machine": machine(), "plan": plan.__dict__, "by_threads": {}}
    try:
        torch.set_num_threads(plan.threads[0])
        models, report["calibration"], frames = models_per_scheme(plan, sampler, log)
        for threads in plan.threads:
            torch.set_num_threads(threads)
            timed = time_frames(models, frames, default_tree(plan.tree_size), sampler)
            report["by_threads"][str(threads)] = ratios(timed, plan.schemes)
            for scheme, r in report["by_threads"][str(threads)].items():
                log(f"{threads} thread(s) {scheme}: AR {r['ar_frame_ms']:.1f} ms, speculative {r['spec_frame_ms']:.1f} ms "
                    f"({r['tokens_per_step']:.2f} tokens/step): {r['spec_over_bf16_ar']:.2f}x over bfloat16 AR")
    finally:
        torch.set_num_threads(threads_before)
    report["weights"] = report["by_threads"][str(plan.threads[0])]
    if len(plan.threads) > 1:
        one, more = report["by_threads"][str(plan.threads[0])], report["by_threads"][str(plan.threads[-1])]
        report["threads_scaling"] = {s: {m: more[s][f"{m}_frame_ms"] / one[s][f"{m}_frame_ms"] for m in MODES}
                                     for s in plan.schemes}
    finish_machine(report["machine"])
    return report


def weights_markdown(report: dict) -> str:
    plan, calibration = report["plan"], report["calibration"]
    lines = ["# rvqspec bench --weights", "",
             f"`{report.get('command', 'rvqspec bench --weights')}`: {plan['arch']} architecture (random layers), heads "
             f"set on the bfloat16 model to {calibration['tokens_per_step']:.2f} tokens/step at N={plan['tree_size']} "
             f"(the paper's {calibration['target']}), then quantized; ReusedHeads drafts, deployed sampler; "
             f"{plan['frames']} frames per setting, every (scheme, mode) in rotating order; medians. "
             f"{machine_text(report['machine'])}.", "",
             "| threads | weights | AR frame ms | spec frame ms | tokens/step | AR over bf16 AR | spec over bf16 AR "
             "| spec over own AR |", "|---|---|---|---|---|---|---|---|"]
    for threads, rows in report["by_threads"].items():
        lines += [f"| {threads} | {scheme} | {r['ar_frame_ms']:.1f} | {r['spec_frame_ms']:.1f} | "
                  f"{r['tokens_per_step']:.2f} | {r['ar_over_bf16_ar']:.2f}x | {r['spec_over_bf16_ar']:.2f}x | "
                  f"{r['spec_over_ar']:.2f}x |" for scheme, r in rows.items()]
    if "threads_scaling" in report:
        lines += ["", f"Frame time at {plan['threads'][-1]} threads over {plan['threads'][0]}: " + "; ".join(
            f"{s} AR {v['ar']:.2f}, spec {v['spec']:.2f}" for s, v in report["threads_scaling"].items()) + "."]
    return "\n".join(lines) + "\n"
