"""The JAX implementation behind ``cupy_rope.jax`` (and the public API's JAX route): custom VJPs
over the XLA launch (``_xla``) on a GPU and over the NumPy backend's formulas in ``jax.numpy`` on
the CPU (jittable, same semantics).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _launch, _numpy_backend, _plan, _worksplit, _xla

# ----------------------------------------------------------------------------- helpers


def _info(a, ptr=0, device=("cpu", 0)):
    """ArrayInfo of a JAX array, tracer or buffer (JAX arrays are always compact)."""
    return None if a is None else _plan.compact_info(a.shape, np.dtype(a.dtype).name, device, ptr)


_ROPE_IN = [[("x", 0)], [("freqs", 0)], [("cu_seqlens", 0)], [("start_positions", 0)]]


def _at(a, ptr, device):
    """ArrayInfo of an array shaped like ``a`` (a ShapeDtypeStruct) at address ``ptr`` on CUDA
    ``device``; None for None."""
    return None if a is None else _info(a, ptr, ("cuda", device))


def _shapes(*arrays):
    """ShapeDtypeStructs of (traced) arrays: what a callback may keep (never the tracers)."""
    return tuple(None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)


def _precompile(spec) -> None:
    """The kernel a traced call launches, compiled before XLA runs (and records) it. The trace
    plans without the device's SM count, so a rope launch compiles every rope kernel of its
    dtype and options (``_worksplit.launch_alternatives``): whichever the device's work split picks."""
    _xla.precompile(_worksplit.launch_alternatives(spec.name))


def _check_cpu_cu(plan, lead_shape, cu):
    """CPU: a concrete ``cu_seqlens`` (not a tracer) is checked like the NumPy backend does."""
    if plan.pos.layout == "thd" and cu is not None and not isinstance(cu, jax.core.Tracer):
        from ._positions import check_cu_seqlens

        check_cu_seqlens(plan.pos, lead_shape[0], np.asarray(cu))


def _on_gpu(*arrays) -> bool:
    for a in arrays:
        if a is None:
            continue
        if isinstance(a, jax.core.Tracer):
            return jax.default_backend() == "gpu"
        try:
            return next(iter(a.devices())).platform == "gpu"
        except Exception:  # pragma: no cover
            return jax.default_backend() == "gpu"
    return False


_HEADS_MAJOR = {"sbhd": "bhsd", "bshd": "bhsd", "thd": "htd"}  # memory order of heads-major q/k


def heads_major_order(layout: str) -> tuple:
    """The major-to-minor dimension order that stores a ``layout``-shaped q or k heads-major
    ([b, h, s, d]; thd: [h, t, d]), XLA's order for its own attention's matrix products."""
    return tuple(layout.index(c) for c in _HEADS_MAJOR[layout])


def _ordered(info, order):
    """``info`` (compact) with the strides of memory order ``order`` (major to minor; None: as is)."""
    if order is None:
        return info
    phys = _plan.output_strides(tuple(info.shape[dim] for dim in order))
    st = [0] * len(order)
    for dim, s in zip(order, phys):
        st[dim] = s
    return _plan.ArrayInfo(info.shape, tuple(st), info.dtype, info.device, info.ptr)


def _layouts(ins, outs):
    """:func:`_xla.gpu_call`'s ``layouts`` for these operand and result memory orders; None where
    all are row-major."""
    return (list(ins), list(outs)) if any(o is not None for o in (*ins, *outs)) else None


