"""`rvqspec bench --weights bfloat16,w8a16,w8a8`: AR and speculative frame times per weights scheme, on this CPU class.

The real 0.6B architecture (random layers) with acceptance-controlled heads: the heads are peaked on the float
model until speculation makes the paper's tokens/step at N = 32 (`calibrate_strength`), then each scheme quantizes
that model, so every scheme runs at about the paper's acceptance (each at its own, measured: a quantized model is a
different model). A scheme this CPU cannot run (w8a8 without int8 dot products or the AVX2 kernel) or whose AR frame,
probed first, takes more than PROBE_LIMIT times bfloat16's is skipped with the reason. For each thread count, every
frame is decoded AR, speculative with each tree size and with the policy's choice (what tree="auto" deploys here
without a device file: this class's built-in table, or one measured on first use) by every scheme in rotating order
(interleaved, so that other jobs on the machine load all of them alike); medians of the frame times.
x_over_y = y's frame time / x's frame time.
"""

import os
import statistics
import tempfile
from dataclasses import dataclass

import torch

from rvqspec.bench.controlled import PAPER_ACCEPTANCE, calibrate_strength, controlled_predictor
from rvqspec.bench.timing import finish_machine, machine, machine_text
from rvqspec.core import cpu_class, device_path
from rvqspec.core.config import ARCHITECTURES
from rvqspec.core.decode import decode_frame, tokens_per_step
from rvqspec.core.device_path import intra_op_threads
from rvqspec.core.drafters import ReusedHeads
from rvqspec.core.errors import RvqspecError
from rvqspec.core.latency import clocks, elapsed_ms
from rvqspec.core.model import DTYPES, resolve_dtype
from rvqspec.core.policy import Policy
from rvqspec.core.quantize import SCHEMES, quantize
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import default_tree

BASELINE = "bfloat16"  # what every ratio is against: the float model users run on a CPU
PROBE_LIMIT = 5.0  # a scheme whose probed AR frame takes this many bfloat16 AR frames is not timed


@dataclass(frozen=True)
class WeightsPlan:
    schemes: list[str]  # float dtypes (the float model) and quantize schemes (of the bfloat16 model)
    threads: list[int]
    tree_size: int = 32  # the heads' acceptance is set at this N
    tree_sizes: tuple[int, ...] = (8, 16, 32)  # speculative frames timed at each
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


def models_per_scheme(plan: WeightsPlan, sampler: Sampler, log) -> tuple[dict, dict, list, dict]:
    """The float model, heads set to the paper's acceptance at N, and each scheme's model of it; the calibration;
    the frames to time; the schemes skipped, with why."""
    predictor = controlled_predictor(ARCHITECTURES[plan.arch], dtype=BASELINE)
    tree = default_tree(plan.tree_size)
    calibrated = calibrate_strength(predictor, tree, PAPER_ACCEPTANCE[plan.tree_size], sampler,
                                    predictor.frames(plan.calibration_frames, seed=2), plan.calibration_iterations)
    log(f"heads at strength {calibrated.strength:.3f}: {calibrated.measured:.3f} tokens/step at N={plan.tree_size} "
        f"(target {calibrated.target})")
    models, skipped = {}, {}
    for scheme in plan.schemes:
        try:
            if scheme in SCHEMES:
                models[scheme] = quantize(predictor.model, scheme)
            else:
                models[scheme] = predictor.model if resolve_dtype(scheme) == resolve_dtype(BASELINE) else \
                    controlled_predictor(ARCHITECTURES[plan.arch], calibrated.strength, dtype=scheme).model
        except RvqspecError as e:  # e.g. w8a8 on an arm CPU
            skipped[scheme] = str(e)
            log(f"{scheme} skipped: {e}")
    frames = predictor.frames(plan.frames, seed=1)
    for scheme, why in probe(models, frames[0], sampler).items():
        skipped[scheme] = why
        del models[scheme]
        log(f"{scheme} skipped: {why}")
    calibration = {"strength": calibrated.strength, "tokens_per_step": calibrated.measured, "target": calibrated.target}
    return models, calibration, frames, skipped


