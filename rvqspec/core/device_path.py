"""Which implementation each part of a call takes on its device and dtype: decided here, once, for the whole core.

A decode call resolves its path once (`context.new_context`: `choose`, or `captured` of it inside a CUDA graph) and
its round, the drafters, the walk and the heads read that `ctx.path`; the model's forward and its matmuls, which
also serve training, read `choose(device, dtype)` per call. Nothing else reads a device type to pick a path:

- static_shapes: every depth is drafted and walked, even near the frame end (rows past it are masked), so that a
  round's work depends only on (B, N) and can be captured and replayed. Accelerators. On the CPU the depths no
  row can reach are skipped instead (their heads cost time).
- host_walk: the walk reads each depth's draws and stops at the first depth without a match (`walk.walk_on_host`);
  a host read costs nothing on the CPU. Elsewhere `walk.walk_on_device` visits every depth without a read.
- int8_drafts: drafts rank their top-m candidates with int8 copies of the heads (`draft_heads`), where the int8
  kernel measured faster than the exact head. A draft never changes what is emitted, only how often it is accepted.
- grouped_heads: per-row heads grouped by codebook through the packed weights (the CPU), else gathered per row.
- captured: the call is captured (`graphs`): no host values, so static shapes, the device walk, gathered heads
  indexed by device codebooks, exact draft heads.
- fused_kernels: the layer's elementwise work in the fused C++ kernels (`fused`), where they are built.
- matmul: how the large matmuls run (`packing`): through oneDNN-prepacked weights or F.linear, for one row and for
  many, each where it measured faster; bfloat16 through rvqspec's kernel (`bf16.cpp`, AVX-512 BF16, part of the
  fused kernels: off with them) where it measured faster than both; and `pad_rows` / `attention_rows`: calls of fewer rows (queries) are padded
  up to that many where the kernel gives a row other bits alone than inside a larger call (on a Zen 4, oneDNN's
  bfloat16 GEMM at K = 3072 and torch's flash attention both block otherwise for 1-3 rows), so that a verify call
  computes what the AR step computes. The predictor's attention on the fast path needs no floor: it visits each
  query's keys in position order (`fused.attention_in_order`, talker steps too); `attention_rows` serves SDPA (a
  talker's prefill, the plain path).

On the CPU the last three are measured, not assumed (`measure`): a second or two at the 0.6B predictor's matmul
shapes and the row counts decoding uses, kept in the user's cache folder (kernels.json) per CPU model, class
(`cpu_class`: the ISA caps included), torch version and thread count, and redone when any of them changes.
They are measured at an explicit preparation step, never inside a forward: `prepare(model, threads)`, which
`rvqspec.Engine(...)` (at its frame loop's thread count), `rvqspec.accelerate(...)`, `MultiCodeDecoder.from_pretrained`
and `rvqspec inspect --device` call, with a one-line message when something is measured. A forward reads what was
prepared in this process or is in the cache file (`known`); for a dtype and thread count with neither it takes the
plain matmuls (`matmul` None: F.linear, no row padding) and exact draft heads, the path float16 and accelerators
take: the same distribution, but on a CPU whose kernels give a row other bits alone than in a larger call
(`pad_rows`), a verify call and an AR step may then differ in a last bit. Call `prepare` after changing the
thread count or dtype to get the measured path. `rvqspec inspect --device` prints the choices and the figures. The CPU fast path (host walk, int8
drafts, fused kernels) switches off as one with `RVQSPEC_FUSED=0` or `fused.enabled(False)`; training and
torch.compile take the plain path.
"""

import functools
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn.functional as F

from rvqspec.core import cpu_class, fused
from rvqspec.core.bf16 import pack_bf16
from rvqspec.core.checkpoint import save_json
from rvqspec.core.config import ARCHITECTURES, layer_shapes
from rvqspec.core.device_file import cache_dir
from rvqspec.core.errors import RvqspecError
from rvqspec.core.files import read_json
from rvqspec.core.quantize import Int8Matmul, draft_scheme

