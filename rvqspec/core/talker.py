"""The talker on the core's blocks: the transformer that emits each frame's c0 (Qwen3-TTS's talker, Sesame CSM's
backbone, the stand-in's), decoding many requests at once, each one row of a shared static cache.

Rows: row b of a step is row b of the cache buffer, and its tokens sit at slots 0..lengths[b]-1 (a token's slot is
its index in its own sequence, not its RoPE position: the stand-in's positions are text-aligned). A step gives every
row one token, written at slot lengths[b] and attending to the slots before it and itself. A new request is
prefilled alone, whole or in pieces (each `prefill` call appends a piece to its row), into a row of a cache of its own
(the scheduler's staging row, so that a half-prefilled row never takes part in a step), then copied into a new last row
(`RowCache.adopt`); a row that leaves takes the last row's entries into its place (`RowCache.remove`), so a step's rows
are always 0..B-1 and it reads a view of the buffer, never a gather.

A step attends over the slots in use rounded up to `SLOT_MULTIPLE`; on the CPU fast path each row's one query visits
its own keys in position order (`fused.attention_in_order`: 0.03-0.31x SDPA's time at the 0.6B's heads over 128-1024
slots, 1-4 rows), elsewhere SDPA's reductions run over the same lanes whatever else is in the batch (masked slots add
exact zeros); a prefill (many queries, alone) takes SDPA (issue 51, 0.6B w8a8, Zen 4, a 71-token prompt: its
matmuls ran at 1.2-1.4x the int8 peak the floors use (a 1024^3 product), SDPA took ~20% of it (~4x its FLOPs' floor);
the in-order kernel was no faster: 0.97x SDPA's prefill time at 71 tokens, 1.11x at 213). Where the matmuls
give a row the same bits in any call (the row floor `device_path` measured: the large bfloat16 weights here), a row's
hidden states do not depend on the batch; where this CPU's kernels differ in the last bit by row count (small float32
matmuls), they differ by rounding only, and greedy codes stay the same (tests/test_runtime.py).

Qwen3-TTS's M-RoPE gives speech and text tokens the same id in its three sections (time, height, width), so its
rotation is 1-D RoPE at that id (upstream's `get_rope_index` for text-only input); the talker uses plain RoPE.
"""

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rvqspec.core.checkpoint import layers_layout
from rvqspec.core.errors import RvqspecError
from rvqspec.core.model import Block, KVCache, RMSNorm, RotaryEmbedding, init_weights, run_layers
from rvqspec.core.packing import Linear

SLOT_MULTIPLE = 64  # slots a call attends over, rounded up to this (module docstring)
GROW_SLOTS = 512  # the cache grows by at least this many slots, and doubles its rows, when it runs out


