"""The spec's test matrix lives in cupy_rope.testing (shared with `python -m cupy_rope check`)."""
from cupy_rope.testing import (NP_DTYPES, Case, inputs, make_cu_seqlens, matrix,  # noqa: F401
                               rng_for, strided)