KERNELS_FORMAT = "rvqspec-kernels/6"  # 2: the int8 draft heads timed through Int8Matmul (rvqspec's float32 kernel);
# 3: rvqspec's bfloat16 kernel timed beside oneDNN (MatmulChoice.bf16_kernel); 4: that kernel timed as the stack runs
# it (`stack_times`: one native call, on 2+ threads one parallel region), not per matrix;
# 5: the int8 draft heads in w8a8 where rvqspec's kernel runs it (`quantize.draft_scheme`); 6: the stack's fastest
# repeats, not their median
SHAPES = ((1024, 3072), (3072, 1024))  # (in, out): the 0.6B predictor's MLP, the widest K and N of a layer
STACK_LAYERS = 2  # layers of the 0.6B predictor timed as a stack: 63 MB of bfloat16, more than the L3 of most CPUs
MANY_ROWS = 33  # a verify call of N = 32
PADS = (1, 2, 4, 8)  # candidate row floors, cheapest first
PAD_COST = 1.25  # padding is taken where it costs at most this much of the unpadded one-row call
HEAD_SHAPE = (1024, 2048)  # a head: hidden -> vocabulary
DRAFT_ROWS = 4  # rows a draft head call ranks (one per tree branch drafted from)
MEASURED_DTYPES = (torch.bfloat16, torch.float32)
ATTENTION_SLOTS = (24, 40, 80)  # cache lengths of a frame's verify calls: 16 committed slots and a tree


@dataclass(frozen=True)
class MatmulChoice:
    packed_one: bool = False  # a one-row call through the prepacked weight (else F.linear)
    packed_many: bool = False  # the same for calls of more rows
    pad_rows: int = 1  # calls of fewer rows are padded up to this many (1: none)
    attention_rows: int = 1  # the same for the queries of an attention call over the cache
    bf16_kernel: bool = False  # bfloat16 calls of any rows through rvqspec's kernel (`bf16.cpp`, no padding needed)


@dataclass(frozen=True)
class DevicePath:
    static_shapes: bool
    host_walk: bool
    int8_drafts: bool
    fused_kernels: bool
    matmul: MatmulChoice | None  # None: F.linear as it is
    grouped_heads: bool = False  # per-row heads: rows grouped by codebook through each head's packed weight (the
    # CPU), else each row gathers its head (one kernel, the same shapes for every call)
    captured: bool = False  # a captured call (CUDA graphs): no host values, so per-row codebooks are device tensors

    @property
    def packed_weights(self) -> bool:
        return self.matmul is not None and (self.matmul.packed_one or self.matmul.packed_many)


def static_shapes(device: torch.device) -> bool:
    """Accelerators keep a round's shapes fixed by (B, N) (see the module docstring)."""
    return device.type != "cpu"


def replays_graphs(device: torch.device) -> bool:
    """Whether CUDA graphs can replay a captured call on `device` (`graphs.cuda_graph`): CUDA devices only."""
    return device.type == "cuda"


def choose(device: torch.device | str, dtype: torch.dtype) -> DevicePath:
    """The path of a call on `device` in `dtype`, in the current grad/compile mode and fast-path switch (read per
    call; the answer for each combination is made once: the model's matmuls ask on every call)."""
    device = device if isinstance(device, torch.device) else torch.device(device)
    cpu = device.type == "cpu"
    inference = not torch.is_grad_enabled() and not torch.compiler.is_compiling()
    fast = cpu and fused.on()
    built = fast and inference and dtype in fused.DTYPES and fused.kernels() is not None
    threads = torch.get_num_threads() if cpu else 0  # the measured choices are per thread count (`cache_key`)
    return path_of(cpu, static_shapes(device), dtype, inference, fast, built, torch.backends.mkldnn.enabled, threads)


@functools.cache
def path_of(cpu: bool, static: bool, dtype: torch.dtype, inference: bool, fast: bool, built: bool,
            mkldnn: bool, threads: int) -> DevicePath:
    measured = cpu and inference and mkldnn and dtype in MEASURED_DTYPES
    choices = known(dtype) if measured else None  # never measured here: a forward asks (module docstring)
    matmul = MatmulChoice(**choices["matmul"]) if choices else None
    if matmul is not None and not built:  # rvqspec's bfloat16 kernel is one of the fused kernels: off with them
        matmul = replace(matmul, bf16_kernel=False)
    return DevicePath(static_shapes=static, host_walk=fast and not static,
                      int8_drafts=fast and choices is not None and choices["int8_drafts"], fused_kernels=built,
                      matmul=matmul, grouped_heads=cpu)


