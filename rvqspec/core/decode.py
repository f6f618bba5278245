"""Decode the residual codes c1..c15 of a batch of frames: plain autoregressive, or speculative with a tree.

Every row of a batch goes through the same predictor calls: AR takes 15 calls per batch, a speculative
round one call per batch whatever each row's progress (k, the codes it has so far). A row whose frame
is complete rides along as padding until the slowest row finishes. `decode_frame` is the batch of one.

A decode call makes its `RoundContext` once (`context.py`: the model, the cache, the tree's plan, the sampler, each
row's noise for the frame's draws, the drafter and the resolved device path), then runs its steps over it:
`decode_speculative` is one loop of `steps.round(ctx, ...)`. The steps are these functions, eager; `graphs=` swaps in the same functions replayed
from captured calls (`graphs.py`), and nothing here knows of it.

Speculative round (docs/design.md, section 2), all in `round_on_device` (which `speculative_round` calls, then reads
the result on the host once, unless the CPU's walk holds it there already), for every row at once:
 1. drafts: the drafter reads the hidden state that produced the row's last code c_k and proposes the
    top-m codes for c_{k+1}..c_{k+K}; the tree picks N of them;
 2. one model call over [root = c_k, node_1..node_N] per row, with the row's tree mask, positions and
    embedding tables (gathered by its k), gives the verifier's distribution at every node;
 3. sample-then-match: walking from the root, a draw x ~ p~(node) is taken at the current node (exactly AR
    sampling wherever the walk goes: the row's noise for that code, `context.py`) and the child whose token is
    x is accepted; the draw at the deepest accepted node is the bonus code. Only the nodes on the path reach
    the heads and the sampler. On the CPU's path the walk reads each depth and stops at the first one without
    a match; on an accelerator's it runs on the device, one draw per depth, and the host reads the result once
    (`walk`);
 4. each row's K/V entries of the root and its accepted nodes are moved to consecutive slots.
Because every emitted code is a draw from the verifier's p~ given the true prefix, the output has
exactly the distribution of AR decoding (and greedy codes are identical). A row's draws use its own noise only,
one block per code: its codes are the same bits alone and in any batch (given the same p~ bits), and a seeded
row's sampled codes are those of AR decoding with the same generator (bar a last-bit difference in p~).

Cache layout (per row): slots 0..G-1 hold committed positions (slot = position); slots G..G+N hold the
round's tree. Committed: positions 0..k (position p holds c_{p-1}; position 0 the talker state). The
compaction copies max_depth + 1 entries per row whatever it accepted: entries past its new k land on
slots that its mask hides until a later round overwrites them, so a round's shapes depend only on
(B, N) and a row never needs a Python branch of its own.
"""

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor

from rvqspec.core.context import RoundContext, frame_slots, new_context, pick
from rvqspec.core.device_path import DevicePath
from rvqspec.core.drafters import Drafter
from rvqspec.core.errors import RvqspecError
from rvqspec.core.model import additive_mask
from rvqspec.core.sampling import Generators, Sampler
from rvqspec.core.tree import Tree
from rvqspec.core.walk import walk

# Talker states are normed (|x| of order 1-100); past this the predictor's float32 norms overflow (x^2 summed over
# the hidden size), and the draws would fail on NaN probabilities.
MAX_HIDDEN = 1e15


@dataclass
class RoundStats:
    accepted: int  # drafts accepted in this round
    path: list[tuple[int, int]]  # (depth, rank) of each accepted draft


@dataclass
class FrameResult:
    codes: Tensor  # [G-1] c1..c15
    calls: int  # predictor calls this frame took part in, the prefill included
    rounds: list[RoundStats] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        return tokens_per_step([self])


@dataclass
class BatchResult:
    codes: Tensor  # [B, G-1] c1..c15 of every row
    calls: int  # predictor calls for the whole batch, the prefill included
    rows: list[FrameResult]  # per row: its codes, the calls it was still decoding in, its rounds

    @property
    def tokens_per_step(self) -> float:
        """Codes per call for one row, averaged over rows (a batch of B rows emits B times as many per call)."""
        return tokens_per_step(self.rows)


def tokens_per_step(frames: list[FrameResult]) -> float:
    """The codes of `frames` per predictor call each took part in: the one definition of tokens per step (AR: 1)."""
    return sum(len(frame.codes) for frame in frames) / sum(frame.calls for frame in frames)


