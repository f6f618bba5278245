"""Decode the residual codes c1..c15 of a batch of frames: plain autoregressive, or speculative with a tree.

Every row of a batch goes through the same predictor calls: AR takes 15 calls per batch, a speculative
round one call per batch whatever each row's progress (k, the codes it has so far). A row whose frame
is complete rides along as padding until the slowest row finishes. `decode_frame` is the batch of one.

Speculative round (DESIGN section 2), all in `round_on_device` (which `speculative_round` calls, then reads the
result on the host once), for every row at once:
 1. drafts: the drafter reads the hidden state that produced the row's last code c_k and proposes the
    top-m codes for c_{k+1}..c_{k+K}; the tree picks N of them;
 2. one model call over [root = c_k, node_1..node_N] per row, with the row's tree mask, positions and
    embedding tables (gathered by its k), gives the verifier's distribution at every node;
 3. sample-then-match: walking from the root, a fresh draw x ~ p~(node) is taken at the current node
    (exactly AR sampling wherever the walk goes) and the child whose token is x is accepted; the draw at
    the deepest accepted node is the bonus code. Only the nodes on the path reach the heads and the
    sampler. On an accelerator the walk runs on the device, one draw per depth, and the host reads the
    result once; on the CPU it stops at the first depth without a match (`walk`);
 4. each row's K/V entries of the root and its accepted nodes are moved to consecutive slots.
Because every emitted code is a draw from the verifier's p~ given the true prefix, the output has
exactly the distribution of AR decoding (and greedy codes are identical).

Cache layout (per row): slots 0..G-1 hold committed positions (slot = position); slots G..G+N hold the
round's tree. Committed: positions 0..k (position p holds c_{p-1}; position 0 the talker state). The
compaction copies max_depth + 1 entries per row whatever it accepted: entries past its new k land on
slots that its mask hides until a later round overwrites them, so a round's shapes depend only on
(B, N) and a row never needs a Python branch of its own.
"""

from dataclasses import dataclass, field

import torch
from torch import Tensor

from rvqspec.engine.drafters import Drafter
from rvqspec.engine.errors import RvqspecError
from rvqspec.engine.sampling import Sampler
from rvqspec.engine.tree import Tree
from rvqspec.engine.walk import walk

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
    """The codes of `frames` per predictor call each took part in: the one definition of tokens/step (AR: 1)."""
    return sum(len(frame.codes) for frame in frames) / sum(frame.calls for frame in frames)


@dataclass
class TreePlan:
    """Everything a round needs about the tree, built once per (tree, groups, device) and kept in `tree.plans`.
    Per-k tables are stacked so that a batch gathers each row's by its k. q = N + 1 query tokens (root + nodes).

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
      path_steps    [1, 2, 3]: a path's entries go to slots k + 1, k + 2, ... (positions 4, 5, 6 at k = 3)
      children      [[1, 2], [3], [], []]: the host walk's child lists
    """

    tree: Tree
    parent: Tensor  # [q]
    draft_index: Tensor  # [N] index into the drafter's flattened top-m table [depth, m]
    scratch: Tensor  # [q] cache slots of the tree
    positions: Tensor  # [G, q] per k: position ids k+1+depth
    tables: Tensor  # [G, q] per k: embedding table of each token (clamped past the last code)
    masks: Tensor  # [G, q, G+q] per k: committed slots 0..k, then the tree's ancestors
    path_slots: Tensor  # [q, max_depth+1] per node: scratch slots of root..node, padded with the node's own
    path_steps: Tensor  # [max_depth+1] 1, 2, ...: where the path goes, counted from the row's k
    children: list[list[int]]  # per node, its children (host lists, for the host walk)


@dataclass
class RoundResult:
    """What one speculative round gives every row (see `speculative_round`)."""

    draws: Tensor  # [B, d] the walk's draws: row b emits its first accepted[b] + 1 of them, capped at the frame end
    hidden: Tensor  # [B, H] the hidden state that produced each row's last draw (the next round drafts from it)
    accepted: list[int]  # per row, drafts accepted (host list)
    bonus_node: list[int]  # per row, the tree node of the bonus draw (0: the root; host list)


def plan_for(tree: Tree, model) -> TreePlan:
    key = (model.config.num_code_groups, str(model.device))
    if key not in tree.plans:
        tree.plans[key] = build_plan(tree, model.config.num_code_groups, model.device)
    return tree.plans[key]


def build_plan(tree: Tree, groups: int, device: torch.device) -> TreePlan:
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
        masks=masks.to(device), path_slots=(groups + torch.tensor(paths)).to(device),
        path_steps=torch.arange(1, tree.max_depth + 2, device=device), children=children)


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


