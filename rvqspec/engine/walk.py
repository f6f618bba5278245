"""The CPU's acceptance walk: stop at the first depth without a match, so only accepted + 1 heads and draws run.

On the CPU a host read costs nothing, so the walk reads each depth's draws and computes the next depth's head
only for the rows whose walk goes on (at the paper's 2.47 tokens/step: 2.5 heads and draws per round instead of
K + 1 = 4). Accelerators keep `decode.walk`, which visits every depth without reading the device.
"""

import torch
from torch import Tensor

from rvqspec import drafters, fused


def applies(device: torch.device) -> bool:
    """The CPU (no static shapes: `drafters.static_shapes`) with the fast path on (`fused.on`)."""
    return fused.on() and not drafters.static_shapes(device)


def children(plan) -> list[list[int]]:
    """Each node's children, once per plan."""
    kids = plan.__dict__.get("_children")
    if kids is None:
        kids = [[] for _ in range(plan.tree.size + 1)]
        for child, parent in enumerate(plan.tree.parent.tolist()[1:], 1):
            kids[parent].append(child)
        plan.__dict__["_children"] = kids
    return kids


def walk_on_host(model, plan, sampler, generator, k_host: list[int], tokens: Tensor,
                 hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`decode.walk`'s contract (last node [B], draws [B, d + 1], accepted drafts [B]), reading each depth's draws:
    a row stops at the first depth whose draw matches no child, or when its frame is complete."""
    tree, last, batch = plan.tree, model.config.num_residual_codes, len(k_host)
    kids, candidates = children(plan), tokens.tolist()
    node, found = [0] * batch, [0] * batch
    walking = [b for b in range(batch) if k_host[b] < last]  # finished rows ride along: nothing to draw
    depths = min(tree.max_depth, last - min(k_host) - 1) + 1
    draws = torch.zeros(batch, max(depths, 1), dtype=torch.long)
    for d in range(depths):
        if not walking:
            break
        rows = torch.tensor(walking)
        logits = model.head_logits(hidden[rows, torch.tensor([node[b] for b in walking])],
                                   [k_host[b] + 1 + d for b in walking])
        drawn = sampler.sample(logits, generator)
        draws[rows, d] = drawn
        going_on = []
        for b, code in zip(walking, drawn.tolist()):
            child = next((c for c in kids[node[b]] if candidates[b][c] == code), None)
            if child is not None:  # the draw is this child's token: accept it; its own draw comes next
                node[b], found[b] = child, found[b] + 1
                if k_host[b] + 2 + d <= last:
                    going_on.append(b)
        walking = going_on
    return torch.tensor(node), draws.to(tokens.device), torch.tensor(found)
