"""Drafters: from the hidden state h_i that produced c_i, logits for c_{i+1}..c_{i+K}.

- ReusedHeads: the frozen head of codebook i+j reads h_i as is (no parameters).
- Offsets: the frozen head of codebook i+j reads h_i + b_j (K x hidden parameters; the paper's method).
- MedusaHeads: a fresh ResBlock + vocabulary head per (position, depth) (the paper's ablation).

The verifier never reads a drafter, so no drafter can change what is generated, only how fast.
"""

import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn

from rvqspec.core import device_path, draft_heads
from rvqspec.core.checkpoint import save_tensors
from rvqspec.core.context import RoundContext, codebooks_ahead
from rvqspec.core.device_path import DevicePath
from rvqspec.core.errors import RvqspecError
from rvqspec.core.tree import DEFAULT_DEPTH


def model_identity(model) -> dict:
    """What a trained drafter must match: the predictor's sizes."""
    c = model.config
    return {"hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "num_code_groups": c.num_code_groups,
            "num_hidden_layers": c.num_hidden_layers, "talker_hidden_size": c.talker_hidden_size}


def model_fingerprint(model) -> str:
    """A short hash of the first head, to tell two checkpoints of the same size apart."""
    model.require_float("a drafter's fingerprint")
    head = model.heads[0].detach().float().cpu().contiguous()
    return hashlib.sha256(head.numpy().tobytes()).hexdigest()[:16]