def check_decoding(generator, drafter, tree) -> None:
    """The generator, drafter and tree of a decode call are of the types it takes (or a clear error)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise RvqspecError(f"generator must be a torch.Generator (or None: torch's global RNG), got "
                           f"{type(generator).__name__}: pass torch.Generator().manual_seed(seed)")
    if drafter is not None and not isinstance(drafter, Drafter):
        raise RvqspecError(f"drafter must be an rvqspec drafter (rvqspec.ReusedHeads(), rvqspec.Offsets.load(path), "
                           f"...) or None for plain AR, got {drafter!r}")
    if drafter is not None and tree is None:
        raise RvqspecError("speculative decoding needs a tree: pass tree=rvqspec.Tree.load(...) or default_tree(N)")
    if tree is not None and not isinstance(tree, Tree):
        raise RvqspecError(f"tree must be an rvqspec.Tree (Tree.from_paths({tree!r}), Tree.load(path) or "
                           f"default_tree(N)), got {type(tree).__name__}")


@torch.inference_mode()
def decode_frame(model, talker_hidden: Tensor, c0, sampler: Sampler, generator: torch.Generator | None = None,
                 drafter=None, tree: Tree | None = None) -> FrameResult:
    """Codes c1..c15 of one frame. drafter None: plain AR (15 calls); else speculative with `tree`."""
    talker_hidden, c0 = check_frame(model, talker_hidden, c0)
    return decode_frames(model, talker_hidden, c0, sampler, generator, drafter, tree).rows[0]


@torch.inference_mode()
def decode_frames(model, talker_hidden: Tensor, c0, sampler: Sampler, generator: torch.Generator | None = None,
                  drafter=None, tree: Tree | None = None, graphs=None) -> BatchResult:
    """Codes c1..c15 of B frames (talker_hidden [B, H], c0 [B]) in one batch of predictor calls.

    drafter None: plain AR, 15 calls for the batch; else speculative with `tree`, until every row is done.
    Each row draws from its own distribution, exactly as it would alone (identical codes when greedy).
    `graphs`: a `rvqspec.engine.graphs.GraphDecoder`, whose captured calls replay the same decoding.
    """
    talker_hidden, c0 = check_batch(model, talker_hidden, c0, sampler)
    check_decoding(generator, drafter, tree)
    model.refresh()
    if drafter is not None:
        drafter.check_model(model)
        tree.check_fits(drafter.depth, model.config.vocab_size)
        drafter.to(model.device, model.dtype)  # no-op when it already matches
    if graphs is not None:
        return graphs.decode(model, talker_hidden, c0, sampler, generator, drafter, tree)
    if drafter is None:
        return decode_autoregressive(model, talker_hidden, c0, sampler, generator)
    return decode_speculative(model, talker_hidden, c0, sampler, generator, drafter, tree)


def prefill(model, cache, talker_hidden: Tensor, c0: Tensor) -> Tensor:
    """Positions 0 (talker state) and 1 (c0) of every row; returns h_1 [B, hidden]."""
    x = torch.stack([model.embed_talker_hidden(talker_hidden), model.embed_codes(c0, torch.zeros_like(c0))], dim=1)
    positions = torch.arange(2, device=model.device)
    mask = torch.arange(cache.slots, device=model.device)[None, :] <= positions[:, None]
    return model(x, positions, mask, cache, positions)[:, 1]


def decode_autoregressive(model, talker_hidden: Tensor, c0: Tensor, sampler: Sampler,
                          generator: torch.Generator | None) -> BatchResult:
    cache = model.new_cache(len(c0), model.config.num_code_groups)
    return ar_batch(autoregressive_codes(model, cache, talker_hidden, c0, sampler, generator))


def ar_batch(codes: Tensor) -> BatchResult:
    """The result of an AR frame's codes [B, G-1]: one call per code for the batch, and for every row."""
    calls = codes.shape[1]
    return BatchResult(codes, calls, [FrameResult(row, calls) for row in codes])


def autoregressive_codes(model, cache, talker_hidden: Tensor, c0: Tensor, sampler: Sampler,
                         generator: torch.Generator | None) -> Tensor:
    """The AR frame's 15 calls into `cache` (G slots per row): codes [B, G-1]. No host values (a CUDA graph can
    capture it, `rvqspec.engine.graphs`)."""
    groups = model.config.num_code_groups
    hidden = prefill(model, cache, talker_hidden, c0)
    codes = [sampler.sample(model.head_logits(hidden, 1), generator)]
    slots = torch.arange(groups, device=model.device)
    masks = slots[None, :] <= slots[:, None]
    for p in range(2, groups):
        codes.append(autoregressive_step(model, cache, sampler, generator, codes[-1], p, slots, masks))
    return torch.stack(codes, dim=1)


def autoregressive_step(model, cache, sampler: Sampler, generator, code: Tensor, p: int, slots: Tensor,
                        masks: Tensor) -> Tensor:
    """One AR call: feed c_{p-1} (`code` [B]) at position p (slot p), return c_p [B]. masks[p]: slots <= p."""
    position = slots[p:p + 1]
    x = model.embed_codes(code, position - 1)[:, None]
    hidden = model(x, position, masks[p:p + 1], cache, position)[:, 0]
    return sampler.sample(model.head_logits(hidden, p), generator)


