"""Every public entry point against arguments of the wrong kind (CPU: NumPy, torch CPU tensors,
JAX on the CPU; the drop-ins and the table builders).

Each entry point starts from a valid call (fresh random data); then each of its arguments in
turn takes each value of ``BAD`` (None, strings, floats, bools, ints past int64, NumPy scalars,
0-d, empty and 5-D arrays, lists, plain objects, tensors). The call must either run or raise a
``ValueError``/``TypeError`` whose message names one of the entry point's own arguments in
backticks (the drop-ins: the original API's names), with every array argument unchanged. Flags
and integer options must not be coerced from other kinds (``interleaved=None``, ``cp_size=1.5``
are errors), except in the TransformerEngine drop-in, which converts them as TE's pybind11
extension does.
"""

from __future__ import annotations

import inspect
import zlib

import numpy as np
import pytest

import cupy_rope

torch = pytest.importorskip("torch")
import cupy_rope.flashinfer as cfi  # noqa: E402
import cupy_rope.te as cte  # noqa: E402
import cupy_rope.torch as crt  # noqa: E402
import cupy_rope.vllm as cvl  # noqa: E402

S, B, H, D = 6, 2, 3, 16
BAD = [None, "x", 1.5, True, -1, 2**63, 2**70, float("nan"), np.float32(1.0), np.int64(2), [1, 2], object(),
       np.zeros(()), np.zeros((2, 2), np.int8), np.zeros(3, np.complex64), np.array([1.0, 2.0]),
       np.zeros((0,), np.int64), np.ones((1, 1, 1, 1, 1), np.float32)]
FLAGS = {"interleaved", "inplace", "inverse", "transpose_output_memory", "is_neox", "interleave", "return_v"}
INTS = {"cp_size", "cp_rank", "head_size", "rope_dim_offset", "num_q_heads", "num_kv_heads", "dim", "max_seq_len",
        "rotary_dim", "max_position", "offset", "max_position_embeddings", "seq_len",
        "pretrained_max_position_embeddings"}
NOT_FLAGS = [None, "x", 1.5, -1, 2**63, np.float32(1.0), [1, 2], object(), np.zeros((2, 2), np.int8)]
NOT_INTS = ["x", 1.5, True, np.float32(1.0), [1, 2], object(), np.zeros((2, 2), np.int8)]


