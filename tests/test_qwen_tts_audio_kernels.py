"""The streamed 12 Hz decoder's own paths (rvqspec/integrations/qwen_tts_audio.py) against upstream's modules on a
tiny decoder: the fused SnakeBeta (core/snake.cpp), the codebook lookup, the pointwise and few-channel convolutions,
the transposed ones as their phases, and the products through packed bfloat16 weights."""

import copy

import pytest
import torch

from rvqspec.core import fused
from rvqspec.integrations import qwen_tts_audio
from rvqspec.integrations.qwen_tts_audio import (StreamingCodec, convolve, convolve_onto, convolve_transposed,
                                                  dequantize, packs, product, snake)

from helpers.upstream_models import upstream_available

if not upstream_available():
    pytest.skip("qwen-tts reference not installed: run `make install`", allow_module_level=True)

from helpers.upstream_tts import CODEBOOK, tiny_speech_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def decoder():
    return tiny_speech_tokenizer().model.decoder.requires_grad_(False)


@pytest.fixture(scope="module")
def activation(decoder):
    """One of the decoder's SnakeBeta modules with trained-looking (non-zero) alpha and beta, and inputs [2, C, 400]
    that reach |alpha x| ~ 1e3 (the range reduction's far end)."""
    module = copy.deepcopy(next(m for m in decoder.modules() if type(m).__name__ == "SnakeBeta"))
    generator = torch.Generator().manual_seed(0)
    module.alpha.copy_(torch.randn(module.alpha.shape, generator=generator) * 0.5)
    module.beta.copy_(torch.randn(module.beta.shape, generator=generator) * 0.5)
    x = torch.randn(2, len(module.alpha), 400, generator=generator) * 4
    x[..., :20] *= 100
    return module, x


def exact(module, x: torch.Tensor) -> torch.Tensor:
    """SnakeBeta of x in float64, from x and the parameters as the dtype holds them."""
    alpha, beta = module.alpha.double().exp()[:, None], module.beta.double().exp()[:, None]
    x = x.double()
    return x + torch.sin(alpha * x) ** 2 / (beta + module.no_div_by_zero)


def test_fused_snake_is_upstreams_activation_within_its_rounding(activation):
    module, x = activation
    if fused.kernels() is None:
        pytest.skip("the fused CPU kernels cannot be built here")
    with torch.inference_mode():
        ours, theirs, truth = snake(module, x), module(x), exact(module, x)
        assert ours.dtype == torch.float32 and not torch.equal(ours, theirs)  # the kernel ran, not upstream's module
        assert (ours - truth).abs().max() <= 2 * (theirs - truth).abs().max()
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-4)
        half = copy.deepcopy(module).to(torch.bfloat16)
        x16 = x.to(torch.bfloat16)
        ours16, theirs16, truth16 = snake(half, x16), half(x16), exact(half, x16)
        assert ours16.dtype == torch.bfloat16
        # one rounding to bfloat16 (half an ulp: 2^-9 of the value, at most), where upstream rounds five times
        assert ((ours16.double() - truth16).abs() <= truth16.abs() * 2 ** -8 + 1e-4).all()
        assert (ours16.double() - truth16).abs().max() < (theirs16.double() - truth16).abs().max()


def test_fused_snake_reads_trimmed_rows_and_the_switch_turns_it_off(activation):
    module, x = activation
    with torch.inference_mode():
        trimmed = x[..., 3:-5]  # what a transposed convolution's trim hands it: rows at a stride
        torch.testing.assert_close(snake(module, trimmed), snake(module, trimmed.contiguous()), rtol=0, atol=0)
        with fused.enabled(False):
            assert torch.equal(snake(module, x), module(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_codebook_lookup_is_upstreams_to_the_bit(decoder, dtype):
    quantizer = copy.deepcopy(decoder.quantizer).to(dtype)
    codes = torch.randint(0, CODEBOOK, (2, 16, 7), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours, theirs = dequantize(quantizer, codes), quantizer.decode(codes)
    assert ours.dtype == theirs.dtype == dtype and torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_pointwise_and_few_channel_convolutions_are_torchs(decoder, dtype, tolerance):
    """conv2 of a residual unit (kernel 1: a batched product) and the waveform's last convolution (to 1 channel: its
    taps' product), on a chunk longer than GEMM_STEPS (where other convolutions go to torch's)."""
    units = [m for m in decoder.modules() if type(m).__name__ == "Qwen3TTSTokenizerV2DecoderDecoderResidualUnit"]
    for conv in (units[0].conv2.conv, decoder.decoder[-1].conv):
        conv = copy.deepcopy(conv).to(dtype)
        padded = torch.randn(2, conv.in_channels, 300 + conv.kernel_size[0] - 1, dtype=dtype)
        with torch.inference_mode():
            ours, theirs = convolve(conv, padded), conv(padded)
        assert ours.dtype == dtype
        torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance * float(theirs.abs().max()))


def transposed_convolutions(decoder) -> list:
    """The decoder's transposed convolutions (the upsampler's kernel = stride, the blocks' kernel 2 x stride) and one
    whose kernel is no multiple of its stride."""
    found = [m for m in decoder.modules() if isinstance(m, torch.nn.ConvTranspose1d)]
    return found + [torch.nn.ConvTranspose1d(6, 4, kernel_size=7, stride=3).requires_grad_(False)]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 0)])
