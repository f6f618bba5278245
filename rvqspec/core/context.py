"""The round context: what every predictor call of one `decode_frames` call reads, made once per call.

The call's path (`device_path.DevicePath`) is resolved here, from the model's device and dtype, and a captured call
(CUDA graphs) takes the path that reads no host value (`device_path.captured`). The drafters, the walk and the heads
read `ctx.path` and `ctx.captured` to pick an implementation, never a device type or an argument's type.

Draws. A context holds each row's Exp(1) noise for the frame, [batch, G-1, V], drawn once from the row's own generator
(`sampling.fill_noise`; where the draws are native, as the float64 uniforms the values are made of), and every draw of
code c_j is argmax(p~ / the row's noise for c_j) (`RoundContext.sample`), torch.multinomial's draw. So a row's codes
and its generator's use depend on nothing but its own frame: the same bits alone and in any batch, AR or speculative,
on every walk and through captured calls; and since each emitted code is one draw from p~ given its true prefix with
noise no other code uses, the codes keep AR's distribution.

The tree's plan (`TreePlan`) is built here too, once per (tree, code groups, device, dtype), and kept in a bounded
cache on the decoding side (least recently used first out), never on the caller's `Tree`.
"""

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rvqspec.core import device_path, draw
from rvqspec.core.device_path import DevicePath
from rvqspec.core.model import KVCache, MultiCodeDecoder, additive_mask
from rvqspec.core.sampling import Generators, Sampler, fill_noise, row_generators
from rvqspec.core.tree import Tree

PLANS = 64  # trees' plans kept (a plan is a few small tensors)


@dataclass
class TreePlan:
    """Everything a round needs about the tree, built once per (tree, groups, device, dtype) (`plan_for`). Per-k
    tables are stacked so that a batch gathers each row's by its k. q = N + 1 query tokens (root + nodes).

    Worked example: the tree [[0], [1], [0, 0]] (q = 4: root 0; node 1 = rank 0 at depth 1; node 2 = rank 1 at
    depth 1; node 3 = rank 0 at depth 2 under node 1), G = 16 codebooks, a row at k = 3 (c1..c3 emitted):
      parent        [0, 0, 0, 1]
      draft_index   [0, 1, 2]: node 1 takes depth 1 rank 0, node 2 depth 1 rank 1, node 3 depth 2 rank 0 of the
                    drafter's [depth, m] top-m table, flattened (m = 2, the tree's top_m)
      scratch       [16, 17, 18, 19]: the tree's cache slots, after the G committed ones
      positions[3]  [4, 5, 5, 6]: position k + 1 + depth (the root c_3 sits at position 4)
      tables[3]     [3, 4, 4, 5]: the root is code c_3 (table 3), depth-1 drafts c_4, depth-2 drafts c_5
      masks[3]      [4, 20]: slots 0..3 (committed) for every query, then each query's ancestors and itself
                    among the scratch slots (node 3 sees slots 16, 17, 19)
      path_slots    [[16, 16, 16], [16, 17, 17], [16, 18, 18], [16, 17, 19]]: root..node, padded with the node
      destinations[3] [4, 5, 6]: a path's entries go to slots k + 1, k + 2, ... (positions 4, 5, 6)
      children      [[1, 2], [3], [], []]: the host walk's child lists
    """

    tree: Tree
    parent: Tensor  # [q]
    draft_index: Tensor  # [N] index into the drafter's flattened top-m table [depth, m]
    scratch: Tensor  # [q] cache slots of the tree
    positions: Tensor  # [G, q] per k: position ids k+1+depth
    tables: Tensor  # [G, q] per k: embedding table of each token (clamped past the last code)
    masks: Tensor  # [G, q, G+q] per k: committed slots 0..k, then the tree's ancestors
    additive: Tensor  # the same in the model's dtype as the forward adds a mask (0: attends; -inf: not), made once
    path_slots: Tensor  # [q, max_depth+1] per node: scratch slots of root..node, padded with the node's own
    destinations: Tensor  # [G, max_depth+1] per k: k + 1, k + 2, ...: the slots a path's entries go to
    children: list[list[int]]  # per node, its children (host lists, for the host walk)
    max_depth: int  # the tree's (read a few times a round: a `Tree` computes it from its paths)
    top_m: int  # candidates drafted per depth: the tree's top_m, at least 1

    def at(self, k: Tensor, k_host: list[int] | None) -> tuple[Tensor, Tensor, Tensor]:
        """The verify call's (positions, tables, additive masks) of rows at `k`: gathered per row ([B, q], [B, q],
        [B, q, G+q]), or, where every row is at the same k on the host, that k's ([q], [q], [q, G+q]: views, which every
        row of the call shares, as an AR step's)."""
        if k_host is not None and len(set(k_host)) == 1:
            return self.positions[k_host[0]], self.tables[k_host[0]], self.additive[k_host[0]]
        return self.positions[k], self.tables[k], self.additive[k]

    def compaction(self, k: Tensor, k_host: list[int] | None, node: Tensor | list[int]) -> tuple[Tensor, Tensor]:
        """(source, destination) slots [B, max_depth+1] of the K/V entries that rows at `k`, whose walks reached
        `node` (host lists on the host walk, with `k_host`; else device tensors), keep (`KVCache.move`)."""
        if isinstance(node, Tensor):
            return self.path_slots[node], self.destinations[k]
        return pick(self.path_slots, node), pick(self.destinations, k_host)


