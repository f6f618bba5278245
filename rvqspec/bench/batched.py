"""`rvqspec bench --batch 1,2,4,8,16`: batched decoding on a real architecture (the 0.6B by default; `--archs
csm-1b` for CSM-1B's depth decoder), frames per second of (a) our batched AR, (b) the decoding policy's choice and
(c) upstream's batched depth-decoder generate (qwen-tts' `code_predictor.generate`, transformers'
`CsmDepthDecoderForCausalLM.generate`) on the same weights, at the paper's acceptance (acceptance-controlled
heads, `rvqspec.bench.controlled`; CSM at the drafts accepted per round that the 0.6B shows there).

Per setting (dtype x threads), in one process:
1. the latency table: ms per call at (B, N) for every batch B and N in 0 (an AR step), the policy's sizes 4..64 (a
   speculative round, rows spread over neighbouring k as ragged progress spreads them), interleaved rounds, medians;
2. acceptance: the heads' peak strength bisected per N = 16, 32, 64 until tokens/step matches the paper's
   (2.25, 2.47, 2.60), once per dtype (another frame length: until the per-round acceptance matches the 0.6B's);
   the sizes the paper did not measure decode at N = 32's strength;
3. the policy (`rvqspec.core.policy`) from that table and the calls each calibration frame took at that
   acceptance (as a calibration report gives them) chooses N per B;
4. frames: per B, the same `repeats` batches of frames decoded by (a), (b), (c) in turn, medians of the batch
   times; frames/s = B / median. Where the policy chose AR, (b) is (a): the same code, so its time is reused.
The latency tables go to the device file, where the policy reads them.
"""

import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from rvqspec.bench.controlled import (PAPER_ACCEPTANCE, PAPER_HEADLINE, ControlledPredictor, at_strength,
                                      calibrate_to_paper, controlled_predictor, log_calibration, paper_round_acceptance)
from rvqspec.bench.timing import finish_machine, machine
from rvqspec.core.config import ARCHITECTURES
from rvqspec.core.decode import decode_frames, tokens_per_step
from rvqspec.core.device_file import update_device_file
from rvqspec.core import device_path
from rvqspec.core.device_path import intra_op_threads
from rvqspec.core.drafters import ReusedHeads
from rvqspec.core.latency import call_latency, clocks, elapsed_ms, latency_row
from rvqspec.core.policy import SIZES, LatencyTable, Policy, measured_distribution, setting_key
from rvqspec.core.quantize import quantize
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import default_tree


@dataclass(frozen=True)
class BatchPlan:
    batches: list[int]
    dtypes: list[str]
    threads: list[int]
    device: str = "cpu"
    latency_rounds: int = 10
    repeats: int = 9
    calibration_iterations: int = 8
    calibration_frames: int = 16
    arch: str = "0.6b"
    weights: str | None = None  # a scheme of rvqspec.quantize: heads set on the float model, then quantized


def quick_batch_plan(batches, dtypes, threads, device, arch: str = "0.6b", weights: str | None = None) -> BatchPlan:
    """The first dtype and thread count, fewer repeats, like `rvqspec bench --quick`: about 1.5 minutes on 2 shared
    cores (both default dtypes: 4.5 minutes, float32's rounds being slow)."""
    return BatchPlan(batches, dtypes[:1], threads[:1], device, latency_rounds=4, repeats=5, calibration_iterations=6,
                     calibration_frames=8, arch=arch, weights=weights)


def upstream_decoder(model):
    """Upstream's own depth decoder holding a copy of `model`'s weights (qwen-tts or transformers)."""
    if model.config.layout == "csm":
        from rvqspec.integrations.csm import upstream_depth_decoder

        return upstream_depth_decoder(model)
    from rvqspec.integrations.qwen_tts import upstream_code_predictor

    return upstream_code_predictor(model)


def sync_upstream_heads(upstream, model) -> None:
    """Give upstream's decoder the controlled predictor's current heads (the rest was copied at the start)."""
    with torch.no_grad():
        if model.config.layout == "csm":
            upstream.codebooks_head.weight.copy_(model.heads.transpose(1, 2))
            return
        for head, weight in zip(upstream.lm_head, model.heads):
            head.weight.copy_(weight)