class Drafter(nn.Module):
    kind = "drafter"

    def __init__(self, depth: int, identity: dict | None):
        super().__init__()
        if depth < 1:
            raise RvqspecError(f"drafter depth must be >= 1, got {depth}")
        self.depth = depth
        self.identity = identity  # None: fits any model (ReusedHeads)
        self.fingerprint: str | None = None

    def check_model(self, model) -> None:
        if self.identity is not None and self.identity != model_identity(model):
            raise RvqspecError(f"this {self.kind} drafter was trained for a code predictor with {self.identity}, "
                               f"not {model_identity(model)}: train one for this model with `rvqspec train-offsets`")

    def transform(self, hidden: Tensor, position: Tensor | list[int], j: int) -> Tensor:
        """The input of the frozen head of codebook position+j (ReusedHeads: unchanged)."""
        return hidden

    def head(self, model, hidden: Tensor, positions: list[int] | Tensor, j: int, path: DevicePath,
             rank_only: bool = False) -> Tensor:
        """Logits [B, V] for c_{positions[b]+j} from hidden [B, H], row b at position positions[b] (a host list, or
        in a captured call a device tensor; codebooks past the last are clamped to it: those rows are pruned by the
        caller). rank_only: logits that only rank the candidates (the CPU's int8 heads, `draft_heads`)."""
        x = self.transform(hidden, positions, j)
        codebooks = codebooks_ahead(positions, j, model.config.num_residual_codes, path.captured)
        return draft_heads.logits(model, x, codebooks, path) if rank_only else model.head_logits(x, codebooks, path)

    def logits(self, model, hidden: Tensor, positions: list[int] | Tensor, depth: int | None = None,
               rank_only: bool = False, path: DevicePath | None = None) -> Tensor:
        """Draft logits [B, depth, V] for c_{p+1}..c_{p+depth} from h_p [B, H] (row b at p = positions[b]).
        Depths past the last code of every row are 0 (computed anyway with `path.static_shapes`); a row's own
        depths past it are garbage (pruned). `path`: a round's (default: `device_path.choose` for this call)."""
        depth, path = depth or self.depth, path or device_path.choose(hidden.device, hidden.dtype)
        reach = depth if path.static_shapes else min(depth, model.config.num_residual_codes - min(positions))
        missing = [hidden.new_zeros(len(positions), model.config.vocab_size)] * (depth - reach) if reach < depth else []
        # the K heads in one native call where they can (the model's heads: a drafter with its own, Medusa's, cannot)
        spanned = draft_heads.one_call(model, positions, path) if rank_only and type(self).head is Drafter.head \
            else None
        if spanned is not None and reach:
            inputs = [self.transform(hidden, positions, j) for j in range(1, reach + 1)]
            logits = draft_heads.span_logits(spanned, inputs, positions[0] + 1)
            return torch.cat([logits, torch.stack(missing, dim=1)], dim=1) if missing else logits
        per_depth = [self.head(model, hidden, positions, j, path, rank_only) for j in range(1, reach + 1)]
        return torch.stack(per_depth + missing, dim=1)

    def candidates(self, ctx: RoundContext, hidden: Tensor, positions: list[int] | Tensor) -> Tensor:
        """A round's top-m draft codes [B, K, m] per depth (K, m: the tree's depth and top_m): all a round needs, so
        ranked by rank-only logits. `positions`: each row's k, as `ctx.positions` gives it."""
        logits = self.logits(ctx.model, hidden, positions, ctx.plan.max_depth, rank_only=True, path=ctx.path)
        return logits.topk(ctx.plan.top_m, dim=-1).indices

    def teacher_forced_logits(self, model, hidden: Tensor, j: int) -> Tensor:
        """Logits [B, P, V] for c_{i+j} from h_i [B, G, H], for i = 1..G-1-j (all positions at once)."""
        last = model.config.num_residual_codes
        positions = torch.arange(1, last + 1 - j, device=hidden.device)
        h = self.transform(hidden[:, 1:last + 1 - j], positions, j)
        return self.batched_head(model, h, positions, j)

    def batched_head(self, model, h: Tensor, positions: Tensor, j: int) -> Tensor:
        first = int(positions[0]) + j  # codebooks first..first+P-1 use heads[first-1 : first-1+P]
        if model.is_quantized:  # int8 heads (a quantized model): one codebook at a time
            return torch.stack([model.head_logits(h[:, p], first + p) for p in range(h.shape[1])], dim=1)
        return torch.einsum("bph,pvh->bpv", h, model.heads[first - 1:first - 1 + h.shape[1]])

    def save(self, path: str | Path, extra_meta: dict | None = None) -> None:
        meta = {"kind": self.kind, "depth": str(self.depth), "model": json.dumps(self.identity),
                "fingerprint": self.fingerprint or "", **(extra_meta or {})}
        save_tensors(path, {k: v.detach() for k, v in self.state_dict().items()}, meta)

    @classmethod
    def load(cls, path: str | Path, model=None):
        """Load a drafter file; with `model`, refuse one trained for a different model."""
        path = Path(path)
        if not path.is_file():
            raise RvqspecError(f"drafter file {path} does not exist")
        try:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise RvqspecError(f"{path} is not a safetensors drafter file ({e})") from None
        kinds = {k.kind: k for k in (Offsets, PositionOffsets, MedusaHeads)}
        if meta.get("kind") not in kinds or (cls is not Drafter and kinds[meta["kind"]] is not cls):
            raise RvqspecError(f"{path} holds a {meta.get('kind', 'unknown')!r} drafter, not {cls.kind!r}")
        depth, identity = drafter_metadata(path, meta, tensors, kinds[meta["kind"]])
        drafter = kinds[meta["kind"]].from_tensors(tensors, depth, identity)
        drafter.fingerprint = meta.get("fingerprint") or None
        if model is not None:
            drafter.check_model(model)
        return drafter


IDENTITY_KEYS = ("hidden_size", "vocab_size", "num_code_groups", "num_hidden_layers", "talker_hidden_size")


