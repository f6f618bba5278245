"""Two threads of an Engine side by side (runtime/threads.py): the frame loop's native kernels let go of the GIL
while they run, so the codec worker's Python between its decoder's ops goes on beside them."""

import os
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

from rvqspec.core import cpu_class, fused
from rvqspec.core.bf16 import pack_bf16
from rvqspec.core.quantize import Int8Matmul
from rvqspec.runtime.threads import ThreadBudget, warn_if_openmp_spins

CALLS = 50  # a kernel call during which the other thread never ran is retried up to this often


def ran_beside(call) -> bool:
    """Whether another Python thread ran while `call()` was inside its native code. The GIL switch interval is set
    long, so the other thread gets the GIL only when this one lets go of it: then the counter can move during `call`
    only if the call released the GIL (the other thread's sleep(0) hands it back as soon as `call` wants it)."""
    counter, started, stop = [0], threading.Event(), threading.Event()

    def count() -> None:
        started.set()
        while not stop.is_set():
            counter[0] += 1
            time.sleep(0)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    thread = threading.Thread(target=count)
    try:
        thread.start()
        started.wait()
        for _ in range(CALLS):
            before = counter[0]
            result = call()  # kept until counted: freeing a large tensor lets go of the GIL too
            moved = counter[0] != before
            del result
            if moved:
                return True
        return False
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)


@pytest.mark.parametrize("scheme", ["w8a8", "w8a16"])
def test_the_int8_kernels_release_the_gil_while_they_run(scheme):
    g = torch.Generator().manual_seed(0)
    matmul = Int8Matmul(torch.randn(8192, 8192, generator=g), scheme)  # a call of milliseconds
    x = torch.randn(1, 8192, generator=g)
    with torch.inference_mode():
        matmul(x)  # its weight packed first (torch ops, which let go of the GIL anyway)
        assert ran_beside(lambda: matmul(x))


def test_the_fused_kernels_release_the_gil_while_they_run():
    ops = fused.kernels()
    x = torch.randn(2048, 4096)
    weight = torch.ones(4096)
    with torch.inference_mode():
        assert ran_beside(lambda: ops.rms_norm(x, weight, 1e-6))
        assert ran_beside(lambda: ops.add_rms_norm(x, x, weight, 1e-6))
        assert ran_beside(lambda: ops.silu_mul(x))


@pytest.mark.skipif(not cpu_class.has_avx512_bf16() or not fused.kernels().has_bf16_gemm(),
                    reason="the bfloat16 kernel needs AVX-512 BF16")
def test_the_bfloat16_kernel_releases_the_gil_while_it_runs():
    weight = torch.randn(8192, 8192).to(torch.bfloat16)
    packed, x = pack_bf16(weight), torch.randn(1, 8192).to(torch.bfloat16)
    with torch.inference_mode():
        assert ran_beside(lambda: fused.kernels().bf16_linear(x, packed, None, 8192))


def wait_policy_after(code: str, policy: str | None) -> str:
    """OMP_WAIT_POLICY after `code` runs in a fresh Python whose environment sets it to `policy` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    code += "; import os; print(os.environ.get('OMP_WAIT_POLICY'))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.split()[-1]


@pytest.mark.parametrize("code, policy, expected", [("import rvqspec", None, "PASSIVE"),
                                                    ("import rvqspec", "ACTIVE", "ACTIVE"),
                                                    ("import torch; import rvqspec", None, "None")])
def test_rvqspec_sets_a_sleeping_wait_policy_only_before_torch_loads_and_unless_the_user_chose(code, policy,
                                                                                               expected):
    assert wait_policy_after(code, policy) == expected


def test_an_engine_on_two_cores_warns_when_openmp_threads_spin(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    with pytest.warns(RuntimeWarning, match="OMP_WAIT_POLICY=PASSIVE"):
        warn_if_openmp_spins(ThreadBudget.split(cores=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_openmp_spins(ThreadBudget.split(cores=1))  # one core: no thread waits beside another
        for policy in ("PASSIVE", "ACTIVE"):  # the user's choice
            monkeypatch.setenv("OMP_WAIT_POLICY", policy)
            warn_if_openmp_spins(ThreadBudget.split(cores=2))
