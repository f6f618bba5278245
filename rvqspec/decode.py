"""Decode one frame's residual codes c1..c15: plain autoregressive, or speculative with a draft tree.

Speculative round (DESIGN section 2), all in `speculative_round`:
 1. drafts: the drafter reads the hidden state that produced the last code c_k and proposes the
    top-m codes for c_{k+1}..c_{k+K}; the tree picks N of them;
 2. one model call over [root = c_k, node_1..node_N] with the tree mask gives the verifier's
    distribution at every node;
 3. sample-then-match: walking from the root, a fresh draw x ~ p~(node) is taken at the current node
    (exactly AR sampling wherever the walk goes) and the child whose token is x is accepted; the draw at
    the deepest accepted node is the bonus code. The walk runs on the device, one draw per depth, so
    only the nodes on the path reach the heads and the sampler, and the host reads the result once;
 4. the K/V entries of the root and the accepted nodes are moved to consecutive slots.
Because every emitted code is a draw from the verifier's p~ given the true prefix, the output has
exactly the distribution of AR decoding (and greedy codes are identical).

Cache layout: slots 0..G-1 hold committed positions (slot = position); slots G..G+N hold the
round's tree. Committed: positions 0..k (position p holds c_{p-1}; position 0 the talker state).
"""

from dataclasses import dataclass, field

import torch
from torch import Tensor

from rvqspec.errors import RvqspecError
from rvqspec.sampling import Sampler
from rvqspec.tree import Tree


@dataclass
class RoundStats:
    accepted: int  # drafts accepted in this round
    path: list[tuple[int, int]]  # (depth, rank) of each accepted draft


@dataclass
class FrameResult:
    codes: Tensor  # [G-1] c1..c15
    calls: int  # predictor calls, the prefill included
    rounds: list[RoundStats] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        return len(self.codes) / self.calls


@dataclass
class TreePlan:
    """Everything a round needs about the tree, built once per (tree, model, device)."""

    tree: Tree
    parent: Tensor  # [q]
    draft_index: Tensor  # [N] index into the drafter's flattened top-m table [depth, m]
    scratch: Tensor  # [q] cache slots of the tree
    positions: list[Tensor]  # per k: [q] position ids k+1+depth
    tables: list[Tensor]  # per k: [q] embedding table of each token (clamped past the last code)
    masks: list[Tensor]  # per k: [q, G+q] committed slots 0..k, then the tree's ancestors
    paths: list[list[int]]  # node -> nodes on its path from the root (root first)


def plan_for(tree: Tree, model) -> TreePlan:
    key = (model.config.num_code_groups, str(model.device))
    plans = tree.__dict__.setdefault("_plans", {})
    if key not in plans:
        plans[key] = build_plan(tree, model.config.num_code_groups, model.device)
    return plans[key]


def build_plan(tree: Tree, groups: int, device: torch.device) -> TreePlan:
    q = tree.size + 1
    depth = tree.depth
    committed = torch.arange(groups)[None, :] <= torch.arange(groups)[:, None]  # [k, slot]: slot <= k
    masks = [torch.cat([committed[k].expand(q, -1), tree.ancestors], dim=1) for k in range(groups)]
    ancestors = tree.ancestors.tolist()
    return TreePlan(
        tree=tree, parent=tree.parent.to(device),
        draft_index=((depth[1:] - 1) * max(tree.top_m, 1) + tree.rank[1:]).to(device),
        scratch=torch.arange(groups, groups + q, device=device),
        positions=[(k + 1 + depth).to(device) for k in range(groups)],
        tables=[(k + depth).clamp(max=groups - 1).to(device) for k in range(groups)],
        masks=[m.to(device) for m in masks],
        paths=[[a for a in range(q) if ancestors[n][a]] for n in range(q)])


