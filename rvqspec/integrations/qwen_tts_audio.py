"""The codec (the 12 Hz speech tokenizer's decoding half) run incrementally: codes in, audio out, chunk by chunk,
equal to the whole-utterance decode.

Upstream's codec (`qwen_tts/core/tokenizer_12hz/modeling_qwen3_tts_tokenizer_v2.py`, `Qwen3TTSTokenizerV2Decoder`)
is causal end to end: codebook lookups per frame, causal convolutions (left zero padding, stride 1), a
sliding-window causal transformer (window 72), transposed convolutions whose overlap reaches one input frame
back, and pointwise activations. So the audio of frame t depends only on frames <= t, and a codec that keeps
each convolution's last inputs and the transformer's KV cache between calls computes the same samples as one
pass over the whole utterance (float rounding aside: tests/test_streaming.py bounds the difference).

Upstream's own whole-utterance decode (`chunked_decode`) restarts every 300 frames from 25 frames of left
context; `StreamingCodec` restarts at the same frames with the same context, so it reproduces that too.
"""

import contextlib
import weakref
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from rvqspec.core import fused
from rvqspec.core.changes import Derived
from rvqspec.core.errors import RvqspecError
from rvqspec.core.packing import packed_layout

# Upstream's Qwen3TTSTokenizerV2Decoder.chunked_decode defaults, as Qwen3TTSTokenizerV2Model.decode calls it.
UPSTREAM_CHUNK_FRAMES = 300
UPSTREAM_LEFT_CONTEXT = 25
# The most frames (rows x chunk frames) one batched forward takes: at the 0.6B sizes on one thread (amx, float32), 8
# rows of 12 frames in one forward ran 0.90-0.96x as fast as one by one, in 2 forwards of 4 rows 1.24x (the split is
# what benchmarks/results/codec-batch-streaming.md times)
MOST_FRAMES_TOGETHER = 48
# Up to this many output steps a convolution runs as one matrix product (`convolve`), beyond it through torch's
# convolution (oneDNN): on a short chunk that one costs several times its arithmetic per call (Zen 4, bfloat16, one
# thread: a 1024 -> 1536 channel, kernel 7 layer took ~10x longer on 12 steps than as a product), on a long one it is
# the faster (benchmarks/results/decoder-stream.md: streamed against whole, by chunk size)
GEMM_STEPS = 128
# Convolutions to at most this many channels (the waveform's last, 96 -> 1) run as one product of their taps: torch's
# took ~7x longer (Zen 4, bfloat16, one thread: a copy of its input and a kernel made for many outputs)
FEW_CHANNELS = 8
PACK_ROWS = 48  # the rows oneDNN lays a decoder product's packed weight out for (`product`: 12-48 rows measured)
FUSED_DTYPES = (torch.float32, torch.bfloat16)  # where `snake` runs the fused kernel (float64 stays upstream's)


