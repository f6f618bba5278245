"""bfloat16 speculation on the CPU: a verify call of N rows against the one-row call, oneDNN against rvqspec's kernel.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bf16_rows.py [--threads 1] [--frames 12]
    python benchmarks/bf16_rows.py --smoke   # seconds: a tiny predictor, a temporary folder

Three measurements, 1 thread by default, each interleaved in one process (medians; a shared machine loads all alike):
1. matrices: one call through the 0.6B predictor's 20 layer matrices (157 MB of bfloat16, more than any cache) at
   1..33 rows, per kernel: oneDNN's prepacked GEMM as decoding ran it before (`torch.ops.mkldnn._linear_pointwise`,
   what torch.compile's freezing uses; calls of fewer rows than the measured floor padded), the same unpadded,
   F.linear (ATen's oneDNN matmul without prepacking), float32 compute on a float32 copy, and rvqspec's bfloat16
   kernel (`bf16.cpp`); against the floor (a copy moving the weights' bytes, `floor.copy_of`: inspect's, timed
   interleaved with the calls).
2. calls: the predictor's AR step and its speculative rounds at N = 4, 8, 16, 32 (`latency.call_latency`), oneDNN
   against rvqspec's kernel: the round's cost over the one-row call, by N.
3. frames: the 0.6B predictor with heads at the paper's acceptance (`rvqspec bench --weights`'s model), AR and
   speculative frames at N = 4, 8, 16, each kernel: speculative over its own AR (the yardstick of issue 51).
4. threads: rvqspec's kernel's AR step and verify rounds (N = 4, 8) on 1 and 2 threads, alone and beside a busy core
   (a process spinning, as the speech decoder does beside the frame loop), through the stack as one native call (on
   2 threads one parallel region: kernels.h's `Team`) and through the Python loop of one fork-join region per matrix
   (how bfloat16 ran before: `rvqspec bench --batch` measured 2 threads slower than 1); wall time, interleaved.
5. the round split: the AR step and the N=4 round on rvqspec's kernel with the core's pieces wrapped in CPU-time
   timers (the layers' native call, the forward's Python, embeddings, drafts and their heads, the walk and its heads
   and draws, the cache move; the rest is glue), with the draft heads ranking as before (the exact bfloat16 heads)
   and as now (`quantize.draft_scheme`'s int8 copies).
Tables 2, 3 and 5 run rvqspec's kernel with the draft heads in each way (exact, w8a16, the chosen scheme).
Times are the process's CPU time at 1 thread (`--clock cpu`, the default there: on a shared machine the time the
process waits for a core is not counted; waiting for memory is), wall time otherwise (and in the threads table).
Writes bf16-rows.{json,md}.
"""

import argparse
import importlib
import multiprocessing
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from rvqspec.bench.controlled import PAPER_ACCEPTANCE, calibrate_strength, controlled_predictor  # noqa: E402
from rvqspec.bench.floor import copy_of, predictor_shapes  # noqa: E402
from rvqspec.bench.systems import smoke_config  # noqa: E402
from rvqspec.bench.timing import (SMOKE_HELP, finish_machine, machine, machine_text, report_folder,  # noqa: E402
                                  write_reports)
from rvqspec.core import cpu_class, device_path, fused  # noqa: E402
from rvqspec.core.bf16 import pack_bf16  # noqa: E402
from rvqspec.core.changes import Derived  # noqa: E402
from rvqspec.core.config import ARCHITECTURES  # noqa: E402
from rvqspec.core.decode import decode_frame, tokens_per_step  # noqa: E402
from rvqspec.core.drafters import ReusedHeads  # noqa: E402
from rvqspec.core.latency import call_latency, clocks, elapsed_ms  # noqa: E402
from rvqspec.core.quantize import QuantizedHeads, draft_scheme  # noqa: E402
from rvqspec.core.sampling import Sampler  # noqa: E402
from rvqspec.core.tree import default_tree  # noqa: E402

