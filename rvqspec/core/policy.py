"""The decoding policy: for a batch of B frames, plain AR (N = 0) or the tree of size N that decodes the
most frames per second, predicted from measured call latencies and the drafts' acceptance.

    frame time (B, 0) = 15 x latency(B, 0)                                 (prefill + 14 AR steps)
    frame time (B, N) = latency(B, 0) + (E[max over B rows of calls] - 1) x latency(B, N)

A batch runs until its slowest row is done, so the speculative term uses the distribution of a frame's
calls, not its mean: P(max <= c) = P(calls <= c)^B. The distribution is measured (each held-out frame's calls
in an `rvqspec calibrate` report: `measured_distribution`) or, where no frames were decoded, predicted from
the per-position acceptance (`calls_distribution`).
latency(B, N) is ms per call at batch B (N = 0: an AR step), measured by `rvqspec bench --batch` on this
device and stored in the device file; without one, the built-in table of this CPU class (`cpu_class`: tables
measured on the development machines, natively and under ISA caps, `latency_default.json`) with a larger margin;
for a real architecture whose built-in tables lack this class, a small table measured now (a few seconds, once:
kept in the device file) rather than another class's; without any, AR. Speculation is chosen only when it is
predicted `margin` faster than AR.
"""

import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from rvqspec.core import cpu_class
from rvqspec.core.device_file import device_file_path, read_device_file, update_device_file
from rvqspec.core.drafters import ReusedHeads
from rvqspec.core.errors import RvqspecError
from rvqspec.core.latency import call_latency, latency_row
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import PRIOR_ACCEPTANCE, Tree, default_tree

SIZES = (4, 6, 8, 12, 16, 32, 64)
MEASURED_MARGIN = 0.05  # speculation must be predicted 5% faster than AR on a table measured here
DEFAULT_MARGIN = 0.15  # ... and 15% on the built-in table of another machine
DEFAULT_TABLES = Path(__file__).with_name("latency_default.json")
FIRST_USE_BATCHES = (1, 2, 4)  # the small table measured where this CPU class has no built-in one
FIRST_USE_ROUNDS = 3


def calls_distribution(tree: Tree, per_position: Tensor) -> list[float]:
    """P(a frame takes c predictor calls), c = 0..G-1, the prefill included, with `tree` and the acceptance
    per_position[k-1][d-1][r] = P(the rank-r draft at depth d wins | its parent did) for drafts from h_k.

    A node's acceptance is the product along its path (depths independent, as in the tree growth); nodes past
    the last code are pruned and the last code gets no bonus (docs/design.md, section 2)."""
    last = per_position.shape[0] + 1
    depths_known, ranks_known = per_position.shape[1], per_position.shape[2]
    parent, depth, rank = tree.parent.tolist(), tree.depth.tolist(), tree.rank.tolist()
    remaining = [[0.0] * (last + 1) for _ in range(last + 1)]  # [k][c]: P(c more calls | c1..c_k emitted)
    remaining[last][0] = 1.0
    for k in range(last - 1, 0, -1):
        left, value = last - k, [1.0]
        for n in range(1, len(parent)):
            d, r = depth[n], rank[n]
            known = d <= min(left, depths_known) and r < ranks_known
            value.append(value[parent[n]] * float(per_position[k - 1, d - 1, r]) if known else 0.0)
        reach = [sum(v for v, d in zip(value, depth) if d == level) for level in range(left + 2)]  # P(D >= level)
        for accepted in range(left + 1):  # D accepted drafts, then a bonus unless the last code was reached
            p = reach[accepted] - (reach[accepted + 1] if accepted < left else 0.0)
            after = remaining[min(k + accepted + 1, last)]
            for calls in range(last):
                remaining[k][calls + 1] += p * after[calls]
    return [0.0] + remaining[1][:last]  # the prefill call, then the rounds