class IncrementalDecoder:
    """Upstream's decoder forward over the next frames of B rows ([B, 16, n] codes -> [B, n * 1920] audio), each
    convolution fed its last inputs: `past_inputs` / `keep_inputs` hold them, `transformer` carries the attention
    cache. `StreamingCodec` is one row; `RowsDecoder` several codecs' rows in one forward."""

    decoder: torch.nn.Module

    def past_inputs(self, module: torch.nn.Module, hidden: Tensor, keep: int) -> Tensor:
        """The last `keep` inputs [B, channels, keep] of `module` before `hidden` (zeros at an utterance's start)."""
        raise NotImplementedError

    def keep_inputs(self, module: torch.nn.Module, inputs: Tensor) -> None:
        """Remember `module`'s last inputs [B, channels, keep] for the next call."""
        raise NotImplementedError

    def transformer(self, hidden: Tensor) -> Tensor:
        raise NotImplementedError

    def run(self, codes: Tensor) -> Tensor:
        """Upstream's `Qwen3TTSTokenizerV2Decoder.forward` for the next frames, with state carried over."""
        decoder = self.decoder
        weight = decoder.pre_conv.conv.weight
        hidden = dequantize(decoder.quantizer, codes.to(weight.device))  # [B, codebook_dim, n]
        hidden = self.conv(decoder.pre_conv, hidden).transpose(1, 2)
        hidden = self.transformer(hidden).permute(0, 2, 1)
        for blocks in decoder.upsample:
            for block in blocks:
                hidden = self.block(block, hidden)
        for block in decoder.decoder:
            hidden = self.block(block, hidden)
        return hidden.clamp(min=-1, max=1).reshape(len(codes), -1)

    def block(self, module: torch.nn.Module, hidden: Tensor) -> Tensor:
        """One module of the codec's upsampler or its waveform blocks (upstream's `decoder.decoder`); convolutions keep
        their history."""
        name = type(module).__name__
        if name == "Qwen3TTSTokenizerV2CausalConvNet":
            return self.conv(module, hidden)
        if name == "Qwen3TTSTokenizerV2CausalTransConvNet":
            return self.transposed_conv(module, hidden)
        if name == "Qwen3TTSTokenizerV2ConvNeXtBlock":
            return self.convnext(module, hidden)
        if name == "Qwen3TTSTokenizerV2DecoderDecoderBlock":
            for part in module.block:
                hidden = self.block(part, hidden)
            return hidden
        if name == "Qwen3TTSTokenizerV2DecoderDecoderResidualUnit":
            inner = snake(module.act2, self.conv(module.conv1, snake(module.act1, hidden)))
            if module.conv2.kernel_size != 1:
                return self.conv(module.conv2, inner) + hidden
            return convolve_onto(module.conv2.conv, inner, hidden)
        if name == "SnakeBeta":
            return snake(module, hidden)
        raise TypeError(f"the incremental 12 Hz codec does not know upstream's {name}: this qwen-tts version "
                        "changed its decoder (tested against qwen-tts 0.1.1)")

    def conv(self, module: torch.nn.Module, hidden: Tensor) -> Tensor:
        """A causal convolution (stride 1): upstream pads kernel - 1 zeros on the left; here, the last inputs."""
        if module.stride != 1:
            raise TypeError("the incremental 12 Hz codec expects stride-1 causal convolutions (qwen-tts 0.1.1)")
        keep = module.kernel_size - 1
        if keep == 0:
            return convolve(module.conv, hidden)
        padded = torch.cat([self.past_inputs(module, hidden, keep), hidden], dim=-1)
        self.keep_inputs(module, padded[..., -keep:])
        return convolve(module.conv, padded)

    def transposed_conv(self, module: torch.nn.Module, hidden: Tensor) -> Tensor:
        """A transposed convolution (kernel K, stride S): input j writes samples [jS, jS + K), so the new
        samples also need the last ceil(K / S) - 1 inputs; upstream trims the K - S samples past the end."""
        conv = module.conv
        keep = -(-conv.kernel_size[0] // conv.stride[0]) - 1
        if keep == 0:
            return convolve_transposed(conv, hidden, 0)
        padded = torch.cat([self.past_inputs(module, hidden, keep), hidden], dim=-1)
        self.keep_inputs(module, padded[..., -keep:])
        return convolve_transposed(conv, padded, keep)

    def convnext(self, module: torch.nn.Module, hidden: Tensor) -> Tensor:
        """Upstream's ConvNeXt block with its depthwise convolution made incremental."""
        x = self.conv(module.dwconv, hidden).permute(0, 2, 1)
        x = product(module.act(product(module.norm(x), module.pwconv1)), module.pwconv2)
        return hidden + (module.gamma * x).permute(0, 2, 1)


class StreamingCodec(IncrementalDecoder):
    """`decode(codes)` turns the next frames of one utterance ([frames, 16] codes) into their audio.

    `decoder` (upstream's name for it): the codec, upstream's `Qwen3TTSTokenizerV2Decoder`
    (`speech_tokenizer.model.decoder`), shared, unchanged.
    One object per utterance: it holds the convolution inputs and the attention cache of what it decoded."""

    def __init__(self, decoder: torch.nn.Module):
        self.decoder = decoder
        self.samples_per_frame = int(decoder.total_upsample)
        self.frames = 0  # frames decoded (audio returned) so far
        self.recent = []  # the last UPSTREAM_LEFT_CONTEXT frames' codes, to restart the way upstream does
        self.reset()

    def reset(self) -> None:
        self.history: dict[torch.nn.Module, Tensor] = {}  # per convolution: its last inputs [1, channels, keep]
        self.cache = None
        self.position = 0  # frames since the last restart: the transformer's next position

    @torch.inference_mode()
    def decode(self, codes: Tensor) -> Tensor:
        """[n, 16] codes (negative ones count as 0, as upstream clamps them) -> float32 audio [n * 1920]."""
        codes = upstream_codes(codes)
        pieces = []
        while len(codes):
            if self.restart_due():
                self.restart()
            until_restart = self.left_in_segment()
            pieces.append(self.run(codes[:until_restart].T[None])[0])
            self.advance(codes[:until_restart])
            codes = codes[until_restart:]
        if not pieces:
            return torch.zeros(0)
        return torch.cat(pieces)

    def restart_due(self) -> bool:
        """Whether the next frame starts a new 300-frame segment (not the utterance's first)."""
        return self.frames > 0 and self.frames % UPSTREAM_CHUNK_FRAMES == 0

    def left_in_segment(self) -> int:
        """Frames until the next restart."""
        return UPSTREAM_CHUNK_FRAMES - self.frames % UPSTREAM_CHUNK_FRAMES

    def fits_in_segment(self, frames: int) -> bool:
        """Whether the next `frames` frames decode without a restart (at their start or inside them)."""
        return 0 < frames <= self.left_in_segment() and not self.restart_due()

    def advance(self, codes: Tensor) -> None:
        """Count `codes` [n, 16] as decoded, and keep the last ones as a restart's context."""
        self.recent = [*self.recent, codes][-UPSTREAM_LEFT_CONTEXT:]
        self.frames += len(codes)

    def restart(self) -> None:
        """What upstream's chunked_decode does at a 300-frame boundary: a fresh pass over 25 frames of context."""
        context = torch.cat(self.recent)[-UPSTREAM_LEFT_CONTEXT:]
        self.reset()
        self.run(context.T[None])

    def past_inputs(self, module: torch.nn.Module, hidden: Tensor, keep: int) -> Tensor:
        history = self.history.get(module)
        return hidden.new_zeros(*hidden.shape[:2], keep) if history is None else history

    def keep_inputs(self, module: torch.nn.Module, inputs: Tensor) -> None:
        self.history[module] = inputs

    def attention_cache(self):
        """The transformer's cache (upstream's DynamicCache: the last window of keys and values), made at first use."""
        from transformers.cache_utils import DynamicCache

        if self.cache is None:
            self.cache = DynamicCache(config=self.decoder.pre_transformer.config)
        return self.cache

    def transformer(self, hidden: Tensor) -> Tensor:
        positions = torch.arange(self.position, self.position + hidden.shape[1], device=hidden.device)
        self.position += hidden.shape[1]
        with packed_linears(self.decoder.pre_transformer, hidden):
            return self.decoder.pre_transformer(inputs_embeds=hidden, past_key_values=self.attention_cache(),
                                                use_cache=True, cache_position=positions).last_hidden_state


class RowsDecoder(IncrementalDecoder):
    """The next chunks of several codecs of one decoder (a row each: equal frame counts, no restart due, see
    `StreamingCodec.fits_in_segment`) in one forward; each codec's inputs, cache and position are its own."""

    def __init__(self, codecs: list[StreamingCodec]):
        self.codecs, self.decoder = codecs, codecs[0].decoder

    def past_inputs(self, module: torch.nn.Module, hidden: Tensor, keep: int) -> Tensor:
        return torch.cat([codec.past_inputs(module, hidden[:1], keep) for codec in self.codecs])

    def keep_inputs(self, module: torch.nn.Module, inputs: Tensor) -> None:
        for codec, row in zip(self.codecs, inputs):
            codec.keep_inputs(module, row[None])

    def transformer(self, hidden: Tensor) -> Tensor:
        """Each row at its own RoPE positions, attending to its own cache (left-padded to the longest, masked)."""
        frames, device = hidden.shape[1], hidden.device
        model = self.decoder.pre_transformer
        caches = [codec.attention_cache() for codec in self.codecs]
        new = torch.arange(frames, device=device)
        cached = [cache.get_mask_sizes(new, 0)[0] - frames for cache in caches]  # keys each row attends to before
        positions = torch.tensor([codec.position for codec in self.codecs], device=device)[:, None] + new
        for codec in self.codecs:
            codec.position += frames
        mask = rows_mask(cached, frames, model.config.sliding_window, hidden.dtype, device)
        with packed_linears(model, hidden):
            return model(inputs_embeds=hidden, past_key_values=RowsCache(caches, cached), use_cache=True,
                         attention_mask={"sliding_attention": mask}, position_ids=positions,
                         cache_position=new).last_hidden_state  # cache_position: unused, the mask is given


class CodecBatchUnsupported(RvqspecError):
    """Upstream's attention cache does not behave as the batched codec needs (another transformers than qwen-tts
    pins): the requests of that call end with this error, and their adapter stops batching."""


class RowsCache:
    """The attention cache of one forward over several codecs' rows: each layer's new keys and values go to each
    row's own cache (upstream's, kept to its window as when the row decodes alone), and the rows' keys and values
    come back left-padded to the longest row's (`rows_mask` hides the padding)."""

    def __init__(self, caches: list, cached: list[int]):
        self.caches, self.cached = caches, cached

    def update(self, keys: Tensor, values: Tensor, layer: int,
               cache_kwargs: dict | None = None) -> tuple[Tensor, Tensor]:
        rows = [cache.update(k[None], v[None], layer, cache_kwargs) for cache, k, v in zip(self.caches, keys, values)]
        lengths = [row_keys.shape[-2] - keys.shape[-2] for row_keys, _ in rows]
        if lengths != self.cached:
            raise CodecBatchUnsupported(
                f"the batched 12 Hz codec expected layer {layer} to attend to {self.cached} cached frames, upstream's "
                f"cache gave {lengths}: install the transformers qwen-tts pins (qwen-tts 0.1.1: transformers==4.57.3); "
                "the Engine decodes its requests one by one from now on")
        longest = max(self.cached) + keys.shape[-2]
        return tuple(torch.cat([left_pad(row[i], longest) for row in rows]) for i in (0, 1))


def left_pad(states: Tensor, length: int) -> Tensor:
    """Keys or values [1, heads, frames, dim] with zeros before them, to `length` frames."""
    return torch.nn.functional.pad(states, (0, 0, length - states.shape[-2], 0))


def rows_mask(cached: list[int], frames: int, window: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The additive attention mask [B, 1, frames, keys] of `frames` new frames over rows with `cached` frames of
    keys each, left-padded (`RowsCache`): upstream's sliding window (a frame sees itself and the window - 1 before
    it), padding hidden."""
    keys = max(cached) + frames
    key = torch.arange(keys, device=device)
    query = key[-frames:, None]
    first = keys - frames - torch.tensor(cached, device=device)  # each row's first real key
    visible = (key <= query) & (key > query - window) & (key >= first[:, None, None])
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)[:, None]


@torch.inference_mode()
def decode_together(codecs: list[StreamingCodec], chunks: list[Tensor]) -> list[Tensor]:
    """Each codec's next chunk ([n, 16] codes) -> its audio, what `codec.decode(chunk)` gives (to float rounding).
    Chunks of one decoder and frame count that need no restart decode in shared forwards (of at most
    MOST_FRAMES_TOGETHER frames); the others each on its own (a restart every 300 frames, a frame count no other row
    has)."""
    chunks = [upstream_codes(chunk) for chunk in chunks]
    audio: list[Tensor | None] = [None] * len(codecs)
    together = defaultdict(list)
    for row, (codec, chunk) in enumerate(zip(codecs, chunks)):
        if codec.fits_in_segment(len(chunk)):
            together[codec.decoder, len(chunk)].append(row)
        else:
            audio[row] = codec.decode(chunk)
    for (_, frames), rows in together.items():
        most = max(1, MOST_FRAMES_TOGETHER // frames)
        for forward in (rows[start:start + most] for start in range(0, len(rows), most)):
            if len(forward) == 1:
                audio[forward[0]] = codecs[forward[0]].decode(chunks[forward[0]])
                continue
            codes = torch.stack([chunks[row] for row in forward]).transpose(1, 2)  # [B, 16, n]
            for row, samples in zip(forward, RowsDecoder([codecs[row] for row in forward]).run(codes)):
                audio[row] = samples
                codecs[row].advance(chunks[row])
    return audio


def dequantize(quantizer: torch.nn.Module, codes: Tensor) -> Tensor:
    """Upstream's `quantizer.decode(codes)` ([B, 16, n] codes -> [B, codebook_dim, n]) to the bit, each codebook's rows
    looked up before they are normalised (upstream normalises all rows of all 16 codebooks every call: 2.5 ms a call
    at the released sizes against 0.6 here, Zen 4, one thread, 1-12 frames)."""
    semantic = quantizer.n_q_semantic
    total = None
    for rvq, group in ((quantizer.rvq_first, codes[:, :semantic]), (quantizer.rvq_rest, codes[:, semantic:])):
        if group.shape[1] == 0:
            continue
        quantized = torch.zeros([1], device=codes.device)[0]  # upstream's start (the sum takes the codebooks' dtype)
        for layer, layer_codes in zip(rvq.vq.layers, group.transpose(0, 1)):
            book = layer._codebook
            usage = book.cluster_usage.clamp(min=book.epsilon)[layer_codes][..., None]
            rows = F.embedding(layer_codes, book.embedding_sum) / usage
            quantized = quantized + layer.project_out(rows).transpose(1, 2)
        quantized = rvq.output_proj(quantized)
        total = quantized if total is None else total + quantized
    return total


def snake(module: torch.nn.Module, hidden: Tensor) -> Tensor:
    """Upstream's SnakeBeta activation `module(hidden)` ([B, C, T]), in one pass of the fused CPU kernels where they
    are built and on (float32 and bfloat16; upstream's five ATen passes took ~10% of a bfloat16 decode)."""
    kernels = fused.kernels() if hidden.device.type == "cpu" and hidden.dtype in FUSED_DTYPES and fused.on() else None
    if kernels is None:
        return module(hidden)
    return kernels.snake(hidden, module.alpha, module.beta, module.no_div_by_zero)


def convolve(conv: torch.nn.Conv1d, padded: Tensor) -> Tensor:
    """`conv(padded)` ([B, C, steps + its span - 1] -> [B, out, steps]; stride 1, no padding of its own), as one matrix
    product where the kernel is 1 or the chunk is short (`GEMM_STEPS`)."""
    kernel, dilation = conv.kernel_size[0], conv.dilation[0]
    batch, channels, length = padded.shape
    if kernel == 1 and conv.groups == 1 and length > GEMM_STEPS:  # in this layout already a product: no copies,
        # ~1.2x torch's convolution; a short chunk's goes to `product` (its packed weight)
        weight = conv.weight[None, :, :, 0].expand(batch, -1, -1)
        return torch.bmm(weight, padded) if conv.bias is None else torch.baddbmm(conv.bias[:, None], weight, padded)
    steps = length - dilation * (kernel - 1)
    if conv.groups == 1 and conv.out_channels <= FEW_CHANNELS:
        return convolve_to_few(conv, padded, steps)
    if conv.groups != 1 or steps > GEMM_STEPS:
        return conv(padded)
    windows = padded.unfold(2, dilation * (kernel - 1) + 1, 1)[..., ::dilation]  # [B, C, steps, kernel]
    columns = windows.permute(0, 2, 1, 3).reshape(batch * steps, channels * kernel)
    out = product(columns, conv)
    return out.view(batch, steps, -1).transpose(1, 2)


def convolve_onto(conv: torch.nn.Conv1d, inputs: Tensor, residual: Tensor) -> Tensor:
    """`residual + conv(inputs)` for a pointwise convolution ([B, C, T]): one product onto the residual (summed in its
    float32 accumulator, rounded once), not the convolution's output rounded, then a pass to add it (Zen 4, bfloat16,
    one thread: the residual units' pointwise half 0.75x as long)."""
    weight = conv.weight[None, :, :, 0].expand(len(inputs), -1, -1)
    addend = residual if conv.bias is None else residual + conv.bias[:, None]
    return torch.baddbmm(addend, weight, inputs)


def convolve_to_few(conv: torch.nn.Conv1d, padded: Tensor, steps: int) -> Tensor:
    """`conv(padded)` for a convolution to a few channels (the waveform's one): each tap's outputs at every input as
    one product ([kernel * out, C] @ [B, C, length]), then the taps' sums (in float32 at least) at their shifts."""
    kernel, dilation, out = conv.kernel_size[0], conv.dilation[0], conv.out_channels
    taps = torch.matmul(conv.weight.permute(2, 0, 1).reshape(kernel * out, -1), padded)
    total = taps[:, :out, :steps].to(torch.promote_types(taps.dtype, torch.float32))
    for k in range(1, kernel):
        total += taps[:, k * out:(k + 1) * out, k * dilation:k * dilation + steps]
    if conv.bias is not None:
        total += conv.bias[:, None]
    return total.to(padded.dtype)


def convolve_transposed(conv: torch.nn.ConvTranspose1d, padded: Tensor, keep: int) -> Tensor:
    """The samples of the transposed convolution `conv` (kernel K, stride S) that the last inputs of `padded` ([B, C,
    keep + new]) complete: [B, out, new * S]. Sample jS + r is the sum over m <= keep of input j - m's tap mS + r: a
    convolution of kernel keep + 1 to out * S channels (its phases, `phases_of`), each output step's S phases then
    laid out as S samples."""
    if conv.groups != 1 or conv.dilation[0] != 1 or conv.padding[0] != 0 or conv.output_padding[0] != 0:
        return conv(padded)[..., keep * conv.stride[0]:padded.shape[-1] * conv.stride[0]]
    phases = phases_of(conv)
    # [B, out * S, new]; to a few channels (tiny decoders) torch's: `convolve_to_few` rounds each tap's product
    phases = phases(padded) if phases.out_channels <= FEW_CHANNELS else convolve(phases, padded)
    batch, _, new = phases.shape
    return phases.view(batch, conv.out_channels, -1, new).transpose(2, 3).reshape(batch, conv.out_channels, -1)


DERIVED: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, Derived]]" = weakref.WeakKeyDictionary()


