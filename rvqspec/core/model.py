"""The MultiCodeDecoder (Qwen3-TTS's `talker.code_predictor`, or CSM's depth decoder) in plain PyTorch, with
a static KV cache. CSM's Llama layers are the Qwen3 layers without q/k norms, with llama3-scaled RoPE.

Layout differs from upstream only where it makes the speculative call cheaper; `checkpoint.py` holds
the map from the official keys onto it:
- q/k/v projections are fused into one matrix (`wqkv`), gate/up into one (`w_gate_up`);
- the talker's c0 table and the 15 code tables (upstream's `codec_embedding`) are stacked into one embedding
  (`code_embed`), so a tree whose nodes sit at different codebooks is embedded in one lookup
  (`table_offset[table] + code`);
- the 15 heads are one [15, V, H] tensor (`heads`).
CSM already has both: one table of num_codebooks x vocab rows, and heads [G-1, H, V] (stored transposed here).
What decoding derives from the heads (packed and int8 draft copies), or a quantized model's int8 heads, is in
`head_set` (`core/heads.py`). A quantized model (`core/quantize.py`, not upstream's: a different model, opt-in)
holds its layer matmuls and heads as int8 (`weights`: its scheme; `heads` is None), and refuses what needs float heads
(training, saving a checkpoint); its state_dict holds the int8 weights (the form: core/quantize.py), and pickles.

Table t (0..G-1, G = 16 for Qwen3-TTS, 32 for CSM) embeds code c_t: table 0 is the talker's c0 table, table t>=1
upstream's `codec_embedding[t-1]`. The token at position p carries c_{p-1} (table p-1) and predicts codebook p
with `heads[p-1]`; position 0 carries the talker's hidden state.
"""

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rvqspec.core import device_path, fused
from rvqspec.core.changes import Watch, parameters_of
from rvqspec.core.checkpoint import combine, official_layout, predictor_prefix, read_tensors, save_predictor
from rvqspec.core.config import PredictorConfig, load_config
from rvqspec.core.device_path import DevicePath
from rvqspec.core.errors import RvqspecError
from rvqspec.core.heads import Heads
from rvqspec.core.packing import Linear, attention
from rvqspec.core.quantize import FLOAT, QuantizedHeads, check_scheme, check_state, load_heads, quantize, save_heads

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise RvqspecError(f"unknown dtype {dtype!r}: use one of float32, bfloat16, float16 (or float64 for tests)")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # As upstream: normalise in float32, cast back, then scale.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None) -> Tensor:
    """Inverse frequencies [head_dim / 2], as transformers computes them: plain, or llama3-scaled (long
    wavelengths slowed by `factor`, short ones kept, a smooth blend between)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    if not scaling or scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < old_context / high) & ~(wavelength > old_context / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """1-D RoPE with a precomputed float32 table, indexed by per-token position ids."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.theta, self.max_positions, self.scaling = head_dim, theta, max_positions, scaling
        self.register_buffer("cos", torch.empty(max_positions, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim), persistent=False)
        self.reset_buffers()

    def tables(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The cos and sin tables in `dtype`, converted once per table and dtype rather than per call (a forward's
        two fewer ops: a predictor round makes one forward)."""
        key = (dtype, self.cos, self.sin)  # new tables (reset_buffers, .to()) replace the buffers: converted anew
        if getattr(self, "_tables_key", None) is None or any(a is not b for a, b in zip(key, self._tables_key)):
            self._tables_key, self._tables = key, (self.cos.to(dtype), self.sin.to(dtype))
        return self._tables

    def reset_buffers(self) -> None:
        inv_freq = rope_frequencies(self.head_dim, self.theta, self.scaling)
        freqs = torch.outer(torch.arange(self.max_positions).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(self.cos.device)
        self.sin = emb.sin().to(self.sin.device)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [T, head_dim] for positions [T]; [B, 1, T, head_dim] (broadcast over heads) for [B, T]."""
        cos, sin = self.tables(dtype)
        cos, sin = cos[positions], sin[positions]
        if positions.dim() == 2:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return cos, sin


def init_weights(module: nn.Module) -> None:
    """Upstream's random init (std 0.02), used for random-weight models in tests and benchmarks."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def by_codebook(hidden: Tensor, codebooks: list[int], vocab: int, logits_of) -> Tensor:
    """Logits [R, V] of hidden [R, H], row r through the head of codebooks[r]: the rows of each codebook in one
    call of `logits_of(rows, codebook)`."""
    if len(set(codebooks)) == 1:
        return logits_of(hidden, codebooks[0])
    books, logits = torch.tensor(codebooks), hidden.new_empty(len(codebooks), vocab)
    for book in sorted(set(codebooks)):
        rows = (books == book).nonzero().squeeze(1)
        logits[rows] = logits_of(hidden[rows], book)
    return logits


class KVCache:
    """Keys and values of every layer in one buffer [layers, 2, batch, kv_heads, slots, head_dim].

    A cache belongs to one decoding call, never to the model, so that callers sharing a model (threads,
    requests) cannot overwrite each other's entries. Zero-filled: a masked slot gets weight 0, and 0 times
    an uninitialised NaN would still be NaN."""

    def __init__(self, layers: int, batch: int, kv_heads: int, slots: int, head_dim: int, dtype: torch.dtype,
                 device):
        self.kv = torch.zeros(layers, 2, batch, kv_heads, slots, head_dim, dtype=dtype, device=device)

    @property
    def slots(self) -> int:
        return self.kv.shape[4]

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B, kv_heads, T, head_dim] at `slots`: [T] for every row, or [B, T] per row (the talker's
        rows, each at its own length); returns the layer's whole keys and values."""
        if slots.dim() == 2:
            rows = torch.arange(len(slots), device=slots.device)[:, None]
            self.kv[layer, 0][rows, :, slots] = k.transpose(1, 2)
            self.kv[layer, 1][rows, :, slots] = v.transpose(1, 2)
        else:
            self.kv[layer, 0].index_copy_(2, slots, k)
            self.kv[layer, 1].index_copy_(2, slots, v)
        return self.kv[layer, 0], self.kv[layer, 1]

    def view(self, rows: slice, slots: int) -> "KVCache":
        """The entries of `rows` at slots 0..slots-1, as a cache whose writes land in this one (no copy)."""
        view = KVCache.__new__(KVCache)
        view.kv = self.kv[:, :, rows, :, :slots]
        return view

    def move(self, src: Tensor, dst: Tensor) -> None:
        """In every layer and for each row b, copy the entries at slots src[b] to slots dst[b] (KV compaction).

        src, dst: [batch, n]; the n destinations of a row are distinct."""
        if src.shape[0] == 1 == self.kv.shape[2] and self.kv.is_contiguous():  # one row (a stream alone): two ops
            blocks = self.kv.view(-1, self.slots, self.kv.shape[-1])  # [slots, head_dim] per layer, k/v and head
            blocks.index_copy_(1, dst.view(-1), blocks.index_select(1, src.view(-1)))  # 3-D: ~3x faster than 6-D
            return
        rows = torch.arange(src.shape[0], device=src.device)[:, None]
        self.kv[:, :, rows, :, dst] = self.kv[:, :, rows, :, src]


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, qk_norm: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.wqkv = Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.wo = Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else nn.Identity()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                cache: KVCache | None, layer: int, slots: Tensor | None) -> Tensor:
        batch, length, _ = x.shape
        q, k, v = self.wqkv(x).split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                                      self.kv_heads * self.head_dim], dim=-1)
        q = self.q_norm(q.view(batch, length, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(batch, length, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=mask is None, attn_mask=mask, enable_gqa=True)
        else:
            k, v = cache.write(layer, slots, k, v)
            y = attention(q, k, v, mask)
        return self.wo(y.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.w_gate_up = Linear(hidden, 2 * intermediate, bias=False)
        self.w_down = Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)
        return self.w_down(F.silu(gate) * up)


class Block(nn.Module):
    """A Qwen3 decoder layer (pre-norm attention with q/k norms, pre-norm SwiGLU MLP), or a Llama one (no q/k
    norms)."""

    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float,
                 qk_norm: bool):
        super().__init__()
        self.attn_norm = RMSNorm(hidden, eps)
        self.attn = Attention(hidden, heads, kv_heads, head_dim, eps, qk_norm)
        self.mlp_norm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, intermediate)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None,
                cache: KVCache | None, layer: int, slots: Tensor | None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache, layer, slots)
        return x + self.mlp(self.mlp_norm(x))


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean attention mask as the forward adds it to the scores in `dtype`: 0 where a query attends, -inf
    elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def run_layers(model: nn.Module, x: Tensor, positions: Tensor, mask: Tensor | None, cache: "KVCache | None",
               slots: Tensor | None, in_order: bool = False, path: DevicePath | None = None) -> Tensor:
    """The decoder stack of `model` (its `layers`, `norm`, `rope`; the predictor's or a talker's) over x [B, T, H]:
    final-norm hidden states. Arguments as `MultiCodeDecoder.forward`; `slots` may also be [B, T] (each row its own,
    `KVCache.write`). The CPU fast path (`fused.layers`) where `device_path` chose it; there `in_order` attends with
    `fused.attention_in_order` (each query's keys in position order: the same bits in any call), else SDPA. `path`:
    the caller's, resolved for x's device and dtype (a decode call's `ctx.path`); default: chosen here."""
    cos, sin = model.rope(positions, x.dtype)
    if mask is not None and mask.dtype == torch.bool:  # additive, once per call rather than inside every SDPA
        mask = additive_mask(mask, x.dtype)
    if mask is not None and mask.dim() == 3:  # per row: [B, 1, T, slots], broadcast over the heads
        mask = mask.unsqueeze(1)
    if (path or device_path.choose(x.device, x.dtype)).fused_kernels:
        attend = fused.attention_in_order if in_order else attention
        return fused.layers(model, x, cos, sin, mask, cache, slots, attend)
    for i, layer in enumerate(model.layers):
        x = layer(x, cos, sin, mask, cache, i, slots)
    return model.norm(x)