@dataclass
class RoundResult:
    """What one speculative round gives every row (see `speculative_round`)."""

    draws: Tensor  # [B, d] the walk's draws: row b emits its first accepted[b] + 1 of them, capped at the frame end
    hidden: Tensor  # [B, H] the hidden state that produced each row's last draw (the next round drafts from it)
    accepted: list[int]  # per row, drafts accepted (host list)
    bonus_node: list[int]  # per row, the tree node of the bonus draw (0: the root; host list)


def check_frame(model, talker_hidden: Tensor, c0) -> tuple[Tensor, Tensor]:
    """One frame's inputs as a batch of one: talker_hidden [1, H], c0 [1]."""
    c = model.config
    if not isinstance(talker_hidden, Tensor) or talker_hidden.reshape(-1).shape[0] != c.talker_hidden_size \
            or talker_hidden.dim() not in (1, 2):
        shape = tuple(talker_hidden.shape) if isinstance(talker_hidden, Tensor) else type(talker_hidden).__name__
        raise RvqspecError(f"talker_hidden must be [{c.talker_hidden_size}] or [1, {c.talker_hidden_size}] "
                           f"(the talker's hidden size), got {shape}")
    c0 = torch.as_tensor(c0).reshape(-1)
    if c0.numel() != 1 or c0.is_floating_point() or not 0 <= int(c0) < c.talker_vocab_size:
        raise RvqspecError(f"c0 must be one integer code in [0, {c.talker_vocab_size}), got {c0.tolist()}")
    return talker_hidden.reshape(1, -1), c0


def check_batch(model, talker_hidden: Tensor, c0, sampler: Sampler) -> tuple[Tensor, Tensor]:
    """talker_hidden [B, H] and c0 [B] on the model's device, or a clear error (one host read)."""
    c = model.config
    if not isinstance(sampler, Sampler):
        raise RvqspecError(f"sampler must be an rvqspec.Sampler, got {type(sampler).__name__}")
    if not isinstance(talker_hidden, Tensor) or talker_hidden.dim() != 2 or len(talker_hidden) == 0 \
            or talker_hidden.shape[1] != c.talker_hidden_size or not talker_hidden.is_floating_point():
        shape = tuple(talker_hidden.shape) if isinstance(talker_hidden, Tensor) else type(talker_hidden).__name__
        raise RvqspecError(f"talker_hidden must be a float tensor [B, {c.talker_hidden_size}] (B frames of the "
                           f"talker's hidden size), got {shape}"
                           + (f" of {talker_hidden.dtype}" if isinstance(talker_hidden, Tensor) else ""))
    c0 = torch.as_tensor(c0, device=talker_hidden.device).reshape(-1)
    if c0.shape[0] != len(talker_hidden) or c0.is_floating_point() or c0.dtype == torch.bool:
        raise RvqspecError(f"c0 must hold one integer code per row of talker_hidden ({len(talker_hidden)}), "
                           f"got {c0.dtype} {tuple(c0.shape)}")
    finite = (talker_hidden.abs() < MAX_HIDDEN).all(1)  # NaN compares False
    low, high, bad = torch.stack([c0.min(), c0.max(), (~finite).long().argmax()]).tolist()
    if not 0 <= low <= high < c.talker_vocab_size:
        raise RvqspecError(f"c0 codes must lie in [0, {c.talker_vocab_size}), got values in [{low}, {high}]")
    if not finite[bad]:
        raise RvqspecError(f"talker_hidden row {bad} is not finite or out of range (NaN, inf or |x| >= {MAX_HIDDEN:.0e}): "
                           "the talker's state is broken, so no codes can be decoded for it")
    return talker_hidden.to(model.device), c0.to(model.device, torch.long)