def drafter_metadata(path: Path, meta: dict, tensors: dict, kind) -> tuple[int, dict]:
    """(depth, model identity) from a drafter file's metadata, refused unless they are what `save` writes and agree
    with its tensors."""
    def bad(what: str):
        raise RvqspecError(f"{path}: {what}: the file is damaged or not one `rvqspec train-offsets` wrote")

    depth = meta.get("depth", "")
    if not (depth.isdigit() and 1 <= int(depth) <= 255):
        bad(f"metadata depth {depth!r} is not an integer in [1, 255]")
    try:
        identity = json.loads(meta.get("model", ""))
    except ValueError:
        bad(f"metadata model {meta.get('model', '')[:60]!r} is not JSON")
    if not (isinstance(identity, dict) and set(identity) == set(IDENTITY_KEYS)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in identity.values())):
        bad(f"metadata model must give the predictor's sizes ({', '.join(IDENTITY_KEYS)}), got {str(identity)[:80]}")
    wanted = {"offsets": ("offsets",), "position-offsets": ("offsets",),
              "medusa": ("res_weight", "res_bias", "vocab")}[kind.kind]
    if set(tensors) != set(wanted):
        bad(f"it holds tensors {sorted(tensors)}, a {kind.kind} drafter holds {list(wanted)}")
    first = tensors[wanted[0]]
    depths = first.shape[0] if kind is Offsets else first.shape[1] if first.dim() >= 3 else -1  # [(positions,) depth]
    if depths != int(depth) or first.shape[-1] != identity["hidden_size"]:
        bad(f"its {wanted[0]} tensor {tuple(first.shape)} does not fit depth {depth} and hidden size "
            f"{identity['hidden_size']}")
    return int(depth), identity


class ReusedHeads(Drafter):
    """The neighbouring frozen heads read h_i unchanged: no parameters."""

    kind = "reused"

    def __init__(self, model=None, depth: int = DEFAULT_DEPTH):
        super().__init__(depth, None)


class Offsets(Drafter):
    """h_i + b_j through the frozen head of codebook i+j; b_j shared by all positions i."""

    kind = "offsets"

    def __init__(self, hidden_size: int, depth: int = DEFAULT_DEPTH, identity: dict | None = None):
        super().__init__(depth, identity)
        self.offsets = nn.Parameter(torch.zeros(depth, hidden_size))

    @classmethod
    def for_model(cls, model, depth: int = DEFAULT_DEPTH) -> "Offsets":
        drafter = cls(model.config.hidden_size, depth, model_identity(model)).to(model.device, model.dtype)
        drafter.fingerprint = model_fingerprint(model)
        return drafter

    @classmethod
    def from_tensors(cls, tensors: dict, depth: int, identity: dict) -> "Offsets":
        drafter = cls(tensors["offsets"].shape[1], depth, identity)
        drafter.load_state_dict(tensors)
        return drafter

    def transform(self, hidden: Tensor, position: Tensor | list[int], j: int) -> Tensor:
        return hidden + self.offsets[j - 1].to(hidden.dtype)


class PositionOffsets(Offsets):
    """h_i + b_{i,j}: one offset per start position i and lookahead distance j (15 x K x hidden for Qwen3-TTS,
    still ~0.01% of the model), where `Offsets` shares b_j across positions."""

    kind = "position-offsets"

    def __init__(self, hidden_size: int, depth: int = DEFAULT_DEPTH, identity: dict | None = None,
                 positions: int = 15):
        Drafter.__init__(self, depth, identity)
        self.offsets = nn.Parameter(torch.zeros(positions, depth, hidden_size))

    @classmethod
    def for_model(cls, model, depth: int = DEFAULT_DEPTH) -> "PositionOffsets":
        c = model.config
        drafter = cls(c.hidden_size, depth, model_identity(model), c.num_residual_codes).to(model.device, model.dtype)
        drafter.fingerprint = model_fingerprint(model)
        return drafter

    @classmethod
    def from_tensors(cls, tensors: dict, depth: int, identity: dict) -> "PositionOffsets":
        positions, _, hidden = tensors["offsets"].shape
        drafter = cls(hidden, depth, identity, positions)
        drafter.load_state_dict(tensors)
        return drafter

    def transform(self, hidden: Tensor, position: Tensor | list[int], j: int) -> Tensor:
        """hidden [B, H] at positions [B], or [B, P, H] at positions [P] (teacher forcing)."""
        index = torch.as_tensor(position, device=hidden.device).clamp(1, self.offsets.shape[0]) - 1
        return hidden + self.offsets[index, j - 1].to(hidden.dtype)