@torch.inference_mode()
def probe(models: dict, frame, sampler: Sampler) -> dict[str, str]:
    """The schemes whose one AR frame takes more than PROBE_LIMIT times bfloat16's, with the figure (so that a
    kernel that is unusable on this CPU is reported, not timed for minutes)."""
    h, c0 = frame
    ms = {}
    for scheme, model in models.items():
        for _ in range(2):  # the second call: packed layouts made
            start = clocks()
            decode_frame(model, h, c0, sampler, torch.Generator().manual_seed(0))
            ms[scheme] = elapsed_ms(start)[0]
    return {scheme: f"one AR frame took {ms[scheme] / ms[BASELINE]:.1f}x bfloat16's ({ms[scheme]:.0f} ms) on "
                    f"{cpu_class.describe()}" for scheme in ms if ms[scheme] > PROBE_LIMIT * ms[BASELINE]}


def policy_sizes(models: dict) -> dict[str, tuple[int, str]]:
    """Per scheme, the tree size (0: AR) the policy deploys for one stream without a device file, and why."""
    chosen, before = {}, os.environ.get("RVQSPEC_CACHE")
    with tempfile.TemporaryDirectory() as empty:
        os.environ["RVQSPEC_CACHE"] = empty  # as on a machine that never ran `rvqspec bench --batch`
        try:
            for scheme, model in models.items():
                policy = Policy.for_model(model)
                chosen[scheme] = (policy.choose(1), policy.explain(1))
        finally:
            os.environ.pop("RVQSPEC_CACHE") if before is None else os.environ.update(RVQSPEC_CACHE=before)
    return chosen


@torch.inference_mode()
def time_frames(models: dict, frames: list, sizes: tuple[int, ...], chosen: dict, sampler: Sampler) -> dict:
    """Median frame ms and tokens/step of each (scheme, mode): mode 0 is AR, N a speculative frame with
    default_tree(N), "policy" the policy's choice where it is a size not timed already; every frame through all of
    them in rotating order."""
    modes = {scheme: [0, *sizes] + (["policy"] if chosen[scheme][0] not in (0, *sizes) else []) for scheme in models}
    runs = [(scheme, mode) for scheme in models for mode in modes[scheme]]
    trees = {mode: default_tree(mode if mode != "policy" else chosen[scheme][0]) if mode else None
             for scheme, mode in runs}
    drafters = {scheme: ReusedHeads(model) for scheme, model in models.items()}
    generators = {run: torch.Generator().manual_seed(0) for run in runs}
    times, decoded = {run: [] for run in runs}, {run: [] for run in runs}
    for i, (h, c0) in enumerate([frames[0]] + frames):  # the first: warm-up (plans, packs, oneDNN layouts)
        for scheme, mode in runs[i % len(runs):] + runs[:i % len(runs)]:
            start = clocks()
            result = decode_frame(models[scheme], h, c0, sampler, generators[scheme, mode],
                                  drafter=drafters[scheme] if mode else None, tree=trees[mode])
            if i:
                times[scheme, mode].append(elapsed_ms(start)[0])
                decoded[scheme, mode].append(result)
    return {run: {"frame_ms": statistics.median(times[run]), "tokens_per_step": tokens_per_step(decoded[run])}
            for run in runs}


def ratios(timed: dict, schemes: list[str], sizes: tuple[int, ...], chosen: dict) -> dict:
    """The report's figures per scheme, x_over_y = y's frame time / x's; spec_* at the fastest tree size."""
    base = timed[BASELINE, 0]["frame_ms"]
    out = {}
    for scheme in schemes:
        ar = timed[scheme, 0]["frame_ms"]
        best = min(sizes, key=lambda n: timed[scheme, n]["frame_ms"])
        size, why = chosen[scheme]
        policy = timed[scheme, size if size in (0, *sizes) else "policy"]["frame_ms"]
        spec = timed[scheme, best]["frame_ms"]
        out[scheme] = {"ar_frame_ms": ar, "spec_frame_ms": spec, "spec_tree_size": best, "ar_over_bf16_ar": base / ar,
                       "spec_over_bf16_ar": base / spec, "spec_over_ar": ar / spec,
                       "tokens_per_step": timed[scheme, best]["tokens_per_step"],
                       "spec_frame_ms_by_size": {str(n): timed[scheme, n]["frame_ms"] for n in sizes},
                       "policy_tree_size": size, "policy_frame_ms": policy, "policy_over_bf16_ar": base / policy,
                       "policy_why": why}
    return out


