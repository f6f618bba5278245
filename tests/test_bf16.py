"""rvqspec's bfloat16 kernel (`bf16.cpp`, AVX-512 BF16), which `packing.linear` takes where it measured faster than
oneDNN: within bfloat16's rounding of a float32 reference, a row's bits the same alone, in any call and at any thread
count, and through it the bfloat16 model's speculative codes are its AR codes, greedy and seeded, alone and in a
batch, and its sampled distribution is AR's (G-test). A bfloat16 decoder stack on the kernel is one native call
(`fused.cpp`: int8_layers, on 2 threads one parallel region whose threads claim chunks of each matrix: kernels.h's
Team) with the Python loop's bits, on 1 and 2 threads. The tiny models here run through the kernel because the tests
lower packing's size floor and force the choice (`kernel_forced`)."""

import pytest
import torch
import torch.nn.functional as F

from rvqspec.core import cpu_class, device_path, fused, packing
from rvqspec.core.bf16 import pack_bf16
from rvqspec.core.decode import decode_frames
from rvqspec.core.drafters import ReusedHeads
from rvqspec.core.sampling import Sampler
from rvqspec.core.tree import default_tree

import test_distribution
from helpers.tiny import random_frames, tiny_model
from test_bit_exact import ar_states, verify_states
from test_int8_layers import (counted, predictor_states, python_loop, same_bits_on_one_and_two_threads,
                              threads)  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(not cpu_class.has_avx512_bf16() or fused.kernels() is None
                                or not fused.kernels().has_bf16_gemm(),
                                reason="needs AVX-512 BF16 and the fused kernels")
SHAPES = [(1024, 3072), (3072, 1024), (77, 40), (5, 17)]  # (K, N): the 0.6B's MLP; odd K, N off the 16-block


def kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return fused.kernels().bf16_linear(x, pack_bf16(weight), bias, weight.shape[0])


@pytest.fixture
def kernel_forced(monkeypatch):
    """Every bfloat16 linear of a model through the kernel, the tiny ones too (packing's size floor lowered), on this
    thread count and on 2 threads."""
    with torch.inference_mode():
        device_path.prepare(torch.nn.Linear(2, 2).bfloat16())  # the measured choice at this thread count
    entry = device_path.known(torch.bfloat16)
    before = torch.get_num_threads()
    for count in {before, 2}:  # the choices are per thread count
        torch.set_num_threads(count)
        monkeypatch.setitem(device_path.prepared, device_path.choices_key(torch.bfloat16),
                            entry | {"matmul": entry["matmul"] | {"bf16_kernel": True}})
    torch.set_num_threads(before)
    monkeypatch.setattr(packing, "PACK_MIN_ELEMENTS", 0)
    device_path.path_of.cache_clear()
    yield
    device_path.path_of.cache_clear()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_kernel_is_a_float32_reference_within_bfloat16_rounding(shape):
    k, n = shape
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(40, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    for b in (None, bias):
        reference = F.linear(x.double(), weight.double(), None if b is None else b.double())
        scale = x.double().abs() @ weight.double().abs().t() + (0 if b is None else b.double().abs())
        error = (kernel(x, weight, b).double() - reference).abs()
        assert (error <= 2 ** -8 * reference.abs() + 1e-6 * scale).all()  # one rounding to bfloat16, float32 sums


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_row_has_its_bits_alone_in_any_call_and_at_any_thread_count(shape):
    k, n = shape
    g = torch.Generator().manual_seed(1)
    weight, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(40, k, generator=g).bfloat16()
    whole = kernel(x, weight)
    for rows in (1, 2, 5, 6, 7, 9, 13, 17, 33):  # one tile, 2-block passes, chunks of rows
        assert torch.equal(kernel(x[:rows], weight), whole[:rows])
    assert all(torch.equal(kernel(x[i:i + 1], weight)[0], whole[i]) for i in range(40))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(kernel(x, weight), whole)
    finally:
        torch.set_num_threads(before)


def test_packing_linear_takes_the_kernel_where_chosen_and_oneDNN_with_the_fast_path_off(kernel_forced):
    g = torch.Generator().manual_seed(2)
    layer = packing.Linear(64, 48, bias=True).bfloat16()
    x = torch.randn(3, 5, 64, generator=g).bfloat16()
    with torch.inference_mode():
        assert torch.equal(layer(x), kernel(x.reshape(15, 64), layer.weight, layer.bias).reshape(3, 5, 48))
        with fused.enabled(False):
            assert not device_path.choose("cpu", torch.bfloat16).matmul.bf16_kernel
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=2e-2, rtol=2 ** -7)


