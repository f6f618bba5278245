"""Issue 51, item 1: the int8 path per call. rvqspec's int8 GEMMs split a call's output channels over torch's threads
(the kernels are built with torch's OpenMP: before, at::parallel_for compiled to a plain loop) and each output keeps
its bits at any thread count; a w8a8 model's decoder stack runs in one native call (`fused.cpp`: int8_layers), whose
hidden states are the Python loop's bit for bit: an AR step, a verify call's rows under a tree mask, a talker step,
with and without q/k norms, on this class and (tests/test_cpu_classes.py's rerun) under the AVX2 caps."""

import pytest
import torch

from rvqspec.core import cpu_class, fused
from rvqspec.core.quantize import VNNI_ROWS, Int8Matmul, int8_kernels, pack_int8, pack_vnni, quantize, \
    quantize_linears, quantize_rows, w8a8_kernel
from rvqspec.core.talker import RowCache, Talker, TalkerConfig, prefill, step

from helpers.tiny import tiny_model

pytestmark = pytest.mark.skipif(int8_kernels() is None, reason="rvqspec's int8 kernels need x86 with AVX2 and built "
                                "kernels (`pip install 'rvqspec[fast]'`)")


@pytest.fixture
def threads():
    """Set torch's thread count inside a test; the previous one back after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_the_kernels_run_on_torchs_openmp_threads():
    """Where torch's parallel loops run on OpenMP (Linux wheels), the kernels are built with it, so that their
    at::parallel_for splits work over torch.set_num_threads' threads."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch's parallel backend is not OpenMP here")
    assert "-fopenmp" in fused.cflags()


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_each_output_has_the_same_bits_on_one_and_two_threads(rows, threads):
    """The GEMMs split output channel blocks over the threads: every output is still summed by one thread in one
    order (w8a8: vnni where the class has it, AVX2; w8a16)."""
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(3000, 1040, generator=generator), torch.randn(rows, 1040, generator=generator)
    q, scale = quantize_rows(weight)
    ops = int8_kernels()
    calls = {"avx2": lambda: ops.int8_linear(x.bfloat16(), *pack_int8(q, scale), 3000),
             "w8a16": lambda: ops.w8a16_linear(x, *pack_int8(q, scale), 3000)}
    if ops.has_vnni_gemm():
        calls["vnni"] = lambda: ops.vnni_linear(x.bfloat16(), *pack_vnni(q, scale), 3000)
    for name, call in calls.items():
        threads(1)
        one = call()
        threads(2)
        assert torch.equal(call(), one), name


def python_loop(monkeypatch):
    """Decoding from here on takes fused.layers' Python loop (int8_stack declines)."""
    monkeypatch.setattr(fused, "int8_stack", lambda model, rows: None)


def counted(monkeypatch) -> list:
    """How many forwards took the one native call, from here on."""
    native, stack = [], fused.int8_stack

    def asked(model, rows: int):
        args = stack(model, rows)
        native.extend([args] * (args is not None))
        return args
    monkeypatch.setattr(fused, "int8_stack", asked)
    return native


@torch.inference_mode()
def predictor_states(model) -> list[torch.Tensor]:
    """Hidden states of a prefill, two AR steps and a verify call of 5 queries under a tree mask (2 rows)."""
    c = model.config
    generator = torch.Generator().manual_seed(4)
    cache, states = model.new_cache(2, 12), []
    x = torch.randn(2, 2, c.hidden_size, generator=generator).to(model.dtype)
    slots = torch.arange(12)
    states.append(model(x, slots[:2], (slots[None, :] <= slots[:2, None]), cache, slots[:2]))
    for p in (2, 3):
        x = torch.randn(2, 1, c.hidden_size, generator=generator).to(model.dtype)
        states.append(model(x, slots[p:p + 1], (slots <= p)[None], cache, slots[p:p + 1]))
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]]).bool()
    mask = torch.cat([(slots[None, :4] <= 3).expand(5, 4), torch.zeros(5, 3, dtype=torch.bool), tree], 1)
    x = torch.randn(2, 5, c.hidden_size, generator=generator).to(model.dtype)
    states.append(model(x, torch.tensor([4, 5, 5, 6, 6]), mask, cache, slots[7:12]))
    return states + [cache.kv.clone()]