def made_once(module: torch.nn.Module, what: str, make):
    """`make(module)`, made once per weight of `module` and kept beside the shared decoder (which stays unchanged):
    a weight laid out anew (`phases_of`, `packed_weight`); made again once the weight changed (`changes.Derived`: a new
    tensor, an in-place write)."""
    kept = DERIVED.setdefault(module, {})
    if what not in kept:
        owner = weakref.ref(module)  # not the module: a value holding its key would keep it alive
        kept[what] = Derived(lambda _weight: make(owner()))
    return kept[what].get(module.weight)


def phases_of(conv: torch.nn.ConvTranspose1d) -> torch.nn.Conv1d:
    """`conv` (kernel K, stride S) as the convolution of kernel ceil(K / S) that makes its S phases: output channel
    o * S + r, tap i (of input j - keep + i) is `conv`'s tap (keep - i) S + r. At every length one product or one
    oneDNN convolution that sums in float32 and rounds once, where torch's transposed convolution took 1.1-1.2x as long
    on 12-frame chunks and 4x on short ones (Zen 4, bfloat16, one thread)."""
    return made_once(conv, "phases", make_phases)


def make_phases(conv: torch.nn.ConvTranspose1d) -> torch.nn.Conv1d:
    weight, stride = conv.weight, conv.stride[0]
    channels, out, kernel = weight.shape
    taps = -(-kernel // stride)
    spread = F.pad(weight, (0, taps * stride - kernel)).view(channels, out, taps, stride)
    phases = torch.nn.Conv1d(channels, out * stride, taps, bias=conv.bias is not None, device=weight.device,
                             dtype=weight.dtype).requires_grad_(False)
    with torch.no_grad():
        phases.weight.copy_(spread.flip(2).permute(1, 3, 0, 2).reshape(out * stride, channels, taps))
        if conv.bias is not None:
            phases.bias.copy_(conv.bias.repeat_interleave(stride))
    return phases


def packed_linears(model: torch.nn.Module, hidden: Tensor):
    """A context in which `model`'s linear layers multiply through their packed weights (`product`), where bfloat16
    products do: upstream's transformer (unchanged) re-lays its 58 weights on every call otherwise (Zen 4, one
    thread: its call 0.85x as long with 3 frames, 0.84x with 12, the mode's own cost in)."""
    if not packs(hidden):
        return contextlib.nullcontext()
    return PackedLinears(made_once(model.input_proj, "linears", lambda _: linears_of(model)))


def linears_of(model: torch.nn.Module) -> dict:
    return {id(module.weight): module for module in model.modules() if isinstance(module, torch.nn.Linear)}


class PackedLinears(TorchFunctionMode):
    """Torch's linear of one of `linears`' weights ({id(weight): Linear}) as `product` (the same bits); every other
    call as it was. Per thread, as torch's function modes are."""

    def __init__(self, linears: dict):
        super().__init__()
        self.linears = linears

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        linear = self.linears.get(id(args[1])) if func is F.linear and len(args) == 3 and not kwargs else None
        if linear is not None and args[1] is linear.weight and args[2] is linear.bias:  # as the Linear calls it
            return product(args[0], linear)
        return func(*args, **kwargs)


def packs(inputs: Tensor) -> bool:
    """Whether `product` multiplies `inputs` through a packed weight: bfloat16 on a CPU with bfloat16 oneDNN."""
    bfloat16_cpu = inputs.dtype == torch.bfloat16 and inputs.device.type == "cpu"
    return bfloat16_cpu and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def product(inputs: Tensor, module: torch.nn.Module) -> Tensor:
    """`inputs` [n, in] times `module`'s weight (a Linear's, or a convolution's as [out, in * kernel]) plus its bias.
    bfloat16 on a CPU with bfloat16 oneDNN: the weight in oneDNN's own layout, made once (`packed_weight`); the same
    bits as torch's product, which lays the weight out again every call (Zen 4, one thread, 12-48 rows: 1.1-1.4x as
    long)."""
    if packs(inputs):
        packed = made_once(module, "packed", packed_weight)
        return torch.ops.mkldnn._linear_pointwise(inputs, packed, module.bias, "none", [], "")
    return F.linear(inputs, module.weight.reshape(len(module.weight), -1), module.bias)


def packed_weight(module: torch.nn.Module) -> Tensor:
    return packed_layout(module.weight.reshape(len(module.weight), -1), PACK_ROWS)


def upstream_codes(codes: Tensor) -> Tensor:
    """Codes as upstream's decode takes them: negative ones (a frame's unused codebooks) count as 0."""
    return codes.clamp(min=0).long()


def offline_decode(speech_tokenizer, codes: Tensor) -> Tensor:
    """Upstream's whole-utterance audio of [frames, 16] codes (the reference streamed audio must equal)."""
    wavs, _ = speech_tokenizer.decode([{"audio_codes": codes}])
    return torch.as_tensor(wavs[0])