@pytest.mark.parametrize("new", [1, 5, 300])  # short chunks (a product) and one longer than GEMM_STEPS (oneDNN)
def test_transposed_convolution_as_its_phases_is_torchs(decoder, dtype, tolerance, new):
    """The new samples of a transposed convolution through its phases (`phases_of`) against torch's transposed
    convolution of the same inputs, trimmed as upstream trims; bfloat16: within one rounding of the exact result
    (float32 sums rounded once)."""
    for conv in transposed_convolutions(decoder):
        conv = copy.deepcopy(conv).to(dtype)
        kernel, stride = conv.kernel_size[0], conv.stride[0]
        keep = -(-kernel // stride) - 1
        padded = torch.randn(2, conv.in_channels, keep + new, generator=torch.Generator().manual_seed(new)).to(dtype)
        with torch.inference_mode():
            ours = convolve_transposed(conv, padded, keep)
            theirs = conv(padded)[..., keep * stride:(keep + new) * stride]
            truth = copy.deepcopy(conv).double()(padded.double())[..., keep * stride:(keep + new) * stride]
        assert ours.dtype == dtype and ours.shape == theirs.shape
        if dtype == torch.bfloat16:
            bound = truth.abs() * 2 ** -8 + 1e-5 * float(truth.abs().max())  # one rounding of a float32 sum
            assert ((ours.double() - truth).abs() <= bound).all()  # torch's too, natively (not under the AVX2 caps)
        else:
            torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance * float(theirs.abs().max()))


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_pointwise_convolution_onto_the_residual_is_the_sum(decoder, dtype, tolerance):
    """A residual unit's end (`convolve_onto`): its pointwise convolution plus the unit's input, in one product."""
    unit = next(m for m in decoder.modules() if type(m).__name__ == "Qwen3TTSTokenizerV2DecoderDecoderResidualUnit")
    conv = copy.deepcopy(unit.conv2.conv).to(dtype)
    generator = torch.Generator().manual_seed(2)
    inputs, residual = (torch.randn(2, conv.in_channels, 300, generator=generator).to(dtype) for _ in range(2))
    with torch.inference_mode():
        ours, theirs = convolve_onto(conv, inputs, residual), conv(inputs) + residual
    assert ours.dtype == dtype
    torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance * float(theirs.abs().max()))


def test_bfloat16_products_through_packed_weights_are_torchs_and_follow_a_changed_weight():
    """`product` in bfloat16 (oneDNN's packed weight where bfloat16 oneDNN runs): the bits of torch's linear, at any
    row count; after the weight changes in place, the new weight's product (the packed copy is made again)."""
    linear = torch.nn.Linear(64, 48).to(torch.bfloat16).requires_grad_(False)
    generator = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for rows in (1, 12, 100):
            inputs = torch.randn(rows, 64, generator=generator).to(torch.bfloat16)
            assert torch.equal(product(inputs, linear), torch.nn.functional.linear(inputs, linear.weight, linear.bias))
    with torch.no_grad():
        linear.weight.mul_(-2)
    with torch.inference_mode():
        assert torch.equal(product(inputs, linear), torch.nn.functional.linear(inputs, linear.weight, linear.bias))


def test_bfloat16_transformer_multiplies_through_packed_weights_to_the_same_bits(decoder, monkeypatch):
    """The streamed decoder's transformer call (`packed_linears`): upstream's transformer to the bit, each linear layer
    through `product` where bfloat16 products pack their weights."""
    from transformers.cache_utils import DynamicCache

    half = copy.deepcopy(decoder).to(torch.bfloat16)
    model, calls = half.pre_transformer, []
    counted = lambda inputs, linear: calls.append(linear) or product(inputs, linear)  # noqa: E731
    monkeypatch.setattr(qwen_tts_audio, "product", counted)
    hidden = torch.randn(1, 5, model.input_proj.in_features, generator=torch.Generator().manual_seed(4))
    hidden = hidden.to(torch.bfloat16)
    with torch.inference_mode():
        ours = StreamingCodec(half).transformer(hidden)
        theirs = model(inputs_embeds=hidden, past_key_values=DynamicCache(config=model.config), use_cache=True,
                       cache_position=torch.arange(5)).last_hidden_state
    assert torch.equal(ours, theirs)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(map(id, calls)) == sorted(map(id, linears if packs(hidden) else []))  # each once