class EagerCalls:
    """The predictor calls of a speculative frame, run as they come; `rvqspec.engine.graphs` replays the same
    calls from CUDA graphs (`start`: prefill and c1, `round`: one round)."""

    def __init__(self, model, batch: int, tree: Tree, sampler: Sampler, generator, drafter):
        self.model, self.sampler, self.generator, self.drafter = model, sampler, generator, drafter
        self.plan = plan_for(tree, model)
        self.cache = model.new_cache(batch, model.config.num_code_groups + tree.size + 1)

    def start(self, talker_hidden: Tensor, c0: Tensor) -> tuple[Tensor, Tensor]:
        """(h_1 [B, hidden], c1 [B])."""
        return first_code(self.model, self.cache, talker_hidden, c0, self.sampler, self.generator)

    def round(self, k: Tensor, k_host: list[int], root: Tensor, hidden: Tensor) -> "RoundResult":
        return speculative_round(self.model, self.cache, self.plan, self.sampler, self.generator, self.drafter, k,
                                 k_host, root, hidden)


def first_code(model, cache, talker_hidden: Tensor, c0: Tensor, sampler: Sampler, generator) -> tuple[Tensor, Tensor]:
    hidden = prefill(model, cache, talker_hidden, c0)
    return hidden, sampler.sample(model.head_logits(hidden, 1), generator)


def decode_speculative(model, talker_hidden: Tensor, c0: Tensor, sampler: Sampler, generator, drafter,
                       tree: Tree, calls: EagerCalls | None = None, rows: int | None = None) -> BatchResult:
    """`calls`: where the predictor calls run (default: eagerly); `rows`: the first rows are the frames, the rest
    padding that starts done (a graph's batch bucket)."""
    batch, last = len(c0), model.config.num_residual_codes
    rows = batch if rows is None else rows
    calls = calls or EagerCalls(model, batch, tree, sampler, generator, drafter)
    hidden, first = calls.start(talker_hidden, c0)
    codes = torch.zeros(batch, last + tree.max_depth + 1, dtype=torch.long, device=model.device)  # + scratch
    codes[:, 0] = first
    k_host = [1] * rows + [last] * (batch - rows)  # codes per row
    results, calls_made = [FrameResult(codes[b, :last], 1) for b in range(rows)], 1
    k = torch.tensor(k_host, device=model.device)  # the same, for the device's gathers
    while min(k_host) < last:
        root = codes.gather(1, k[:, None] - 1)[:, 0]
        result = calls.round(k, k_host, root, hidden)
        hidden, accepted = result.hidden, result.accepted
        # Draws go to c_{k+1}..; those past what a row emitted land on codes a later round overwrites.
        codes.scatter_(1, k[:, None] + torch.arange(result.draws.shape[1], device=k.device), result.draws)
        for b, row in enumerate(results):
            if k_host[b] < last:
                row.calls += 1
                row.rounds.append(RoundStats(accepted[b], list(enumerate(tree.paths[result.bonus_node[b] - 1], 1))
                                             if accepted[b] else []))
                k_host[b] = min(k_host[b] + 1 + accepted[b], last)
        k = torch.tensor(k_host, device=model.device)
        calls_made += 1
    return BatchResult(codes[:rows, :last], calls_made, results)


def speculative_round(model, cache, plan: TreePlan, sampler: Sampler, generator, drafter, k: Tensor,
                      k_host: list[int], root: Tensor, hidden_k: Tensor) -> RoundResult:
    """One fused draft+verify call for every row. Row b has emitted c1..c_{k[b]} (`k_host` the same on the
    host); `root` [B] = c_k (not yet fed), `hidden_k` [B, H] = the h_k that produced it."""
    draws, hidden, found, node = round_on_device(model, cache, plan, sampler, generator, drafter, k, k_host, root,
                                                 hidden_k)
    accepted, bonus = torch.stack([found, node]).tolist()  # the round's one host read
    return RoundResult(draws, hidden, accepted, bonus)


def round_on_device(model, cache, plan: TreePlan, sampler: Sampler, generator, drafter, k: Tensor,
                    k_host: list[int] | None, root: Tensor, hidden_k: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Steps 1-4: (draws, the hidden state at each row's bonus node, drafts accepted [B], bonus node [B]), all on
    the device. With `k_host` None no step reads a host value, so a CUDA graph can capture the round."""
    tree, batch = plan.tree, len(k)
    positions = k if k_host is None else k_host
    # 1. Drafts from h_k: the top-m candidates per depth, picked by the tree's (depth, rank) nodes.
    top = drafter.candidates(model, hidden_k, positions, tree.max_depth, max(tree.top_m, 1))
    tokens = torch.cat([root[:, None], top.flatten(1)[:, plan.draft_index]], dim=1)  # [B, q]
    # 2. Verify every row's tree in one call.
    x = model.embed_codes(tokens, plan.tables[k])
    hidden = model(x, plan.positions[k], plan.masks[k], cache, plan.scratch)
    # 3. Sample-then-match (`walk`: on the CPU reading each depth, so it stops early; elsewhere on the device).
    path = walk(model, plan, sampler, generator, k, k_host, tokens, hidden)
    # 4. Keep the K/V of the root and the accepted nodes at their positions' slots k+1.. (see module doc).
    cache.move(plan.path_slots[path.node], k[:, None] + plan.path_steps)
    return path.draws, hidden[torch.arange(batch, device=path.node.device), path.node], path.found, path.node