from int8_calls import beside_busy, spin  # noqa: E402

ROWS = (1, 2, 4, 8, 9, 16, 17, 33)
CALL_SIZES = (4, 6, 8, 16, 32)
FRAME_SIZES = (4, 6, 8, 16)  # the policy's sizes up to its picks here
SMOKE = {"frames": 2, "repeats": 1, "alternations": 1, "thread_alternations": 1, "rounds": 1,
         "calibration_frames": 2, "calibration_iterations": 1}
KERNELS = ("onednn", "bf16.cpp")  # how decoding's bfloat16 matmuls ran before, and with rvqspec's kernel
DRAFTS = ("exact", "w8a16", "chosen")  # how draft heads rank: the exact heads (before), torch's weight-only int8,
# `quantize.draft_scheme` (now)
SETTINGS = [("onednn", "chosen"), *(("bf16.cpp", drafts) for drafts in DRAFTS)]  # (kernel, drafts) of tables 2, 3
W8A16_COPIES: dict[int, Derived] = {}  # per model: `draft_ranking`'s w8a16 copies, where the chosen ones are not
SPLIT_SIZE = 4  # the round split's N
SPLIT_WARMUP = 2  # call_latency's warm-up rounds: not in the split
# (piece, module, owner, attribute): timed inclusive, the split's pieces (a piece may take several functions)
SPLIT_PIECES = [("forward", "rvqspec.core.model", "MultiCodeDecoder", "forward"),
                ("layers (the native stack)", "rvqspec.core.fused", None, "layers"),
                ("embeddings", "rvqspec.core.model", "MultiCodeDecoder", "embed_codes"),
                ("drafts", "rvqspec.core.drafters", "Drafter", "candidates"),
                ("draft heads", "rvqspec.core.drafters", "Drafter", "head"),
                ("draft heads", "rvqspec.core.draft_heads", None, "span_logits"),
                ("walk", "rvqspec.core.decode", None, "walk"),
                ("heads", "rvqspec.core.model", "MultiCodeDecoder", "head_logits"),
                ("draws", "rvqspec.core.context", "RoundContext", "sample"),
                ("cache move", "rvqspec.core.model", "KVCache", "move")]
PIECE_NAMES = list(dict.fromkeys(piece for piece, *_ in SPLIT_PIECES))
THREAD_SIZES = (4, 8)
STACKS = ("Python loop", "one native call")  # a fork-join region per matrix (before), one per stack


@contextmanager
def matmuls(kernel: str):
    """Decode with oneDNN ("onednn": the measured choice without rvqspec's kernel) or rvqspec's kernel, by editing
    this process's measured choice (`device_path.prepared`)."""
    entry = device_path.prepared[device_path.choices_key(torch.bfloat16)]["matmul"]
    before = entry["bf16_kernel"]
    entry["bf16_kernel"] = kernel == "bf16.cpp"
    device_path.path_of.cache_clear()
    try:
        yield
    finally:
        entry["bf16_kernel"] = before
        device_path.path_of.cache_clear()


@contextmanager
def draft_ranking(model, drafts: str):
    """Rank drafts with the exact heads ("exact"), w8a16 int8 copies or `quantize.draft_scheme`'s ("chosen"), by
    editing this process's measured choice (`int8_drafts`) and the model's derived draft copies."""
    entry = device_path.prepared[device_path.choices_key(model.dtype)]
    before, copies = entry["int8_drafts"], model.head_set.drafts
    entry["int8_drafts"] = drafts != "exact"
    if drafts == "w8a16" and draft_scheme() != "w8a16":  # made once, kept beside the model's own copies
        model.head_set.drafts = W8A16_COPIES.setdefault(id(model), Derived(lambda heads: QuantizedHeads(heads, "w8a16")))
    device_path.path_of.cache_clear()
    try:
        yield
    finally:
        entry["int8_drafts"], model.head_set.drafts = before, copies
        device_path.path_of.cache_clear()