def run_weights_bench(plan: WeightsPlan, log=print) -> dict:
    sampler = Sampler()
    report = {"machine": machine(), "plan": plan.__dict__, "by_threads": {}}
    with intra_op_threads(plan.threads[0]):
        models, report["calibration"], frames, report["skipped"] = models_per_scheme(plan, sampler, log)
    for threads in plan.threads:
        with intra_op_threads(threads):
            for model in models.values():  # their kernel choices at this thread count, as loaded models have them
                device_path.prepare(model, name="the benchmark's predictor")
            chosen = policy_sizes(models)
            timed = time_frames(models, frames, plan.tree_sizes, chosen, sampler)
            report["by_threads"][str(threads)] = ratios(timed, list(models), plan.tree_sizes, chosen)
            for scheme, r in report["by_threads"][str(threads)].items():
                log(f"{threads} thread(s) {scheme}: AR {r['ar_frame_ms']:.1f} ms, speculative {r['spec_frame_ms']:.1f} ms "
                    f"at N={r['spec_tree_size']} ({r['tokens_per_step']:.2f} tokens/step): {r['spec_over_bf16_ar']:.2f}x "
                    f"over bfloat16 AR; the policy's {policy_text(r)}: {r['policy_over_bf16_ar']:.2f}x")
    report["weights"] = report["by_threads"][str(plan.threads[0])]
    if len(plan.threads) > 1:
        one, more = report["by_threads"][str(plan.threads[0])], report["by_threads"][str(plan.threads[-1])]
        report["threads_scaling"] = {s: {m: more[s][f"{m}_frame_ms"] / one[s][f"{m}_frame_ms"] for m in ("ar", "spec")}
                                     for s in models}
    finish_machine(report["machine"])
    return report


def policy_text(r: dict) -> str:
    return f"N={r['policy_tree_size']}" if r["policy_tree_size"] else "AR"


def weights_markdown(report: dict) -> str:
    plan, calibration = report["plan"], report["calibration"]
    lines = ["# rvqspec bench --weights", "",
             f"`{report.get('command', 'rvqspec bench --weights')}`: {plan['arch']} architecture (random layers), heads "
             f"set on the bfloat16 model to {calibration['tokens_per_step']:.2f} tokens/step at N={plan['tree_size']} "
             f"(the paper's {calibration['target']}), then quantized; ReusedHeads drafts, deployed sampler; "
             f"{plan['frames']} frames per setting, every (scheme, mode) in rotating order; medians; spec: the fastest of "
             f"N = {', '.join(map(str, plan['tree_sizes']))}; policy: what tree=\"auto\" deploys without a device file. "
             f"CPU class **{report['machine'].get('cpu_class', '?')}**: {machine_text(report['machine'])}.", "",
             "| threads | weights | AR frame ms | spec frame ms (N) | tokens/step | policy | AR over bf16 AR | "
             "spec over bf16 AR | policy over bf16 AR | spec over own AR |", "|---|---|---|---|---|---|---|---|---|---|"]
    for threads, rows in report["by_threads"].items():
        lines += [f"| {threads} | {scheme} | {r['ar_frame_ms']:.1f} | {r['spec_frame_ms']:.1f} ({r['spec_tree_size']}) "
                  f"| {r['tokens_per_step']:.2f} | {policy_text(r)} | {r['ar_over_bf16_ar']:.2f}x | "
                  f"{r['spec_over_bf16_ar']:.2f}x | {r['policy_over_bf16_ar']:.2f}x | {r['spec_over_ar']:.2f}x |"
                  for scheme, r in rows.items()]
    lines += ["", "Skipped: " + "; ".join(f"{s}: {why}" for s, why in report["skipped"].items()) + "."] \
        if report.get("skipped") else []
    if "threads_scaling" in report:
        lines += ["", f"Frame time at {plan['threads'][-1]} threads over {plan['threads'][0]}: " + "; ".join(
            f"{s} AR {v['ar']:.2f}, spec {v['spec']:.2f}" for s, v in report["threads_scaling"].items()) + "."]
    return "\n".join(lines) + "\n"
