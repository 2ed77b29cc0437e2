"""Development tools, never imported by the runtime layers: the benchmark harness
(``benchmark``, behind ``python -m cupy_rope bench``) and the host (CPU) build of the kernel
source used by the test suite (``hostkernels``)."""