def captured(path: DevicePath) -> DevicePath:
    """The path of a captured call: it reads no host value, so its shapes are static, its walk is on the device and
    its heads are gathered by device codebooks (the int8 draft heads take host codebooks)."""
    return replace(path, static_shapes=True, host_walk=False, int8_drafts=False, grouped_heads=False, captured=True)


def packable(dtype: torch.dtype) -> bool:
    """oneDNN prepacks bfloat16 weights only where the CPU class has bfloat16 or AVX-512 instructions (on AVX2 it
    raises, whatever torch's own check says, which ignores ONEDNN_MAX_CPU_ISA)."""
    return dtype == torch.float32 or cpu_class.cpu_class().startswith(("avx512", "amx"))


def fastest_float() -> torch.dtype:
    """The float dtype to decode in on this CPU: bfloat16 where oneDNN multiplies it (`packable`), else float32 (on
    AVX2 bfloat16 is emulated: 4x float32's time at 33 rows, issue 45)."""
    return torch.bfloat16 if packable(torch.bfloat16) else torch.float32


def cache_key() -> str:
    return f"{cpu_class.describe()} | torch {torch.__version__} | {torch.get_num_threads()}t"


_lock = threading.Lock()
prepared: dict[str, dict] = {}  # the choices this process measured or read, by `choices_key`


def choices_key(dtype: torch.dtype) -> str:
    return f"{cache_key()} | {str(dtype).removeprefix('torch.')}"


def kernels_file():
    return cache_dir() / "kernels.json"


def stored_entries() -> dict:
    """The cache file's entries (none if it is missing, damaged or of another format)."""
    path = kernels_file()
    try:
        stored = read_json(path, "delete it") if path.is_file() else {}
    except RvqspecError:  # a damaged cache: measured again and rewritten
        stored = {}
    return stored.get("entries", {}) if isinstance(stored, dict) and stored.get("format") == KERNELS_FORMAT else {}


def known(dtype: torch.dtype) -> dict | None:
    """The choices for `dtype` at this thread count if they were measured (in this process or by an earlier one, in
    the cache file); None if not. Never measures: what a forward reads (`path_of`)."""
    key = choices_key(dtype)
    with _lock:
        if key not in prepared and valid_choices(entry := stored_entries().get(key)):
            prepared[key] = entry  # another process measured them since a path was answered without them
            path_of.cache_clear()
        return prepared.get(key)


def decided(dtype: torch.dtype, name: str | None = None) -> dict:
    """The measured choices for `dtype` at this thread count: `known`, else measured now (with a one-line message on
    stderr naming what for, `name`, if given) and written to the cache file. A preparation step (`prepare`), never
    called by a forward."""
    found = known(dtype)
    if found is not None:
        return found
    key = choices_key(dtype)
    with _lock:
        if key not in prepared:
            if name is not None:
                print(f"rvqspec: measuring this CPU's kernels for {name} ({str(dtype).removeprefix('torch.')}, "
                      f"{torch.get_num_threads()} thread(s); once: kept in {kernels_file()})", file=sys.stderr,
                      flush=True)
            prepared[key] = measure(dtype)
            try:
                save_json(kernels_file(), {"format": KERNELS_FORMAT, "entries": stored_entries() | {key: prepared[key]}})
            except OSError:  # a read-only cache: measured again by the next process
                pass
    path_of.cache_clear()  # paths answered before without these choices
    return prepared[key]


def prepare(model: torch.nn.Module, threads: int | None = None, name: str = "this model") -> None:
    """The explicit preparation step: the kernel choices `model`'s forwards read in its dtype at `threads` intra-op
    threads (None: the current count), measured now where neither this process nor the cache file has them, with a
    one-line message naming `name`. A no-op for what is not measured (accelerators, other dtypes)."""
    weight = next((p for p in model.parameters() if p.is_floating_point()), None)  # int8 layers keep float parts
    if weight is None or weight.device.type != "cpu" or weight.dtype not in MEASURED_DTYPES \
            or not torch.backends.mkldnn.enabled:
        return
    with intra_op_threads(threads or torch.get_num_threads()), torch.inference_mode():
        decided(weight.dtype, name)


@contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """Run the block with `count` intra-op threads in this thread (torch keeps the count per thread; the measured
    choices are per count), then restore the count it had."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def valid_choices(entry) -> bool:
    """A cached entry as `measure` writes it today (one written by an older rvqspec is measured again)."""
    return isinstance(entry, dict) and set(entry) == {"matmul", "int8_drafts", "figures"} and \
        isinstance(entry["matmul"], dict) and set(entry["matmul"]) == {f.name for f in fields(MatmulChoice)} and \
        all(isinstance(v, int) and v >= 1 for k, v in entry["matmul"].items() if k.endswith("rows")) and \
        isinstance(entry["figures"], dict) and isinstance(entry["figures"].get("batch_invariant"), dict)


def median_ms(calls: dict, reps: int = 11, clock=time.perf_counter, fastest: bool = False,
              primed: bool = False) -> dict:
    """Median time in ms (wall, or `clock`'s) of each of `calls` (name -> function), timed in turn, one call of each
    per repeat, after one warm-up call each: a busy machine slows them alike. `fastest`: the fastest repeat instead
    (what each call takes in the machine's quiet moments: for calls on 2+ threads, which a busy core slows unalike).
    `primed`: each timed call right after an untimed call of itself, so that it finds the caches and threads as it
    leaves them (a decoding step follows a step), not as the call before it in turn left them."""
    times = {name: [] for name in calls}
    for rep in range(reps + 1):
        for name, call in calls.items():
            if primed:
                call()
            start = clock()
            call()
            if rep:
                times[name].append(clock() - start)
    return {name: sorted(t)[0 if fastest else reps // 2] * 1e3 for name, t in times.items()}


@torch.inference_mode()
def measure(dtype: torch.dtype) -> dict:
    """Time and compare, at SHAPES: the plain and packed matmuls at 1 and MANY_ROWS rows; the smallest row floor from
    PADS that gives every row the bits it gets in any larger call, where it costs at most PAD_COST; rvqspec's bfloat16
    kernel (where it gives a row its bits in any call) against oneDNN through a decoder stack (`stack_times`); the int8
    draft heads against the exact head."""
    generator = torch.Generator().manual_seed(0)
    figures, one, many, pads, ours = {}, [], [], [], []
    for k, n in SHAPES:
        weight = torch.randn(n, k, generator=generator).to(dtype) / k ** 0.5
        x = torch.randn(2 * MANY_ROWS, k, generator=generator).to(dtype)
        kernels = matmul_kernels(weight)
        times = median_ms({(name, rows): lambda f=f, rows=rows: f(x[:rows]) for name, f in kernels.items()
                           for rows in (1, MANY_ROWS)})
        figures[f"{k}x{n}"] = {f"{name} {rows} rows ms": round(ms, 4) for (name, rows), ms in times.items()}
        one.append(times.get(("packed", 1), float("inf")) < times[("plain", 1)])
        many.append(times.get(("packed", MANY_ROWS), float("inf")) < times[("plain", MANY_ROWS)])
        pads.append(row_floor(kernels["packed" if many[-1] else "plain"], kernels["packed" if one[-1] else "plain"], x,
                              figures[f"{k}x{n}"]))
        ours.append("bf16" in kernels and row_floor(kernels["bf16"], kernels["bf16"], x, {}) == 1)
    attention_rows = attention_floor(dtype, figures)
    figures["batch_invariant"] = {"matmuls": all(ours) or all(pads), "attention": attention_rows > 0}
    bf16_kernel = all(ours) and bf16_kernel_wins(stack_times(all(one), all(many), figures))
    matmul = MatmulChoice(packed_one=all(one), packed_many=all(many), pad_rows=max(max(pads), 1),
                          attention_rows=max(attention_rows, 1), bf16_kernel=bf16_kernel)
    return {"matmul": asdict(matmul), "int8_drafts": int8_drafts_faster(dtype, figures, matmul.bf16_kernel),
            "figures": figures}


def matmul_kernels(weight: torch.Tensor) -> dict:
    """The ways to multiply rows by `weight` measured here (name -> function of the rows): "plain" (F.linear),
    "packed" (oneDNN's prepacked weight) where oneDNN packs the dtype, "bf16" (rvqspec's kernel) for bfloat16 where
    the class has AVX-512 BF16 and the fused kernels are on and built."""
    kernels = {"plain": lambda rows: F.linear(rows, weight)}
    if packable(weight.dtype):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        kernels["packed"] = lambda rows: torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")
    ops = fused.kernels() if weight.dtype == torch.bfloat16 and cpu_class.has_avx512_bf16() and fused.on() else None
    if ops is not None and ops.has_bf16_gemm():
        ours = pack_bf16(weight)
        kernels["bf16"] = lambda rows: ops.bf16_linear(rows, ours, None, weight.shape[0])
    return kernels


@torch.inference_mode()
def stack_times(packed_one: bool, packed_many: bool, figures: dict) -> dict:
    """ms of one row and of MANY_ROWS rows through STACK_LAYERS bfloat16 layers of the 0.6B predictor as decoding runs
    them: on rvqspec's kernel ("bf16") one native call (`fused.cpp`'s int8_layers: its norms, RoPE and attention
    included; on 2+ threads one parallel region, whose threads claim chunks of each matrix), else the layer matrices
    one by one through oneDNN as measured ("packed" or "plain"; the elementwise work left out, so the kernel wins
    only by more than it). Timed per matrix, the kernel forks and joins torch's threads per call and lost to oneDNN
    on 2 threads where its stack ran 1.34x faster than on 1 (benchmarks/results/bf16-rows.md)."""
    c, ops, generator = ARCHITECTURES["0.6b"], fused.kernels(), torch.Generator().manual_seed(3)
    shapes, d = layer_shapes(c, STACK_LAYERS), c.head_dim
    weights = [(torch.randn(shape, generator=generator) / shape[1] ** 0.5).bfloat16() for shape in shapes]
    kernels = [matmul_kernels(w) for w in weights]
    ones, slots = torch.ones(c.hidden_size, dtype=torch.bfloat16), ATTENTION_SLOTS[1]
    args = ([ones] * (2 * STACK_LAYERS + 1), [torch.ones(d, dtype=torch.bfloat16)] * (2 * STACK_LAYERS),
            [[pack_bf16(w)] for w in weights], [w.shape[0] for w in weights])
    kv_cache = torch.zeros(STACK_LAYERS, 2, 1, c.num_key_value_heads, slots, d, dtype=torch.bfloat16)

    def native(x: torch.Tensor) -> torch.Tensor:
        cos, sin = torch.ones(1, x.shape[1], d, dtype=x.dtype), torch.zeros(1, x.shape[1], d, dtype=x.dtype)
        return ops.int8_layers(x, *args, cos, sin, None, kv_cache, torch.arange(x.shape[1]), c.rms_norm_eps,
                               c.num_attention_heads, c.num_key_value_heads)

    inputs = {rows: {k: torch.randn(1, rows, k, generator=generator).bfloat16() for k in {s[1] for s in shapes}}
              for rows in (1, MANY_ROWS)}

    def onednn(rows: int, packed: bool) -> list:
        return [k["packed" if packed else "plain"](inputs[rows][w.shape[1]][0]) for k, w in zip(kernels, weights)]
    calls = {("bf16", 1): lambda: native(inputs[1][c.hidden_size]),
             ("bf16", MANY_ROWS): lambda: native(inputs[MANY_ROWS][c.hidden_size]),
             ("onednn", 1): lambda: onednn(1, packed_one), ("onednn", MANY_ROWS): lambda: onednn(MANY_ROWS, packed_many)}
    # The fastest of the repeats: the choice is kept in the kernels file, and on 2 threads a busy moment made the
    # median flip it to oneDNN (the bfloat16 AR step then took 1.75x its 1-thread time in latency-tables/bf16-2t.md).
    times = median_ms(calls, fastest=True)
    figures[f"{STACK_LAYERS} layers as a stack"] = {f"{name} {rows} rows ms": round(ms, 4)
                                                    for (name, rows), ms in times.items()}
    return times


def bf16_kernel_wins(times: dict) -> bool:
    """Whether rvqspec's bfloat16 kernel beats the others at one row and costs at most PAD_COST times the fastest at
    MANY_ROWS rows (`times`: (kernel, rows) -> ms, as `stack_times` gives them)."""
    def best(rows: int) -> float:
        return min(ms for (name, r), ms in times.items() if r == rows and name != "bf16")
    return times[("bf16", 1)] < best(1) and times[("bf16", MANY_ROWS)] <= PAD_COST * best(MANY_ROWS)


def row_floor(kernel, one_row_kernel, x: torch.Tensor, figures: dict) -> int:
    """The smallest floor in PADS for which a row computed in a call of that many rows (the row and copies of it:
    `one_row_kernel` for one row, else `kernel`, as `packing.linear` runs them) has the bits it has inside calls of
    MANY_ROWS and 2 MANY_ROWS rows, where padding costs at most PAD_COST times the one-row call; 0 where none does."""
    inside = [kernel(x[:MANY_ROWS]), kernel(x)]
    for pad in PADS:
        run = one_row_kernel if pad == 1 else kernel
        alone = [run(x[i:i + 1].expand(pad, -1).contiguous())[:1] for i in range(MANY_ROWS)]
        if all(torch.equal(a[0], whole[i]) for whole in inside for i, a in enumerate(alone)):
            times = median_ms({"pad": lambda: run(x[:pad]), "one": lambda: one_row_kernel(x[:1])})
            figures[f"pad {pad} rows cost"] = round(times["pad"] / times["one"], 3)
            return pad if pad == 1 or times["pad"] <= PAD_COST * times["one"] else 0
    return 0


def attention_floor(dtype: torch.dtype, figures: dict, heads: int = 16, kv_heads: int = 8, dim: int = 128) -> int:
    """The smallest query floor in PADS for which a query row attended in a call of that many rows (copies of it)
    gets the bits it gets inside calls of MANY_ROWS and 2 MANY_ROWS rows, at the 0.6B's heads and caches of
    ATTENTION_SLOTS under a random mask (as a tree's); its cost is reported (attention is a small part of a call); 0
    where none does."""
    generator = torch.Generator().manual_seed(2)
    cases = []
    for slots in ATTENTION_SLOTS:
        k, v = (torch.randn(1, kv_heads, slots, dim, generator=generator).to(dtype) for _ in range(2))
        q = torch.randn(1, heads, 2 * MANY_ROWS, dim, generator=generator).to(dtype)
        allowed = torch.rand(2 * MANY_ROWS, slots, generator=generator) < 0.5
        allowed[:, 0] = True
        cases.append((q, k, v, torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))))

    def attend(case, rows: int, pad: int = 0, row: int = 0) -> torch.Tensor:
        q, k, v, mask = case
        if pad:  # copies, contiguous as `packing.attention` makes them (an expanded view takes another path)
            q, mask = q[:, :, row:row + 1].expand(-1, -1, pad, -1).contiguous(), mask[row:row + 1].expand(pad, -1)
        query, where = (q, mask.contiguous()) if pad else (q[:, :, :rows], mask[:rows])
        return F.scaled_dot_product_attention(query, k, v, attn_mask=where, enable_gqa=True)

    inside = [(case, attend(case, rows)) for case in cases for rows in (MANY_ROWS, 2 * MANY_ROWS)]
    for pad in PADS:
        if all(torch.equal(attend(case, 1, pad, i)[:, :, 0], whole[:, :, i]) for case, whole in inside
               for i in range(MANY_ROWS)):
            times = median_ms({"pad": lambda: attend(cases[-1], 1, pad), "one": lambda: attend(cases[-1], 1)})
            figures["attention"] = {f"pad {pad} rows cost": round(times["pad"] / times["one"], 3),
                                    "one row ms": round(times["one"], 4)}
            return pad
    return 0


def int8_drafts_faster(dtype: torch.dtype, figures: dict, bf16_kernel: bool = False) -> bool:
    """Whether the int8 draft heads (`quantize.draft_scheme`: w8a8 on rvqspec's kernel, else w8a16) rank
    DRAFT_ROWS rows through a head faster than the exact head (through rvqspec's bfloat16 kernel where chosen)."""
    k, n = HEAD_SHAPE
    generator = torch.Generator().manual_seed(1)
    head, x = torch.randn(n, k, generator=generator).to(dtype), torch.randn(DRAFT_ROWS, k, generator=generator).to(dtype)
    matmul = Int8Matmul(head, draft_scheme())
    exact = matmul_kernels(head)["bf16"] if bf16_kernel else lambda rows: F.linear(rows, head)
    times = median_ms({"int8 ms": lambda: matmul(x), "exact ms": lambda: exact(x)})
    figures["draft head"] = {name: round(ms, 4) for name, ms in times.items()}
    return times["int8 ms"] < times["exact ms"]
