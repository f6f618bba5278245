"""Where a speculative round's time goes on this CPU, next to one AR step: why 2.0x is (not) reached.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/round_profile.py [--arch 0.6b] [--dtype bfloat16] [--size 32]

The real architecture (random weights: timing does not depend on them), the deployed sampler, ReusedHeads
drafts, a default tree of N nodes, timed mid-frame (k = TIMED_K as in `rvqspec bench`). The core's own
functions are timed piece by piece, interleaved, medians of repeats:
- AR step = forward at q=1 + one head + one sampled code (`autoregressive_step` does exactly these);
- round   = drafts (K rank-only heads + top-m: `Drafter.candidates`) + forward at q=N+1 + tree walk (one head
            and one draw per visited depth: on the CPU `walk.walk_on_host`, which stops at the first depth without a
            match) + cache move; the whole `speculative_round` is timed too, to check that the pieces add up.
The timed round's random drafts are rarely accepted, so its walk visits fewer depths than a round at the
paper's acceptance (T tokens/step: T depths on average); the bound table adds one head + draw per missing depth.
torch.profiler then splits the two forwards by op kind (matmul, attention, elementwise), profiled alternately,
medians: the part of the round that grows with q. Reaching S x over AR at T tokens/step needs round <= T / S AR steps; the report shows the
speed-up bound T x AR / round as measured, and with each excess removed. Writes round-profile.{json,md}. `--smoke`:
a tiny predictor (`smoke_config`), 3 repeats, a temporary folder.
"""

import argparse
import statistics
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from rvqspec.bench.controlled import PAPER_ACCEPTANCE, controlled_predictor
from rvqspec.bench.one_stream import ARCHS
from rvqspec.bench.systems import smoke_config
from rvqspec.bench.timing import SMOKE_HELP, finish_machine, machine, machine_text, report_folder
from rvqspec.core import device_path
from rvqspec.core.checkpoint import save_json, save_text
from rvqspec.core.context import new_context
from rvqspec.core.decode import autoregressive_step, speculative_round
from rvqspec.core.drafters import ReusedHeads
from rvqspec.core.latency import TIMED_K, clocks, elapsed_ms
from rvqspec.core.quantize import SCHEMES, quantize
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import default_tree
from rvqspec.core.walk import walk

OP_KINDS = {"matmul": ("linear", "mm", "addmm", "bmm", "matmul"),
            "attention": ("scaled_dot_product", "flash_attention")}


def op_kind(name: str) -> str:
    leaf = name.split("::")[-1]
    return next((kind for kind, keys in OP_KINDS.items() if any(k in leaf for k in keys)), "elementwise and other")


def pieces(model, cache, drafter, tree, sampler, generator) -> dict:
    """Closures, one per timed piece, over the same state the core uses at k = TIMED_K (a batch of one)."""
    ctx = new_context(model, cache, sampler, generator, drafter, tree, 1)
    c, plan, k = model.config, ctx.plan, TIMED_K
    slots = torch.arange(cache.slots)  # one cache for all pieces: AR masks cover the tree's slots too
    masks = slots[None, :] <= slots[:, None]
    code, hidden_k = torch.ones(1, dtype=torch.long), torch.randn(1, c.hidden_size).to(model.dtype)
    ks, k_row = [k], torch.tensor([k])
    top = drafter.candidates(ctx, hidden_k, ks)
    tokens = torch.cat([code[:, None], top.flatten(1)[:, plan.draft_index]], dim=1)
    positions, tables, tree_mask = plan.at(k_row, ks)
    x = model.embed_codes(tokens, tables)
    position = slots[k + 1:k + 2]
    x1 = model.embed_codes(code, position - 1)[:, None]
    hidden = model(x, positions, tree_mask, cache, plan.scratch)
    node = [0]  # the host walk's (a host list)

    def the_walk():  # the core's, as `speculative_round` calls it, and its result on the host
        path = walk(ctx, k_row, ks, tokens, hidden)
        return [path.node, path.found] if isinstance(path.node, list) else torch.stack([path.node, path.found]).tolist()

    return {
        "ar: forward q=1": lambda: model(x1, position, masks[k + 1:k + 2], cache, position),
        "ar: head + sample": lambda: sampler.sample(model.head_logits(hidden[:, 0], k + 1), generator),
        "ar: whole step": lambda: autoregressive_step(ctx, code, k + 1, slots, masks),
        "round: drafts": lambda: drafter.candidates(ctx, hidden_k, ks),
        f"round: forward q={tree.size + 1}": lambda: model(x, positions, tree_mask, cache, plan.scratch),
        "round: walk": the_walk,
        "round: cache move": lambda: cache.move(*plan.compaction(k_row, ks, node)),
        "round: whole": lambda: speculative_round(ctx, k_row, ks, code, hidden_k),
    }