@dataclass(frozen=True)
class TalkerConfig:
    """The talker's shape (upstream's names)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # rows of the c0 head: codes and special tokens
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    qk_norm: bool = True  # Qwen3's q/k norms (a Llama backbone has none)
    rope_scaling: dict | None = None


class Talker(nn.Module):
    """A Qwen3 (or Llama) decoder stack with its c0 head (`codec_head`), in the predictor's layer layout (fused q/k/v
    and gate/up: `checkpoint.official_layout`)."""

    def __init__(self, config: TalkerConfig):
        super().__init__()
        self.config = c = config
        self.layers = nn.ModuleList(
            Block(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                  c.rms_norm_eps, c.qk_norm) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.codec_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        self.rope = RotaryEmbedding(c.head_dim, c.rope_theta, c.max_position_embeddings, c.rope_scaling)
        self.apply(init_weights)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @classmethod
    def from_official(cls, config: TalkerConfig, tensors: dict[str, Tensor], prefix: str, head: str) -> "Talker":
        """A Talker (eval, frozen) holding upstream's tensors (a state_dict): its layers under `prefix`
        (`checkpoint.layers_layout`), its c0 head under `head`; on their device and dtype. Single tensors are shared,
        not copied; q/k/v and gate/up are concatenated (copies: one matmul each, as in the predictor)."""
        state = {native: tensors[parts[0][0]] if len(parts) == 1 else torch.cat([tensors[name] for name, _ in parts])
                 for native, (_, parts) in layers_layout(config, prefix).items()}
        state["codec_head.weight"] = tensors[head]
        with torch.device("meta"):  # no random init of weights about to be replaced (0.6B: seconds)
            model = cls(config)
        model.load_state_dict(state, assign=True)
        c = config
        model.rope = RotaryEmbedding(c.head_dim, c.rope_theta, c.max_position_embeddings, c.rope_scaling)  # computed
        return model.to(tensors[head].device).eval().requires_grad_(False)

    def forward(self, x: Tensor, positions: Tensor, mask: Tensor, cache: KVCache, slots: Tensor) -> Tensor:
        """Final-norm hidden states [B, T, H] (arguments: `model.run_layers`)."""
        return run_layers(self, x, positions, mask, cache, slots)


def round_slots(slots: int) -> int:
    return -(-slots // SLOT_MULTIPLE) * SLOT_MULTIPLE


class RowCache:
    """The K/V of a talker's rows, one per live request (module docstring); grows as rows and lengths need."""

    def __init__(self, talker: nn.Module, rows: int = 1, slots: int = GROW_SLOTS):
        self.talker = talker
        self.kv = self.new(rows, round_slots(slots))
        self.lengths: list[int] = []

    def new(self, rows: int, slots: int) -> KVCache:
        c, weight = self.talker.config, self.talker.norm.weight
        return KVCache(c.num_hidden_layers, rows, c.num_key_value_heads, slots, c.head_dim, weight.dtype,
                       weight.device)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def reserve(self, rows: int, slots: int) -> None:
        """Room for `rows` rows of `slots` slots (the entries so far copied into a bigger buffer if needed)."""
        have_rows, have_slots = self.kv.kv.shape[2], self.kv.slots
        if rows <= have_rows and slots <= have_slots:
            return
        bigger = self.new(have_rows if rows <= have_rows else max(rows, 2 * have_rows),
                          have_slots if slots <= have_slots else max(round_slots(slots), have_slots + GROW_SLOTS))
        used = max(self.lengths, default=0)
        bigger.kv[:, :, :self.rows, :, :used] = self.kv.kv[:, :, :self.rows, :, :used]
        self.kv = bigger

    def add(self) -> int:
        """A new empty row (the last); its index."""
        self.reserve(self.rows + 1, 1)
        self.lengths.append(0)
        return self.rows - 1

    def remove(self, row: int) -> None:
        """Drop `row`; the last row's entries move into its place (rows after it keep their indices)."""
        last = self.rows - 1
        if row != last:
            used = self.lengths[last]
            self.kv.kv[:, :, row, :, :used] = self.kv.kv[:, :, last, :, :used]
            self.lengths[row] = used
        self.lengths.pop()

    def adopt(self, source: "RowCache", row: int) -> int:
        """A new last row holding the entries of `source`'s `row` (a prefilled request's); its index."""
        used = source.lengths[row]
        self.reserve(self.rows + 1, used)
        self.lengths.append(used)
        self.kv.kv[:, :, self.rows - 1, :, :used] = source.kv.kv[:, :, row, :, :used]
        return self.rows - 1

    def clear(self, row: int) -> None:
        """Zero `row`'s entries, all of its slots: a masked slot still multiplies its value by 0, and 0 * nan is
        nan for the next request there (a failed one's stale nan)."""
        self.kv.kv[:, :, row].zero_()


def prefill(talker: nn.Module, cache: RowCache, row: int, embeds: Tensor, positions: Tensor) -> Tensor:
    """Run a piece of a request's prompt, embeds [L, H] at RoPE ids `positions` [L], into `row` after the entries
    it holds (none: the whole prompt at once): the piece's last hidden state [H] (the prompt's last one emits its first
    c0). In pieces or whole, a row's entries and last state are the same but for rounding: a piece's matmuls have
    other row counts and its attention other widths (tests/test_prefill.py)."""
    start, length = cache.lengths[row], len(embeds)
    check_positions(talker, positions)
    cache.reserve(cache.rows, start + length)
    width = round_slots(start + length)
    slots = torch.arange(start, start + length, device=embeds.device)
    mask = torch.arange(width, device=embeds.device)[None, :] <= slots[:, None]
    hidden = run_layers(talker, embeds[None].to(talker.norm.weight.dtype), positions, mask,
                        cache.kv.view(slice(row, row + 1), width), slots)
    cache.lengths[row] = start + length
    return hidden[0, -1]


def step(talker: nn.Module, cache: RowCache, inputs: Tensor, positions: Tensor) -> Tensor:
    """One token for each of the cache's rows: inputs [B, H] at RoPE ids `positions` [B] -> hidden states [B, H]."""
    check_positions(talker, positions)
    lengths = torch.tensor(cache.lengths, device=inputs.device)
    longest = max(cache.lengths) + 1
    cache.reserve(cache.rows, longest)
    width = round_slots(longest)
    mask = torch.arange(width, device=inputs.device)[None, None, :] <= lengths[:, None, None]
    hidden = run_layers(talker, inputs[:, None].to(talker.norm.weight.dtype), positions[:, None], mask,
                        cache.kv.view(slice(0, cache.rows), width), lengths[:, None], in_order=True)
    cache.lengths = [length + 1 for length in cache.lengths]
    return hidden[:, 0]


def check_positions(talker: nn.Module, positions: Tensor) -> None:
    if int(positions.max()) >= talker.rope.max_positions:
        raise RvqspecError(f"RoPE position {int(positions.max())} exceeds the talker's {talker.rope.max_positions}: "
                           "use a shorter text or a lower max_new_tokens")
