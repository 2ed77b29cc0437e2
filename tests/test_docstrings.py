"""Every example in the public docstrings runs and prints what it says (CPU)."""

import doctest
import importlib

import pytest


@pytest.mark.parametrize("name", ["cupy_rope._api", "cupy_rope.torch", "cupy_rope._jax_ops"])
def test_docstring_examples(name):
    pytest.importorskip(name.split(".")[-1] if name != "cupy_rope._api" else "numpy")
    mod = importlib.import_module(name)
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0