# ----------------------------------------------------------------------------- single tensor
def _rope_impl(x, freqs, cu, sp, layout, interleaved, cp_size, cp_rank, backward, mem=(None, None)):
    """x -> x' in one launch; ``mem``: the memory orders of x and x' (as :func:`_qk_impl`'s)."""
    plan = _plan.resolve_rope(_info(x), _info(freqs), layout, interleaved, _info(cu), _info(sp), cp_size,
                              cp_rank, None, backward, x_name="grad" if backward else "x")
    if not _on_gpu(x, freqs):
        _check_cpu_cu(plan, tuple(x.shape[:-2]), cu)
        return _numpy_backend.rope(jnp, plan, x, freqs, cu, sp)
    if x.size == 0:
        return jnp.zeros(x.shape, x.dtype)
    _precompile(plan.launch(_info(x), _info(x), _info(freqs), _info(cu), _info(sp), 1))

    xs, fs, cs, ss = _shapes(x, freqs, cu, sp)
    layouts = _layouts([mem[0], None, None, None], [mem[1]])

    def build(addr, device, ordered=False):
        xi, yi = (_at(xs, addr[n], device) for n in ("x", "y"))
        if ordered:
            xi, yi = _ordered(xi, mem[0]), _ordered(yi, mem[1])
        return plan.launch(xi, yi, _at(fs, addr["freqs"], device), _at(cs, addr["cu_seqlens"], device),
                           _at(ss, addr["start_positions"], device), _launch.sm_count(device))

    return _xla.gpu_call(jax.ShapeDtypeStruct(x.shape, x.dtype), (x, freqs, cu, sp), _ROPE_IN, [[("y", 0)]], build,
                         layouts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _rope(x, freqs, cu, sp, layout, interleaved, cp_size, cp_rank, backward, mem=(None, None)):
    return _rope_impl(x, freqs, cu, sp, layout, interleaved, cp_size, cp_rank, backward, mem)


def _rope_fwd(x, freqs, cu, sp, *static):
    return _rope(x, freqs, cu, sp, *static), (freqs, cu, sp)


def _zero_cot(a):
    if a is None:
        return None
    if jnp.issubdtype(a.dtype, jnp.integer):
        return np.zeros(a.shape, jax.dtypes.float0)
    return jnp.zeros_like(a)


def _rope_bwd(layout, interleaved, cp_size, cp_rank, backward, mem, res, g):
    freqs, cu, sp = res  # the cotangent comes in the output's memory order, goes out in the input's
    gx = _rope(g, freqs, cu, sp, layout, interleaved, cp_size, cp_rank, not backward, mem[::-1])
    return gx, _zero_cot(freqs), _zero_cot(cu), _zero_cot(sp)


_rope.defvjp(_rope_fwd, _rope_bwd)


def _per_rank(layout, interleaved, cp_size, cp_rank, fn):
    """``fn(layout, interleaved, cp_size, rank)`` with the options checked, for a static rank, or
    a ``lax.switch`` over all ranks for a traced one (a scalar integer array, e.g.
    ``jax.lax.axis_index("cp")`` inside ``shard_map``)."""
    if isinstance(cp_rank, (int, np.integer)):
        return fn(*_plan.check_options(layout, interleaved, cp_size, cp_rank))
    layout, interleaved, cp_size, _ = _plan.check_options(layout, interleaved, cp_size, 0)
    traced = isinstance(cp_rank, jax.Array)
    if not (traced and cp_rank.shape == () and jnp.issubdtype(cp_rank.dtype, jnp.integer)):
        got = f"shape {tuple(cp_rank.shape)} {cp_rank.dtype}" if traced else type(cp_rank).__name__
        raise _plan._terr("cp_rank", "an int or a scalar integer JAX array (e.g. jax.lax.axis_index)", got)
    branches = [functools.partial(lambda r, _: fn(layout, interleaved, cp_size, r), r) for r in range(cp_size)]
    return jax.lax.switch(jnp.asarray(cp_rank, jnp.int32), branches, None)


def _arrays(optional=("cu_seqlens", "start_positions"), **named) -> None:
    """JAX (or NumPy) arrays, tracers included, or None where the name is in ``optional``:
    anything else is a ``TypeError`` naming the argument."""
    _plan.check_arrays((jax.Array, np.ndarray), "a JAX array", optional, **named)


def apply_rope(x, freqs, layout="sbhd", *, interleaved=False, cu_seqlens=None, start_positions=None,
               cp_size=1, cp_rank=0, heads_major=False):
    """:func:`cupy_rope.apply_rope` for JAX arrays; jittable and differentiable in ``x``.

    ``cp_rank`` may be a traced integer (``jax.lax.axis_index`` inside ``shard_map``): the call
    then switches between the ``cp_size`` static-rank versions. ``heads_major``: the result
    stored in memory order ``[b, h, s, d]`` (thd: ``[h, t, d]``), as in
    :func:`apply_rope_qk_fused`.

    Example:
        >>> import jax.numpy as jnp, cupy_rope, cupy_rope.jax as crj
        >>> f = jnp.asarray(cupy_rope.rope_freqs(64, 16))
        >>> crj.apply_rope(jnp.ones((16, 1, 2, 64)), f).shape
        (16, 1, 2, 64)
    """
    _arrays(x=x, freqs=freqs, cu_seqlens=cu_seqlens, start_positions=start_positions)
    hm = _plan.check_bool("heads_major", heads_major)
    return _per_rank(layout, interleaved, cp_size, cp_rank,
                     lambda *o: _rope(x, freqs, cu_seqlens, start_positions, *o, False,
                                      (None, heads_major_order(o[0]) if hm else None)))


def apply_rope_backward(grad, freqs, layout="sbhd", *, interleaved=False, cu_seqlens=None,
                        start_positions=None, cp_size=1, cp_rank=0):
    """:func:`cupy_rope.apply_rope_backward` for JAX arrays (differentiable: its VJP is the forward).

    ``grad``: the forward input's shape and dtype; keywords as :func:`apply_rope`.

    Example:
        >>> import jax.numpy as jnp, cupy_rope, cupy_rope.jax as crj
        >>> f = jnp.asarray(cupy_rope.rope_freqs(64, 16))
        >>> crj.apply_rope_backward(jnp.ones((16, 1, 2, 64)), f).shape
        (16, 1, 2, 64)
    """
    _arrays(grad=grad, freqs=freqs, cu_seqlens=cu_seqlens, start_positions=start_positions)
    return _per_rank(layout, interleaved, cp_size, cp_rank,
                     lambda *o: _rope(grad, freqs, cu_seqlens, start_positions, *o, True))


# ----------------------------------------------------------------------------- q and k, one launch
def _views_info(shape, dtype, views):
    """ArrayInfos (address 0) of ``views`` = [(shape, strides, offset)] into a compact array."""
    return [_plan.ArrayInfo(tuple(sh), tuple(st), np.dtype(dtype).name, ("cpu", 0), 0) for sh, st, _ in views]


def _qk_impl(q, k, freqs, cu, sp, layout, interleaved, cp_size, cp_rank, backward, views=None, out_shape=None,
             mem=(None, None)):
    """q, k -> (q', k') in one launch. With ``views`` (fused entry) ``q`` is the fused projection
    and ``k`` None: q and k are the strided views [(shape, strides, offset)] into it. With
    ``out_shape`` as well (the fused entry's transpose) ``q`` and ``k`` are separate and the
    result is one compact array of ``out_shape`` holding q' and k' at ``views``; the rest of it is
    zero on the CPU and unspecified on the GPU (the caller writes it).

    ``mem`` = (order of separate q and k inputs, order of separate q' and k' outputs): memory
    orders (major to minor, None: row-major) the XLA call declares as its operands' and results'
    layouts, the kernel reading and writing them with those strides (the FFI launch only: a
    buffer callback's buffers are row-major; nothing changes on the CPU)."""
    names = ("dq", "dk") if backward else ("q", "k")
    into = out_shape is not None
    views_in = views is not None and not into  # q and k read out of one projection
    if views_in:
        qi, ki = _views_info(q.shape, q.dtype, views)
    else:
        qi, ki = _info(q), _info(k)
    pq, pk = _plan.resolve_rope_pair(qi, ki, _info(freqs), layout, interleaved, _info(cu), _info(sp), cp_size,
                                     cp_rank, False, backward, names)
    if not _on_gpu(q, freqs):
        _check_cpu_cu(pq, tuple(qi.shape[:-2]), cu)
        if views_in:
            q, k = (_view(q, v) for v in views)
        outs = tuple(_numpy_backend.rope(jnp, p, a, freqs, cu, sp) for p, a in ((pq, q), (pk, k)))
        return _assemble(out_shape, views, outs) if into else outs
    if into:
        shapes = (jax.ShapeDtypeStruct(tuple(out_shape), q.dtype),)
        outs = _views_info(out_shape, q.dtype, views)
    else:
        shapes = (jax.ShapeDtypeStruct(pq.shape, q.dtype), jax.ShapeDtypeStruct(pk.shape, q.dtype))
        outs = [_info(s) for s in shapes]
    in_order, out_order = (None if views_in else mem[0]), (None if into else mem[1])
    layouts = _layouts([in_order, in_order, None, None, None], [out_order] * len(shapes))
    if qi.size == 0 and ki.size == 0:
        zeros = tuple(jnp.zeros(s.shape, s.dtype) for s in shapes)
        return zeros[0] if into else zeros
    _precompile(_worksplit.rope_launch([pq, pk], [(qi, outs[0]), (ki, outs[1])], _info(freqs), _info(cu),
                                       _info(sp), 1))

    isz = np.dtype(q.dtype).itemsize
    if views_in:
        in_slots = [[("x", views[0][2] * isz), ("x2", views[1][2] * isz)], []]
    else:
        in_slots = [[("x", 0)], [("x2", 0)]]
    in_slots += _ROPE_IN[1:]
    out_slots = [[("y", views[0][2] * isz), ("y2", views[1][2] * isz)]] if into else [[("y", 0)], [("y2", 0)]]

    fs, cs, ss = _shapes(freqs, cu, sp)

    def build(addr, device, ordered=False):
        def at(i, n, order):
            i = _ordered(i, order) if ordered else i
            return _plan.ArrayInfo(i.shape, i.strides, i.dtype, ("cuda", device), addr[n])

        xs = [at(i, n, in_order) for i, n in ((qi, "x"), (ki, "x2"))]
        ys = [at(o, n, out_order) for o, n in zip(outs, ("y", "y2"))]
        return _worksplit.rope_launch([pq, pk], list(zip(xs, ys)), _at(fs, addr["freqs"], device),
                                      _at(cs, addr["cu_seqlens"], device),
                                      _at(ss, addr["start_positions"], device), _launch.sm_count(device))

    res = _xla.gpu_call(shapes, (q, k, freqs, cu, sp), in_slots, out_slots, build, layouts)
    return res[0] if into else res


def _view(a, view):
    """The strided view (shape, element strides, offset) of a compact jnp array, as a jnp array."""
    shape, strides, off = view
    flat = a.reshape(-1)
    idx = off + sum(np.arange(n).reshape((-1,) + (1,) * (len(shape) - i - 1)) * s
                    for i, (n, s) in enumerate(zip(shape, strides)))
    return flat[idx]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _qk(q, k, freqs, cu_sp, layout, interleaved, cp_size, cp_rank, backward, mem=(None, None)):
    return _qk_impl(q, k, freqs, *cu_sp, layout, interleaved, cp_size, cp_rank, backward, mem=mem)


def _qk_fwd(q, k, freqs, cu_sp, *static):
    return _qk(q, k, freqs, cu_sp, *static), (freqs, cu_sp)


def _qk_bwd(layout, interleaved, cp_size, cp_rank, backward, mem, res, g):
    freqs, cu_sp = res  # the cotangents come in the outputs' memory order, go out in the inputs'
    gq, gk = _qk(g[0], g[1], freqs, cu_sp, layout, interleaved, cp_size, cp_rank, not backward, mem[::-1])
    return gq, gk, _zero_cot(freqs), tuple(_zero_cot(a) for a in cu_sp)


_qk.defvjp(_qk_fwd, _qk_bwd)


def apply_rope_qk(q, k, freqs, layout="sbhd", *, interleaved=False, cu_seqlens=None, start_positions=None,
                  cp_size=1, cp_rank=0, heads_major=False):
    """:func:`cupy_rope.apply_rope_qk` for JAX arrays: ``(q', k')`` from one launch; jittable and
    differentiable in ``q`` and ``k``. Under ``jit`` prefer :func:`apply_rope_qk_fused` when q and
    k are slices of one projection (a slice passed to a kernel is materialised by XLA first).
    ``heads_major``: as in :func:`apply_rope_qk_fused`.

    Example:
        >>> import jax.numpy as jnp, cupy_rope, cupy_rope.jax as crj
        >>> f = jnp.asarray(cupy_rope.rope_freqs(64, 16))
        >>> q, k = crj.apply_rope_qk(jnp.ones((16, 1, 4, 64)), jnp.ones((16, 1, 2, 64)), f)
        >>> q.shape, k.shape
        ((16, 1, 4, 64), (16, 1, 2, 64))
    """
    _arrays(q=q, k=k, freqs=freqs, cu_seqlens=cu_seqlens, start_positions=start_positions)
    hm = _plan.check_bool("heads_major", heads_major)
    return _per_rank(layout, interleaved, cp_size, cp_rank,
                     lambda *o: _qk(q, k, freqs, (cu_seqlens, start_positions), *o, False,
                                    (None, heads_major_order(o[0]) if hm else None)))


def apply_rope_qk_backward(dq, dk, freqs, layout="sbhd", *, interleaved=False, cu_seqlens=None,
                           start_positions=None, cp_size=1, cp_rank=0):
    """:func:`cupy_rope.apply_rope_qk_backward` for JAX arrays (differentiable: its VJP is the forward).

    Example:
        >>> import jax.numpy as jnp, cupy_rope, cupy_rope.jax as crj
        >>> f = jnp.asarray(cupy_rope.rope_freqs(64, 16))
        >>> gq, gk = crj.apply_rope_qk_backward(jnp.ones((16, 1, 4, 64)), jnp.ones((16, 1, 2, 64)), f)
        >>> gq.shape
        (16, 1, 4, 64)
    """
    _arrays(dq=dq, dk=dk, freqs=freqs, cu_seqlens=cu_seqlens, start_positions=start_positions)
    return _per_rank(layout, interleaved, cp_size, cp_rank,
                     lambda *o: _qk(dq, dk, freqs, (cu_seqlens, start_positions), *o, True))


# ----------------------------------------------------------------------------- positions API
def _pos_impl(positions, q, k, table, tname, head_size, interleaved, rot_off, inverse):
    """The positions API: (q', k') or (q',) from one launch."""
    tables = {n: (_info(table) if n == tname else None) for n in _plan.TABLE_ARGS}
    plans, views, _ = _plan.resolve_rope_pos(_info(positions), _info(q), _info(k), tables, head_size,
                                             interleaved, rot_off, inverse, False, ("q", "k"))
    xs = [a for a in (q, k) if a is not None]
    if not _on_gpu(q, table):
        return tuple(_numpy_backend.rope(jnp, p, a.reshape(v.shape), table, ids=positions).reshape(a.shape)
                     for a, p, v in zip(xs, plans, views))
    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in xs)
    if not any(v.size for v in views):
        return tuple(jnp.zeros(s.shape, s.dtype) for s in shapes)
    ntok = positions.ndim
    outs = [_plan.head_view(_info(s), p.d, n, ntok) for s, p, n in zip(shapes, plans, ("q", "k"))]
    ps, ts = _shapes(positions, table)
    _precompile(_worksplit.rope_launch(plans, list(zip(views, outs)), _info(table), None, None, 1,
                                       ids=_info(positions)))

    def at(i, ptr, device):
        return _plan.ArrayInfo(i.shape, i.strides, i.dtype, ("cuda", device), ptr)

    def build(addr, device):
        pairs = [(at(v, addr[x], device), at(o, addr[y], device))
                 for v, o, x, y in zip(views, outs, ("x", "x2"), ("y", "y2"))]
        return _worksplit.rope_launch(plans, pairs, _at(ts, addr["freqs"], device), None, None,
                                      _launch.sm_count(device), ids=_at(ps, addr["positions"], device))

    in_slots = [[("positions", 0)], [("x", 0)], [("x2", 0)], [("freqs", 0)]]
    out_slots = [[("y", 0)], [("y2", 0)]][:len(shapes)]
    return tuple(_xla.gpu_call(shapes, (positions, q, k, table), in_slots, out_slots, build))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _pos(positions, q, k, table, tname, head_size, interleaved, rot_off, inverse):
    return _pos_impl(positions, q, k, table, tname, head_size, interleaved, rot_off, inverse)