class MultiCodeDecoder(nn.Module):
    def __init__(self, config: PredictorConfig):
        super().__init__()
        self.config = c = config
        tables = c.num_code_groups  # c0 (talker table) + one code table per residual code
        self.code_embed = nn.Embedding(c.talker_vocab_size + (tables - 1) * c.vocab_size, c.talker_hidden_size)
        self.project = (Linear(c.talker_hidden_size, c.hidden_size, bias=c.projection_bias) if c.projects
                        else nn.Identity())
        self.layers = nn.ModuleList(
            Block(c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                  c.rms_norm_eps, c.qk_norm) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.heads = nn.Parameter(torch.empty(c.num_residual_codes, c.vocab_size, c.hidden_size))
        self.head_set = Heads(c.num_residual_codes)
        self.weights = FLOAT  # or a scheme of `quantize` (core/quantize.py)
        self.watch = Watch()  # the weights `refresh` saw last
        # Derived, non-checkpoint buffers. Positions in a frame stay below num_code_groups; tree nodes past
        # the frame end are masked but still need a table row, hence the slack.
        self.rope = RotaryEmbedding(c.head_dim, c.rope_theta, c.num_code_groups + 64, c.rope_scaling)
        offsets = [0] + [c.talker_vocab_size + t * c.vocab_size for t in range(c.num_code_groups - 1)]
        self.register_buffer("table_offset", torch.tensor(offsets), persistent=False)
        self.apply(init_weights)
        nn.init.normal_(self.heads, std=0.02)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def is_quantized(self) -> bool:
        """Whether this model holds int8 weights (`weights`: a scheme of `quantize`), its heads as int8 matmuls only
        (`heads` None)."""
        return self.weights != FLOAT

    @property
    def head_weights(self) -> QuantizedHeads | None:
        """A quantized model's int8 heads (None for a float model)."""
        return self.head_set.int8

    def refresh(self) -> None:
        """Drop the copies derived from the weights if any weight changed since the previous call, a write through
        `.data` included (`changes.Watch`); `decode_frames` calls it once per call."""
        self.watch.follow(parameters_of(self), self.forget_derived)

    def forget_derived(self) -> None:
        """Drop the copies derived from the weights (oneDNN packs, int8 draft heads): they are made again on use."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack.forget()
        self.head_set.forget()

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def new_cache(self, batch: int, slots: int) -> KVCache:
        """A fresh static cache of `slots` entries per layer for `batch` rows."""
        c = self.config
        return KVCache(c.num_hidden_layers, batch, c.num_key_value_heads, slots, c.head_dim, self.dtype, self.device)

    def embed_codes(self, codes: Tensor, tables: Tensor) -> Tensor:
        """Input embeddings (projected) of `codes` looked up in `tables` (same shape). The lookup is the module's
        (nn.Embedding without its options), without its call and the identity's where there is no projection."""
        x = F.embedding(self.table_offset[tables] + codes, self.code_embed.weight)
        return self.project(x) if self.config.projects else x

    def embed_talker_hidden(self, talker_hidden: Tensor) -> Tensor:
        return self.project(talker_hidden.to(self.dtype))

    def forward(self, x: Tensor, positions: Tensor, mask: Tensor | None = None, cache: KVCache | None = None,
                slots: Tensor | None = None, path: DevicePath | None = None) -> Tensor:
        """Final-norm hidden states [B, T, hidden] of input embeddings `x` [B, T, hidden].

        `positions` are RoPE ids, [T] shared by the rows or [B, T] per row. With a `cache`: K/V are
        written to it at `slots` [T] and each query attends to the whole cache under the boolean `mask`
        ([T, slots] shared, or [B, T, slots] per row; True = attend): this is how one call verifies a
        whole tree. Without: plain causal attention over the T tokens (training). `path`: a decode call's (`ctx.path`,
        resolved once per call rather than per forward); default: `device_path.choose` for this call.
        """
        return run_layers(self, x, positions, mask, cache, slots, in_order=True, path=path)

    def head_logits(self, hidden: Tensor, codebook: int | list[int] | Tensor, path: DevicePath | None = None
                    ) -> Tensor:
        """Logits of codebook `codebook` (1..15) from hidden states [..., hidden]; or, with one codebook per row,
        logits [R, V] of hidden [R, hidden]: a host list, or in a captured call (`path.captured`) a device tensor.

        `path` (default: `device_path.choose` for this call) decides how per-row heads run: grouped by codebook, so
        that each group goes through its head's packed weight (`grouped_heads`: the CPU), or gathered per row (one
        kernel, no host work, the same shapes for every call)."""
        if isinstance(codebook, int):  # one codebook for every row
            return self.head_set.logits(self.heads, hidden, codebook)
        path = path or device_path.choose(hidden.device, hidden.dtype)
        if path.captured:
            return self.gathered_head_logits(hidden, codebook)
        if len(set(codebook)) == 1:
            return self.head_logits(hidden, codebook[0])
        if path.grouped_heads:
            return self.grouped_head_logits(hidden, codebook)
        return self.gathered_head_logits(hidden, codebook)

    def grouped_head_logits(self, hidden: Tensor, codebook: list[int]) -> Tensor:
        return by_codebook(hidden, codebook, self.config.vocab_size, self.head_logits)

    def gathered_head_logits(self, hidden: Tensor, codebook: list[int] | Tensor) -> Tensor:
        if self.is_quantized:
            raise RvqspecError("per-row heads on the device need float heads: quantized weights run on the CPU")
        index = torch.as_tensor(codebook, device=hidden.device) - 1
        return torch.einsum("bh,bvh->bv", hidden, self.heads[index])

    def teacher_forced_hidden(self, talker_hidden: Tensor, codes: Tensor) -> Tensor:
        """Hidden states [B, G, hidden] of all G positions of frames with known codes [B, G]."""
        batch, groups = codes.shape
        tables = torch.arange(groups - 1, device=codes.device).expand(batch, -1)
        x = torch.cat([self.embed_talker_hidden(talker_hidden).unsqueeze(1),
                       self.embed_codes(codes[:, :-1], tables)], dim=1)
        return self.forward(x, torch.arange(groups, device=codes.device))

    def teacher_forced_logits(self, talker_hidden: Tensor, codes: Tensor) -> Tensor:
        """Logits [B, G-1, V] for c1..c_{G-1}, like upstream `forward_finetune`."""
        self.require_float("teacher-forced logits")
        hidden = self.teacher_forced_hidden(talker_hidden, codes)[:, 1:]
        return torch.einsum("bgh,gvh->bgv", hidden, self.heads)

    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype: torch.dtype | str = torch.float32,
                        device: str | torch.device = "cpu", weights: str | None = None) -> "MultiCodeDecoder":
        """Load the depth decoder of a checkpoint folder: Qwen3-TTS (official, or the stand-in) or Sesame CSM (as
        saved by transformers), told apart by config.json; only the decoder's tensors are read. `weights`: a
        scheme of `rvqspec.quantize` ("w8a16", "w8a8") to quantize it to once loaded. Loading prepares this CPU's
        kernel choices for its dtype at the current thread count (`device_path.prepare`)."""
        if weights is not None:
            check_scheme(weights)
            return quantize(cls.from_pretrained(folder, dtype, device), weights)
        folder = Path(folder)
        if not folder.is_dir():
            problem = "is a file, not a folder" if folder.exists() else "does not exist"
            raise RvqspecError(f"checkpoint folder {folder} {problem}: pass the folder that holds config.json and "
                               "*.safetensors")
        config = load_config(folder)
        wanted = {name: shape for _, parts in official_layout(config).values() for name, shape in parts}
        tensors = read_tensors(folder, wanted, resolve_dtype(dtype), all_of=predictor_prefix(config))
        model = cls.from_official(config, tensors, torch.device(device))
        device_path.prepare(model, name=folder.name)  # the kernel choices its forwards read (at this thread count)
        return model

    @classmethod
    def from_official(cls, config: PredictorConfig, tensors: dict[str, Tensor], device: torch.device
                      ) -> "MultiCodeDecoder":
        """A MultiCodeDecoder (eval, frozen) from tensors under official key names (taken out of `tensors`)."""
        state = {}
        for native, (how, parts) in official_layout(config).items():
            state[native] = combine(how, [tensors.pop(name) for name, _ in parts])
        # Built on the CPU with its random init, then given the tensors. A meta-device build skips the init, but
        # its device context imports torch._dynamo, which costs more than the init (timed when this was written).
        model = cls(config)
        model.load_state_dict({k: v.to(device) for k, v in state.items()}, assign=True)
        return model.to(device).eval().requires_grad_(False)  # .to: the derived buffers (RoPE tables, offsets)

    def require_float(self, what: str) -> None:
        """Refuse `what` on a quantized model, whose heads exist only as int8 matmuls."""
        if self.is_quantized:
            raise RvqspecError(f"{what} needs the float model, and this one holds {self.weights} weights: use the model "
                               "it was quantized from (save it, train with it, and quantize after loading: "
                               f"MultiCodeDecoder.from_pretrained(folder, weights={self.weights!r}))")

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """nn.Module's; a quantized model adds its scheme and int8 heads (`quantize.save_heads`)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.is_quantized:
            save_heads(self, destination, prefix)

    def _load_from_state_dict(self, state: dict, prefix: str, metadata: dict, strict: bool, missing: list,
                              unexpected: list, errors: list) -> None:
        if self.is_quantized:
            load_heads(self, state, prefix, missing, errors)
        super()._load_from_state_dict(state, prefix, metadata, strict, missing, unexpected, errors)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """nn.Module's, after `quantize.check_state`: a state_dict of another weights scheme (float or int8) or
        another shape is refused whole (RvqspecError), before anything is loaded."""
        check_state(self, state_dict, strict)
        return super().load_state_dict(state_dict, strict, assign)

    def save_pretrained(self, folder: str | Path, talker_config: dict | None = None) -> None:
        """Write config.json + model.safetensors in the official key layout (atomically)."""
        self.require_float("saving a checkpoint")
        save_predictor(self, folder, talker_config)