class MedusaHeads(Drafter):
    """One ResBlock (h + silu(W h + b)) and one vocabulary head per (position i, depth j).

    Initialised like Medusa: the ResBlock at zero (identity) and each vocabulary head as a copy of
    the frozen head it stands in for, so an untrained MedusaHeads drafts exactly like ReusedHeads.
    """

    kind = "medusa"

    def __init__(self, positions: int, hidden_size: int, vocab_size: int, depth: int = DEFAULT_DEPTH,
                 identity: dict | None = None):
        super().__init__(depth, identity)
        self.res_weight = nn.Parameter(torch.zeros(positions, depth, hidden_size, hidden_size))
        self.res_bias = nn.Parameter(torch.zeros(positions, depth, hidden_size))
        self.vocab = nn.Parameter(torch.zeros(positions, depth, vocab_size, hidden_size))

    @classmethod
    def for_model(cls, model, depth: int = DEFAULT_DEPTH) -> "MedusaHeads":
        c = model.config
        model.require_float("Medusa heads (copies of the model's heads)")
        drafter = cls(c.num_residual_codes, c.hidden_size, c.vocab_size, depth, model_identity(model))
        drafter = drafter.to(model.device, model.dtype)
        with torch.no_grad():
            for i in range(1, c.num_residual_codes + 1):
                for j in range(1, depth + 1):
                    drafter.vocab[i - 1, j - 1] = model.heads[min(i + j, c.num_residual_codes) - 1]
        drafter.fingerprint = model_fingerprint(model)
        return drafter

    @classmethod
    def from_tensors(cls, tensors: dict, depth: int, identity: dict) -> "MedusaHeads":
        positions, _, vocab, hidden = tensors["vocab"].shape
        drafter = cls(positions, hidden, vocab, depth, identity)
        drafter.load_state_dict(tensors)
        return drafter

    def resblock(self, hidden: Tensor, position: Tensor, j: int) -> Tensor:
        """hidden [B, H] at positions [B], or [B, P, H] at positions [P] (teacher forcing)."""
        w, b = self.res_weight[position - 1, j - 1], self.res_bias[position - 1, j - 1]
        equation = "bh,bgh->bg" if hidden.dim() == 2 else "bph,pgh->bpg"
        return hidden + F.silu(torch.einsum(equation, hidden, w) + b)

    def head(self, model, hidden: Tensor, positions: list[int] | Tensor, j: int, path: DevicePath,
             rank_only: bool = False) -> Tensor:
        index = torch.as_tensor(positions, device=hidden.device).clamp(max=self.vocab.shape[0])
        return torch.einsum("bh,bvh->bv", self.resblock(hidden, index, j), self.vocab[index - 1, j - 1])

    def batched_head(self, model, h: Tensor, positions: Tensor, j: int) -> Tensor:
        return torch.einsum("bph,pvh->bpv", self.resblock(h, positions, j), self.vocab[positions - 1, j - 1])

    def transform(self, hidden: Tensor, position: Tensor | list[int], j: int) -> Tensor:
        return hidden  # the ResBlock is applied in head/batched_head, next to its own vocabulary head


KINDS = ("reused", "offsets", "position-offsets", "medusa")  # what `make_drafter` makes (and `rvqspec train-offsets`
# trains, but reused)


def check_depth(depth: int, model) -> None:
    """A draft depth K the model's frame has room for: drafts from h_1 reach c_{1+K} <= c_last."""
    deepest = model.config.num_residual_codes - 1
    if not 1 <= depth <= deepest:
        raise RvqspecError(f"draft depth {depth} does not fit a frame of {model.config.num_residual_codes} residual "
                           f"codes: use a depth of 1..{deepest}")


def make_drafter(kind: str, model, depth: int = DEFAULT_DEPTH) -> Drafter:
    """A fresh (untrained) drafter of `kind` for `model`."""
    check_depth(depth, model)
    makers = {"reused": lambda: ReusedHeads(model, depth), "offsets": lambda: Offsets.for_model(model, depth),
              "position-offsets": lambda: PositionOffsets.for_model(model, depth),
              "medusa": lambda: MedusaHeads.for_model(model, depth)}
    if kind not in makers:
        raise RvqspecError(f"unknown drafter {kind!r}: use one of {', '.join(makers)}")
    return makers[kind]()