def test_the_kernel_is_chosen_by_its_stack_as_decoding_runs_it(monkeypatch):
    """measure() takes rvqspec's bfloat16 kernel by the decoder stack's times (`stack_times`: one native call, on 2
    threads one parallel region), not by each matrix timed alone (each call a fork and join of torch's threads, where
    oneDNN won on 2 threads though the stack was 1.34x faster than on 1): faster at one row, at most PAD_COST of
    oneDNN at a verify call's rows, whatever the matrices' own times. stack_times runs every layer matrix in one native
    call."""
    calls, native = [], fused.kernels().int8_layers
    monkeypatch.setattr(fused.kernels(), "int8_layers", lambda *a: calls.append(a) or native(*a))
    times = device_path.stack_times(True, True, {})
    assert set(times) == {(kernel, rows) for kernel in ("bf16", "onednn") for rows in (1, device_path.MANY_ROWS)}
    assert calls and all(len(a[3]) == 4 * device_path.STACK_LAYERS for a in calls)
    monkeypatch.setattr(device_path, "median_ms", lambda calls, *a, **k: {name: 1.0 for name in calls})  # ties
    keys = [("bf16", 1), ("bf16", device_path.MANY_ROWS), ("onednn", 1), ("onednn", device_path.MANY_ROWS)]
    for stack_ms, wins in [((3, 20, 4, 20), True), ((3, 30, 4, 20), False)]:  # a verify call 1.5x oneDNN's
        monkeypatch.setattr(device_path, "stack_times", lambda one, many, figures: dict(zip(keys, stack_ms)))
        with torch.inference_mode():
            assert device_path.measure(torch.bfloat16)["matmul"]["bf16_kernel"] == wins


def test_the_stack_is_timed_by_its_fastest_repeats(monkeypatch):
    """The kernel choice is kept, so a busy moment must not make it: stack_times takes each call's fastest repeat
    (on 2 threads a busy core slowed rvqspec's stack more than oneDNN's, and the median gave a bfloat16 AR step at
    1.75x its 1-thread time)."""
    ticks = iter([0, 1, 10, 10, 12, 12, 15])  # the warm-up reads the clock once, then repeats of 9, 2, 3 seconds
    assert device_path.median_ms({"call": lambda: None}, reps=3, clock=lambda: next(ticks), fastest=True) == \
        {"call": 2e3}
    ticks = iter([0, 1, 10, 10, 12, 12, 15])
    assert device_path.median_ms({"call": lambda: None}, reps=3, clock=lambda: next(ticks)) == {"call": 3e3}
    used = []
    monkeypatch.setattr(device_path, "median_ms", lambda calls, *a, **k: used.append(k) or {n: 1.0 for n in calls})
    device_path.stack_times(True, True, {})
    assert used == [{"fastest": True}]


def test_a_primed_call_is_timed_right_after_an_untimed_call_of_itself():
    """`primed` (the floor's timing, issue 51): a decoding step follows a step, so each timed call finds the caches
    as a call of its own leaves them; timed after the floor's copy, the one-row stack took 1.15-1.2x as long."""
    events = []
    clock = lambda: events.append("clock") or len(events)  # noqa: E731
    device_path.median_ms({"a": lambda: events.append("a"), "b": lambda: events.append("b")}, reps=2, clock=clock,
                          primed=True)
    warm_up = ["a", "clock", "a", "b", "clock", "b"]  # its end is not read
    assert events == warm_up + ["a", "clock", "a", "clock", "b", "clock", "b", "clock"] * 2