@contextmanager
def setting(model, kernel: str, drafts: str):
    """Decode with `kernel`'s matmuls (`matmuls`) and drafts ranked by `drafts` (`draft_ranking`)."""
    with matmuls(kernel), draft_ranking(model, drafts):
        yield


def setting_name(kernel: str, drafts: str) -> str:
    return kernel if drafts == "chosen" else f"{kernel}, {drafts} draft heads"


@torch.inference_mode()
def matrix_rows(shapes: list, pad_rows: int, repeats: int, clock: str) -> dict:
    """ms of one call through every matrix of `shapes` per kernel and row count, and the floor."""
    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(s, generator=generator) / s[1] ** 0.5).bfloat16() for s in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]
    ours = [pack_bf16(w) for w in weights] if fused.kernels() is not None and fused.kernels().has_bf16_gemm() else None
    wide = [w.float() for w in weights]
    inputs = {r: {k: torch.randn(r, k, generator=generator).bfloat16() for k in {s[1] for s in shapes}} for r in ROWS}

    def onednn(x: dict, pad: int) -> list:
        rows = len(next(iter(x.values())))
        x = {k: torch.cat([v, v[-1:].expand(pad - rows, -1)]) for k, v in x.items()} if rows < pad else x
        return [torch.ops.mkldnn._linear_pointwise(x[w.shape[1]], p, None, "none", [], "")
                for w, p in zip(weights, packed)]

    kernels = {f"oneDNN packed, padded to {pad_rows} (before)": lambda x: onednn(x, pad_rows),
               "oneDNN packed": lambda x: onednn(x, 1),
               "F.linear": lambda x: [F.linear(x[w.shape[1]], w) for w in weights],
               "float32 compute": lambda x: [F.linear(x[w.shape[1]].float(), w) for w in wide]}
    if ours is not None:
        kernels["rvqspec bf16.cpp"] = lambda x: [fused.kernels().bf16_linear(x[w.shape[1]], p, None, w.shape[0])
                                                 for w, p in zip(weights, ours)]
    nbytes = sum(w.numel() * 2 for w in weights)
    calls = {(name, r): lambda f=f, r=r: f(inputs[r]) for name, f in kernels.items() for r in ROWS}
    ms = device_path.median_ms(calls | {("copy", 0): copy_of(nbytes)}, repeats,
                               time.process_time if clock == "cpu" else time.perf_counter)
    floor = ms["copy", 0]  # a copy moving the weights' bytes (read + write: `floor.copy_of`, inspect's floor)
    return {"floor_ms": floor, "bandwidth_gb_s": nbytes / floor / 1e6, "bytes": nbytes,
            "ms": {name: {str(r): ms[name, r] for r in ROWS} for name in kernels}}


def call_costs(model, sampler: Sampler, alternations: int, rounds: int, clock: str) -> dict:
    """Per setting (`SETTINGS`): median ms of the AR step and of a speculative round per N (alternating settings)."""
    trees = {n: default_tree(n) for n in CALL_SIZES}
    drafter = ReusedHeads(model)
    samples = {s: {"ar": [], **{n: [] for n in CALL_SIZES}} for s in SETTINGS}
    for _ in range(alternations):
        for kernel, drafts in SETTINGS:
            with setting(model, kernel, drafts):
                latency = call_latency(model, drafter, trees, sampler, rounds)
            samples[kernel, drafts]["ar"].append(latency["ar"][f"{clock}_ms"])
            for n in CALL_SIZES:
                samples[kernel, drafts][n].append(latency["spec"][n][f"{clock}_ms"])
    return {setting_name(*s): {str(key): statistics.median(v) for key, v in runs.items()}
            for s, runs in samples.items()}