def check_frame_calls(calls, groups: int, source, size: int) -> None:
    """A calibration report's calls per frame: integers in [1, G-1] (None: the report predates them)."""
    if calls is None:
        return
    if not isinstance(calls, list) or not calls or not all(
            isinstance(c, int) and not isinstance(c, bool) and 1 <= c <= groups - 1 for c in calls):
        raise RvqspecError(f"{source}: measured_frame_calls of the N={size} tree must be a non-empty list of integers "
                           f"in [1, {groups - 1}] (a frame's predictor calls): rerun `rvqspec calibrate`")



def report_size(row: dict) -> int:
    """The tree size N of a row of a calibration report's trees: `size`, or `budget` in reports written before the
    core's vocabulary settled on "tree size N" (their folders still load)."""
    return int(row["size"] if "size" in row else row["budget"])


def measured_distribution(calls: list[int], groups: int) -> list[float]:
    """P(a frame takes c calls), c = 0..G-1, from the calls that decoded frames took (a histogram)."""
    counts = [0] * groups
    for c in calls:
        counts[c] += 1
    return [n / len(calls) for n in counts]


def expected_calls(distribution: list[float], batch: int = 1) -> float:
    """E[max over `batch` independent rows of their calls]."""
    cumulative, total = 0.0, 0.0
    for p in distribution[:-1]:
        cumulative += p
        total += 1 - min(cumulative, 1.0) ** batch
    return total


def uniform_acceptance(pooled: Tensor, groups: int) -> Tensor:
    """Per-position acceptance [G-2, K, m] with the same a[d][r] at every position."""
    return pooled[None].expand(groups - 2, -1, -1)


def setting_key(model) -> str:
    """Which latency table fits `model` here: device, dtype (and weights scheme of a quantized model: `+w8a8`), threads
    (CPU), the predictor's architecture and, on the CPU, its class (`cpu_class`: amx, avx512-vnni-bf16, ...)."""
    c, device = model.config, model.device
    threads = f"{torch.get_num_threads()}t" if device.type == "cpu" else device.type
    arch = f"h{c.hidden_size}-l{c.num_hidden_layers}-v{c.vocab_size}-g{c.num_code_groups}"
    weights = "" if model.weights == "float" else f"+{model.weights}"
    key = f"{device.type}/{str(model.dtype).removeprefix('torch.')}{weights}/{threads}/{arch}"
    return f"{key}/{cpu_class.cpu_class()}" if device.type == "cpu" else key


@dataclass
class LatencyTable:
    ms: dict[int, dict[int, float]]  # batch -> N -> ms per call (N = 0: an AR step)
    source: str
    margin: float = MEASURED_MARGIN

    @classmethod
    def from_json(cls, entry: dict, source: str, margin: float) -> "LatencyTable":
        return cls({int(b): {int(n): float(ms) for n, ms in row.items()} for b, row in entry["ms"].items()}, source,
                   margin)

    @property
    def sizes(self) -> list[int]:
        return sorted(set.intersection(*(set(row) for row in self.ms.values())) - {0})

    def at(self, batch: int, size: int) -> float:
        """ms per call, linear in the batch between measured sizes; past the largest, per-row cost constant."""
        batches = sorted(self.ms)
        if batch >= batches[-1]:
            return self.ms[batches[-1]][size] * batch / batches[-1]
        above = next(b for b in batches if b >= batch)
        below = max((b for b in batches if b <= batch), default=above)
        if above == below:
            return self.ms[above][size]
        share = (batch - below) / (above - below)
        return self.ms[below][size] * (1 - share) + self.ms[above][size] * share


SETTING_KEY = re.compile(r"[a-z]+/[a-z0-9]+(\+[a-z0-9]+)?/[a-z0-9]+/h\d+-l\d+-v\d+-g\d+(/[a-z0-9-]+)?")  # setting_key
MAX_BATCH, MAX_MS = 1 << 16, 1e7  # latencies: positive, finite, below ~3 hours per call