def _pos_fwd(positions, q, k, table, *static):
    return _pos(positions, q, k, table, *static), (positions, table, k is not None)


def _pos_bwd(tname, head_size, interleaved, rot_off, inverse, res, g):
    positions, table, has_k = res
    outs = _pos(positions, g[0], g[1] if has_k else None, table, tname, head_size, interleaved, rot_off,
                not inverse)
    return _zero_cot(positions), outs[0], outs[1] if has_k else None, _zero_cot(table)


_pos.defvjp(_pos_fwd, _pos_bwd)


def apply_rope_pos(positions, q, k=None, *, cos_sin_cache=None, freqs=None, inv_freq=None, head_size=None,
                   interleaved=False, rope_dim_offset=0, inverse=False):
    """:func:`cupy_rope.apply_rope_pos` for JAX arrays: ``(q', k')`` (``k'`` None without ``k``)
    from one launch; jittable, differentiable in ``q`` and ``k`` (the tables and positions get
    no gradient). On the CPU without ``jax_enable_x64``, ``inv_freq`` angles are float32.

    Example:
        >>> import jax.numpy as jnp, cupy_rope, cupy_rope.jax as crj
        >>> cache = jnp.asarray(cupy_rope.rope_cos_sin_cache(64, 128))
        >>> q, k = crj.apply_rope_pos(jnp.arange(4), jnp.ones((4, 8, 64)), jnp.ones((4, 2, 64)),
        ...                           cos_sin_cache=cache)
        >>> q.shape, k.shape
        ((4, 8, 64), (4, 2, 64))
    """
    tables = {"cos_sin_cache": cos_sin_cache, "freqs": freqs, "inv_freq": inv_freq}
    tname, table = _plan.pick_table(tables)
    _arrays(("k",), positions=positions, q=q, k=k, **{tname: table})
    hs = None if head_size is None else _plan.check_int("head_size", head_size, lo=1)
    outs = _pos(positions, q, k, table, tname, hs, _plan.check_bool("interleaved", interleaved),
                _plan.check_int("rope_dim_offset", rope_dim_offset, lo=0), _plan.check_bool("inverse", inverse))
    return outs[0], (outs[1] if k is not None else None)