@dataclass(frozen=True)
class RoundContext:
    """One decode call's predictor, cache, tree plan, sampler, noise, drafter and path: every step of it (the AR
    frame, the prefill, each round) reads this and its own per-round inputs only."""

    model: MultiCodeDecoder
    cache: KVCache
    plan: TreePlan | None  # None: plain AR
    sampler: Sampler
    noise: Tensor | None  # [batch, G-1, V] each row's Exp(1) noise for c1..c_{G-1} (module docstring); None: greedy
    drafter: nn.Module | None  # a `drafters.Drafter`; None: plain AR
    path: DevicePath
    rows: int  # the frames; cache rows past them are padding (a graph's bucket) that starts done

    @property
    def captured(self) -> bool:
        """The steps run inside a captured call (CUDA graphs): no step may read a host value."""
        return self.path.captured

    @property
    def batch(self) -> int:
        """Cache rows: the frames and their padding."""
        return self.cache.kv.shape[2]

    def positions(self, k: Tensor, k_host: list[int] | None) -> Tensor | list[int]:
        """Each row's k as the round's steps take it: the device tensor in a captured call, else the host list."""
        return k if self.captured else k_host

    def sample(self, logits: Tensor, codebooks: int | list[int] | Tensor, rows: list[int] | None = None) -> Tensor:
        """The draws of `rows` (default: every row) from `logits` [n, V], each of its code c_{codebook} with its noise
        for that code: `codebooks` one for all (an int) or one per row (a host list, then `rows` a host list too, or a
        device tensor)."""
        if self.noise is None:
            return self.sampler.sample_noise(logits, None)
        if isinstance(codebooks, int):
            return self.sampler.sample_noise(logits, self.noise[:, codebooks - 1])
        if isinstance(codebooks, list):
            rows = list(range(len(codebooks))) if rows is None else rows
            return self.sampler.sample_noise(logits, pick(self.noise, rows, [c - 1 for c in codebooks]))
        index = codebooks - 1
        return self.sampler.sample_noise(logits, self.noise[torch.arange(len(index), device=index.device), index])


def new_context(model: MultiCodeDecoder, cache: KVCache, sampler: Sampler, generator: Generators,
                drafter: nn.Module | None, tree: Tree | None, rows: int, captured: bool = False,
                noise: Tensor | None = None) -> RoundContext:
    """The context of a decode call over `cache` (`rows` frames): the path resolved for the model's device and dtype
    in the current grad mode and fast-path switch, the plan built (or found) where there is a drafter, the rows'
    noise drawn from `generator` (one for every row, or one per row) into `noise` (a captured call's static
    buffer; default: a new one)."""
    path = device_path.choose(model.device, model.dtype)
    plan = plan_for(tree, model) if drafter is not None else None
    noise = frame_noise(model, sampler, generator, rows, cache.kv.shape[2], noise)
    return RoundContext(model, cache, plan, sampler, noise, drafter, device_path.captured(path) if captured else path,
                        rows)


