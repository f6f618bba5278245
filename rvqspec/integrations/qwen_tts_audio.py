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

import torch
from torch import Tensor

# Upstream's Qwen3TTSTokenizerV2Decoder.chunked_decode defaults, as Qwen3TTSTokenizerV2Model.decode calls it.
UPSTREAM_CHUNK_FRAMES = 300
UPSTREAM_LEFT_CONTEXT = 25


class StreamingCodec:
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
        self.history: dict[torch.nn.Module, Tensor] = {}  # per convolution: its last inputs
        self.cache = None
        self.position = 0  # frames since the last restart: the transformer's next position

    @torch.inference_mode()
    def decode(self, codes: Tensor) -> Tensor:
        """[n, 16] codes (negative ones count as 0, as upstream clamps them) -> float32 audio [n * 1920]."""
        codes = codes.clamp(min=0).long()
        pieces = []
        while len(codes):
            until_restart = UPSTREAM_CHUNK_FRAMES - self.frames % UPSTREAM_CHUNK_FRAMES
            if self.frames and until_restart == UPSTREAM_CHUNK_FRAMES:
                self.restart()
            pieces.append(self.run(codes[:until_restart]))
            self.remember(codes[:until_restart])
            self.frames += len(codes[:until_restart])
            codes = codes[until_restart:]
        if not pieces:
            return torch.zeros(0)
        return torch.cat(pieces)

    def restart(self) -> None:
        """What upstream's chunked_decode does at a 300-frame boundary: a fresh pass over 25 frames of context."""
        context = torch.cat(self.recent)[-UPSTREAM_LEFT_CONTEXT:]
        self.reset()
        self.run(context)

    def remember(self, codes: Tensor) -> None:
        self.recent = [*self.recent, codes][-UPSTREAM_LEFT_CONTEXT:]

    def run(self, codes: Tensor) -> Tensor:
        """Upstream's `Qwen3TTSTokenizerV2Decoder.forward` for the next frames, with state carried over."""
        decoder = self.decoder
        weight = decoder.pre_conv.conv.weight
        hidden = decoder.quantizer.decode(codes.T[None].to(weight.device))  # [1, codebook_dim, n]
        hidden = self.conv(decoder.pre_conv, hidden).transpose(1, 2)
        hidden = self.transformer(hidden).permute(0, 2, 1)
        for blocks in decoder.upsample:
            for block in blocks:
                hidden = self.block(block, hidden)
        for block in decoder.decoder:
            hidden = self.block(block, hidden)
        return hidden.clamp(min=-1, max=1).reshape(-1)

    def transformer(self, hidden: Tensor) -> Tensor:
        from transformers.cache_utils import DynamicCache

        model = self.decoder.pre_transformer
        if self.cache is None:
            self.cache = DynamicCache(config=model.config)
        positions = torch.arange(self.position, self.position + hidden.shape[1], device=hidden.device)
        self.position += hidden.shape[1]
        return model(inputs_embeds=hidden, past_key_values=self.cache, use_cache=True,
                     cache_position=positions).last_hidden_state

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
            inner = self.conv(module.conv1, module.act1(hidden))
            return self.conv(module.conv2, module.act2(inner)) + hidden
        if name == "SnakeBeta":
            return module(hidden)
        raise TypeError(f"the incremental 12 Hz codec does not know upstream's {name}: this qwen-tts version "
                        "changed its decoder (tested against qwen-tts 0.1.1)")

    def conv(self, module: torch.nn.Module, hidden: Tensor) -> Tensor:
        """A causal convolution (stride 1): upstream pads kernel - 1 zeros on the left; here, the last inputs."""
        if module.stride != 1:
            raise TypeError("the incremental 12 Hz codec expects stride-1 causal convolutions (qwen-tts 0.1.1)")
        keep = module.kernel_size - 1
        if keep == 0:
            return module.conv(hidden)
        history = self.history.get(module)
        if history is None:
            history = hidden.new_zeros(*hidden.shape[:2], keep)
        padded = torch.cat([history, hidden], dim=-1)
        self.history[module] = padded[..., -keep:]
        return module.conv(padded)

    def transposed_conv(self, module: torch.nn.Module, hidden: Tensor) -> Tensor:
        """A transposed convolution (kernel K, stride S): input j writes samples [jS, jS + K), so the new
        samples also need the last ceil(K / S) - 1 inputs; upstream trims the K - S samples past the end."""
        conv = module.conv
        kernel, stride = conv.kernel_size[0], conv.stride[0]
        keep = -(-kernel // stride) - 1
        if keep == 0:
            return conv(hidden)[..., :hidden.shape[-1] * stride]
        history = self.history.get(module)
        if history is None:
            history = hidden.new_zeros(*hidden.shape[:2], keep)
        padded = torch.cat([history, hidden], dim=-1)
        self.history[module] = padded[..., -keep:]
        return conv(padded)[..., keep * stride:(keep + hidden.shape[-1]) * stride]

    def convnext(self, module: torch.nn.Module, hidden: Tensor) -> Tensor:
        """Upstream's ConvNeXt block with its depthwise convolution made incremental."""
        x = self.conv(module.dwconv, hidden).permute(0, 2, 1)
        x = module.pwconv2(module.act(module.pwconv1(module.norm(x))))
        return hidden + (module.gamma * x).permute(0, 2, 1)


def offline_decode(speech_tokenizer, codes: Tensor) -> Tensor:
    """Upstream's whole-utterance audio of [frames, 16] codes (the reference streamed audio must equal)."""
    wavs, _ = speech_tokenizer.decode([{"audio_codes": codes}])
    return torch.as_tensor(wavs[0])