@pytest.mark.parametrize("csm", [False, True], ids=["qwen", "llama-csm"])
def test_a_bfloat16_stack_is_one_native_call_with_the_python_loops_bits(kernel_forced, csm, monkeypatch):
    model = tiny_model(seed=5, dtype=torch.bfloat16, hidden=64, layers=3, csm=csm, std=0.1)
    native = counted(monkeypatch)
    ours = predictor_states(model)
    assert len(native) == 4 and all(len(weights) == 1 for weights in native[0][2])  # pack_bf16's one tensor each
    python_loop(monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(ours, predictor_states(model), strict=True))


@torch.inference_mode()
def test_a_bfloat16_stack_on_oneDNN_or_with_a_bias_keeps_the_python_loop(kernel_forced):
    model = tiny_model(seed=5, dtype=torch.bfloat16, hidden=64, layers=2)
    assert fused.int8_stack(model, 1) is not None
    with fused.enabled(False):  # oneDNN's matmuls: not the kernel
        assert fused.int8_stack(model, 1) is None
    model.layers[1].attn.wo.bias = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))
    assert fused.int8_stack(model, 1) is None


def test_the_bfloat16_stack_on_two_threads_gives_one_threads_bits(kernel_forced, threads, monkeypatch):
    """On 2 threads the stack is one parallel region (1.7 MB of weights: a stack under 1 MiB keeps torch's loops)
    whose threads claim groups of 64 channels of each matrix (widths of 1..16 groups): each channel is still summed
    by one thread in one order."""
    same_bits_on_one_and_two_threads(tiny_model(seed=3, dtype=torch.bfloat16, hidden=256, layers=2, std=0.05),
                                     threads, monkeypatch)


def test_a_verify_call_gives_every_node_its_ar_steps_hidden_state(kernel_forced):
    model, tree = tiny_model(seed=3, dtype=torch.bfloat16, hidden=64, layers=2, vocab=64), default_tree(8)
    inputs = random_frames(model, 4, seed=1)
    talker_hidden, c0 = torch.stack([h for h, _ in inputs]), torch.tensor([c for _, c in inputs])
    codes = decode_frames(model, talker_hidden, c0, Sampler(do_sample=False)).codes
    ar = ar_states(model, talker_hidden, c0, codes)
    k = torch.tensor([1, 3, 5, 7])
    together = verify_states(model, talker_hidden, c0, codes, tree, k)
    for b in range(4):
        alone = verify_states(model, talker_hidden[b:b + 1], c0[b:b + 1], codes[b:b + 1], tree, k[b:b + 1])[0]
        assert torch.equal(alone, together[b])
        for node, depth in enumerate(tree.depth.tolist()):
            if k[b] + depth <= model.config.num_code_groups - 2:
                assert torch.equal(together[b, node], ar[b, k[b] + depth]), (b, node)


@pytest.mark.parametrize("budget", [4, 16])
def test_speculative_codes_are_ars_greedy_and_seeded_alone_and_in_a_batch(kernel_forced, budget):
    model = tiny_model(seed=3, dtype=torch.bfloat16, hidden=64, layers=2, vocab=64)
    inputs = random_frames(model, 16, seed=5)
    talker_hidden, c0 = torch.stack([h for h, _ in inputs]), torch.tensor([c for _, c in inputs])
    drafter, tree = ReusedHeads(model), default_tree(budget)
    for sampler in (Sampler(do_sample=False), Sampler(temperature=1.0, top_k=0)):
        def decode(rows, **speculation):
            seeds = [torch.Generator().manual_seed(100 + b) for b in rows]
            return decode_frames(model, talker_hidden[rows], c0[rows], sampler, seeds, **speculation).codes

        ar = decode(list(range(16)))
        assert torch.equal(decode(list(range(16)), drafter=drafter, tree=tree), ar)
        for b in (0, 9):
            assert torch.equal(decode([b], drafter=drafter, tree=tree)[0], ar[b])


def test_bfloat16_speculative_sampling_through_the_kernel_matches_enumeration(kernel_forced):
    test_distribution.test_bfloat16_speculative_sampling_matches_enumeration()  # its G-test, every matmul ours