def fused_views(shape, layout: str, num_q_heads=None, num_kv_heads=None):
    """q and k views [(shape, element strides, offset)] of a compact fused projection of ``shape``:
    ``lead + (3, h, d)`` (stacked q, k, v) or ``lead + ((hq + 2*hk) * d,)`` (concatenated, with
    ``num_q_heads`` and ``num_kv_heads``); ``lead`` = (s, b), (b, s) or (t,) per ``layout``."""
    layout = _plan.check_layout(layout)
    nlead = 1 if layout == "thd" else 2
    shape = tuple(shape)
    st = _plan.output_strides(shape)
    if len(shape) == nlead + 3:
        if shape[nlead] != 3:
            raise _plan._err("qkv", f"dimension {nlead} of size 3 (q, k, v) for a stacked projection",
                             f"shape {shape}")
        for name, v in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads)):
            if v is not None:
                raise _plan._err(name, "None for a stacked [.., 3, h, d] projection", repr(v))
        lead, lst = shape[:nlead], st[:nlead]
        q = (lead + shape[-2:], lst + st[-2:], 0)
        return [q, (q[0], q[1], st[nlead])]
    if len(shape) != nlead + 1:
        raise _plan._err("qkv", f"a {nlead + 3}-D [.., 3, h, d] or {nlead + 1}-D [.., (hq + 2*hk) * d] "
                         f"projection for layout {layout!r}", f"shape {shape}")
    hq = _plan.check_int("num_q_heads", num_q_heads, lo=1) if num_q_heads is not None else None
    hk = _plan.check_int("num_kv_heads", num_kv_heads, lo=1) if num_kv_heads is not None else None
    if hq is None or hk is None:
        raise _plan._err("num_q_heads", "num_q_heads and num_kv_heads for a [.., (hq + 2*hk) * d] projection",
                         f"num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads}")
    w = shape[-1]
    if w % (hq + 2 * hk):
        raise _plan._err("qkv", f"a last dimension divisible by hq + 2*hk = {hq + 2 * hk}", f"{w}")
    d = w // (hq + 2 * hk)
    lead, lst = shape[:nlead], st[:nlead]
    return [(lead + (hq, d), lst + (d, 1), 0), (lead + (hk, d), lst + (d, 1), hq * d)]