def upstream_frames(upstream, model, talker_hidden, c0, sampler: Sampler) -> torch.Tensor:
    """Upstream's per-frame call, as its talker or backbone makes it: qwen-tts generate(inputs_embeds=[B, 2, H],
    max_new_tokens=15); CSM generate(input_ids=[B, 2] (0, c0), backbone_last_hidden_state=[B, H]) for 31 codes."""
    settings = dict(max_new_tokens=model.config.num_residual_codes, do_sample=True, top_k=sampler.top_k,
                    top_p=sampler.top_p, temperature=sampler.temperature)
    if model.config.layout == "csm":
        ids = torch.stack([torch.zeros_like(c0), c0], dim=1)
        return upstream.generate(input_ids=ids, backbone_last_hidden_state=talker_hidden,
                                 min_new_tokens=model.config.num_residual_codes, **settings)
    prompt = torch.stack([talker_hidden, model.code_embed(c0)], dim=1)
    return upstream.generate(inputs_embeds=prompt, **settings)


def batch_inputs(predictor: ControlledPredictor, batch: int, repeat: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The talker states [B, H] and c0 [B] of the `repeat`-th timed batch of `batch` frames."""
    frames = predictor.frames(batch, seed=1000 * batch + repeat)
    device = predictor.model.device
    return torch.stack([h for h, _ in frames]).to(device), torch.tensor([c for _, c in frames], device=device)


@torch.inference_mode()
def time_batches(predictor: ControlledPredictor, upstream, batch: int, size: int, strength: float | None,
                 repeats: int, sampler: Sampler, weights: str | None = None) -> dict:
    """Median ms of decoding `repeats` batches of `batch` frames with (a) our AR, (b) the policy's tree N = `size`
    (0: AR, timed once as (a)), (c) upstream; the same frames for all three, interleaved. Each of ours draws from
    its own generator seeded 0, as `rvqspec.bench.controlled.tokens_per_step` does: calibrated on the same frames
    (`batch_inputs`), the policy's run repeats the calibration's draws."""
    model, drafter = predictor.model, ReusedHeads(predictor.model)
    tree = default_tree(size) if size else None
    if strength is not None:
        predictor.set_strength(strength)
        if upstream is not None:
            sync_upstream_heads(upstream, model)
    model = quantize(model, weights) if weights else model  # our AR and policy with int8 weights; upstream float
    ar_draws, policy_draws = (torch.Generator(model.device).manual_seed(0) for _ in range(2))
    inputs = [batch_inputs(predictor, batch, r) for r in range(repeats + 1)]
    runs = {"ar": lambda h, c: decode_frames(model, h, c, sampler, ar_draws)}
    if size:
        runs["policy"] = lambda h, c: decode_frames(model, h, c, sampler, policy_draws, drafter, tree)
    if upstream is not None:
        runs["upstream"] = lambda h, c: upstream_frames(upstream, model, h, c, sampler)
    times = {name: [] for name in runs}
    decoded = []  # the policy's rows
    for r, (hidden, c0) in enumerate(inputs):  # the first batch warms every path up
        for name, run in runs.items():
            start = clocks(model.device)
            out = run(hidden, c0)
            if r:
                times[name].append(elapsed_ms(start, model.device)[0])
                if name == "policy":
                    decoded += out.rows
    ms = {name: statistics.median(values) for name, values in times.items()}
    ms.setdefault("policy", ms["ar"])
    fps = {name: 1e3 * batch / value for name, value in ms.items()}
    return {"batch": batch, "tree_size": size, "ms": ms, "frames_per_second": fps,
            "policy_tokens_per_step": tokens_per_step(decoded) if decoded else 1.0,
            "policy_over_ar": fps["policy"] / fps["ar"],
            "policy_over_upstream": fps["policy"] / fps["upstream"] if "upstream" in fps else None,
            "ar_over_upstream": fps["ar"] / fps["upstream"] if "upstream" in fps else None}


def measure_setting(predictor: ControlledPredictor, upstream, plan: BatchPlan, strengths: dict, sampler: Sampler,
                    dtype: str, threads: int, log) -> dict:
    model = quantize(predictor.model, plan.weights) if plan.weights else predictor.model
    device_path.prepare(model, name="the benchmark's predictor")  # its kernel choices at this thread count, as a
    # loaded model has them (`MultiCodeDecoder.from_pretrained`, the Engine): else a fresh cache times the plain path
    trees = {n: default_tree(n) for n in SIZES}
    drafter = ReusedHeads(model)
    ms = {}
    for batch in plan.batches:
        ms[batch] = latency_row(call_latency(model, drafter, trees, sampler, plan.latency_rounds, batch=batch))
        log(f"  B={batch}: AR step {ms[batch][0]:.2f} ms; round " +
            ", ".join(f"N={n} {ms[batch][n]:.2f}" for n in trees) + " ms")
    frames = predictor.frames(plan.calibration_frames, seed=1)
    for n in PAPER_ACCEPTANCE:
        if n not in strengths:
            strengths[n] = calibrate_to_paper(predictor, trees[n], sampler, frames, plan.calibration_iterations,
                                              lambda: paper_round_acceptance(
                                                  trees[n], PAPER_ACCEPTANCE[n], sampler, plan.calibration_frames,
                                                  plan.calibration_iterations, model.dtype, model.device))
            log_calibration(log, n, strengths[n])
    for n in trees:  # sizes the paper did not measure: at its headline's operating point, as the Engine's benchmarks
        if n not in strengths:
            strengths[n] = at_strength(predictor, trees[n], strengths[PAPER_HEADLINE].strength, sampler, frames)
    # The policy sees what a user's calibration gives it: each frame's calls at that acceptance.
    calls = {n: measured_distribution(strengths[n].frame_calls, model.config.num_code_groups) for n in trees}
    policy = Policy.build(model, trees, calls, LatencyTable(ms, "measured in this run"))
    rows = []
    for batch in plan.batches:
        size = policy.choose(batch)
        row = time_batches(predictor, upstream, batch, size, strengths[size].strength if size else None, plan.repeats,
                           sampler, plan.weights)
        row["predicted_policy_over_ar"] = policy.predicted_speedup(batch, size) if size else 1.0
        row["why"] = policy.explain(batch)
        rows.append(row)
        log(f"  B={batch}: {'AR' if not size else f'N={size}'}; frames/s AR {row['frames_per_second']['ar']:.1f}, "
            f"policy {row['frames_per_second']['policy']:.1f} ({row['policy_over_ar']:.2f}x, predicted "
            f"{row['predicted_policy_over_ar']:.2f}x)" + (f", upstream {row['frames_per_second']['upstream']:.1f}"
                                                           if upstream is not None else ""))
    switch = next((r["batch"] for r in rows if r["tree_size"] == 0), None)
    return {"dtype": dtype, "threads": threads, "device": plan.device, "key": setting_key(model),
            "weights": model.weights,
            "latency_ms": {str(b): {str(n): v for n, v in row.items()} for b, row in ms.items()},
            "strengths": {str(n): {"strength": v.strength, "calibrated": v.measured, "frame_calls": v.frame_calls,
                                   "tokens_per_step": model.config.num_residual_codes * len(v.frame_calls)
                                   / sum(v.frame_calls)}
                          for n, v in strengths.items()}, "frames": rows, "switch_to_ar_at": switch}


ARCHITECTURE_NAMES = {"0.6b": "Qwen3-TTS 0.6B code predictor", "1.7b": "Qwen3-TTS 1.7B code predictor",
                      "csm-1b": "Sesame CSM-1B depth decoder"}


def run_batch_bench(plan: BatchPlan, log=print) -> dict:
    sampler = Sampler()
    config = ARCHITECTURES[plan.arch]
    report = {"machine": machine(), "plan": plan.__dict__, "architecture": ARCHITECTURE_NAMES[plan.arch],
              "codes_per_frame": config.num_residual_codes,
              "sampler": {"temperature": sampler.temperature, "top_k": sampler.top_k}, "settings": []}
    for dtype in plan.dtypes:
        predictor = controlled_predictor(config, dtype=dtype, device=plan.device)
        try:
            upstream = upstream_decoder(predictor.model)
        except Exception as e:  # the reference is an optional extra: report without it
            log(f"upstream qwen-tts unavailable ({e}): timing ours only")
            upstream = None
        strengths: dict = {}
        for threads in plan.threads:
            with intra_op_threads(threads):
                log(f"{plan.arch} {dtype} {threads} thread(s) on {plan.device}:")
                report["settings"].append(measure_setting(predictor, upstream, plan, strengths, sampler, dtype,
                                                          threads, log))
        del predictor, upstream
    finish_machine(report["machine"])
    first = report["settings"][0]
    report["batch_policy_speedup"] = {str(r["batch"]): r["policy_over_ar"] for r in first["frames"]}
    report["batch_policy_speedup_by_setting"] = {
        f"{s['dtype']}/{s['threads']}t": {str(r["batch"]): r["policy_over_ar"] for r in s["frames"]}
        for s in report["settings"]}
    return report


def latency_entries(report: dict) -> dict:
    """The device file's latency tables from a report: {setting key: {"ms": ..., "measured_on": ...}}."""
    where = f"{report['machine']['cpu']}, {report['machine']['date']}"
    return {s["key"]: {"ms": s["latency_ms"], "measured_on": f"{s['key']} on {where}"} for s in report["settings"]}


def write_device_latency(report: dict) -> Path:
    return update_device_file({"latency": latency_entries(report)})