@torch.inference_mode()
def frame_times(predictor, frames: list, sampler: Sampler, clock: str) -> dict:
    """Median frame ms and tokens/step per (setting, mode): mode 0 AR, N speculative; rotating order per frame. An
    AR frame reads no draft: one AR run per kernel, every setting of the kernel measured against it."""
    model = predictor.model
    runs = [((kernel, "chosen"), 0) for kernel in KERNELS] + [(s, n) for s in SETTINGS for n in FRAME_SIZES]
    trees = {n: default_tree(n) for n in FRAME_SIZES}
    drafter = ReusedHeads(model)
    times, decoded = {run: [] for run in runs}, {run: [] for run in runs}
    for i, (h, c0) in enumerate([frames[0]] + frames):  # the first: warm-up
        for s, n in runs[i % len(runs):] + runs[:i % len(runs)]:
            with setting(model, *s):
                start = clocks()
                result = decode_frame(model, h, c0, sampler, torch.Generator().manual_seed(i),
                                      drafter=drafter if n else None, tree=trees.get(n))
                if i:
                    times[s, n].append(elapsed_ms(start)[clock == "cpu"])
                    decoded[s, n].append(result)
    own = lambda s, n: (s[0], "chosen") if n == 0 else s  # noqa: E731  (the run that measured it)
    paired = lambda s, n: statistics.median(a / b for a, b in zip(times[own(s, 0), 0], times[s, n]))  # noqa: E731
    return {setting_name(*s): {str(n): {"frame_ms": statistics.median(times[own(s, n), n]),
                                        "tokens_per_step": tokens_per_step(decoded[own(s, n), n]),
                                        "paired_speedup": paired(s, n) if n else 1.0}
                               for n in (0, *FRAME_SIZES)} for s in SETTINGS}


@contextmanager
def stack(how: str):
    """Run the decoder stack as one native call (`fused.int8_stack`'s answer) or through the Python loop."""
    native = fused.int8_stack
    fused.int8_stack = native if how == STACKS[1] else lambda model, rows: None
    try:
        yield
    finally:
        fused.int8_stack = native


class RoundSplit:
    """Inclusive CPU time per piece (`SPLIT_PIECES`) of the AR step and of the round, per call: the pieces wrapped in
    place while `installed`; a piece within itself (heads through `by_codebook`) counts once, the heads within drafts
    (exact draft heads) count as draft heads only."""

    def __init__(self):
        self.phase, self.active, self.ms, self.calls = None, dict.fromkeys((*PIECE_NAMES, "total"), 0), {}, {}

    def wrap(self, func, piece: str):
        def timed(*args, **kwargs):
            counted = self.phase is not None and not self.active[piece] and not (
                piece == "heads" and self.active["drafts"])
            self.active[piece] += 1
            start = time.thread_time()
            try:
                return func(*args, **kwargs)
            finally:
                self.active[piece] -= 1
                if counted:
                    key = self.phase, piece
                    self.ms[key] = self.ms.get(key, 0.0) + (time.thread_time() - start) * 1e3
        return timed

    def wrap_phase(self, func, phase: str):
        seen = [0]

        def timed(*args, **kwargs):
            seen[0] += 1
            if seen[0] > SPLIT_WARMUP:
                self.phase, self.calls[phase] = phase, self.calls.get(phase, 0) + 1
            try:
                return self.wrap(func, "total")(*args, **kwargs)
            finally:
                self.phase = None
        return timed

    @contextmanager
    def installed(self):
        modules = [(piece, importlib.import_module(module), owner, name) for piece, module, owner, name in SPLIT_PIECES]
        targets = [(piece, getattr(module, owner) if owner else module, name) for piece, module, owner, name in modules]
        latency = importlib.import_module("rvqspec.core.latency")
        originals = [(target, name, getattr(target, name)) for _, target, name in targets]
        originals += [(latency, name, getattr(latency, name)) for name in ("autoregressive_step", "speculative_round")]
        for piece, target, name in targets:
            setattr(target, name, self.wrap(getattr(target, name), piece))
        latency.autoregressive_step = self.wrap_phase(latency.autoregressive_step, "AR step")
        latency.speculative_round = self.wrap_phase(latency.speculative_round, f"N={SPLIT_SIZE} round")
        try:
            yield
        finally:
            for target, name, original in originals:
                setattr(target, name, original)

    def per_call(self) -> dict:
        """phase -> piece -> ms per call, with the derived pieces: the forward's Python, the drafts' top-m and glue,
        the walk's matching and glue, and the rest (glue)."""
        result = {}
        for phase, calls in self.calls.items():
            ms = {piece: self.ms.get((phase, piece), 0.0) / calls for piece in (*PIECE_NAMES, "total")}
            ms["forward: Python around the stack"] = ms["forward"] - ms["layers (the native stack)"]
            ms["drafts: top-m and glue"] = ms["drafts"] - ms["draft heads"]
            walked = ms["walk"] > 0  # the round's heads and draws are the walk's
            ms["walk: matching and glue"] = ms["walk"] - ms["heads"] - ms["draws"] if walked else 0.0
            outer = ms["forward"] + ms["embeddings"] + ms["drafts"] + ms["cache move"] + (
                ms["walk"] if walked else ms["heads"] + ms["draws"])
            ms["glue (the rest)"] = ms["total"] - outer
            result[phase] = ms
        return result