def frame_noise(model: MultiCodeDecoder, sampler: Sampler, generator: Generators, rows: int, batch: int,
                noise: Tensor | None = None) -> Tensor | None:
    """The noise [batch, G-1, V] of `rows` frames' draws of c1..c_{G-1} (`RoundContext.noise`; None when greedy), in
    `noise` if given. Padding rows (past `rows`) take nothing from the generators."""
    if not sampler.do_sample:
        return None
    if noise is None:  # as uniforms where the draws are native: they make the few Exp(1) values they read
        own = type(sampler).sample_noise is Sampler.sample_noise  # a subclass's own draw gets Exp(1) values
        c, uniforms = model.config, own and draw.takes_uniforms(model.device, sampler.top_p)
        noise = torch.empty(batch, c.num_residual_codes, c.vocab_size, device=model.device,
                            dtype=torch.float64 if uniforms else torch.float32)
        if batch > rows:
            noise[rows:].fill_(0.5)  # padding rows: any valid noise (their draws are ignored)
    return fill_noise(noise, row_generators(generator, rows))


def frame_slots(model: MultiCodeDecoder, tree: Tree | None) -> int:
    """Cache slots per row of a frame: G committed, and a speculative frame's tree (root and N nodes)."""
    return model.config.num_code_groups + (tree.size + 1 if tree is not None else 0)


def codebooks_ahead(positions: Tensor | list[int], ahead: int, last: int, captured: bool) -> Tensor | list[int]:
    """The codebook `ahead` codes past each row's position, capped at the last (rows past it are masked or pruned):
    a device tensor in a captured call, else a host list (`RoundContext.positions`)."""
    if captured:
        return (positions + ahead).clamp(max=last)
    return [min(p + ahead, last) for p in positions]


_plans: OrderedDict[tuple, TreePlan] = OrderedDict()  # least recently used first
_plans_lock = threading.Lock()


def plan_for(tree: Tree, model: MultiCodeDecoder) -> TreePlan:
    """`tree`'s plan for `model`'s code groups, device and dtype, built on first use (trees count by value)."""
    key = (tuple(tree.paths), model.config.num_code_groups, str(model.device), model.dtype)
    with _plans_lock:
        if key in _plans:
            _plans.move_to_end(key)
        else:
            _plans[key] = build_plan(tree, model.config.num_code_groups, model.device, model.dtype)
            while len(_plans) > PLANS:
                _plans.popitem(last=False)
        return _plans[key]


def build_plan(tree: Tree, groups: int, device: torch.device, dtype: torch.dtype) -> TreePlan:
    q, depth, ks = tree.size + 1, tree.depth, torch.arange(groups)[:, None]
    committed = torch.arange(groups)[None, :] <= ks  # [k, slot]: slot <= k
    masks = torch.cat([committed[:, None, :].expand(-1, q, -1), tree.ancestors.expand(groups, -1, -1)], dim=2)
    ancestors = tree.ancestors.tolist()
    paths = [[a for a in range(q) if ancestors[n][a]] for n in range(q)]
    paths = [path + path[-1:] * (tree.max_depth + 1 - len(path)) for path in paths]
    children = [[] for _ in range(q)]
    for child, parent in enumerate(tree.parent.tolist()[1:], 1):
        children[parent].append(child)
    return TreePlan(
        tree=tree, parent=tree.parent.to(device),
        draft_index=((depth[1:] - 1) * max(tree.top_m, 1) + tree.rank[1:]).to(device),
        scratch=torch.arange(groups, groups + q, device=device),
        positions=(ks + 1 + depth).to(device), tables=(ks + depth).clamp(max=groups - 1).to(device),
        masks=masks.to(device), additive=additive_mask(masks, dtype).to(device),
        path_slots=(groups + torch.tensor(paths)).to(device),
        children=children, destinations=(ks + torch.arange(1, tree.max_depth + 2)).to(device),
        max_depth=tree.max_depth, top_m=max(tree.top_m, 1))


def pick(rows: Tensor, index: list[int], within: list[int] | None = None) -> Tensor:
    """rows[index[i]] (or rows[index[i], within[i]]) for each i, stacked: host indices, so one index is a view (no
    copy, no index tensor to make, one indexing call: what a round of one row takes, many times a frame), more an
    indexing copy."""
    if len(index) == 1:
        first = index[0]
        return rows[first:first + 1] if within is None else rows[first:first + 1, within[0]]
    return rows[index] if within is None else rows[index, within]