def check_inputs(model, talker_hidden: Tensor, c0, sampler: Sampler) -> tuple[Tensor, Tensor]:
    c = model.config
    if not isinstance(sampler, Sampler):
        raise RvqspecError(f"sampler must be an rvqspec.Sampler, got {type(sampler).__name__}")
    if not isinstance(talker_hidden, Tensor) or talker_hidden.reshape(-1).shape[0] != c.talker_hidden_size \
            or talker_hidden.dim() not in (1, 2):
        shape = tuple(talker_hidden.shape) if isinstance(talker_hidden, Tensor) else type(talker_hidden).__name__
        raise RvqspecError(f"talker_hidden must be [{c.talker_hidden_size}] or [1, {c.talker_hidden_size}] "
                           f"(the talker's hidden size), got {shape}")
    c0 = torch.as_tensor(c0).reshape(-1)
    if c0.numel() != 1 or c0.is_floating_point() or not 0 <= int(c0) < c.talker_vocab_size:
        raise RvqspecError(f"c0 must be one integer code in [0, {c.talker_vocab_size}), got {c0.tolist()}")
    return talker_hidden.reshape(1, -1).to(model.device), c0.to(model.device)


def prefill(model, talker_hidden: Tensor, c0: Tensor, slots: int) -> Tensor:
    """Positions 0 (talker state) and 1 (c0); returns h_1 [hidden]."""
    model.setup_cache(slots)
    x = torch.cat([model.embed_talker_hidden(talker_hidden), model.embed_codes(c0, torch.zeros_like(c0))])
    positions = torch.arange(2, device=model.device)
    mask = torch.arange(slots, device=model.device)[None, :] <= positions[:, None]
    return model(x[None], positions, mask, positions)[0, 1]


@torch.inference_mode()
def decode_frame(model, talker_hidden: Tensor, c0, sampler: Sampler, generator: torch.Generator | None = None,
                 drafter=None, tree: Tree | None = None) -> FrameResult:
    """Codes c1..c15 of one frame. drafter None: plain AR (15 calls); else speculative with `tree`."""
    talker_hidden, c0 = check_inputs(model, talker_hidden, c0, sampler)
    if drafter is None:
        return decode_autoregressive(model, talker_hidden, c0, sampler, generator)
    if tree is None:
        raise RvqspecError("speculative decoding needs a tree: pass tree=rvqspec.Tree.load(...) or default_tree(N)")
    drafter.check_model(model)
    tree.check_fits(drafter.depth, model.config.vocab_size)
    drafter.to(model.device, model.dtype)  # no-op when it already matches
    return decode_speculative(model, talker_hidden, c0, sampler, generator, drafter, tree)


def decode_autoregressive(model, talker_hidden: Tensor, c0: Tensor, sampler: Sampler,
                          generator: torch.Generator | None) -> FrameResult:
    groups = model.config.num_code_groups
    hidden = prefill(model, talker_hidden, c0, groups)
    codes = [sampler.sample(model.head_logits(hidden[None], 1), generator)]
    slots = torch.arange(groups, device=model.device)
    masks = slots[None, :] <= slots[:, None]
    for p in range(2, groups):
        codes.append(autoregressive_step(model, sampler, generator, codes[-1], p, slots, masks))
    return FrameResult(torch.cat(codes), calls=groups - 1)


def autoregressive_step(model, sampler: Sampler, generator, code: Tensor, p: int, slots: Tensor,
                        masks: Tensor) -> Tensor:
    """One AR call: feed c_{p-1} (`code` [1]) at position p (slot p), return c_p [1]. masks[p]: slots <= p."""
    position = slots[p:p + 1]
    hidden = model(model.embed_codes(code, position - 1)[None], position, masks[p:p + 1], position)[0]
    return sampler.sample(model.head_logits(hidden, p), generator)