def valid_key(key) -> bool:
    """A `setting_key`: CPU keys name a thread count ("1t"), others their device type again."""
    if not isinstance(key, str) or not SETTING_KEY.fullmatch(key):
        return False
    device, _, threads, *_ = key.split("/")
    return re.fullmatch(r"\d+t", threads) is not None if device == "cpu" else threads == device


def check_latency_tables(tables, source) -> dict:
    """Refuse latency tables that are not {setting key: {"ms": {batch: {N: ms}}}} with batches in [1, 2^16], N >= 0
    with an N = 0 (AR) column in every row, and positive finite ms: one line naming the source, key and field."""
    def bad(where: str, what: str):
        raise RvqspecError(f"{source}: {where} {what}: rerun `rvqspec bench --batch` (or delete the file)")

    if not isinstance(tables, dict):
        bad("latency", "must map setting keys to tables")
    for key, entry in tables.items():
        if not valid_key(key):
            bad(f"key {str(key)[:60]!r}", "is not a setting key like cpu/bfloat16/1t/h1024-l5-v2048-g16")
        rows = entry.get("ms") if isinstance(entry, dict) else None
        if not isinstance(rows, dict) or not rows:
            bad(f"{key}", "must hold a non-empty 'ms' table {batch: {N: ms}}")
        for batch, row in rows.items():
            if not (isinstance(batch, str) and batch.isdigit() and 1 <= int(batch) <= MAX_BATCH):
                bad(f"{key} batch {str(batch)[:20]!r}", f"must be an integer in [1, {MAX_BATCH}]")
            if not isinstance(row, dict) or "0" not in row:
                bad(f"{key} batch {batch}", "must map tree sizes N to ms, with N = 0 (an AR step)")
            for n, ms in row.items():
                if not (isinstance(n, str) and n.isdigit()):
                    bad(f"{key} batch {batch} N {str(n)[:20]!r}", "must be an integer >= 0")
                if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 < ms < MAX_MS:
                    bad(f"{key} batch {batch} N {n}", f"must be a latency in ms in (0, {MAX_MS:g}), got {ms!r}")
    return tables


def find_latency_table(key: str) -> LatencyTable | None:
    """This device's table for `key` (the device file), else the built-in one for the key, else None. A CPU
    setting with another thread count falls back to the nearest measured count of the same class."""
    info = read_device_file() or {}
    measured = check_latency_tables(info.get("latency", {}), device_file_path())
    for tables, source, margin in ((measured, "measured on this device by `rvqspec bench --batch`", MEASURED_MARGIN),
                                   (built_in_tables(), "built-in (development machines)", DEFAULT_MARGIN)):
        entry = tables.get(key) or nearest_threads(tables, key)
        if entry:
            return LatencyTable.from_json(entry, f"{source}: {entry.get('measured_on', key)}", margin)
    return None


def built_in_tables() -> dict:
    return json.loads(DEFAULT_TABLES.read_text())


def nearest_threads(tables: dict, key: str) -> dict | None:
    """The table of `key`'s setting at the nearest thread count (CPU keys; the class must match)."""
    device, dtype, threads, *rest = key.split("/")
    if not threads.endswith("t"):
        return None
    candidates = [(abs(int(k.split("/")[2][:-1]) - int(threads[:-1])), k) for k in tables
                  if k.split("/")[:2] == [device, dtype] and k.split("/")[3:] == rest and k.split("/")[2].endswith("t")]
    return tables[min(candidates)[1]] if candidates else None


def other_classes_have(key: str) -> bool:
    """Whether the built-in tables hold `key`'s CPU setting for another class: a real architecture, whose table for
    this class is then measured on first use (`measure_first_use`) rather than borrowed."""
    device, dtype, _, arch, *_ = key.split("/")
    return device == "cpu" and any(k.split("/")[:2] == [device, dtype] and k.split("/")[3:4] == [arch]
                                   for k in built_in_tables())


