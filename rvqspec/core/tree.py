"""Sparse draft trees: rank paths (Medusa style), their buffers, greedy growth from acceptance stats.

A path `(r1, r2, ...)` is the node that takes the rank-r1 draft at depth 1, then rank r2 at depth 2
under it, and so on. Index 0 of every buffer is the root (the last emitted code); nodes 1..N follow
in breadth-first order, so the nodes of one depth are contiguous.

JSON format (`Tree.save`/`Tree.load`):
    {"format": "rvqspec-tree/1", "paths": [[0], [1], [0, 0]], "meta": {...}}
`meta` is free-form (`grow_tree` writes the tree size N it was asked for, under its old key "budget", and the
predicted tokens per round; calibration adds what it measured).
"""

import heapq
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from rvqspec.core.errors import RvqspecError
from rvqspec.core.files import read_json

FORMAT = "rvqspec-tree/1"
DEFAULT_DEPTH = 3  # K, the codes drafted ahead of the last one (the paper's)
MAX_NODES = 1024  # N: a verify call over 1,025 tokens is far past any speed-up; tree growth is quadratic in N
MAX_DEPTH = 255  # drafts reach at most the frame's last code (config caps: 256 code groups)
MAX_RANK = 1 << 18  # a rank indexes a codebook (config caps: vocabularies of 2^18)


@dataclass
class Tree:
    paths: list[tuple[int, ...]]
    meta: dict = field(default_factory=dict)
    parent: Tensor = field(init=False)  # [q] index of each node's parent (the root points at itself)
    depth: Tensor = field(init=False)  # [q] 0 for the root
    rank: Tensor = field(init=False)  # [q] rank of each node's draft (0 for the root)
    ancestors: Tensor = field(init=False)  # [q, q] True where column is an ancestor of row, or row itself
    depth_slices: list[tuple[int, int]] = field(init=False)  # node index range of each depth 0..max_depth

    def __post_init__(self) -> None:
        self.paths = validate_paths(self.paths)
        index = {(): 0} | {path: i + 1 for i, path in enumerate(self.paths)}
        nodes = [()] + self.paths
        self.parent = torch.tensor([index[p[:-1]] if p else 0 for p in nodes])
        self.depth = torch.tensor([len(p) for p in nodes])
        self.rank = torch.tensor([p[-1] if p else 0 for p in nodes])
        self.ancestors = torch.tensor([[q == p[:len(q)] for q in nodes] for p in nodes])
        depths = self.depth.tolist()
        self.depth_slices = [(depths.index(d), len(depths) - depths[::-1].index(d)) for d in range(self.max_depth + 1)]

    @property
    def size(self) -> int:
        """N, the number of draft nodes (the verify call's query is N + 1 long)."""
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    @property
    def top_m(self) -> int:
        """How many ranked candidates per depth the drafter must provide."""
        return max((r for p in self.paths for r in p), default=-1) + 1

    def check_fits(self, depth: int, vocab_size: int | None = None) -> None:
        if self.max_depth > depth:
            raise RvqspecError(f"tree is {self.max_depth} deep but the drafter drafts only {depth} codes ahead: "
                               f"use a tree of depth <= {depth} or a deeper drafter")
        if vocab_size is not None and self.top_m > vocab_size:
            raise RvqspecError(f"tree uses draft rank {self.top_m - 1} but a codebook has only {vocab_size} codes: "
                               f"use a tree whose ranks are < {vocab_size}")

    @classmethod
    def from_paths(cls, paths, meta: dict | None = None) -> "Tree":
        try:
            return cls([tuple(p) for p in paths], dict(meta or {}))
        except TypeError:
            raise RvqspecError(f"invalid tree paths {paths!r}: expected a list of rank sequences like [[0], [1], [0, 0]]"
                               ) from None

    @classmethod
    def chain(cls, depth: int) -> "Tree":
        """The single path of rank-0 drafts (classic speculative decoding)."""
        return cls.from_paths([(0,) * d for d in range(1, depth + 1)])

    @classmethod
    def load(cls, path: str | Path) -> "Tree":
        path = Path(path)
        if not path.is_file():
            raise RvqspecError(f"tree file {path} does not exist")
        obj = read_json(path, "write the tree again (Tree.save, rvqspec calibrate)")
        if not isinstance(obj, dict) or obj.get("format") != FORMAT or not isinstance(obj.get("paths"), list):
            raise RvqspecError(f"{path} is not an rvqspec tree: expected {{\"format\": \"{FORMAT}\", \"paths\": [...]}}")
        if not isinstance(obj.get("meta", {}), dict):
            raise RvqspecError(f"{path}: meta must be an object (free-form), got {str(obj['meta'])[:60]}")
        return cls.from_paths(obj["paths"], obj.get("meta"))

    def save(self, path: str | Path) -> None:
        from rvqspec.core.checkpoint import save_json

        save_json(path, {"format": FORMAT, "paths": [list(p) for p in self.paths], "meta": self.meta})