def _regions(shape, views):
    """(axis, [(start, size)] of q, k and v along it): the parts of a fused projection of
    ``shape`` whose q and k views are ``views``; they tile the axis after the token dimensions."""
    axis = len(views[0][0]) - 2
    if len(shape) == axis + 3:  # stacked lead + (3, h, d)
        return axis, [(0, 1), (1, 1), (2, 1)]
    q, k = (int(np.prod(v[0][-2:])) for v in views)  # concatenated lead + ((hq + 2*hk) * d,)
    return axis, [(0, q), (q, k), (q + k, shape[-1] - q - k)]


def _region(a, part, shape, views):
    """``a`` (q-, k- or v-shaped) as region ``part`` (0, 1, 2) of a projection of ``shape``."""
    axis, regions = _regions(shape, views)
    return a.reshape(tuple(shape[:axis]) + (regions[part][1],) + tuple(shape[axis + 1:]))


def _v_part(qkv, views):
    """The v part of a fused projection, shaped like its k view (an XLA slice, no launch)."""
    axis, regions = _regions(qkv.shape, views)
    start, size = regions[2]
    return jax.lax.slice_in_dim(qkv, start, start + size, axis=axis).reshape(views[1][0])


def _assemble(shape, views, qk):
    """A projection of ``shape`` from its q and k parts (``qk``), its v part zeros."""
    v = jnp.zeros(views[1][0], qk[0].dtype)
    return jnp.concatenate([_region(a, i, shape, views) for i, a in enumerate((*qk, v))],
                           axis=_regions(shape, views)[0])


