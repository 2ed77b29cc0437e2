"""The randomised fuzz of every entry point (tests/fuzz.py), with fixed seeds.

CPU: the NumPy backend through NumPy and torch CPU tensors, JAX arrays on JAX's CPU backend, and
the host build of the kernels through the real launch plan. GPU (marked, run on the H200): CuPy
and torch CUDA tensors, and JAX arrays through XLA's launch of the kernels.
Replay a failure with the command its message prints (``python tests/fuzz.py --backend B
--seed S -v``). ``CUPY_ROPE_FUZZ_SCALE`` multiplies the number of seeds.
"""

import os

import pytest

import fuzz

SCALE = float(os.environ.get("CUPY_ROPE_FUZZ_SCALE", "1"))
CHUNK = 250


def _chunks(n):
    n = int(n * SCALE)
    return [(a, min(a + CHUNK, n)) for a in range(0, n, CHUNK)]


def _run(backend, lo, hi):
    failures = []
    for seed in range(lo, hi):
        try:
            fuzz.run_case(seed, backend)
        except AssertionError as e:
            failures.append(f"seed {seed}: {str(e)[:1500]}\n  replay: python tests/fuzz.py --backend {backend} "
                            f"--seed {seed} -v")
    assert not failures, f"{len(failures)} of {hi - lo} cases failed:\n" + "\n".join(failures[:5])


@pytest.mark.parametrize("lo,hi", _chunks(3000), ids=lambda v: str(v))
def test_fuzz_numpy(lo, hi):
    _run("numpy", lo, hi)


@pytest.mark.parametrize("lo,hi", _chunks(2000), ids=lambda v: str(v))
def test_fuzz_torch_cpu(lo, hi):
    pytest.importorskip("torch")
    _run("torch-cpu", 100000 + lo, 100000 + hi)


@pytest.mark.parametrize("lo,hi", _chunks(3000), ids=lambda v: str(v))
def test_fuzz_host_kernels(lo, hi):
    _run("host", 200000 + lo, 200000 + hi)


@pytest.mark.parametrize("lo,hi", _chunks(500), ids=lambda v: str(v))
def test_fuzz_jax_cpu(lo, hi):
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "cpu":
        pytest.skip("JAX's default backend is a GPU here: test_fuzz_gpu runs the JAX cases")
    _run("jax", 400000 + lo, 400000 + hi)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy", "torch-cuda"])
@pytest.mark.parametrize("lo,hi", _chunks(1000), ids=lambda v: str(v))
def test_fuzz_gpu(backend, lo, hi):
    if backend == "torch-cuda":
        pytest.importorskip("torch")
    _run(backend, 300000 + lo, 300000 + hi)


@pytest.mark.gpu
@pytest.mark.parametrize("lo,hi", _chunks(250), ids=lambda v: str(v))
def test_fuzz_gpu_jax(lo, hi):
    """Fewer seeds: each new shape is an XLA compilation."""
    if pytest.importorskip("jax").default_backend() != "gpu":
        pytest.skip("JAX sees no GPU")
    _run("jax", 300000 + lo, 300000 + hi)