@torch.inference_mode()
def time_pieces(funcs: dict, repeats: int) -> dict:
    samples = {name: [] for name in funcs}
    for r in range(repeats + 2):
        for name, func in funcs.items():
            start = clocks()
            func()
            if r >= 2:
                samples[name].append(elapsed_ms(start)[0])
    return {name: statistics.median(v) for name, v in samples.items()}


@torch.inference_mode()
def op_times(func, calls: int) -> dict:
    """Self CPU ms per call of `func`, by op kind."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            func()
    kinds = dict.fromkeys((*OP_KINDS, "elementwise and other"), 0.0)
    for event in prof.key_averages():
        kinds[op_kind(event.key)] += event.self_cpu_time_total / 1e3 / calls
    return kinds


def forward_ops(funcs: dict, alternations: int = 7, calls: int = 3) -> dict:
    """op_times of each function in `funcs`, profiled alternately (the load drifts); medians per op kind."""
    samples = {name: [] for name in funcs}
    for _ in range(alternations):
        for name, func in funcs.items():
            samples[name].append(op_times(func, calls))
    return {name: {kind: statistics.median(s[kind] for s in runs) for kind in runs[0]}
            for name, runs in samples.items()}


def visited_depths(funcs: dict, tree, calls: int = 20) -> float:
    """Mean depths the timed walk visits (the CPU's walk: accepted + 1; the device walk: every depth)."""
    if not device_path.choose(torch.device("cpu"), torch.bfloat16).host_walk:
        return tree.max_depth + 1
    with torch.inference_mode():
        return statistics.mean(funcs["round: walk"]()[1][0] + 1 for _ in range(calls))  # [[node], [found]]


def analyse(times: dict, ops: dict, size: int, tokens: float, target: float, visited: float) -> dict:
    forward_n, forward_1 = times[f"round: forward q={size + 1}"], times["ar: forward q=1"]
    # A round at the paper's acceptance walks `tokens` depths on average: one head + draw per depth not visited here.
    missing = max(tokens - visited, 0.0) * times["ar: head + sample"]
    ar, round_ms = times["ar: whole step"], times["round: whole"] + missing
    heads = times["round: drafts"] + times["round: walk"] + missing - times["ar: head + sample"]
    growth = {kind: ops["round"][kind] - ops["ar"][kind] for kind in ops["round"]}
    # The profiler inflates many small ops, so the elementwise growth is the timed growth of the forward
    # minus what the profiler puts on the big kernels (matmul, attention).
    elementwise = max(forward_n - forward_1 - growth["matmul"] - growth["attention"], 0.0)
    without = {"as measured (walk of tokens/step depths)": round_ms,
               "elementwise growth removed": round_ms - elementwise,
               "extra heads and draws removed (drafts + walk = one head + sample)": round_ms - heads,
               "both removed": round_ms - elementwise - heads}
    return {"ar_step_ms": ar, "round_ms": round_ms, "round_over_ar": round_ms / ar,
            "needed_round_over_ar": tokens / target, "forward_growth_ms": forward_n - forward_1,
            "timed_walk_depths": visited, "walk_depths_added_ms": missing,
            "forward_growth_by_kind_ms": growth, "elementwise_growth_ms": elementwise, "extra_heads_ms": heads,
            "speedup_bound": {name: tokens * ar / ms for name, ms in without.items()}}


def markdown(report: dict) -> str:
    a, m, s = report["analysis"], report["machine"], report["settings"]
    lines = ["# Where a speculative round's time goes", "",
             f"`python benchmarks/round_profile.py --arch {s['arch']} --dtype {s['dtype']} --size {s['size']} --threads "
             f"{s['threads']}" + (f" --weights {s['weights']}" if s.get("weights") else "") +
             f"`: random weights, ReusedHeads drafts, default tree N={s['size']}, k={s['k']}, "
             f"median of {s['repeats']} interleaved repeats; {machine_text(m)}.", "",
             "| piece | ms |", "|---|---|"]
    lines += [f"| {name} | {ms:.2f} |" for name, ms in report["times_ms"].items()]
    lines += ["", "Self CPU ms per forward by op kind (torch.profiler):", "",
              f"| op kind | q=1 | q={s['size'] + 1} | growth |", "|---|---|---|---|"]
    for kind in report["ops_ms"]["round"]:
        q1, qn = report["ops_ms"]["ar"].get(kind, 0.0), report["ops_ms"]["round"][kind]
        lines.append(f"| {kind} | {q1:.2f} | {qn:.2f} | {qn - q1:+.2f} |")
    lines += ["", f"The forward grows by {a['forward_growth_ms']:.2f} ms from q=1 to q={s['size'] + 1} (timed), of which "
              f"{a['elementwise_growth_ms']:.2f} ms is not matmul or attention (norms, RoPE, SiLU, residuals, casts: "
              f"many small ops whose cost grows with q); drafts + walk cost {a['extra_heads_ms']:.2f} ms more than "
              "the AR step's one head and draw.", "",
              f"The timed walk visited {a['timed_walk_depths']:.2f} depths (its random drafts are rarely accepted); a "
              f"round at {s['tokens_per_step']:.2f} tokens/step visits {s['tokens_per_step']:.2f} on average, so "
              f"{a['walk_depths_added_ms']:.2f} ms (one head + draw per missing depth) is added to the round below.", "",
              f"A round costs {a['round_over_ar']:.2f} AR steps; {s['target']:.1f}x at the paper's "
              f"{s['tokens_per_step']:.2f} tokens/step needs <= {a['needed_round_over_ar']:.3f}. Speed-up bound "
              "tokens/step x AR step / round:", "", "| round | bound |", "|---|---|"]
    lines += [f"| {name} | {bound:.2f}x |" for name, bound in a["speedup_bound"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--arch", default="0.6b", choices=list(ARCHS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--size", type=int, default=32, choices=list(PAPER_ACCEPTANCE))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=None, help="default 30 (--smoke: 3)")
    parser.add_argument("--target", type=float, default=2.0, help="speed-up over AR to check")
    parser.add_argument("--weights", choices=SCHEMES, help="quantize the model (rvqspec.quantize) before timing")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (3 if args.smoke else 30)
    torch.set_num_threads(args.threads)
    info = machine()
    model = controlled_predictor(smoke_config(ARCHS[args.arch]) if args.smoke else ARCHS[args.arch],
                                 dtype=args.dtype).model
    model = quantize(model, args.weights) if args.weights else model
    tree, sampler, generator = default_tree(args.size), Sampler(), torch.Generator().manual_seed(0)
    cache = model.new_cache(1, model.config.num_code_groups + tree.size + 1)
    with torch.inference_mode():
        funcs = pieces(model, cache, ReusedHeads(model), tree, sampler, generator)
    times = time_pieces(funcs, args.repeats)
    ops = forward_ops({"ar": funcs["ar: forward q=1"], "round": funcs[f"round: forward q={args.size + 1}"]})
    visited = visited_depths(funcs, tree)
    tokens = PAPER_ACCEPTANCE[args.size]
    settings = vars(args) | {"k": TIMED_K, "tokens_per_step": tokens}
    report = {"settings": settings, "machine": finish_machine(info), "times_ms": times,
              "ops_ms": ops, "analysis": analyse(times, ops, args.size, tokens, args.target, visited)}
    out = report_folder(Path(args.out), args.smoke)
    name = f"round-profile-{args.weights}" if args.weights else "round-profile"
    save_json(out / f"{name}.json", report)
    save_text(out / f"{name}.md", markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