def _set_v(d, v, views):
    """``d`` with its v region replaced by ``v`` (None: zeros); XLA updates it in place."""
    axis, regions = _regions(d.shape, views)
    v = jnp.zeros(views[1][0], d.dtype) if v is None else v
    return jax.lax.dynamic_update_slice_in_dim(d, _region(v, 2, d.shape, views), regions[2][0], axis=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8, 9, 10))
def _fused(qkv, freqs, cu_sp, views, with_v, layout, interleaved, cp_size, cp_rank, backward, order):
    q, k = _qk_impl(qkv, None, freqs, *cu_sp, layout, interleaved, cp_size, cp_rank, backward, views,
                    mem=(None, order))
    return (q, k, _v_part(qkv, views)) if with_v else (q, k)


def _fused_fwd(qkv, freqs, cu_sp, views, *static):
    return _fused(qkv, freqs, cu_sp, views, *static), (qkv.shape, freqs, cu_sp)


def _fused_bwd(views, with_v, layout, interleaved, cp_size, cp_rank, backward, order, res, g):
    """The gradient of the projection in one launch writing the q and k parts of one buffer, its v
    part then set in place (v's gradient, or zeros): the bytes of the formula's gradient. Under
    ``jax_debug_nans``/``jax_debug_infs`` the buffer is assembled from separate q and k outputs
    instead (the launch leaves the v part unspecified until it is set)."""
    shape, freqs, cu_sp = res
    opts = (layout, interleaved, cp_size, cp_rank, not backward)
    if jax.config.jax_debug_nans or jax.config.jax_debug_infs:
        d = _assemble(shape, views, _qk(g[0], g[1], freqs, cu_sp, *opts, (order, None)))
    else:
        d = _fused_t(g[0], g[1], freqs, cu_sp, views, shape, *opts, order)
    return _set_v(d, g[2] if with_v else None, views), _zero_cot(freqs), tuple(_zero_cot(a) for a in cu_sp)


_fused.defvjp(_fused_fwd, _fused_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9, 10, 11))
def _fused_t(gq, gk, freqs, cu_sp, views, shape, layout, interleaved, cp_size, cp_rank, backward, order):
    """The fused entry's transpose: gq, gk (in memory order ``order``) -> one projection-shaped
    buffer holding them rotated at ``views`` (its v part: zeros on the CPU, unspecified on the
    GPU; :func:`_fused_bwd` sets it)."""
    return _qk_impl(gq, gk, freqs, *cu_sp, layout, interleaved, cp_size, cp_rank, backward, views, shape,
                    mem=(order, None))


def _fused_t_fwd(gq, gk, freqs, cu_sp, *static):
    return _fused_t(gq, gk, freqs, cu_sp, *static), (freqs, cu_sp)


def _fused_t_bwd(views, shape, layout, interleaved, cp_size, cp_rank, backward, order, res, c):
    freqs, cu_sp = res
    a, b = _fused(c, freqs, cu_sp, views, False, layout, interleaved, cp_size, cp_rank, not backward, order)
    return a, b, _zero_cot(freqs), tuple(_zero_cot(x) for x in cu_sp)


_fused_t.defvjp(_fused_t_fwd, _fused_t_bwd)


def _hashable_views(views):
    return tuple((tuple(sh), tuple(st), int(off)) for sh, st, off in views)


