"""Step 3 of a speculative round: sample-then-match down every row's tree. Two walks, one contract.

Contract. Row b has emitted c1..c_k (k = k_host[b]); its tree's tokens are `tokens[b]` (node 0 the root c_k) and
`hidden[b, n]` is the verifier's state at node n. From the root, at depth d (the current node's draft predicts
c_{k+1+d}) the walk draws x ~ p~(node) (exactly AR sampling: the right head, the deployed sampler) and moves to
the child whose token is x, if any; a row stops at the first draw no child holds, or at the frame end: a row
walks at depth d only while `walks_at(k, d, last)`, i.e. c_{k+1+d} is still a code of the frame. Returns
`Walk(node, draws, found)`: the last node reached per row [B], the draws along the path [B, d + 1] (row b emits
its first found[b] + 1 of them, capped at the frame end) and the accepted drafts per row [B].

- `walk_on_host` (the CPU, `DevicePath.host_walk`): reads each depth's draws and computes the next depth's head
  only for the rows whose walk goes on: accepted + 1 heads and draws per round instead of K + 1. Its node and found
  are host lists (it has read them): the round needs no other host read, and a row's state at a node is a view.
- `walk_on_device` (accelerators): no host read, so every depth some row can reach is visited (with static shapes
  every depth); a stopped row stays put and its extra draws are ignored.

Either way a draw of c_j uses the row's noise for c_j (`RoundContext.sample`): an extra draw takes nothing from the
row's generator, so both walks give a row the same codes alone and in any batch.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from rvqspec.core.context import RoundContext, codebooks_ahead, pick


@dataclass
class Walk:
    node: Tensor | list[int]  # [B] the last node reached (the node of the bonus draw); a host list on the host walk
    draws: Tensor  # [B, d + 1] the draws along the path, depth 0 first
    found: Tensor | list[int]  # [B] drafts accepted; a host list on the host walk


def walks_at(k, d: int, last: int):
    """Whether a row with k codes walks at depth d: its draw there is c_{k+1+d}, which must not pass c_last.
    `k` an int or a tensor of them."""
    return k + 1 + d <= last


def depths(ctx: RoundContext, k_host: list[int] | None) -> int:
    """Depths to visit: the tree's, or fewer where no row can reach them (all of them with static shapes, which a
    captured call, without host values, always takes)."""
    deepest, last = ctx.plan.max_depth, ctx.model.config.num_residual_codes
    if ctx.path.static_shapes:
        return deepest + 1
    return min(deepest, last - min(k_host) - 1) + 1


def walk(ctx: RoundContext, k: Tensor, k_host: list[int] | None, tokens: Tensor, hidden: Tensor) -> Walk:
    """The walk of the context's path (`DevicePath.host_walk`)."""
    if ctx.path.host_walk:
        return walk_on_host(ctx, k_host, tokens, hidden)
    return walk_on_device(ctx, k, k_host, tokens, hidden)


def walk_on_host(ctx: RoundContext, k_host: list[int], tokens: Tensor, hidden: Tensor) -> Walk:
    model, plan, last = ctx.model, ctx.plan, ctx.model.config.num_residual_codes
    batch, candidates = len(k_host), tokens.tolist()
    node, found = [0] * batch, [0] * batch
    walking = [b for b in range(batch) if walks_at(k_host[b], 0, last)]  # finished rows ride along
    visited = depths(ctx, k_host)
    draws = [[0] * max(visited, 1) for _ in range(batch)]
    for d in range(visited):
        if not walking:
            break
        codebooks = [k_host[b] + 1 + d for b in walking]
        logits = model.head_logits(pick(hidden, walking, [node[b] for b in walking]), codebooks, ctx.path)
        going_on = []
        for b, code in zip(walking, ctx.sample(logits, codebooks, walking).tolist()):
            draws[b][d] = code
            child = next((c for c in plan.children[node[b]] if candidates[b][c] == code), None)
            if child is not None:  # the draw is this child's token: accept it; its own draw comes next
                node[b], found[b] = child, found[b] + 1
                if walks_at(k_host[b], d + 1, last):
                    going_on.append(b)
        walking = going_on
    return Walk(node, torch.tensor(draws, device=tokens.device), found)


def walk_on_device(ctx: RoundContext, k: Tensor, k_host: list[int] | None, tokens: Tensor, hidden: Tensor) -> Walk:
    tree, last = ctx.plan.tree, ctx.model.config.num_residual_codes
    rows = torch.arange(len(k), device=tokens.device)
    node = found = torch.zeros(len(k), dtype=torch.long, device=tokens.device)
    alive = walks_at(k, 0, last)
    positions = ctx.positions(k, k_host)
    draws = []
    for d in range(depths(ctx, k_host)):
        # rows past their frame end draw garbage, ignored
        codebooks = codebooks_ahead(positions, 1 + d, last, ctx.captured)
        logits = ctx.model.head_logits(hidden[rows, node], codebooks, ctx.path)
        draws.append(ctx.sample(logits, codebooks))
        if d < ctx.plan.max_depth:  # children exist at depth d + 1
            start, end = tree.depth_slices[d + 1]
            match = (ctx.plan.parent[start:end] == node[:, None]) & (tokens[:, start:end] == draws[-1][:, None])
            match &= (alive & walks_at(k, d, last))[:, None]
            alive = match.any(1)  # siblings differ: at most one child matches
            node = torch.where(alive, start + match.long().argmax(1), node)
            found = found + alive
    return Walk(node, torch.stack(draws, dim=1), found)
