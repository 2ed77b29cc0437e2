"""The tests' float64 reference lives in the package (cupy_rope.testing) so that
``python -m cupy_rope check`` uses the same one; it shares no code with the backends."""
from cupy_rope.testing import *  # noqa: F401,F403
from cupy_rope.testing import assert_close_to_ref, qkv_split_ref, rope_ref, term_scale  # noqa: F401
