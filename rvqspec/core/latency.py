"""Per-call latency of the AR step and of speculative rounds: what the decoding policy's tables hold (ms per call at
batch B and tree size N, N = 0 an AR step), measured by `rvqspec bench --batch`, by `tune`, and by the policy itself
on first use where this CPU class has no table (`policy.find_latency_table`)."""

import statistics
import time

import torch

from rvqspec.core.context import frame_slots, new_context
from rvqspec.core.decode import autoregressive_step, speculative_round
from rvqspec.core.model import MultiCodeDecoder
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import Tree

TIMED_K = 7  # rounds are timed mid-frame, where every depth of a depth-3 tree is still in the frame


def clocks(device: torch.device | None = None) -> tuple[float, float]:
    """Wall and process CPU time, after the device's queued work (an accelerator runs asynchronously)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter(), time.process_time()


def elapsed_ms(start: tuple[float, float], device: torch.device | None = None) -> tuple[float, float]:
    wall, cpu = clocks(device)
    return (wall - start[0]) * 1e3, (cpu - start[1]) * 1e3


def medians(samples: list[tuple[float, float]]) -> dict:
    return {"wall_ms": statistics.median(s[0] for s in samples), "cpu_ms": statistics.median(s[1] for s in samples),
            "repeats": len(samples)}


def timed_ks(batch: int) -> list[int]:
    """Each row's k in a timed round: TIMED_K for one row; a batch spreads its rows over TIMED_K-2..TIMED_K+2,
    as ragged progress does (rows at different codebooks need different heads)."""
    return [TIMED_K - 2 + (b + 2) % 5 for b in range(batch)]


@torch.inference_mode()
def call_latency(model: MultiCodeDecoder, drafter, trees: dict[int, Tree], sampler: Sampler, rounds: int,
                 warmup: int = 2, batch: int = 1) -> dict:
    """Median wall and CPU ms of one AR step and of one speculative round per tree for `batch` rows,
    interleaved in rounds."""
    c, generator = model.config, torch.Generator(model.device).manual_seed(0)
    slots = torch.arange(c.num_code_groups, device=model.device)
    masks = slots[None, :] <= slots[:, None]
    code = torch.ones(batch, dtype=torch.long, device=model.device)
    hidden = torch.randn(batch, c.hidden_size, device=model.device).to(model.dtype)
    ks = timed_ks(batch)
    k = torch.tensor(ks, device=model.device)
    samples: dict = {"ar": []} | {n: [] for n in trees}
    for r in range(warmup + rounds):
        ctx = new_context(model, model.new_cache(batch, c.num_code_groups), sampler, generator, None, None, batch)
        start = clocks(model.device)
        autoregressive_step(ctx, code, TIMED_K + 1, slots, masks)
        if r >= warmup:
            samples["ar"].append(elapsed_ms(start, model.device))
        for n, tree in trees.items():
            cache = model.new_cache(batch, frame_slots(model, tree))
            ctx = new_context(model, cache, sampler, generator, drafter, tree, batch)
            start = clocks(model.device)
            speculative_round(ctx, k, ks, code, hidden)
            if r >= warmup:
                samples[n].append(elapsed_ms(start, model.device))
    ar = medians(samples["ar"])
    spec = {n: medians(samples[n]) | {"overhead": medians(samples[n])["wall_ms"] / ar["wall_ms"] - 1,
                                      "overhead_cpu": medians(samples[n])["cpu_ms"] / ar["cpu_ms"] - 1}
            for n in trees}
    return {"ar": ar, "spec": spec}


def latency_row(latency: dict) -> dict[int, float]:
    """A `call_latency` result as one row of a policy latency table: N -> ms per call (N = 0: the AR step)."""
    return {0: latency["ar"]["wall_ms"]} | {n: value["wall_ms"] for n, value in latency["spec"].items()}