def validate_paths(paths: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Check the paths form a tree and return them in breadth-first order."""
    if not paths:
        raise RvqspecError("a tree needs at least one node: use a tree of size >= 1, or decode without a drafter for "
                           "plain AR")
    if len(paths) > MAX_NODES:
        raise RvqspecError(f"the tree has {len(paths)} nodes, more than {MAX_NODES}: a verify call over that many "
                           "tokens is far past any speed-up (and building its masks grows quadratically): use N <= "
                           f"{MAX_NODES} (the paper's devices choose 16-32)")
    seen = set()
    for path in paths:
        if not path or len(path) > MAX_DEPTH or not all(isinstance(r, int) and not isinstance(r, bool)
                                                        and 0 <= r < MAX_RANK for r in path):
            raise RvqspecError(f"invalid tree path {str(path)[:80]}: a path is a non-empty sequence of at most "
                               f"{MAX_DEPTH} ranks >= 0 (each < {MAX_RANK})")
        if path in seen:
            raise RvqspecError(f"tree path {path!r} appears twice: every node must be listed once")
        seen.add(path)
    for path in paths:
        if len(path) > 1 and path[:-1] not in seen:
            raise RvqspecError(f"tree path {path!r} has no parent {path[:-1]!r}: every prefix of a path must be in the tree")
    return sorted(paths, key=lambda p: (len(p), p))


def grow_tree(acceptance: Tensor, budget: int, max_depth: int | None = None) -> Tree:
    """Greedy sparse tree (docs/design.md, section 3) from acceptance[d][r] = P(rank r wins at depth d+1), of
    size N = `budget` (the parameter keeps its name; fewer nodes where the candidates run out).

    A node's value is the product of acceptance along its path, i.e. the probability that it is
    accepted; each time, the best candidate (first child or next sibling of a node already in the
    tree) is added. Expected tokens per round (the codes a round emits: accepted + 1) = 1 + sum of values.
    """
    depth_cap, top_m = acceptance.shape
    depth_cap = min(depth_cap, max_depth or depth_cap)
    a = acceptance.tolist()
    value = {(): 1.0}
    frontier: list[tuple[float, tuple[int, ...]]] = []

    def offer(path: tuple[int, ...]) -> None:
        if len(path) <= depth_cap and path[-1] < top_m:
            heapq.heappush(frontier, (-value[path[:-1]] * a[len(path) - 1][path[-1]], path))

    offer((0,))
    while len(value) <= budget and frontier:
        negative, path = heapq.heappop(frontier)
        value[path] = -negative
        offer(path + (0,))
        offer(path[:-1] + (path[-1] + 1,))
    paths = [p for p in value if p]
    expected = 1.0 + sum(value[p] for p in paths)
    return Tree.from_paths(paths, {"budget": budget, "predicted_tokens_per_round": expected})


def prior_acceptance(depth: int) -> Tensor:
    """A prior acceptance profile for the default trees, until `rvqspec calibrate` measures the real one: rank r
    at depth d wins with probability 0.55 * 0.45**r * 0.9**d (drafts get worse with rank and depth)."""
    return torch.tensor([[0.55 * 0.45 ** r * 0.9 ** d for r in range(16)] for d in range(depth)])


PRIOR_ACCEPTANCE = prior_acceptance(DEFAULT_DEPTH)


def default_tree(budget: int, depth: int = DEFAULT_DEPTH) -> Tree:
    """A sparse tree of size N = `budget` (the parameter keeps its name), at most `depth` deep, grown from the
    prior; N = 3 and below give chains/fans."""
    return grow_tree(prior_acceptance(depth), budget)