def _r(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _numpy(rng):
    f, c = cupy_rope.rope_freqs(D, 2 * S), cupy_rope.rope_cos_sin_cache(D, 2 * S)
    return {
        "apply_rope": (cupy_rope.apply_rope, dict(x=_r(rng, S, B, H, D), freqs=f, start_positions=np.array([1, 2]))),
        "apply_rope thd": (cupy_rope.apply_rope, dict(x=_r(rng, 7, H, D), freqs=f, layout="thd",
                                                      cu_seqlens=np.array([0, 3, 7], np.int32))),
        "apply_rope_backward": (cupy_rope.apply_rope_backward, dict(grad=_r(rng, S, B, H, D), freqs=f)),
        "apply_rope_qk": (cupy_rope.apply_rope_qk, dict(q=_r(rng, S, B, H, D), k=_r(rng, S, B, 1, D), freqs=f)),
        "apply_rope_qk_backward": (cupy_rope.apply_rope_qk_backward,
                                   dict(dq=_r(rng, S, B, H, D), dk=_r(rng, S, B, 1, D), freqs=f)),
        "apply_qkv_rope": (cupy_rope.apply_qkv_rope, dict(qkv=_r(rng, S, B, 2, 4 * D), q_freqs=f, k_freqs=f,
                                                          split=(2 * D, D, D))),
        "apply_qkv_rope_backward": (cupy_rope.apply_qkv_rope_backward,
                                    dict(dq=_r(rng, S, B, 4, D), dk=_r(rng, S, B, 2, D), dv=_r(rng, S, B, 2, D),
                                         q_freqs=f, k_freqs=f, num_q_heads=4)),
        "apply_rope_pos": (cupy_rope.apply_rope_pos, dict(positions=rng.integers(0, 2 * S, S), q=_r(rng, S, H * D),
                                                          k=_r(rng, S, D), cos_sin_cache=c, head_size=D)),
        "rope_freqs": (cupy_rope.rope_freqs, dict(dim=D, max_seq_len=8)),
        "rope_cos_sin_cache": (cupy_rope.rope_cos_sin_cache, dict(rotary_dim=D, max_position=8)),
        "rope_inv_freq": (cupy_rope.rope_inv_freq, dict(rotary_dim=D)),
    }


def _torch(rng):
    t = torch.from_numpy
    f, c = t(cupy_rope.rope_freqs(D, 2 * S)), t(cupy_rope.rope_cos_sin_cache(D, 2 * S))
    pos = t(rng.integers(0, 2 * S, S))
    return {
        "torch.apply_rope": (crt.apply_rope, dict(x=t(_r(rng, S, B, H, D)), freqs=f)),
        "torch.apply_rope_backward": (crt.apply_rope_backward, dict(grad=t(_r(rng, S, B, H, D)), freqs=f)),
        "torch.apply_rope_qk": (crt.apply_rope_qk, dict(q=t(_r(rng, S, B, H, D)), k=t(_r(rng, S, B, 1, D)), freqs=f)),
        "torch.apply_rope_qk_backward": (crt.apply_rope_qk_backward,
                                         dict(dq=t(_r(rng, S, B, H, D)), dk=t(_r(rng, S, B, 1, D)), freqs=f)),
        "torch.apply_qkv_rope": (crt.apply_qkv_rope, dict(qkv=t(_r(rng, S, B, 2, 4 * D)), q_freqs=f, k_freqs=f,
                                                          split=(2 * D, D, D))),
        "torch.apply_qkv_rope_backward": (crt.apply_qkv_rope_backward,
                                          dict(dq=t(_r(rng, S, B, 4, D)), dk=t(_r(rng, S, B, 2, D)),
                                               dv=t(_r(rng, S, B, 2, D)), q_freqs=f, k_freqs=f, num_q_heads=4)),
        "torch.apply_rope_pos": (crt.apply_rope_pos, dict(positions=pos, q=t(_r(rng, S, H * D)), k=t(_r(rng, S, D)),
                                                          cos_sin_cache=c, head_size=D)),
        "torch.RotaryPositionEmbedding": (crt.RotaryPositionEmbedding, dict(dim=D)),
        "vllm.rotary_embedding": (cvl.rotary_embedding, dict(positions=pos, query=t(_r(rng, S, H * D)),
                                                             key=t(_r(rng, S, D)), head_size=D, cos_sin_cache=c,
                                                             is_neox=True)),
        "flashinfer.apply_rope_with_cos_sin_cache_inplace": (
            cfi.apply_rope_with_cos_sin_cache_inplace,
            dict(positions=pos, query=t(_r(rng, S, H * D)), key=t(_r(rng, S, D)), head_size=D, cos_sin_cache=c)),
        "flashinfer.apply_rope_pos_ids": (cfi.apply_rope_pos_ids, dict(q=t(_r(rng, S, H, D)), k=t(_r(rng, S, 1, D)),
                                                                       pos_ids=pos)),
        "flashinfer.apply_llama31_rope": (cfi.apply_llama31_rope,
                                          dict(q=t(_r(rng, S, H, D)), k=t(_r(rng, S, 1, D)),
                                               indptr=torch.tensor([0, 2, S]), offsets=torch.tensor([3, 0]))),
        "te.fused_rope_forward": (cte.fused_rope_forward,
                                  dict(input=t(_r(rng, S, B, H, D)), freqs=f, start_positions=None, qkv_format="sbhd",
                                       interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0)),
        "te.fused_rope_backward": (cte.fused_rope_backward,
                                   dict(output_grads=t(_r(rng, S, B, H, D)), freqs=f, start_positions=None,
                                        qkv_format="sbhd", interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0)),
        "te.fused_qkv_rope_forward": (cte.fused_qkv_rope_forward,
                                      dict(qkv_input=t(_r(rng, S, B, 2, 4 * D)), q_freqs=f, k_freqs=f,
                                           start_positions=None, qkv_split_arg_list=[2 * D, D, D], qkv_format="sbhd",
                                           interleaved=False, cp_size=1, cp_rank=0)),
        "te.fused_qkv_rope_backward": (cte.fused_qkv_rope_backward,
                                       dict(q_grad_out=t(_r(rng, S, B, 4, D)), k_grad_out=t(_r(rng, S, B, 2, D)),
                                            v_grad_out=t(_r(rng, S, B, 2, D)), q_freqs=f, k_freqs=f,
                                            qkv_split_arg_list=[2 * D, D, D], qkv_format="sbhd", interleaved=False,
                                            cp_size=1, cp_rank=0)),
    }


def _jax(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cupy_rope.jax as crj

    if jax.default_backend() != "cpu":
        pytest.skip("the JAX cases run on JAX's CPU backend")
    a = jnp.asarray
    f, c = a(cupy_rope.rope_freqs(D, 2 * S)), a(cupy_rope.rope_cos_sin_cache(D, 2 * S))
    return {
        "jax.apply_rope": (crj.apply_rope, dict(x=a(_r(rng, S, B, H, D)), freqs=f)),
        "jax.apply_rope_qk": (crj.apply_rope_qk, dict(q=a(_r(rng, S, B, H, D)), k=a(_r(rng, S, B, 1, D)), freqs=f)),
        "jax.apply_rope_qk_fused": (crj.apply_rope_qk_fused, dict(qkv=a(_r(rng, B, S, 3, H, D)), freqs=f,
                                                                  layout="bshd")),
        "jax.apply_qkv_rope": (crj.apply_qkv_rope, dict(qkv=a(_r(rng, S, B, 2, 4 * D)), q_freqs=f, k_freqs=f,
                                                        split=(2 * D, D, D))),
        "jax.apply_qkv_rope_backward": (crj.apply_qkv_rope_backward,
                                        dict(dq=a(_r(rng, S, B, 4, D)), dk=a(_r(rng, S, B, 2, D)),
                                             dv=a(_r(rng, S, B, 2, D)), q_freqs=f, k_freqs=f)),
        "jax.apply_rope_pos": (crj.apply_rope_pos, dict(positions=a(rng.integers(0, 2 * S, S)), q=a(_r(rng, S, H * D)),
                                                        k=a(_r(rng, S, D)), cos_sin_cache=c, head_size=D)),
    }


FAMILIES = {"numpy": _numpy, "torch": _torch, "jax": _jax}
ENTRIES = [(fam, name) for fam, build in (("numpy", _numpy), ("torch", _torch)) for name in build(np.random.default_rng(0))]
ENTRIES += [("jax", n) for n in ("jax.apply_rope", "jax.apply_rope_qk", "jax.apply_rope_qk_fused", "jax.apply_qkv_rope",
                                 "jax.apply_qkv_rope_backward", "jax.apply_rope_pos")]


def _like(family, v):
    """``v`` as the family's array type where it is a NumPy array."""
    if isinstance(v, np.ndarray) and family == "torch":
        return torch.from_numpy(v.copy())
    if isinstance(v, np.ndarray) and family == "jax":
        import jax.numpy as jnp

        return jnp.asarray(v)
    return v


def _snapshot(kw):
    """Copies of the arrays among ``kw``'s values (NumPy, torch, JAX), by name."""
    out = {}
    for n, v in kw.items():
        if isinstance(v, torch.Tensor):
            out[n] = v.detach().numpy().copy()
        elif isinstance(v, np.ndarray) or type(v).__name__ == "ArrayImpl":
            out[n] = np.asarray(v).copy()
    return out


@pytest.mark.parametrize("family,entry", ENTRIES)
def test_wrong_kinds_of_argument(family, entry):
    rng = np.random.default_rng(zlib.crc32(entry.encode()))
    fn, valid = FAMILIES[family](rng)[entry]
    fn(**valid)  # the valid call runs
    params = list(inspect.signature(fn).parameters)
    te_entry = entry.startswith("te.")
    for p in params:
        for v in BAD:
            fn, kw = FAMILIES[family](rng)[entry]
            kw = dict(kw)
            kw[p] = _like(family, v)
            before = _snapshot({n: a for n, a in kw.items() if n != p})
            try:
                fn(**kw)
            except (TypeError, ValueError) as e:
                msg = str(e)
                assert any(f"`{q}`" in msg for q in params), f"{entry}({p}={v!r}): {msg}"
                for n, a in _snapshot({n: kw[n] for n in before}).items():
                    np.testing.assert_array_equal(a, before[n], err_msg=f"{entry}({p}={v!r}) wrote `{n}`")
                continue
            except Exception as e:  # noqa: BLE001
                pytest.fail(f"{entry}({p}={v!r}) raised {type(e).__name__}: {e}")
            if p in FLAGS and not te_entry:
                assert not any(v is w for w in NOT_FLAGS), f"{entry}: `{p}` took {v!r} as a bool"
            if p in INTS and not te_entry:
                assert not any(v is w for w in NOT_INTS), f"{entry}: `{p}` took {v!r} as an int"


def test_te_converts_flags_and_ints_as_pybind11():
    """TE's extension takes None and numbers as bools and rejects strings and lists; its ints take
    ``__index__`` but not floats. The drop-in does the same, naming TE's arguments."""
    rng = np.random.default_rng(5)
    f = torch.from_numpy(cupy_rope.rope_freqs(D, S))
    x = torch.from_numpy(_r(rng, S, B, H, D))
    ref = cte.fused_rope_forward(x, f, None, "sbhd", False, None, 1, 0)
    torch.testing.assert_close(cte.fused_rope_forward(x, f, None, "sbhd", None, None, np.int64(1), 0), ref,
                               rtol=0, atol=0)
    torch.testing.assert_close(cte.fused_rope_forward(x, f, None, cte.NVTE_SBHD, 0.0, None, 1, torch.tensor(0)), ref,
                               rtol=0, atol=0)
    for args, name in (((x, f, None, "sbhd", "x", None, 1, 0), "interleaved"),
                       ((x, f, None, "sbhd", False, None, 1.0, 0), "cp_size"),
                       ((x, f, None, "sbhd", False, None, 1, "0"), "cp_rank"),
                       ((x, f, None, 1.5, False, None, 1, 0), "qkv_format"),
                       ((None, f, None, "sbhd", False, None, 1, 0), "input")):
        with pytest.raises((TypeError, ValueError), match=f"`{name}`"):
            cte.fused_rope_forward(*args)
    with pytest.raises(TypeError, match="`qkv_split_arg_list`"):
        cte.fused_qkv_rope_forward(torch.zeros(S, B, 2, 4 * D), f, f, None, None, "sbhd", False, 1, 0)


def test_torch_shim_does_not_coerce_options():
    """torch's argument parser would take None or 1.5 as a bool; the shim checks first, as the
    public API does, and accepts what the public API accepts (NumPy ints and bools)."""
    rng = np.random.default_rng(6)
    f = torch.from_numpy(cupy_rope.rope_freqs(D, S))
    x = torch.from_numpy(_r(rng, S, B, H, D))
    for kw in (dict(interleaved=None), dict(interleaved=1), dict(cp_size=True), dict(cp_size=torch.tensor(1)),
               dict(transpose_output_memory=None)):
        with pytest.raises(TypeError, match=f"`{next(iter(kw))}`"):
            crt.apply_rope(x, f, **kw)
    with pytest.raises(ValueError, match="`cp_rank`"):
        crt.apply_rope_qk(x, x, f, cp_size=2, cp_rank=2)
    y = crt.apply_rope(x, f, "sbhd", interleaved=np.bool_(True), cp_size=np.int64(1), cp_rank=np.int32(0))
    torch.testing.assert_close(y, crt.apply_rope(x, f, interleaved=True), rtol=0, atol=0)


def test_jax_cp_rank_static_or_scalar_integer():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cupy_rope.jax as crj

    rng = np.random.default_rng(7)
    f = jnp.asarray(cupy_rope.rope_freqs(D, 4 * S))
    x = jnp.asarray(_r(rng, S, B, H, D))
    want = crj.apply_rope(x, f, cp_size=2, cp_rank=1)
    got = jax.jit(lambda x, r: crj.apply_rope(x, f, cp_size=2, cp_rank=r))(x, jnp.int32(1))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)  # XLA's fusion rounds
    for rank in (jnp.zeros((2,), jnp.int32), jnp.float32(1.0), "1", None):
        with pytest.raises(TypeError, match="`cp_rank`"):
            crj.apply_rope(x, f, cp_size=2, cp_rank=rank)
    with pytest.raises(TypeError, match="`interleaved`"):
        jax.jit(lambda x: crj.apply_rope(x, f, interleaved="yes"))(x)


def test_tables_name_their_arguments():
    cases = [(lambda: cupy_rope.rope_freqs(D, 4, rotary_percent=None), TypeError, "rotary_percent"),
             (lambda: cupy_rope.rope_freqs(D, 4, base="x"), TypeError, "base"),
             (lambda: cupy_rope.rope_freqs(D, 4, offset=0.5), TypeError, "offset"),
             (lambda: cupy_rope.rope_freqs(D, 2**40), ValueError, "max_seq_len"),
             (lambda: cupy_rope.rope_freqs(D, 4, seq_len_interpolation_factor="x",
                                           pretrained_max_position_embeddings=2), TypeError,
              "seq_len_interpolation_factor"),
             (lambda: cupy_rope.rope_cos_sin_cache(D, 4, dtype=np.zeros(2)), TypeError, "dtype"),
             (lambda: cupy_rope.rope_cos_sin_cache(D, 4, dtype="int8"), ValueError, "dtype"),
             (lambda: cupy_rope.rope_inv_freq(D, max_position_embeddings="x"), TypeError, "max_position_embeddings"),
             (lambda: cfi.apply_rope_pos_ids(torch.zeros(2, 1, D), torch.zeros(2, 1, D), torch.arange(2),
                                             rope_theta=torch.ones(2)), TypeError, "rope_theta")]
    for call, exc, name in cases:
        with pytest.raises(exc, match=f"`{name}`"):
            call()
    for like in (None, torch.empty(0)):  # an empty interleaved table
        assert tuple(cupy_rope.rope_freqs(D, 0, interleaved=True, like=like).shape) == (0, 1, 1, D)