def measure_first_use(model, trees: dict[int, Tree], log=None) -> LatencyTable:
    """A small latency table for `model` on this CPU (batches FIRST_USE_BATCHES, the candidate trees, a few rounds:
    seconds), written to the device file so that it is measured once; one progress line per batch on stderr."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    key, drafter, rows = setting_key(model), ReusedHeads(model), {}
    for batch in FIRST_USE_BATCHES:
        log(f"rvqspec: no latency table for this CPU class ({cpu_class.describe()}): measuring {key}, batch {batch} "
            f"of {', '.join(map(str, FIRST_USE_BATCHES))} (once; `rvqspec bench --batch` measures a fuller one)")
        rows[batch] = latency_row(call_latency(model, drafter, trees, Sampler(), FIRST_USE_ROUNDS, batch=batch))
    entry = {"ms": {str(b): {str(n): ms for n, ms in row.items()} for b, row in rows.items()},
             "measured_on": f"{key} on {cpu_class.cpu_model()} at first use, {time.strftime('%Y-%m-%d %H:%M')}"}
    try:
        update_device_file({"latency": {key: entry}})
    except OSError:  # a read-only cache folder: measured again next time
        pass
    return LatencyTable.from_json(entry, f"measured at first use on this device: {entry['measured_on']}",
                                  MEASURED_MARGIN)


@dataclass
class Policy:
    latency: LatencyTable | None  # None: nothing measured for this setting, so always AR
    trees: dict[int, Tree]  # candidate trees by N
    calls: dict[int, list[float]]  # N -> distribution of a frame's calls with that tree
    groups: int
    choices: dict[int, int] = field(default_factory=dict)  # batch -> N, memoised

    @classmethod
    def build(cls, model, trees: dict[int, Tree], calls: dict[int, list[float]],
              latency: LatencyTable | None = None) -> "Policy":
        """`calls[N]`: the distribution of a frame's calls with tree N (`calls_distribution` from the acceptance,
        or `measured_distribution` of decoded frames); `latency`: default, the table for `model` on this device
        (`find_latency_table`)."""
        if latency is None:
            key = setting_key(model)
            latency = find_latency_table(key)
            if latency is None and other_classes_have(key):
                latency = measure_first_use(model, trees)
        return cls(latency, trees, calls, model.config.num_code_groups)

    @classmethod
    def for_model(cls, model, calibration: str | Path | None = None, latency: LatencyTable | None = None) -> "Policy":
        """Candidates from an `rvqspec calibrate` folder: its trees, each with the calls its held-out frames took
        (or, in reports without them, the distribution predicted from the measured per-position acceptance);
        else `default_tree(N)` for N in SIZES with the prior acceptance they were grown from."""
        groups = model.config.num_code_groups
        if calibration is None:
            trees = {n: default_tree(n) for n in SIZES}
            prior = uniform_acceptance(PRIOR_ACCEPTANCE, groups)
            return cls.build(model, trees, {n: calls_distribution(tree, prior) for n, tree in trees.items()}, latency)
        folder = Path(calibration)
        try:
            report = json.loads((folder / "report.json").read_text())
            per_position = torch.tensor(report["acceptance_per_position"], dtype=torch.float64)
            rows = {report_size(t): t for t in report["trees"]}
            trees = {n: Tree.load(folder / row["file"]) for n, row in rows.items()}
        except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise RvqspecError(f"{folder} is not an `rvqspec calibrate` folder (report.json with "
                               f"acceptance_per_position and its tree-N*.json): {e}") from None
        if per_position.dim() != 3:
            raise RvqspecError(f"{folder / 'report.json'}'s acceptance_per_position is not a table [positions, depth, "
                               "rank]: rerun `rvqspec calibrate` into this folder")
        if per_position.shape[0] != groups - 2:
            raise RvqspecError(f"{folder} was calibrated for {per_position.shape[0] + 2} codebooks, not {groups}")
        for n, row in rows.items():
            check_frame_calls(row.get("measured_frame_calls"), groups, folder / "report.json", n)
            if "predicted_tokens_per_round" in row and trees[n].meta.get("predicted_tokens_per_round") != \
                    row["predicted_tokens_per_round"]:
                raise RvqspecError(f"{folder / row['file']} is not the tree {folder / 'report.json'} measured (another "
                                   "calibration's, e.g. an interrupted run): rerun `rvqspec calibrate` into this folder")
        calls = {n: (measured_distribution(rows[n]["measured_frame_calls"], groups) if rows[n].get("measured_frame_calls")
                     else calls_distribution(tree, per_position)) for n, tree in trees.items()}
        return cls.build(model, trees, calls, latency)

    def candidates(self) -> list[int]:
        return [n for n in sorted(self.trees) if self.latency and n in self.latency.sizes]

    def frame_ms(self, batch: int, size: int) -> float:
        """Predicted ms to decode a batch of `batch` frames with tree N = `size` (0: AR)."""
        ar_step = self.latency.at(batch, 0)
        if size == 0:
            return (self.groups - 1) * ar_step
        return ar_step + (expected_calls(self.calls[size], batch) - 1) * self.latency.at(batch, size)

    def choose(self, batch: int) -> int:
        """N for a batch of `batch` frames; 0 = AR."""
        if batch not in self.choices:
            sizes = self.candidates()
            best = min(sizes, key=lambda n: self.frame_ms(batch, n), default=0)
            pays = best and self.frame_ms(batch, 0) >= (1 + self.latency.margin) * self.frame_ms(batch, best)
            self.choices[batch] = best if pays else 0
        return self.choices[batch]

    def tree_for(self, batch: int) -> Tree | None:
        size = self.choose(batch)
        return self.trees[size] if size else None

    def predicted_speedup(self, batch: int, size: int) -> float:
        return self.frame_ms(batch, 0) / self.frame_ms(batch, size)

    def explain(self, batch: int) -> str:
        """Why, in one line: e.g. "AR: speculation predicted at best 0.84x (N=32, 1.55 tokens/step)"."""
        if self.latency is None:
            return "AR: no call latency measured for this device and dtype (run `rvqspec bench --batch`)"
        sizes = self.candidates()
        if not sizes:
            return "AR: no candidate tree has a measured latency"
        size = self.choose(batch)
        shown = size or max(sizes, key=lambda n: self.predicted_speedup(batch, n))
        # Predicted tokens per step: a frame's codes over its expected calls (measured: `decode.tokens_per_step`).
        tokens = (self.groups - 1) / sum(c * p for c, p in enumerate(self.calls[shown]))
        figure = f"{self.predicted_speedup(batch, shown):.2f}x (N={shown}, {tokens:.2f} tokens/step, batch {batch})"
        what = f"speculative N={size}: predicted {figure}" if size else f"AR: speculation predicted at best {figure}"
        # The measured reason: a round's cost in AR steps against the codes a round emits (e.g. float32 on a CPU,
        # where the matmuls are compute-bound: a tree-sized call costs several one-row calls, docs/cpu-fast-path.md).
        cost = self.latency.at(batch, shown) / self.latency.at(batch, 0)
        return f"{what}: a round of N={shown} costs {cost:.2f} AR steps; latency {self.latency.source}"


def tree_for(drafter, tree: Tree | None, policy: Policy | None, batch: int) -> Tree | None:
    """The tree that decodes a batch of `batch` frames: None (AR) without a drafter, else the policy's choice, or the
    fixed `tree` where there is no policy."""
    if drafter is None:
        return None
    return policy.tree_for(batch) if policy is not None else tree


def explain(drafter, tree: Tree | None, policy: Policy | None, batch: int) -> str:
    """What decodes a batch of `batch` frames (`tree_for`), and why."""
    if drafter is None:
        return "AR: no drafter"
    if policy is None:
        return f"speculative with the fixed tree of size N={tree.size}"
    return policy.explain(batch)
