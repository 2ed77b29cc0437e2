"""Every example in the public docstrings runs and prints what it says (CPU)."""

import doctest
import importlib

import pytest


@pytest.mark.parametrize("name", ["cupy_rope._api", "cupy_rope._freqs", "cupy_rope.vllm", "cupy_rope.flashinfer",
                                  "cupy_rope.torch", "cupy_rope._jax_ops"])
def test_docstring_examples(name):
    pytest.importorskip(name.split(".")[-1] if name in ("cupy_rope.torch", "cupy_rope._jax_ops") else "numpy")
    mod = importlib.import_module(name)
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.attempted > 0 and res.failed == 0


@pytest.mark.parametrize("name", ["cupy_rope", "cupy_rope.vllm", "cupy_rope.flashinfer", "cupy_rope.torch",
                                  "cupy_rope.jax"])
def test_public_functions_document_shapes_and_examples(name):
    """Every public function of the public modules has a docstring with an example."""
    pytest.importorskip(name.split(".")[-1] if name in ("cupy_rope.torch", "cupy_rope.jax") else "numpy")
    mod = importlib.import_module(name)
    names = getattr(mod, "__all__", None) or [n for n in dir(mod) if not n.startswith("_")]
    for n in names:
        obj = getattr(mod, n)
        if callable(obj) and getattr(obj, "__module__", "").startswith("cupy_rope"):
            doc = obj.__doc__ or ""
            assert ">>>" in doc or "Example" in doc, f"{name}.{n} has no example"