def apply_rope_qk_fused(qkv, freqs, layout="sbhd", *, num_q_heads=None, num_kv_heads=None,
                        interleaved=False, cu_seqlens=None, start_positions=None, cp_size=1, cp_rank=0,
                        return_v=False, heads_major=False):
    """Rotate q and k read straight out of an unsliced fused projection, in one launch.

    Under ``jit`` a custom call's operands are dense, so ``qkv[:, :, 0]`` would be copied before
    the kernel runs; this entry reads q and k where they are in ``qkv``. The gradient with
    respect to ``qkv`` is written by one launch into one buffer (its v part then set in place).

    Args:
        qkv: ``lead + (3, h, d)`` (q, k, v stacked) or ``lead + ((hq + 2*hk) * d,)`` (q heads, then
            k heads, then v heads, concatenated; give ``num_q_heads`` = hq and ``num_kv_heads`` =
            hk); ``lead`` = ``(s, b)`` (sbhd), ``(b, s)`` (bshd) or ``(t,)`` (thd).
        return_v: also return v (``lead + (hk, d)``, sliced from ``qkv``, not rotated). Take v from
            here in a model that is differentiated: v's gradient then goes into the gradient's
            buffer directly, where a v sliced from ``qkv`` separately gets its own gradient
            buffer, which XLA adds to this entry's (reading and writing the whole projection once
            more).
        heads_major: store q' and k' heads-major, in memory order ``[b, h, s, d]`` (thd:
            ``[h, t, d]``); their shapes, values and everything JAX shows of them stay the same.
            It is the order XLA's own attention computes in (``jax.nn.dot_product_attention``'s
            ``xla`` implementation, the default, and einsum attention), which then reads them
            without first transposing them: one pass over q and k fewer, forward and backward
            (the gradient is read in that order too). Leave it off where q and k go to an op
            that wants them row-major (cuDNN attention, another custom call): XLA would then
            transpose them back. Only the GPU's FFI launch declares it (XLA's layout of the
            call's results); elsewhere the outputs are row-major as without it.
        Other arguments as :func:`apply_rope`.

    Returns:
        ``(q, k)``: ``lead + (hq, d)`` and ``lead + (hk, d)``, rotated (with ``return_v``:
        ``(q, k, v)``). Differentiable in ``qkv`` (without ``return_v`` the v part of the gradient
        is zero).

    Example:
        >>> import jax.numpy as jnp, cupy_rope, cupy_rope.jax as crj
        >>> f = jnp.asarray(cupy_rope.rope_freqs(64, 16))
        >>> q, k, v = crj.apply_rope_qk_fused(jnp.ones((2, 16, 3, 4, 64)), f, "bshd", return_v=True)
        >>> q.shape, v.shape
        ((2, 16, 4, 64), (2, 16, 4, 64))
    """
    _arrays(qkv=qkv, freqs=freqs, cu_seqlens=cu_seqlens, start_positions=start_positions)
    views = _hashable_views(fused_views(qkv.shape, layout, num_q_heads, num_kv_heads))
    with_v = _plan.check_bool("return_v", return_v)
    hm = _plan.check_bool("heads_major", heads_major)
    return _per_rank(layout, interleaved, cp_size, cp_rank,
                     lambda *o: _fused(qkv, freqs, (cu_seqlens, start_positions), views, with_v, *o, False,
                                       heads_major_order(o[0]) if hm else None))


# ----------------------------------------------------------------------------- packed QKV
def _qkv_plan(arrays, qf, kf, split, layout, interleaved, cu, sp, cp_size, cp_rank, backward):
    common = (_info(qf), _info(kf), split, layout, None, interleaved, _info(cu), _info(sp), cp_size, cp_rank)
    if backward:
        return _plan.resolve_qkv_backward(*(_info(a) for a in arrays), *common)
    return _plan.resolve_qkv(_info(arrays[0]), *common)


