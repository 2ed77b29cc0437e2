"""JAX shim: RoPE for JAX arrays, eager and under ``jax.jit``, differentiable (``jax.grad``,
``jax.vjp``) through a custom VJP whose backward is the library's backward kernel.

On a GPU the CUDA kernel runs inside ``jax.experimental.buffer_callback`` on XLA's stream,
writing into the buffer XLA allocated (no copies). On the CPU the same functions run the
NumPy backend's formulas in ``jax.numpy`` (jittable, same semantics). ``jax.vmap`` maps the
kernel sequentially; inside ``shard_map`` each shard passes its own ``cp_rank``.

Static arguments (``layout``, ``interleaved``, ``cp_size``, ``cp_rank``, ``split``) are Python
values; ``cu_seqlens`` and ``start_positions`` are arrays. The angle tables, ``cu_seqlens``
and ``start_positions`` get no gradient.

Example::

    import jax, jax.numpy as jnp, cupy_rope, cupy_rope.jax as crj
    freqs = jnp.asarray(cupy_rope.rope_freqs(128, 2048))
    x = jax.random.normal(jax.random.key(0), (2048, 2, 8, 128), jnp.bfloat16)
    y = jax.jit(lambda x: crj.apply_rope(x, freqs, "sbhd"))(x)
    g = jax.grad(lambda x: crj.apply_rope(x, freqs).astype(jnp.float32).sum())(x)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _numpy_backend, _plan

# ----------------------------------------------------------------------------- helpers


def _info(a, ptr=0, device=("cpu", 0)):
    """ArrayInfo of a JAX array, tracer or buffer (JAX arrays are always compact)."""
    if a is None:
        return None
    shape = tuple(a.shape)
    return _plan.ArrayInfo(shape, _plan.output_strides(shape), np.dtype(a.dtype).name, device, ptr)


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


def _buffer_info(buf):
    ptr = buf.__cuda_array_interface__["data"][0]
    dev = ("cuda", int(buf.__dlpack_device__()[1]))
    return _info(buf, ptr, dev)


def _gpu_call(result_shapes, arrays: tuple, launch_fn):
    """Run ``launch_fn(stream, device, out_infos, in_infos)`` in a buffer_callback."""
    from jax.experimental.buffer_callback import buffer_callback

    present = tuple(a is not None for a in arrays)
    args = tuple(a for a in arrays if a is not None)

    def callback(ctx, out, *bufs):
        it = iter(bufs)
        ins = [_buffer_info(next(it)) if p else None for p in present]
        outs = out if isinstance(out, (tuple, list)) else (out,)
        out_infos = [_buffer_info(o) for o in outs]
        device = out_infos[0].device[1]
        launch_fn(int(ctx.stream), device, out_infos, ins)

    fn = buffer_callback(callback, result_shapes, vmap_method="sequential")
    return fn(*args)


# ----------------------------------------------------------------------------- single tensor
def _rope_impl(x, freqs, cu, sp, layout, interleaved, cp_size, cp_rank, backward):
    plan = _plan.resolve_rope(_info(x), _info(freqs), layout, interleaved, _info(cu), _info(sp), cp_size,
                              cp_rank, None, backward, x_name="grad" if backward else "x")
    if not _on_gpu(x, freqs):
        _check_cpu_cu(plan, tuple(x.shape[:-2]), cu)
        return _numpy_backend.rope(jnp, plan, x, freqs, cu, sp)
    if x.size == 0:
        return jnp.zeros(x.shape, x.dtype)

    def launch(stream, device, outs, ins):
        from . import _launch

        xi, fi, ci, si = ins
        name, grid, block, params = plan.launch(xi, outs[0], fi, ci, si, _launch.sm_count(device))
        _launch.launch(name, grid, block, params, stream, device)

    return _gpu_call(jax.ShapeDtypeStruct(x.shape, x.dtype), (x, freqs, cu, sp), launch)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _rope(x, freqs, cu, sp, layout, interleaved, cp_size, cp_rank, backward):
    return _rope_impl(x, freqs, cu, sp, layout, interleaved, cp_size, cp_rank, backward)


def _rope_fwd(x, freqs, cu, sp, layout, interleaved, cp_size, cp_rank, backward):
    return _rope(x, freqs, cu, sp, layout, interleaved, cp_size, cp_rank, backward), (freqs, cu, sp)


def _zero_cot(a):
    if a is None:
        return None
    if jnp.issubdtype(a.dtype, jnp.integer):
        return np.zeros(a.shape, jax.dtypes.float0)
    return jnp.zeros_like(a)


def _rope_bwd(layout, interleaved, cp_size, cp_rank, backward, res, g):
    freqs, cu, sp = res
    gx = _rope(g, freqs, cu, sp, layout, interleaved, cp_size, cp_rank, not backward)
    return gx, _zero_cot(freqs), _zero_cot(cu), _zero_cot(sp)


_rope.defvjp(_rope_fwd, _rope_bwd)


def _per_rank(cp_size, cp_rank, fn):
    """``fn(rank)`` for a static rank, or a ``lax.switch`` over all ranks for a traced one
    (e.g. ``jax.lax.axis_index("cp")`` inside ``shard_map``)."""
    if isinstance(cp_rank, (int, np.integer)):
        return fn(int(cp_rank))
    branches = [functools.partial(lambda r, _: fn(r), r) for r in range(int(cp_size))]
    return jax.lax.switch(jnp.asarray(cp_rank, jnp.int32), branches, None)


def apply_rope(x, freqs, layout="sbhd", *, interleaved=False, cu_seqlens=None, start_positions=None,
               cp_size=1, cp_rank=0):
    """:func:`cupy_rope.apply_rope` for JAX arrays; jittable and differentiable in ``x``.

    ``cp_rank`` may be a traced integer (``jax.lax.axis_index`` inside ``shard_map``): the call
    then switches between the ``cp_size`` static-rank versions.

    Example:
        >>> import jax.numpy as jnp, cupy_rope, cupy_rope.jax as crj
        >>> f = jnp.asarray(cupy_rope.rope_freqs(64, 16))
        >>> crj.apply_rope(jnp.ones((16, 1, 2, 64)), f).shape
        (16, 1, 2, 64)
    """
    return _per_rank(cp_size, cp_rank, lambda r: _rope(x, freqs, cu_seqlens, start_positions, layout,
                                                       bool(interleaved), int(cp_size), r, False))


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
    return _per_rank(cp_size, cp_rank, lambda r: _rope(grad, freqs, cu_seqlens, start_positions, layout,
                                                       bool(interleaved), int(cp_size), r, True))


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

    def launch(stream, device, outs, ins):
        from . import _launch

        n = len(arrays)
        a_in, (qfi, kfi, ci, si) = ins[:n], ins[n:]
        packed, q, k, v = (outs[0], *a_in) if backward else (a_in[0], *outs)
        name, grid, block, params = plan.launch(packed, q, k, v, qfi, kfi, ci, si, _launch.sm_count(device))
        _launch.launch(name, grid, block, params, stream, device)

    return _gpu_call(shapes, tuple(arrays) + (qf, kf, cu, sp), launch)


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


def _static_split(groups, width, split, num_q_heads, arg):
    n, d = _plan.qkv_heads(split, num_q_heads, groups, width, arg)
    return (n * d, d, d)


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
    sp = _static_split(qkv.shape[-2], qkv.shape[-1], split, num_q_heads, "qkv")
    return _per_rank(cp_size, cp_rank, lambda r: _qkv_fwd_p(qkv, q_freqs, k_freqs, (cu_seqlens, start_positions),
                                                            sp, layout, bool(interleaved), int(cp_size), r))


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
    g, d = dk.shape[-2], dk.shape[-1]
    n = dq.shape[-2] // max(g, 1)
    sp = _static_split(g, (n + 2) * d, split, num_q_heads, "dqkv") if (split is not None or num_q_heads is not None) \
        else (n * d, d, d)
    return _per_rank(cp_size, cp_rank, lambda r: _qkv_bwd_p((dq, dk, dv), q_freqs, k_freqs,
                                                            (cu_seqlens, start_positions), sp, layout,
                                                            bool(interleaved), int(cp_size), r))
