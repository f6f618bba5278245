"""The reports of `rvqspec bench` (one stream: latency per N, Figure 4) and `rvqspec bench --batch` (frames/s
per batch size): Markdown and plots from the measured JSON, nothing measured here."""

from pathlib import Path

from rvqspec.bench.timing import machine_text
from rvqspec.core.checkpoint import atomic_write


def setting_name(s: dict) -> str:
    return f"{s['model']} {s['dtype']} {s['threads']}t"


def optional(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def target_text(row: dict) -> str:
    target = row.get("target") or {"metric": "tokens_per_step", "value": row["target_tokens_per_step"]}
    unit = "tok/step" if target["metric"] == "tokens_per_step" else "accepted/round"
    return f"{target['value']:.2f} {unit}"


def markdown(report: dict) -> str:
    lines = ["# rvqspec bench", "", *latency_lines(report), *controlled_lines(report), *summary_lines(report)]
    return "\n".join(lines) + "\n"


def latency_lines(report: dict) -> list[str]:
    """The header, per-call latency and overhead per setting, and the speed-up it predicts."""
    m, sizes = report["machine"], report["plan"]["sizes"]
    lines = [f"`{report.get('command', 'rvqspec bench')}` (OMP_WAIT_POLICY={m['omp_wait_policy']}), {m['cores']} "
             f"cores, {machine_text(m)}: absolute times vary; the ratios come from interleaved measurements in one run.",
             "", f"Per-call latency, median of {report['plan']['latency_rounds']} interleaved rounds (wall clock). A step "
             "is all the decoding core does per call (AR: embed, model, head, sample; speculative: drafts, model over "
             f"q=N+1, tree walk, cache move). Timed at k={report['timed_k']}.", "",
             "| setting | AR step ms | " + " | ".join(f"N={n} ms (overhead)" for n in sizes) + " |",
             "|---|---|" + "---|" * len(sizes)]
    for s in report["settings"]:
        lat = s["latency"]
        lines.append(f"| {setting_name(s)} | {lat['ar']['wall_ms']:.2f} | " + " | ".join(
            f"{lat['spec'][n]['wall_ms']:.2f} ({lat['spec'][n]['overhead']:+.0%})" for n in sizes) + " |")
    lines += ["", "Overhead from CPU time instead (less sensitive to other jobs taking the cores):", "",
              "| setting | " + " | ".join(f"N={n}" for n in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for s in report["settings"]:
        lines.append(f"| {setting_name(s)} | " + " | ".join(
            f"{s['latency']['spec'][n]['overhead_cpu']:+.0%}" for n in sizes) + " |")
    tokens = report["tokens_per_step_by_size"]
    shown = [n for n in sizes if n in tokens]
    lines += ["", f"Predicted speed-up tokens/step / (1 + overhead), tokens/step from {report['tokens_per_step_source']} "
              "(for Qwen3-TTS's 15-code frames; CSM's own tokens/step are in the controlled rows below):",
              "", "| setting | " + " | ".join(f"N={n} ({tokens[n]:.2f} tok/step)" for n in shown) + " |",
              "|---|" + "---|" * len(shown)]
    for s in report["settings"]:
        lines.append(f"| {setting_name(s)} | " + " | ".join(f"{s['predicted_speedup'][n]:.2f}x" for n in shown) + " |")
    return lines


def controlled_lines(report: dict) -> list[str]:
    """The acceptance-controlled runs of the real architectures, and the stand-in's own run."""
    lines, controlled = [], [(s, r) for s in report["settings"] for r in s["controlled"]]
    if controlled:
        lines += ["", "Acceptance-controlled runs (real architecture, random layers, heads peaked with a bisected "
                  "strength; ReusedHeads drafts; deployed sampler). Whole frames with `decode_frame`, AR and "
                  "speculative alternately; realized = median AR frame / median speculative frame. Qwen3-TTS "
                  "frames (15 codes) are set to the paper's tokens/step; other frame lengths (CSM: 31 codes) to the "
                  "drafts accepted per round (rounds with room for the whole tree) that the 0.6B shows there:", "",
                  "| setting | N | target | accepted/round | achieved tok/step | calls/frame | AR frame ms | "
                  "spec frame ms | predicted | realized (wall) | realized (CPU) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {setting_name(s)} | {r['tree_size']} | {target_text(r)} | {optional(r.get('round_acceptance'))} | "
                  f"{r['tokens_per_step']:.2f} | {r['calls_per_frame']:.2f} | {r['ar_frame']['wall_ms']:.1f} | "
                  f"{r['spec_frame']['wall_ms']:.1f} | {r['predicted_speedup']:.2f}x | {r['realized_speedup']:.2f}x | "
                  f"{r['realized_speedup_cpu']:.2f}x |" for s, r in controlled]
    for s in report["settings"]:
        if s["stand_in"]:
            r = s["stand_in"]
            lines += ["", f"Stand-in ({setting_name(s)}, N={r['tree_size']}, frames from {r['frames_from']}): "
                      f"{r['tokens_per_step']:.3f} tokens/step, realized {r['realized_speedup']:.2f}x, ceiling "
                      f"tokens/step / (1 + overhead) {r['ceiling']:.2f}x."]
    return lines


def summary_lines(report: dict) -> list[str]:
    """The chosen N, and the best realized speed-ups at the paper's acceptance (0.6B, CSM-1B)."""
    lines = []
    if report["chosen"]:
        c = report["chosen"]
        lines += ["", f"Chosen for this device: N = {c['tree_size']} ({c['model']}, {c['dtype']}, {c['threads']} "
                  f"thread(s), predicted {c['predicted_speedup']:.2f}x)."]
    if report["paper_acceptance"]:
        p = report["paper_acceptance"]
        lines += [f"Realized speed-up of the 0.6B architecture at the paper's acceptance, best setting: "
                  f"{p['speedup']:.2f}x ({p['dtype']}, {p['threads']} thread(s), N = {p['tree_size']}, "
                  f"{p['tokens_per_step']:.2f} tokens/step; predicted {p['predicted_speedup']:.2f}x)."]
    if report.get("csm_at_paper_acceptance"):
        c = report["csm_at_paper_acceptance"]
        lines += [f"CSM-1B's depth decoder at the same per-round acceptance ({c['round_acceptance']:.2f} drafts "
                  f"accepted per round), best setting: {c['speedup']:.2f}x ({c['dtype']}, {c['threads']} thread(s), "
                  f"N = {c['tree_size']}, {c['tokens_per_step']:.2f} tokens/step, {c['calls_per_frame']:.1f} calls per "
                  f"frame instead of 31; predicted {c['predicted_speedup']:.2f}x)."]
    return lines


def plot(report: dict, path: Path) -> None:
    """Figure 4 style: verify overhead and speed-up vs tree size, acceptance as the grey dashed ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes, tokens = report["plan"]["sizes"], report["tokens_per_step_by_size"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, s in enumerate(report["settings"]):
        color = f"C{i % 10}"
        left.plot(sizes, [s["latency"]["spec"][n]["overhead"] * 100 for n in sizes], "o-", color=color,
                  label=setting_name(s))
        shown = [n for n in sizes if n in s["predicted_speedup"]]
        right.plot(shown, [s["predicted_speedup"][n] for n in shown], "o-", color=color, label=setting_name(s))
        runs = s["controlled"] + ([s["stand_in"]] if s["stand_in"] else [])
        right.plot([r["tree_size"] for r in runs], [r["realized_speedup"] for r in runs], "*", color=color,
                   markersize=11)
    shown = [n for n in sizes if n in tokens]
    right.plot(shown, [tokens[n] for n in shown], "--", color="grey", label="tokens/step (ceiling)")
    right.axhline(1.0, color="black", linewidth=0.6)
    for ax, label in ((left, "verify overhead (%)"), (right, "speed-up over AR (x)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xlabel("sparse tree size N")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    right.set_title("lines: tokens/step / (1 + overhead); stars: realized", fontsize=9)
    left.set_title(f"{report['machine']['cpu']}", fontsize=9)
    left.legend(fontsize=7)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)


def batch_markdown(report: dict) -> str:
    m = report["machine"]
    lines = ["# rvqspec bench --batch", "",
             f"`{report.get('command', 'rvqspec bench --batch')}`: {report['architecture']} (random weights, "
             f"acceptance controlled to the paper's), {machine_text(m)}. Frames/s = B / median time of one "
             f"batched frame ({report.get('codes_per_frame', 15)} codes per row), the same batches for every method, "
             "interleaved; ratios are from one run.", ""]
    for s in report["settings"]:
        weights = f" with {s['weights']} weights" if s.get("weights", "float") != "float" else ""
        lines += [f"## {s['dtype']}{weights}, {s['threads']} thread(s), {s['device']}", "",
                  "| B | policy | frames/s AR (ours) | frames/s policy | frames/s upstream | policy / AR | predicted "
                  "| policy / upstream | tokens/step |", "|---|---|---|---|---|---|---|---|---|"]
        for r in s["frames"]:
            fps = r["frames_per_second"]
            upstream = f"{fps['upstream']:.1f}" if "upstream" in fps else "-"
            versus = f"{r['policy_over_upstream']:.2f}x" if r["policy_over_upstream"] else "-"
            choice = f"N={r['tree_size']}" if r["tree_size"] else "AR"
            lines.append(f"| {r['batch']} | {choice} | {fps['ar']:.1f} | {fps['policy']:.1f} | {upstream} | "
                         f"{r['policy_over_ar']:.2f}x | {r['predicted_policy_over_ar']:.2f}x | {versus} | "
                         f"{r['policy_tokens_per_step']:.2f} |")
        switch = s["switch_to_ar_at"]
        lines += ["", f"The policy switches to AR at B = {switch}." if switch else
                  "The policy keeps speculating at every measured B.", "",
                  "Latency per call (ms, median), N = 0 an AR step:", "",
                  "| B | " + " | ".join(f"N={n}" for n in next(iter(s["latency_ms"].values()))) + " |",
                  "|---|" + "---|" * len(next(iter(s["latency_ms"].values())))]
        lines += [f"| {b} | " + " | ".join(f"{v:.2f}" for v in row.values()) + " |" for b, row in s["latency_ms"].items()]
        lines.append("")
    return "\n".join(lines)


def batch_plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, s in enumerate(report["settings"]):
        batches = [r["batch"] for r in s["frames"]]
        name = f"{s['dtype']} {s['threads']}t"
        for method, style in (("policy", "o-"), ("ar", "s--"), ("upstream", "^:")):
            values = [r["frames_per_second"].get(method) for r in s["frames"]]
            if None not in values:
                ax.plot(batches, values, style, color=f"C{i}", label=f"{name} {method}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size B")
    ax.set_ylabel("frames per second")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"{report['architecture']}, {report['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)