def decode_speculative(model, talker_hidden: Tensor, c0: Tensor, sampler: Sampler, generator, drafter,
                       tree: Tree) -> FrameResult:
    plan = plan_for(tree, model)
    last = model.config.num_residual_codes
    hidden = prefill(model, talker_hidden, c0, model.config.num_code_groups + tree.size + 1)
    codes = [sampler.sample(model.head_logits(hidden[None], 1), generator)]
    k, calls, rounds = 1, 1, []
    while k < last:
        new_codes, hidden, stats = speculative_round(model, plan, sampler, generator, drafter, k, codes[-1][-1:], hidden)
        codes.append(new_codes)
        rounds.append(stats)
        k += len(new_codes)
        calls += 1
    return FrameResult(torch.cat(codes), calls=calls, rounds=rounds)


def speculative_round(model, plan: TreePlan, sampler: Sampler, generator, drafter, k: int, root: Tensor,
                      hidden_k: Tensor) -> tuple[Tensor, Tensor, RoundStats]:
    """One fused draft+verify call. `root` = c_k (not yet fed), `hidden_k` = h_k that produced it.

    Returns the codes emitted (accepted drafts, then the bonus unless c15 was reached), the hidden
    state that produced the last of them, and the round's statistics.
    """
    tree, last = plan.tree, model.config.num_residual_codes
    # 1. Drafts from h_k: the top-m candidates per depth, picked by the tree's (depth, rank) nodes.
    top = drafter.logits(model, hidden_k, k, tree.max_depth).topk(max(tree.top_m, 1), dim=-1).indices
    tokens = torch.cat([root.view(1), top.reshape(-1)[plan.draft_index]])
    # 2. Verify the whole tree in one call.
    x = model.embed_codes(tokens, plan.tables[k])
    hidden = model(x[None], plan.positions[k], plan.masks[k], plan.scratch)[0]
    # 3. Sample-then-match, on the device: one read at the end gives the walk's length and last node.
    node, draws, found = walk(model, plan, sampler, generator, k, tokens, hidden)
    depth, bonus_node = torch.stack([found, node]).tolist()
    path = plan.paths[bonus_node]
    ends_frame = k + depth == last  # c15 was an accepted draft: no bonus, c15 is never fed
    emitted = draws[:depth + (not ends_frame)]  # accepted drafts equal the draws at their parents
    # 4. Keep the K/V of the root and the accepted nodes, at their positions' slots.
    if not ends_frame:
        model.cache.move(plan.scratch[path], torch.arange(k + 1, k + 2 + depth, device=tokens.device))
    stats = RoundStats(depth, [(d + 1, r) for d, r in enumerate(tree.paths[bonus_node - 1])] if depth else [])
    return emitted, hidden[bonus_node], stats


def walk(model, plan: TreePlan, sampler: Sampler, generator, k: int, tokens: Tensor,
         hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Walk the tree from the root: draw at the current node (depth d predicts c_{k+1+d}), move to the child
    holding the draw, stop when none does. Without host reads, so every depth is visited; once stopped,
    the node stays put and the extra draws are ignored.

    Returns the last node reached (0-d), the draws along the path ([depth + 1], fewer at the frame end)
    and the number of accepted drafts (0-d).
    """
    tree, last = plan.tree, model.config.num_residual_codes
    node = found = torch.zeros((), dtype=torch.long, device=tokens.device)
    alive = torch.ones((), dtype=torch.bool, device=tokens.device)
    draws = []
    for d in range(min(tree.max_depth, last - k - 1) + 1):
        draws.append(sampler.sample(model.head_logits(hidden[node][None], k + 1 + d), generator))
        if d < tree.max_depth:  # children exist (and hold codes <= c_{k+1+d} <= c_last)
            start, end = tree.depth_slices[d + 1]
            match = (plan.parent[start:end] == node) & (tokens[start:end] == draws[-1]) & alive
            alive = match.any()  # siblings differ: at most one child matches
            node = torch.where(alive, start + match.long().argmax(), node)
            found = found + alive
    return node, torch.cat(draws), found