def check_decoding(generator, drafter, tree, rows: int) -> None:
    """The generator(s), drafter and tree of a decode call of `rows` frames are of the types it takes (or a clear
    error)."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != rows or not all(isinstance(g, torch.Generator) for g in generator):
            raise RvqspecError(f"generator as a list must hold one torch.Generator per frame ({rows}), got "
                               f"{len(generator)} items of {sorted({type(g).__name__ for g in generator})}: pass "
                               "[torch.Generator().manual_seed(seed) for seed in seeds], one per row")
    elif generator is not None and not isinstance(generator, torch.Generator):
        raise RvqspecError(f"generator must be a torch.Generator, a list of one per frame (or None: torch's global "
                           f"RNG), got {type(generator).__name__}: pass torch.Generator().manual_seed(seed)")
    if drafter is not None and not isinstance(drafter, Drafter):
        raise RvqspecError(f"drafter must be an rvqspec drafter (rvqspec.ReusedHeads(), rvqspec.Offsets.load(path), "
                           f"...) or None for plain AR, got {drafter!r}")
    if drafter is not None and tree is None:
        raise RvqspecError("speculative decoding needs a tree: pass tree=rvqspec.Tree.load(...) or default_tree(N)")
    if tree is not None and not isinstance(tree, Tree):
        raise RvqspecError(f"tree must be an rvqspec.Tree (Tree.from_paths({tree!r}), Tree.load(path) or "
                           f"default_tree(N)), got {type(tree).__name__}")


@torch.inference_mode()
def decode_frame(model, talker_hidden: Tensor, c0, sampler: Sampler, generator: Generators = None,
                 drafter=None, tree: Tree | None = None) -> FrameResult:
    """Codes c1..c15 of one frame. drafter None: plain AR (15 calls); else speculative with `tree`."""
    talker_hidden, c0 = check_frame(model, talker_hidden, c0)
    return decode_frames(model, talker_hidden, c0, sampler, generator, drafter, tree).rows[0]


@torch.inference_mode()
def decode_frames(model, talker_hidden: Tensor, c0, sampler: Sampler, generator: Generators = None,
                  drafter=None, tree: Tree | None = None, graphs=None) -> BatchResult:
    """Codes c1..c15 of B frames (talker_hidden [B, H], c0 [B]) in one batch of predictor calls.

    drafter None: plain AR, 15 calls for the batch; else speculative with `tree`, until every row is done.
    Each row draws from its own distribution, exactly as it would alone (identical codes when greedy).
    `generator`: one torch.Generator for every row (each row's noise in turn), a list of one per row (row b's
    codes then depend on generator b alone: the same bits in any batch), or None (torch's global RNG).
    `graphs`: where the calls run, a `rvqspec.core.graphs.GraphCache` (captured calls, replayed; the same
    decoding); default: eagerly (`eager_calls`).
    """
    talker_hidden, c0 = check_batch(model, talker_hidden, c0, sampler)
    check_decoding(generator, drafter, tree, len(c0))
    model.refresh()
    if drafter is not None:
        fit_speculation(model, drafter, tree)
    return decode_checked(model, talker_hidden, c0, sampler, generator, drafter, tree, graphs)


def fit_speculation(model, drafter, tree: Tree) -> None:
    """`drafter` fits `model` and sits on its device and dtype; `tree` fits the drafter and the vocabulary."""
    drafter.check_model(model)
    tree.check_fits(drafter.depth, model.config.vocab_size)
    drafter.to(model.device, model.dtype)  # no-op when it already matches


@torch.inference_mode()
def decode_checked(model, talker_hidden: Tensor, c0: Tensor, sampler: Sampler, generator: Generators,
                   drafter, tree: Tree | None, graphs=None) -> BatchResult:
    """`decode_frames` without its checks, for a caller that made them once rather than per frame step (the
    Engine's scheduler: its requests, drafter, trees and model are checked when they are made): talker_hidden
    [B, H] finite and c0 [B] long codes of the talker's vocabulary, both on the model's device; generators of the
    types `check_decoding` takes; the drafter fitted to the model (`check_model`, `to` its device and dtype) and
    the tree to the drafter (`fit_speculation`); the model's derived copies current (`refresh`)."""
    calls = eager_calls if graphs is None else graphs.calls
    with calls(model, len(c0), sampler, generator, drafter, tree) as (ctx, steps):
        talker_hidden, c0 = padded(talker_hidden, ctx.batch), padded(c0, ctx.batch)
        if drafter is None:
            return ar_batch(steps.frame(ctx, talker_hidden, c0)[:ctx.rows])
        return decode_speculative(ctx, steps, talker_hidden, c0)


class Steps(NamedTuple):
    """The calls a decode makes, each a function of the decode's `RoundContext` and its own inputs: eager by default
    (`eager_calls`); `rvqspec.core.graphs` gives the same functions replayed from captured calls."""

    frame: Callable[[RoundContext, Tensor, Tensor], Tensor]  # an AR frame: codes [B, G-1]
    start: Callable[[RoundContext, Tensor, Tensor], tuple[Tensor, Tensor]]  # a speculative frame's h_1 and c1
    round: Callable[[RoundContext, Tensor, list[int], Tensor, Tensor], RoundResult]  # `speculative_round`


@contextmanager
def eager_calls(model, batch: int, sampler: Sampler, generator: Generators, drafter, tree: Tree | None
                ) -> Iterator[tuple[RoundContext, Steps]]:
    """A decode's context over a fresh cache of `batch` rows, and its steps run as they come."""
    cache = model.new_cache(batch, frame_slots(model, tree if drafter is not None else None))
    yield new_context(model, cache, sampler, generator, drafter, tree, batch), \
        Steps(autoregressive_codes, first_code, speculative_round)


def padded(x: Tensor, size: int) -> Tensor:
    """`x` [B, ...] with its last row repeated up to `size` rows (a context's padding rows)."""
    return torch.cat([x, x[-1:].expand(size - len(x), *x.shape[1:])]) if size > len(x) else x


def prefill(model, cache, talker_hidden: Tensor, c0: Tensor, path: DevicePath | None = None) -> Tensor:
    """Positions 0 (talker state) and 1 (c0) of every row; returns h_1 [B, hidden]. `path`: the call's (`ctx.path`)."""
    x = torch.stack([model.embed_talker_hidden(talker_hidden), model.embed_codes(c0, torch.zeros_like(c0))], dim=1)
    positions, mask = prefill_mask(cache.slots, model.device, model.dtype)
    return model(x, positions, mask, cache, positions, path)[:, 1]


@functools.cache
def prefill_mask(slots: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The prefill's positions [2] and additive mask [2, slots] (slot <= position attends), made once per cache
    length, device and dtype (a few per process; read only, and never freed: a captured graph may read them)."""
    positions = torch.arange(2, device=device)
    return positions, additive_mask(torch.arange(slots, device=device)[None, :] <= positions[:, None], dtype)


def ar_batch(codes: Tensor) -> BatchResult:
    """The result of an AR frame's codes [B, G-1]: one call per code for the batch, and for every row."""
    calls = codes.shape[1]
    return BatchResult(codes, calls, [FrameResult(row, calls) for row in codes])


def autoregressive_codes(ctx: RoundContext, talker_hidden: Tensor, c0: Tensor) -> Tensor:
    """The AR frame's 15 calls into `ctx.cache` (G slots per row): codes [B, G-1]. No host values (a CUDA graph can
    capture it, `rvqspec.core.graphs`)."""
    model, groups = ctx.model, ctx.model.config.num_code_groups
    hidden = prefill(model, ctx.cache, talker_hidden, c0, ctx.path)
    codes = [ctx.sample(model.head_logits(hidden, 1), 1)]
    slots = torch.arange(groups, device=model.device)
    masks = slots[None, :] <= slots[:, None]
    for p in range(2, groups):
        codes.append(autoregressive_step(ctx, codes[-1], p, slots, masks))
    return torch.stack(codes, dim=1)


def autoregressive_step(ctx: RoundContext, code: Tensor, p: int, slots: Tensor, masks: Tensor) -> Tensor:
    """One AR call: feed c_{p-1} (`code` [B]) at position p (slot p), return c_p [B]. masks[p]: slots <= p."""
    position = slots[p:p + 1]
    x = ctx.model.embed_codes(code, position - 1)[:, None]
    hidden = ctx.model(x, position, masks[p:p + 1], ctx.cache, position, ctx.path)[:, 0]
    return ctx.sample(ctx.model.head_logits(hidden, p), p)


def first_code(ctx: RoundContext, talker_hidden: Tensor, c0: Tensor) -> tuple[Tensor, Tensor]:
    """A speculative frame's prefill: (h_1 [B, hidden], c1 [B])."""
    hidden = prefill(ctx.model, ctx.cache, talker_hidden, c0, ctx.path)
    return hidden, ctx.sample(ctx.model.head_logits(hidden, 1), 1)


def decode_speculative(ctx: RoundContext, steps: Steps, talker_hidden: Tensor, c0: Tensor) -> BatchResult:
    """The speculative frames of `ctx`'s rows: the prefill, then rounds until every row is done. Rows past
    `ctx.rows` are padding that starts done."""
    batch, last, tree = ctx.batch, ctx.model.config.num_residual_codes, ctx.plan.tree
    hidden, first = steps.start(ctx, talker_hidden, c0)
    codes = torch.zeros(batch, last + ctx.plan.max_depth + 1, dtype=torch.long, device=first.device)  # + scratch
    codes[:, 0] = first
    k_host = [1] * ctx.rows + [last] * (batch - ctx.rows)  # codes per row
    results, calls_made = [FrameResult(codes[b, :last], 1) for b in range(ctx.rows)], 1
    ks = torch.arange(last, device=first.device)  # one row's k as a view of it: no tensor made per round
    while min(k_host) < last:
        k = ks[k_host[0]:k_host[0] + 1] if batch == 1 else torch.tensor(k_host, device=first.device)  # for gathers
        result = steps.round(ctx, k, k_host, pick(codes, list(range(batch)), [p - 1 for p in k_host]), hidden)
        hidden = result.hidden
        keep_draws(codes, k, k_host, result.draws)
        for b, row in enumerate(results):
            if k_host[b] < last:
                row.calls += 1
                row.rounds.append(round_stats(tree, result.accepted[b], result.bonus_node[b]))
                k_host[b] = min(k_host[b] + 1 + result.accepted[b], last)
        calls_made += 1
    return BatchResult(codes[:ctx.rows, :last], calls_made, results)


def keep_draws(codes: Tensor, k: Tensor, k_host: list[int], draws: Tensor) -> None:
    """Each row's draws [B, d] into its codes [B, ...] as c_{k+1}..c_{k+d}; those past what a row emitted land on
    codes a later round overwrites. One row: a slice copy (one op, no index tensors)."""
    if len(k_host) == 1:
        codes[:, k_host[0]:k_host[0] + draws.shape[1]] = draws
    else:
        codes.scatter_(1, k[:, None] + torch.arange(draws.shape[1], device=k.device), draws)


def round_stats(tree: Tree, accepted: int, bonus_node: int) -> RoundStats:
    """A row's round: its accepted drafts, each as (depth, rank) along the path to its bonus node."""
    return RoundStats(accepted, list(enumerate(tree.paths[bonus_node - 1], 1)) if accepted else [])


def speculative_round(ctx: RoundContext, k: Tensor, k_host: list[int], root: Tensor, hidden_k: Tensor
                      ) -> RoundResult:
    """One fused draft+verify call for every row. Row b has emitted c1..c_{k[b]} (`k_host` the same on the
    host); `root` [B] = c_k (not yet fed), `hidden_k` [B, H] = the h_k that produced it."""
    draws, hidden, found, node = round_on_device(ctx, k, k_host, root, hidden_k)
    if isinstance(found, list):  # the host walk read them already
        return RoundResult(draws, hidden, found, node)
    return read_round(draws, hidden, found, node)


def read_round(draws: Tensor, hidden: Tensor, found: Tensor, node: Tensor) -> RoundResult:
    """A round's result, with its one host read (accepted drafts and bonus node per row)."""
    accepted, bonus = torch.stack([found, node]).tolist()
    return RoundResult(draws, hidden, accepted, bonus)


def round_on_device(ctx: RoundContext, k: Tensor, k_host: list[int] | None, root: Tensor, hidden_k: Tensor
                    ) -> tuple[Tensor, Tensor, Tensor | list[int], Tensor | list[int]]:
    """Steps 1-4: (draws, the hidden state at each row's bonus node, drafts accepted [B], bonus node [B]), on the
    device; the last two are host lists where the walk read them (`walk_on_host`). In a captured context
    (`ctx.captured`, `k_host` None) no step reads a host value."""
    model, plan, cache = ctx.model, ctx.plan, ctx.cache
    # 1. Drafts from h_k: the top-m candidates per depth, picked by the tree's (depth, rank) nodes.
    top = ctx.drafter.candidates(ctx, hidden_k, ctx.positions(k, k_host))
    tokens = torch.cat([root[:, None], top.flatten(1).index_select(1, plan.draft_index)], dim=1)  # [B, q]
    # 2. Verify every row's tree in one call (rows at one k share its positions, tables and mask, as AR steps do).
    positions, tables, masks = plan.at(k, k_host)
    hidden = model(model.embed_codes(tokens, tables), positions, masks, cache, plan.scratch, ctx.path)
    # 3. Sample-then-match (`walk`: on the host reading each depth, so it stops early; or on the device).
    path = walk(ctx, k, k_host, tokens, hidden)
    # 4. Keep the K/V of the root and the accepted nodes at their positions' slots k+1.. (see module doc).
    cache.move(*plan.compaction(k, k_host, path.node))
    return path.draws, bonus_states(hidden, path.node), path.found, path.node


def bonus_states(hidden: Tensor, node: Tensor | list[int]) -> Tensor:
    """hidden [B, q, H] at each row's bonus node [B] (a host list: `pick`, a view for one row)."""
    if isinstance(node, list):
        return pick(hidden, list(range(len(node))), node)
    return hidden[torch.arange(len(node), device=node.device), node]