def round_split(model, sampler: Sampler, alternations: int, rounds: int) -> dict:
    """`RoundSplit.per_call` of the AR step and the N=SPLIT_SIZE round on rvqspec's kernel, per way of ranking the
    drafts (exact heads: before; `quantize.draft_scheme`: now), alternating; medians over alternations."""
    drafter, trees, ways = ReusedHeads(model), {SPLIT_SIZE: default_tree(SPLIT_SIZE)}, ("exact", "chosen")
    samples = {drafts: [] for drafts in ways}
    for _ in range(alternations):
        for drafts in ways:
            split = RoundSplit()
            with setting(model, "bf16.cpp", drafts), split.installed():
                call_latency(model, drafter, trees, sampler, rounds)
            samples[drafts].append(split.per_call())
    return {drafts: {phase: {piece: statistics.median(run[phase][piece] for run in runs) for piece in runs[0][phase]}
                     for phase in runs[0]} for drafts, runs in samples.items()}


def thread_costs(model, sampler: Sampler, alternations: int) -> dict:
    """Wall ms of the AR step and the rounds of THREAD_SIZES on rvqspec's kernel per (stack, busy, threads), one
    call_latency round per alternation (many short samples: a shared machine's load moves between them), in
    alternating order; 1 and 2 threads of a stack run side by side, so that their ratio per alternation sees one
    moment's load. The busy process spins only in busy runs."""
    trees, drafter = {n: default_tree(n) for n in THREAD_SIZES}, ReusedHeads(model)
    runs = [(how, busy, threads) for how in STACKS for busy in (False, True) for threads in (1, 2)]
    samples = {run: {"ar": [], **{str(n): [] for n in THREAD_SIZES}} for run in runs}
    flag = multiprocessing.get_context("spawn").Value("i", 0)
    spinner = multiprocessing.get_context("spawn").Process(target=spin, args=(flag,), daemon=True)
    spinner.start()
    try:
        for i in range(alternations):
            for how, busy, threads in runs if i % 2 == 0 else runs[::-1]:
                torch.set_num_threads(threads)
                with stack(how), matmuls("bf16.cpp"):
                    measure = lambda: call_latency(model, drafter, trees, sampler, 1, warmup=1)  # noqa: E731
                    latency = beside_busy(flag, measure)() if busy else measure()
                samples[how, busy, threads]["ar"].append(latency["ar"]["wall_ms"])
                for n in THREAD_SIZES:
                    samples[how, busy, threads][str(n)].append(latency["spec"][n]["wall_ms"])
    finally:
        flag.value = -1
        spinner.join()
    return {f"{how}{', a busy core' if busy else ''}": pair_figures(samples[how, busy, 1], samples[how, busy, 2])
            for how in STACKS for busy in (False, True)}