def _qkv_impl(arrays, qf, kf, cu, sp, split, layout, interleaved, cp_size, cp_rank, backward):
    plan = _qkv_plan(arrays, qf, kf, split, layout, interleaved, cu, sp, cp_size, cp_rank, backward)
    dt = arrays[0].dtype
    if not _on_gpu(*arrays):
        _check_cpu_cu(plan, plan.lead_shape, cu)
        fn = _numpy_backend.qkv_backward if backward else _numpy_backend.qkv_forward
        return fn(jnp, plan, *arrays, qf, kf, cu, sp)
    if backward:
        shapes = jax.ShapeDtypeStruct(plan.packed_shape, dt)
    else:
        shapes = (jax.ShapeDtypeStruct(plan.q_shape, dt), jax.ShapeDtypeStruct(plan.kv_shape, dt),
                  jax.ShapeDtypeStruct(plan.kv_shape, dt))
    if arrays[0].size == 0:
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    n = len(arrays)
    infos = [_info(a) for a in arrays]
    outs = [_info(jax.ShapeDtypeStruct(s.shape, s.dtype)) for s in jax.tree.leaves(shapes)]
    views = (outs[0], *infos) if backward else (infos[0], *outs)
    _precompile(plan.launch(*views, _info(qf), _info(kf), _info(cu), _info(sp), 1))

    roles = ("q", "k", "v", "packed") if backward else ("packed", "q", "k", "v")
    shaped = _shapes(*arrays) + tuple(jax.tree.leaves(shapes))  # in role order
    qfs, kfs, cs, ss = _shapes(qf, kf, cu, sp)
    in_slots = [[(r, 0)] for r in roles[:n]] + [[("q_freqs", 0)], [("k_freqs", 0)], [("cu_seqlens", 0)],
                                                  [("start_positions", 0)]]

    def build(addr, device):
        by_role = {r: _at(a, addr[r], device) for r, a in zip(roles, shaped)}
        return plan.launch(by_role["packed"], by_role["q"], by_role["k"], by_role["v"],
                           _at(qfs, addr["q_freqs"], device), _at(kfs, addr["k_freqs"], device),
                           _at(cs, addr["cu_seqlens"], device), _at(ss, addr["start_positions"], device),
                           _launch.sm_count(device))

    return _xla.gpu_call(shapes, tuple(arrays) + (qf, kf, cu, sp), in_slots, [[(r, 0)] for r in roles[n:]], build)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _qkv_fwd_p(qkv, qf, kf, cu_sp, split, layout, interleaved, cp_size, cp_rank):
    return _qkv_impl((qkv,), qf, kf, *cu_sp, split, layout, interleaved, cp_size, cp_rank, False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _qkv_bwd_p(grads, qf, kf, cu_sp, split, layout, interleaved, cp_size, cp_rank):
    return _qkv_impl(tuple(grads), qf, kf, *cu_sp, split, layout, interleaved, cp_size, cp_rank, True)


def _qkv_fwd_fwd(qkv, qf, kf, cu_sp, *static):
    return _qkv_fwd_p(qkv, qf, kf, cu_sp, *static), (qf, kf, cu_sp)


def _qkv_fwd_bwd(*args):
    static, (res, g) = args[:5], args[5:]
    qf, kf, cu_sp = res
    d = _qkv_bwd_p(tuple(g), qf, kf, cu_sp, *static)
    return d, _zero_cot(qf), _zero_cot(kf), tuple(_zero_cot(a) for a in cu_sp)


def _qkv_bwd_fwd(grads, qf, kf, cu_sp, *static):
    return _qkv_bwd_p(grads, qf, kf, cu_sp, *static), (qf, kf, cu_sp)


def _qkv_bwd_bwd(*args):
    static, (res, g) = args[:5], args[5:]
    qf, kf, cu_sp = res
    q, k, v = _qkv_fwd_p(g, qf, kf, cu_sp, *static)
    return (q, k, v), _zero_cot(qf), _zero_cot(kf), tuple(_zero_cot(a) for a in cu_sp)


_qkv_fwd_p.defvjp(_qkv_fwd_fwd, _qkv_fwd_bwd)
_qkv_bwd_p.defvjp(_qkv_bwd_fwd, _qkv_bwd_bwd)


def apply_qkv_rope(qkv, q_freqs, k_freqs, split=None, layout="sbhd", *, num_q_heads=None, interleaved=False,
                   cu_seqlens=None, start_positions=None, cp_size=1, cp_rank=0):
    """:func:`cupy_rope.apply_qkv_rope` for JAX arrays: ``(q, k, v)``, differentiable in ``qkv``.

    Example:
        >>> import jax.numpy as jnp, cupy_rope, cupy_rope.jax as crj
        >>> f = jnp.asarray(cupy_rope.rope_freqs(64, 8))
        >>> q, k, v = crj.apply_qkv_rope(jnp.ones((8, 1, 2, 384)), f, f, split=(256, 64, 64))
        >>> q.shape
        (8, 1, 8, 64)
    """
    _arrays(qkv=qkv, q_freqs=q_freqs, k_freqs=k_freqs, cu_seqlens=cu_seqlens, start_positions=start_positions)
    sp = _plan.qkv_split(qkv.shape, split, num_q_heads, layout)
    return _per_rank(layout, interleaved, cp_size, cp_rank,
                     lambda *o: _qkv_fwd_p(qkv, q_freqs, k_freqs, (cu_seqlens, start_positions), sp, *o))


def apply_qkv_rope_backward(dq, dk, dv, q_freqs, k_freqs, split=None, layout="sbhd", *, num_q_heads=None,
                            interleaved=False, cu_seqlens=None, start_positions=None, cp_size=1, cp_rank=0):
    """:func:`cupy_rope.apply_qkv_rope_backward` for JAX arrays: ``dq [.., g*n, d]``,
    ``dk``/``dv [.., g, d]`` -> packed ``dqkv [.., g, (n+2)*d]``.

    Example:
        >>> import jax.numpy as jnp, cupy_rope, cupy_rope.jax as crj
        >>> f = jnp.asarray(cupy_rope.rope_freqs(64, 8))
        >>> crj.apply_qkv_rope_backward(jnp.ones((8, 1, 8, 64)), jnp.ones((8, 1, 2, 64)),
        ...                             jnp.ones((8, 1, 2, 64)), f, f).shape
        (8, 1, 2, 384)
    """
    _arrays(dq=dq, dk=dk, dv=dv, q_freqs=q_freqs, k_freqs=k_freqs, cu_seqlens=cu_seqlens,
            start_positions=start_positions)
    n, d = _plan.qkv_backward_heads(_info(dq), _info(dk), _info(dv), split, _plan.check_layout(layout), num_q_heads)
    sp = (n * d, d, d)
    return _per_rank(layout, interleaved, cp_size, cp_rank,
                     lambda *o: _qkv_bwd_p((dq, dk, dv), q_freqs, k_freqs, (cu_seqlens, start_positions), sp, *o))