@pytest.mark.skipif(w8a8_kernel() not in ("vnni", "avx2"), reason="needs rvqspec's w8a8 GEMM (vnni or avx2)")
@pytest.mark.parametrize("csm", [False, True], ids=["qwen", "llama-csm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_one_native_call_gives_the_python_loops_bits(csm, dtype, monkeypatch):
    model = quantize(tiny_model(seed=5, dtype=dtype, hidden=64, layers=3, csm=csm), "w8a8")
    native = counted(monkeypatch)
    ours = predictor_states(model)
    assert len(native) == 4
    python_loop(monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(ours, predictor_states(model), strict=True))


@pytest.mark.skipif(w8a8_kernel() not in ("vnni", "avx2"), reason="needs rvqspec's w8a8 GEMM (vnni or avx2)")
def test_the_native_call_on_two_threads_gives_one_threads_bits(threads, monkeypatch):
    """On 2 threads the stack is one parallel region whose threads claim chunks of each matrix (kernels.h: Team; VNNI
    natively, the AVX2 GEMM under the caps): every output is still summed by one thread in one order, and every chunk
    is taken once (widths of 1..20 chunks of 64 channels, so that both threads take some; 1.35 MB of weights: a stack
    under 1 MiB keeps torch's loops)."""
    model = quantize(tiny_model(seed=3, dtype=torch.bfloat16, hidden=320, layers=3), "w8a8")
    same_bits_on_one_and_two_threads(model, threads, monkeypatch)


def same_bits_on_one_and_two_threads(model, threads, monkeypatch) -> None:
    """`model`'s states on 2 threads are its states on 1, bit for bit, every forward one native call."""
    native = counted(monkeypatch)
    threads(1)
    one = predictor_states(model)
    threads(2)
    assert all(torch.equal(a, b) for a, b in zip(predictor_states(model), one, strict=True))
    assert len(native) == 8


@pytest.mark.skipif(w8a8_kernel() not in ("vnni", "avx2"), reason="needs rvqspec's w8a8 GEMM (vnni or avx2)")
def test_a_talker_step_gives_the_python_loops_bits(monkeypatch):
    torch.manual_seed(0)
    model = Talker(TalkerConfig(64, 128, 2, 4, 2, 16, 300)).bfloat16().eval()
    quantize_linears(model, "w8a8")
    x = torch.randn(2, 64).bfloat16()

    def steps() -> list[torch.Tensor]:
        cache = RowCache(model)
        with torch.inference_mode():
            for length in (5, 3):
                prefill(model, cache, cache.add(), torch.randn(length, 64, generator=torch.Generator().manual_seed(
                    length)).bfloat16(), torch.arange(length))
            return [step(model, cache, x, torch.tensor(cache.lengths)) for _ in range(3)]
    native = counted(monkeypatch)
    ours = steps()
    assert len(native) == 3  # the prefills attend through SDPA's blocks: they keep the Python loop
    python_loop(monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(ours, steps(), strict=True))


def test_the_native_call_declines_float_weights_and_onednns_calls(monkeypatch):
    model = tiny_model(seed=1, dtype=torch.float32, hidden=64)
    assert fused.int8_stack(model, 1) is None
    if w8a8_kernel() == "vnni":
        quantized = quantize(model, "w8a8")
        assert fused.int8_stack(quantized, VNNI_ROWS) is not None
        assert (fused.int8_stack(quantized, VNNI_ROWS + 1) is None) == (cpu_class.cpu_class() == "amx")
    assert Int8Matmul(torch.randn(16, 32), "w8a16").native(1) is None


@pytest.mark.skipif(w8a8_kernel() not in ("vnni", "avx2"), reason="needs rvqspec's w8a8 GEMM (vnni or avx2)")
def test_a_hooked_matrix_keeps_the_python_loop(monkeypatch):
    """A forward hook on a layer matrix (a profiler, an adapter) still runs: the stack is not one native call then."""
    model = quantize(tiny_model(seed=2, dtype=torch.bfloat16, hidden=64), "w8a8")
    seen = []
    model.layers[1].mlp.w_down.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    native = counted(monkeypatch)
    predictor_states(model)
    assert native == [] and len(seen) == 4