def pair_figures(one: dict, two: dict) -> dict:
    """Per call: median ms on 1 and 2 threads, the median of their ratio per alternation, and the ratio of their
    fastest tenths (the quietest moments': 10th percentiles)."""
    tenth = lambda v: sorted(v)[(len(v) - 1) // 10]  # noqa: E731
    return {call: {"1": statistics.median(one[call]), "2": statistics.median(two[call]),
                   "ratio": statistics.median(a / b for a, b in zip(one[call], two[call])),
                   "quiet_ratio": tenth(one[call]) / tenth(two[call])} for call in one}


def run(args) -> dict:
    info = machine()
    config = smoke_config(ARCHITECTURES["0.6b"]) if args.smoke else ARCHITECTURES["0.6b"]
    sampler = Sampler()
    predictor = controlled_predictor(config, dtype="bfloat16")
    for threads in {args.threads, 2}:  # the threads table's 2 threads: the kernel choices there too
        device_path.prepare(predictor.model, threads, "the 0.6B predictor")
    choice = device_path.known(torch.bfloat16)
    if choice is None or not cpu_class.has_avx512_bf16() or not fused.kernels() or not fused.kernels().has_bf16_gemm():
        return {"machine": finish_machine(info), "settings": vars(args),
                "skipped": f"needs AVX-512 BF16, oneDNN and the fused kernels; this is {cpu_class.describe()}"}
    calibrated = calibrate_strength(predictor, default_tree(32), PAPER_ACCEPTANCE[32], sampler,
                                    predictor.frames(args.calibration_frames, seed=2), args.calibration_iterations)
    print(f"heads at {calibrated.measured:.2f} tokens/step at N=32 (paper {calibrated.target})", flush=True)
    report = {"machine": info, "settings": vars(args), "choice": choice["matmul"],
              "drafts": {"scheme": draft_scheme(), "int8_drafts": choice["int8_drafts"],
                         "head_ms": choice["figures"].get("draft head")},
              "calibration": {"tokens_per_step": calibrated.measured, "target": calibrated.target}}
    report["matrices"] = matrix_rows(predictor_shapes() if not args.smoke else [(64, 32), (32, 64)],
                                     choice["matmul"]["pad_rows"], args.repeats, args.clock)
    report["calls"] = call_costs(predictor.model, sampler, args.alternations, args.rounds, args.clock)
    report["frames"] = frame_times(predictor, predictor.frames(args.frames, seed=1), sampler, args.clock)
    report["threads"] = thread_costs(predictor.model, sampler, args.thread_alternations)
    torch.set_num_threads(args.threads)
    report["split"] = round_split(predictor.model, sampler, args.alternations, args.rounds)
    torch.set_num_threads(args.threads)
    finish_machine(info)
    return report


def markdown(report: dict) -> str:
    s = report["settings"]
    command = "OMP_WAIT_POLICY=PASSIVE python benchmarks/bf16_rows.py" + (f" --threads {s['threads']}" if s[
        "threads"] != 1 else "") + f" --frames {s['frames']}" + (f" --clock {s['clock']}" if s.get("clock") not in (
        None, "cpu" if s["threads"] == 1 else "wall") else "")
    clock = "the process's CPU time" if s.get("clock") == "cpu" else "wall time"
    lines = ["# bfloat16: a verify call of N rows against the one-row call", "",
             f"`{command}`: {machine_text(report['machine'])}; native, {s['threads']} thread(s). "
             f"Medians of interleaved runs, {clock}; compare within a table.", ""]
    if "skipped" in report:
        return "\n".join(lines + [f"Skipped: {report['skipped']}."]) + "\n"
    m = report["matrices"]
    lines += [
             f"## One call through the 0.6B predictor's 20 layer matrices ({m['bytes'] / 1e6:.0f} MB), ms", "",
             f"Floor: the bytes over the copy bandwidth ({m['bandwidth_gb_s']:.1f} GB/s, a copy of them timed among "
             f"the calls) = {m['floor_ms']:.2f} ms.", "",
             "| kernel | " + " | ".join(f"{r} rows" for r in ROWS) + " | 1 row of floor | 9 rows / 1 | 17 rows / 1 |",
             "|---|" + "---|" * (len(ROWS) + 3)]
    for name, ms in m["ms"].items():
        lines.append(f"| {name} | " + " | ".join(f"{ms[str(r)]:.2f}" for r in ROWS) +
                     f" | {m['floor_ms'] / ms['1']:.0%} | {ms['9'] / ms['1']:.2f}x | {ms['17'] / ms['1']:.2f}x |")
    calls = report["calls"]
    lines += ["", "## The predictor's calls: the AR step and a speculative round of N (drafts, verify, walk), ms", "",
              "| kernel | AR step | " + " | ".join(f"N={n}" for n in CALL_SIZES) + " | " +
              " | ".join(f"N={n} / AR" for n in CALL_SIZES) + " |", "|---|" + "---|" * (1 + 2 * len(CALL_SIZES))]
    for kernel, c in calls.items():
        lines.append(f"| {kernel} | {c['ar']:.2f} | " + " | ".join(f"{c[str(n)]:.2f}" for n in CALL_SIZES) + " | " +
                     " | ".join(f"{c[str(n)] / c['ar']:.2f}x" for n in CALL_SIZES) + " |")
    frames, cal = report["frames"], report["calibration"]
    lines += ["", f"## Frames (15 codes), heads at the paper's acceptance ({cal['tokens_per_step']:.2f} tokens/step at "
              f"N=32, paper {cal['target']}), ms", "",
              "| kernel | AR | " + " | ".join(f"N={n}" for n in FRAME_SIZES) + " | best spec over own AR | "
              "the same N, per frame | best spec over oneDNN AR |", "|---|" + "---|" * (4 + len(FRAME_SIZES))]
    base = frames["onednn"]["0"]["frame_ms"]
    for kernel, f in frames.items():
        best = min(FRAME_SIZES, key=lambda n: f[str(n)]["frame_ms"])
        lines.append(f"| {kernel} | {f['0']['frame_ms']:.1f} | " +
                     " | ".join(f"{f[str(n)]['frame_ms']:.1f} ({f[str(n)]['tokens_per_step']:.2f})"
                                for n in FRAME_SIZES) +
                     f" | **{f['0']['frame_ms'] / f[str(best)]['frame_ms']:.2f}x** (N={best}) | "
                     f"{f[str(best)].get('paired_speedup', float('nan')):.2f}x | {base / f[str(best)]['frame_ms']:.2f}x |")
    lines += ["", "Speculative cells: frame ms (tokens/step); per frame: the median over frames of a frame's AR time over "
              "its speculative time (the same frame, run close in time: less of the machine's drift). Draft heads: as chosen here unless named (exact: the "
              "exact bfloat16 heads, as before; w8a16: torch's weight-only int8 kernel); an AR frame reads none: one "
              "AR run per kernel.", ""]
    lines += threads_table(report["threads"]) + [""] + split_table(report)
    return "\n".join(lines) + "\n"


SPLIT_ROWS = ("layers (the native stack)", "forward: Python around the stack", "embeddings", "draft heads",
              "drafts: top-m and glue", "heads", "draws", "walk: matching and glue", "cache move", "glue (the rest)",
              "total")


def split_table(report: dict) -> list[str]:
    """The round split: per piece, the AR step and the round with the draft heads as before and as now."""
    split, d = report["split"], report["drafts"]
    ar, rounds = split["chosen"]["AR step"], {drafts: split[drafts][f"N={SPLIT_SIZE} round"] for drafts in split}
    now = f"{d['scheme']} int8 copies" if d["int8_drafts"] else "exact heads"
    lines = [f"## Where the N={SPLIT_SIZE} round's time goes, against the AR step (rvqspec's kernel, CPU ms per call)",
             "", f"The core's pieces wrapped in CPU-time timers during `call_latency` runs (k=7; the timed walk's random "
             "drafts are rarely accepted, so it visits about one depth: a frame's rounds visit tokens/step depths, "
             "one head and draw each). Draft heads before: the exact bfloat16 heads (the measured choice on this class "
             f"before w8a8 drafts); now: {now} (`quantize.draft_scheme`; measured head ms, hot: "
             f"{d['head_ms']}). Heads: the walk's (the AR step's one).", "",
             f"| piece | AR step | N={SPLIT_SIZE} round, draft heads before | N={SPLIT_SIZE} round, now | "
             "round - AR, before | round - AR, now |", "|---|---|---|---|---|---|"]
    for piece in SPLIT_ROWS:
        a, before, after = ar[piece], rounds["exact"][piece], rounds["chosen"][piece]
        name = f"**{piece}**" if piece == "total" else piece
        lines.append(f"| {name} | {a:.3f} | {before:.3f} | {after:.3f} | {before - a:+.3f} | {after - a:+.3f} |")
    return lines


def threads_table(runs: dict) -> list[str]:
    """The threads part: ms per call on 1 and 2 threads, and 1 thread over 2 (> 1: the second thread helps), per
    stack, alone and beside a busy core."""
    calls = ["ar", *map(str, THREAD_SIZES)]
    names = {"ar": "AR step", **{str(n): f"N={n} round" for n in THREAD_SIZES}}
    lines = ["## rvqspec's kernel on 1 and 2 threads (wall time)", "",
             "The stack as one native call (2 threads: one parallel region, kernels.h's Team) or through the Python "
             "loop (a fork-join region per matrix, as bfloat16 ran before); a busy core: a process spinning beside the "
             "call, as the speech decoder does beside the frame loop. 1 and 2 threads of a row run side by side in "
             "each alternation; 1 thread over 2: the median of their ratio per alternation (> 1: the second thread "
             "helps), and the ratio of their fastest tenths (10th percentiles: the machine's quietest moments).", "",
             "| stack | " + " | ".join(f"{names[c]}: 1 / 2 threads, ms | 1 over 2 | fastest tenth, 1 over 2"
                                      for c in calls)
             + " |", "|---|" + "---|" * 3 * len(calls)]
    for name, figures in runs.items():
        cells = [f"{f['1']:.2f} / {f['2']:.2f} | **{f['ratio']:.2f}x** | {f['quiet_ratio']:.2f}x"
                 for f in (figures[c] for c in calls)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--frames", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=9, help="matrix calls per kernel and row count")
    parser.add_argument("--alternations", type=int, default=5, help="call_latency runs per kernel")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per call_latency run")
    parser.add_argument("--thread-alternations", type=int, default=60, help="one-round call_latency runs per "
                        "stack, thread count and busy core (the threads table: wall time)")
    parser.add_argument("--calibration-frames", type=int, default=8)
    parser.add_argument("--calibration-iterations", type=int, default=6)
    parser.add_argument("--clock", choices=("cpu", "wall"), help="cpu: the process's CPU time (the default at 1 "
                        "thread); wall: wall time (the default with more threads)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    args.clock = args.clock or ("cpu" if args.threads == 1 else "wall")
    if args.smoke:
        vars(args).update(SMOKE)
    torch.set_num_threads(args.threads)
    report = run(args)
    write_reports(report, report_folder(Path(args.out), args.smoke), "bf16-rows", markdown)
    print(markdown(report))


if __name__ == "__main__":
    main()
