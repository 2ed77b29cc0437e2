"""The public API: dispatch by array type to the CUDA kernels or the NumPy backend."""

from __future__ import annotations

import os

import numpy as np

from . import _interop, _launch, _numpy_backend, _plan
from ._positions import check_cu_seqlens, check_index_contents, check_position_ids
from ._worksplit import rope_launch

_DEBUG = [os.environ.get("CUPY_ROPE_DEBUG", "") not in ("", "0")]


def set_debug(enabled: bool) -> None:
    """Check index contents (``cu_seqlens``, ``start_positions``) against the table on every call.

    Off by default (the check copies the index tensors to the host and so synchronises).
    Also enabled by the environment variable ``CUPY_ROPE_DEBUG=1``. With it on, a position
    outside the table, a decreasing ``cu_seqlens`` or an odd context-parallel length raises
    ``ValueError``; without it such tokens are copied through unrotated (spec 5.4). For the
    positions API it reports positions outside the table.

    Example:
        >>> import cupy_rope
        >>> cupy_rope.set_debug(True); cupy_rope.debug_enabled()
        True
        >>> cupy_rope.set_debug(False)
    """
    _DEBUG[0] = bool(enabled)
    for listener in _launch.DEBUG_LISTENERS:
        listener(_DEBUG[0])


def debug_enabled() -> bool:
    """Whether the debug check of :func:`set_debug` is on.

    Example:
        >>> import cupy_rope
        >>> cupy_rope.debug_enabled()
        False
    """
    return _DEBUG[0]


def _host_index(a, kind):
    """Index tensor on the host, for the debug check only."""
    if a is None:
        return None
    if kind == "torch":
        return a.detach().cpu().numpy()
    if kind == "cupy":
        return a.get()
    return np.asarray(a)


# Arguments that may be None; every other array argument is required.
_OPTIONAL = ("cu_seqlens", "start_positions", "out")


class _Args:
    """The call's arrays, each with its framework kind and descriptor; errors name the argument."""

    def __init__(self, optional=_OPTIONAL, **arrays):
        self.native, self.kinds, self.infos = {}, {}, {}
        for name, a in arrays.items():
            if a is None and name in optional:
                self.native[name], self.kinds[name], self.infos[name] = None, None, None
                continue
            self.native[name], self.kinds[name], self.infos[name] = _interop.describe(name, a)
        if self.native.get("out") is not None:
            _interop.check_writable("out", self.native["out"], self.kinds["out"])

    def numpy(self, name):
        return _interop.to_numpy(self.native[name], self.kinds[name])

    def host(self, name):
        return _host_index(self.native[name], self.kinds[name])


def _jax_route(x, out=None, transpose_output_memory=False):
    """JAX arrays on a GPU go through cupy_rope.jax (XLA allocates; works eagerly and under jit).
    JAX arrays are immutable: no ``out``, no ``transpose_output_memory``."""
    if type(x).__module__.split(".")[0] not in ("jax", "jaxlib") or _interop.kind_of(x) != "jax":
        return False
    if out is not None or transpose_output_memory is not False:
        raise ValueError("cupy_rope: `out`/`transpose_output_memory`: expected None/False for JAX "
                         "arrays (JAX arrays are immutable), got " + ("an array" if out is not None
                                                                     else repr(transpose_output_memory)))
    return next(iter(x.devices())).platform == "gpu"


def _jax_inplace_route(q, inplace) -> bool:
    """:func:`_jax_route` for the calls that take ``inplace``: never True for JAX arrays, on any
    device."""
    is_jax = type(q).__module__.split(".")[0] in ("jax", "jaxlib") and _interop.kind_of(q) == "jax"
    if is_jax and inplace is not False:
        raise ValueError("cupy_rope: `inplace`: expected False for JAX arrays (JAX arrays are "
                         f"immutable), got {inplace!r}")
    return is_jax and _jax_route(q, None, False)


def _device(args: _Args, ref: str) -> str:
    """Where the call runs: 'cpu' (NumPy backend), 'cuda' (the kernels) or 'meta' (torch meta
    tensors: outputs of the right shapes, nothing computed). The one device check of every entry
    point; the others' devices must match ``ref``'s (checked by the planner)."""
    kind = args.infos[ref].device[0]
    if kind in ("cpu", "cuda") or (kind == "meta" and args.kinds[ref] == "torch"):
        return kind
    raise ValueError(f"cupy_rope: `{ref}`: expected an array on the CPU or a CUDA device, got an array "
                     f"on device {kind!r}")


def _check_contents(args: _Args, pos, lead_shape, tables: dict, dev: str):
    """Index-tensor contents: always on the CPU (the values are on the host already), on the GPU
    only in debug mode (it synchronises)."""
    if _DEBUG[0] and dev != "meta":
        check_index_contents(pos, lead_shape, tables, args.host("cu_seqlens"), args.host("start_positions"))
    elif dev == "cpu" and pos.layout == "thd":
        check_cu_seqlens(pos, lead_shape[0], args.host("cu_seqlens"))


def _jax_ops():
    from . import _jax_ops

    return _jax_ops


# Address names of each launch, in the order the launch cache passes addresses: the key's arrays,
# then the outputs.
_ROPE_NAMES = ("x", "freqs", "cu_seqlens", "start_positions", "y")
_QK_NAMES = ("x", "x2", "freqs", "cu_seqlens", "start_positions", "y", "y2")
_POS_NAMES = ("x", "x2", "freqs", "positions", "y", "y2")
_QKV_FWD_NAMES = ("packed", "q_freqs", "k_freqs", "cu_seqlens", "start_positions", "q", "k", "v")
_QKV_BWD_NAMES = ("q", "k", "v", "q_freqs", "k_freqs", "cu_seqlens", "start_positions", "packed")


def _launch_gpu(spec, kind, dev, names):
    return _launch.launch(spec, _interop.current_stream(kind, dev), dev, names)


cache_info = _launch.cache_info


def _rope(x, freqs, layout, interleaved, cu_seqlens, start_positions, cp_size, cp_rank, out,
          transpose_output_memory, backward: bool, x_name: str):
    key = None
    kind = _launch.cache_kind(x)
    if kind is None and _jax_route(x, out, transpose_output_memory):
        fn = _jax_ops().apply_rope_backward if backward else _jax_ops().apply_rope
        return fn(x, freqs, layout, interleaved=interleaved, cu_seqlens=cu_seqlens,
                  start_positions=start_positions, cp_size=cp_size, cp_rank=cp_rank)
    if kind == "torch" and out is None and _launch.NATIVE is not None and not _DEBUG[0]:
        res = _launch.NATIVE("rope", x, x, freqs, layout, interleaved, cu_seqlens, start_positions, cp_size, cp_rank,
                             backward, transpose_output_memory)
        if res is not None:
            return res
    # cached launches skip validation: only for outputs that cannot overlap the input differently
    if kind is not None and not _DEBUG[0] and (out is None or out is x):
        key, res = _launch.lookup(kind, ("rope", backward, out is None),
                                  (layout, interleaved, cp_size, cp_rank, transpose_output_memory),
                                  (x, freqs, cu_seqlens, start_positions), written=0 if out is None else 1)
        if res is not None:
            return out if out is not None else res[0]
    args = _Args(**{x_name: x}, freqs=freqs, cu_seqlens=cu_seqlens, start_positions=start_positions,
                 out=out)
    xi = args.infos[x_name]
    plan = _plan.resolve_rope(xi, args.infos["freqs"], layout, interleaved, args.infos["cu_seqlens"],
                              args.infos["start_positions"], cp_size, cp_rank, args.infos["out"],
                              backward, transpose_output_memory, x_name=x_name)
    where = _device(args, x_name)
    _check_contents(args, plan.pos, tuple(xi.shape[:-2]), {"freqs": plan.table.rows}, where)
    kind, native = args.kinds[x_name], args.native[x_name]
    if where == "cpu":
        y = _numpy_backend.rope(np, plan, args.numpy(x_name), args.numpy("freqs"), args.numpy("cu_seqlens"),
                                args.numpy("start_positions"))
        if out is None and not plan.transpose_output:
            return _interop.from_numpy(np.ascontiguousarray(y), kind)
        if out is None:
            out = _interop.empty_like(kind, native, plan.shape, True)[0]
        _interop.write_into(out, args.kinds["out"] or kind, y)
        return out
    y = out if out is not None else _interop.empty_like(kind, native, plan.shape, plan.transpose_output)[0]
    if where == "meta":
        return y
    dev = xi.device[1]
    if xi.size:
        yi = _interop.info(y, args.kinds["out"] if out is not None else kind)
        spec = plan.launch(xi, yi, args.infos["freqs"], args.infos["cu_seqlens"],
                           args.infos["start_positions"], _launch.sm_count(dev))
        prepared = _launch_gpu(spec, kind, dev, _ROPE_NAMES)
        outputs = [] if out is not None else [(0, plan.shape, plan.transpose_output, yi.ptr & 15)]
        _launch.cache_put(key, prepared, outputs)
    return y


def _rope_qk(q, k, freqs, layout, interleaved, cu_seqlens, start_positions, cp_size, cp_rank,
             inplace, backward: bool, names=("q", "k")):
    """q and k (same tokens, positions and table) in one launch: q in the grid's first blocks, k
    in the rest."""
    key = None
    kind = _launch.cache_kind(q)
    if kind is None and _jax_inplace_route(q, inplace):
        fn = _jax_ops().apply_rope_qk_backward if backward else _jax_ops().apply_rope_qk
        return fn(q, k, freqs, layout, interleaved=interleaved, cu_seqlens=cu_seqlens,
                  start_positions=start_positions, cp_size=cp_size, cp_rank=cp_rank)
    # cached only with inplace a bool itself (the key's overlap signature depends on it)
    cached, res = kind is not None and not _DEBUG[0] and (inplace is True or inplace is False), None
    if cached and kind == "torch" and _launch.NATIVE is not None:
        res = _launch.NATIVE("rope_qk_" if inplace else "rope_qk", q, q, k, freqs, layout, interleaved, cu_seqlens,
                             start_positions, cp_size, cp_rank, backward)
    if cached and res is None:
        key, res = _launch.lookup(kind, ("qk", backward), (layout, interleaved, cp_size, cp_rank, inplace),
                                  (q, k, freqs, cu_seqlens, start_positions), written=2 if inplace else 0)
    if res is not None:
        return (q, k) if inplace else tuple(res)
    nq, nk = names
    args = _Args(**{nq: q, nk: k}, freqs=freqs, cu_seqlens=cu_seqlens, start_positions=start_positions)
    inf = args.infos
    inplace = _plan.check_bool("inplace", inplace)
    if inplace:
        for n in names:
            _interop.check_writable(n, args.native[n], args.kinds[n])
    pq, pk = _plan.resolve_rope_pair(inf[nq], inf[nk], inf["freqs"], layout, interleaved, inf["cu_seqlens"],
                                     inf["start_positions"], cp_size, cp_rank, inplace, backward, names)
    where = _device(args, nq)
    _check_contents(args, pq.pos, tuple(inf[nq].shape[:-2]), {"freqs": pq.table.rows}, where)
    kind = args.kinds[nq]
    if where == "cpu":
        res = []
        for n, plan in zip(names, (pq, pk)):
            y = _numpy_backend.rope(np, plan, args.numpy(n), args.numpy("freqs"), args.numpy("cu_seqlens"),
                                    args.numpy("start_positions"))
            if inplace:
                _interop.write_into(args.native[n], args.kinds[n], y)
                res.append(args.native[n])
            else:
                res.append(_interop.from_numpy(np.ascontiguousarray(y), args.kinds[n]))
        return tuple(res)
    natives = [args.native[n] for n in names]
    ys = natives if inplace else [_interop.empty_like(kind, a, p.shape)[0] for a, p in zip(natives, (pq, pk))]
    if where == "meta":
        return tuple(ys)
    dev = inf[nq].device[1]
    if inf[nq].size or inf[nk].size:
        yis = [_interop.info(y, kind) for y in ys]
        spec = rope_launch([pq, pk], [(inf[nq], yis[0]), (inf[nk], yis[1])], inf["freqs"], inf["cu_seqlens"],
                           inf["start_positions"], _launch.sm_count(dev))
        prepared = _launch_gpu(spec, kind, dev, _QK_NAMES)
        outputs = [] if inplace else [(i, p.shape, False, yi.ptr & 15) for i, p, yi in zip((0, 1), (pq, pk), yis)]
        _launch.cache_put(key, prepared, outputs)
    return tuple(ys)


def _rope_pos(positions, q, k, tables: dict, head_size, interleaved, rope_dim_offset, inverse, inplace):
    """The positions API: q (and k) at per-token positions, one launch."""
    key = None
    kind = _launch.cache_kind(q)
    if kind is None and _jax_inplace_route(q, inplace):
        return _jax_ops().apply_rope_pos(positions, q, k, **tables, head_size=head_size,
                                         interleaved=interleaved, rope_dim_offset=rope_dim_offset,
                                         inverse=inverse)
    cached = kind is not None and not _DEBUG[0] and (inplace is True or inplace is False)  # as in _rope_qk
    given = [n for n, t in tables.items() if t is not None] if cached else ()
    res = None
    # the torch ops' head_size 0 stands for None (a 0 given here is refused below)
    if (kind == "torch" and len(given) == 1 and _launch.NATIVE is not None
            and (head_size is None or (type(head_size) is int and head_size > 0))):
        res = _launch.NATIVE("rope_pos_" if inplace else "rope_pos", q, positions, q, k, tables[given[0]], given[0],
                             head_size or 0, interleaved, rope_dim_offset, inverse)
    if res is None and len(given) == 1:  # cached per table kind; the one table given is the launch's "freqs"
        key, res = _launch.lookup(kind, ("pos", k is None, given[0]),
                                  (head_size, interleaved, rope_dim_offset, inverse, inplace),
                                  (q, k, tables[given[0]], positions), written=2 if inplace else 0)
    if res is not None:
        return (q, k) if inplace else (res[0], res[1] if k is not None else None)
    args = _Args(optional=("k",) + _plan.TABLE_ARGS, positions=positions, q=q, k=k, **tables)
    inf = args.infos
    tab = {n: inf[n] for n in _plan.TABLE_ARGS}
    plans, views, tname = _plan.resolve_rope_pos(inf["positions"], inf["q"], inf["k"], tab, head_size,
                                                 interleaved, rope_dim_offset, inverse, inplace, ("q", "k"))
    names = ("q", "k")[:len(plans)]
    if inplace:
        for n in names:
            _interop.check_writable(n, args.native[n], args.kinds[n])
    where = _device(args, "q")
    if _DEBUG[0] and where != "meta":
        check_position_ids(args.host("positions"), tname, plans[0].table.rows)
    kind = args.kinds["q"]
    if where == "cpu":
        res = []
        for n, plan, v in zip(names, plans, views):
            x = args.numpy(n).reshape(v.shape)
            y = _numpy_backend.rope(np, plan, x, args.numpy(tname), ids=args.numpy("positions")).reshape(plan.shape)
            if inplace:
                _interop.write_into(args.native[n], args.kinds[n], y)
                res.append(args.native[n])
            else:
                res.append(_interop.from_numpy(np.ascontiguousarray(y), args.kinds[n]))
        return tuple(res) + (None,) * (2 - len(res))
    natives = [args.native[n] for n in names]
    ys = natives if inplace else [_interop.empty_like(kind, a, p.shape)[0] for a, p in zip(natives, plans)]
    result = tuple(ys) + (None,) * (2 - len(ys))
    if where == "meta" or not any(v.size for v in views):
        return result
    ntok = inf["positions"].ndim
    yvs = [_plan.head_view(_interop.info(y, kind), p.d, n, ntok) for y, p, n in zip(ys, plans, names)]
    dev = views[0].device[1]
    spec = rope_launch(plans, list(zip(views, yvs)), inf[tname], None, None, _launch.sm_count(dev),
                       ids=inf["positions"])
    prepared = _launch_gpu(spec, kind, dev, _POS_NAMES)
    outputs = [] if inplace else [(i, p.shape, False, yv.ptr & 15) for i, p, yv in zip((0, 1), plans, yvs)]
    _launch.cache_put(key, prepared, outputs)
    return result


def apply_rope_pos(positions, q, k=None, *, cos_sin_cache=None, freqs=None, inv_freq=None, head_size=None,
                   interleaved=False, rope_dim_offset=0, inverse=False, inplace=False):
    """RoPE at per-token positions (the serving-side interface: vLLM, FlashInfer, SGLang, HF).

    Queries and keys are rotated in one launch, each token by its own position.

    Args:
        positions: int32/int64 ``[t]`` (flattened tokens) or ``[b, s]``, any strides and values;
            a position outside the table (negative, or >= its rows) leaves its token unrotated
            (debug mode, :func:`set_debug`, raises instead).
        q: ``[tokens.., hq, d]`` or ``[tokens.., hq * d]`` (then give ``head_size``), where
            ``tokens..`` is the shape of ``positions``; float32, float16 or bfloat16; any strides.
        k: optional, the same token dimensions and dtype, its own head count (GQA/MQA) and
            strides; ``None`` rotates ``q`` alone.
        cos_sin_cache: ``[max_pos, rotary_dim]``, cos of pair i in column i, sin in column
            ``rotary_dim/2 + i`` (vLLM / FlashInfer layout); float32 or ``q``'s dtype.
        freqs: a float32 angle table ``[max_pos, rotary_dim]`` / ``[max_pos, 1, 1, rotary_dim]``
            (:func:`rope_freqs`), indexed by position.
        inv_freq: ``[rotary_dim / 2]`` float64/float32 inverse frequencies: any position, angle
            ``position * inv_freq[i]`` formed and evaluated in float64 (exact at long context).
            Exactly one of the three tables.
        head_size: the head dim ``d``, required when ``q``/``k`` have no head dimension.
        interleaved: GPT-J pairs ``(2i, 2i + 1)``; default rotate-half (NeoX) pairs
            ``(i, i + rotary_dim/2)``.
        rope_dim_offset: first channel of the rotary slice (MLA: the rotary part at the end);
            channels outside ``[offset, offset + rotary_dim)`` pass through.
        inverse: rotate by ``-angle`` (undo a rotation; the backward of this function).
        inplace: write into ``q`` and ``k`` (they must share no element). Not for JAX arrays.

    Returns:
        ``(q_out, k_out)`` (``k_out`` is None when ``k`` is): new contiguous arrays of the inputs'
        shapes, or ``q``, ``k`` themselves when ``inplace``. On the caller's current stream.

    Example:
        >>> import numpy as np, cupy_rope
        >>> cache = cupy_rope.rope_cos_sin_cache(64, 4096)             # [4096, 64] float32
        >>> pos = np.array([0, 5, 4095], np.int64)
        >>> q = np.random.rand(3, 8 * 64).astype(np.float32)          # [t, hq * d]
        >>> k = np.random.rand(3, 2, 64).astype(np.float32)           # [t, hk, d]
        >>> qo, ko = cupy_rope.apply_rope_pos(pos, q, k, cos_sin_cache=cache, head_size=64)
        >>> qo.shape, ko.shape
        ((3, 512), (3, 2, 64))
    """
    return _rope_pos(positions, q, k, {"cos_sin_cache": cos_sin_cache, "freqs": freqs, "inv_freq": inv_freq},
                     head_size, interleaved, rope_dim_offset, inverse, inplace)


def apply_rope(x, freqs, layout="sbhd", *, interleaved=False, cu_seqlens=None, start_positions=None,
               cp_size=1, cp_rank=0, out=None, transpose_output_memory=False):
    """Rotary position embedding, forward (TransformerEngine's ``fused_rope_forward``).

    Args:
        x: ``[s, b, h, d]`` (``"sbhd"``), ``[b, s, h, d]`` (``"bshd"``) or ``[t, h, d]``
            (``"thd"``); float32, float16 or bfloat16; any strides (0 included). A CuPy array,
            torch tensor (CUDA or CPU), JAX array, NumPy array, or any ``__dlpack__`` object.
        freqs: float32 angles in radians, ``[S, 1, 1, d2]`` or ``[S, d2]``; ``d2`` even,
            ``d2 <= d``; channels ``d2..d-1`` pass through. See :func:`rope_freqs`.
        layout: ``"sbhd"``, ``"bshd"`` or ``"thd"``.
        interleaved: GPT-J pairs ``(2k, 2k+1)`` instead of rotate-half ``(i, i + d2/2)``.
        cu_seqlens: thd only: int32/int64 ``[nseq + 1]`` cumulative (global, for cp: padded)
            sequence lengths.
        start_positions: int32/int64 ``[>= b]`` (or ``[>= nseq]``) per-sequence offsets.
        cp_size, cp_rank: context parallelism (dual-chunk split, spec 5.1).
        out: optional preallocated output of ``x``'s shape and dtype, any strides; may be
            ``x`` itself (in place).
        transpose_output_memory: sbhd only: return an sbhd view over bshd-ordered memory.

    Returns:
        The rotated array, same type, device, shape and dtype as ``x``; contiguous unless
        ``out`` or ``transpose_output_memory`` says otherwise. Runs on the caller's current
        stream without synchronising.

    Example:
        >>> import numpy as np, cupy_rope
        >>> freqs = cupy_rope.rope_freqs(64, 128)              # [128, 1, 1, 64] float32
        >>> x = np.random.rand(128, 2, 8, 64).astype(np.float32)
        >>> y = cupy_rope.apply_rope(x, freqs, "sbhd")
        >>> y.shape
        (128, 2, 8, 64)
    """
    return _rope(x, freqs, layout, interleaved, cu_seqlens, start_positions, cp_size, cp_rank, out,
                 transpose_output_memory, backward=False, x_name="x")


def apply_rope_backward(grad, freqs, layout="sbhd", *, interleaved=False, cu_seqlens=None,
                        start_positions=None, cp_size=1, cp_rank=0, out=None,
                        transpose_output_memory=False):
    """Gradient of :func:`apply_rope` with respect to its input (spec section 4).

    ``grad`` is dL/dy with ``x``'s shape (any strides, e.g. the stride-0 gradient of
    ``y.sum()``); the other arguments must be the forward's. Returns dL/dx, contiguous
    (or in ``out``).

    Example:
        >>> import numpy as np, cupy_rope
        >>> freqs = cupy_rope.rope_freqs(64, 16)
        >>> g = np.ones((16, 1, 4, 64), np.float32)
        >>> cupy_rope.apply_rope_backward(g, freqs, "sbhd").shape
        (16, 1, 4, 64)
    """
    return _rope(grad, freqs, layout, interleaved, cu_seqlens, start_positions, cp_size, cp_rank,
                 out, transpose_output_memory, backward=True, x_name="grad")


def apply_rope_qk(q, k, freqs, layout="sbhd", *, interleaved=False, cu_seqlens=None,
                  start_positions=None, cp_size=1, cp_rank=0, inplace=False):
    """Rotate queries and keys with the same positions in one kernel launch.

    Equivalent to ``(apply_rope(q, freqs, ...), apply_rope(k, freqs, ...))`` with the same
    keywords, at the cost of one call: models rotate q and k at every layer.

    Args:
        q: ``[s, b, hq, dq]`` / ``[b, s, hq, dq]`` / ``[t, hq, dq]`` (per ``layout``), any strides,
            e.g. a view into a fused projection ``qkv[:, :, 0]``.
        k: the same token dimensions and dtype as ``q``; its own head count ``hk`` and head dim
            ``dk`` (``d2 <= min(dq, dk)``), any strides.
        freqs, layout, interleaved, cu_seqlens, start_positions, cp_size, cp_rank: as for
            :func:`apply_rope`, shared by q and k.
        inplace: write the results into ``q`` and ``k`` themselves (they must share no element;
            views of one fused buffer are fine). Not for JAX arrays.

    Returns:
        ``(q_out, k_out)``: new contiguous arrays (or ``q``, ``k`` when ``inplace``), same type,
        device and dtype. Runs on the caller's current stream without synchronising.

    Example:
        >>> import numpy as np, cupy_rope
        >>> f = cupy_rope.rope_freqs(64, 16)
        >>> qkv = np.random.rand(2, 16, 3, 4, 64).astype(np.float32)     # [b, s, 3, h, d]
        >>> q, k = cupy_rope.apply_rope_qk(qkv[:, :, 0], qkv[:, :, 1], f, "bshd")
        >>> q.shape, k.shape
        ((2, 16, 4, 64), (2, 16, 4, 64))
    """
    return _rope_qk(q, k, freqs, layout, interleaved, cu_seqlens, start_positions, cp_size, cp_rank,
                    inplace, backward=False)


def apply_rope_qk_backward(dq, dk, freqs, layout="sbhd", *, interleaved=False, cu_seqlens=None,
                           start_positions=None, cp_size=1, cp_rank=0, inplace=False):
    """Gradient of :func:`apply_rope_qk`: ``(dq, dk)`` (dL/d outputs, any strides) ->
    ``(dL/dq, dL/dk)`` in one launch; keywords as the forward's.

    Example:
        >>> import numpy as np, cupy_rope
        >>> f = cupy_rope.rope_freqs(64, 8)
        >>> gq, gk = cupy_rope.apply_rope_qk_backward(np.ones((8, 1, 4, 64), np.float32),
        ...                                           np.ones((8, 1, 2, 64), np.float32), f)
        >>> gq.shape, gk.shape
        ((8, 1, 4, 64), (8, 1, 2, 64))
    """
    return _rope_qk(dq, dk, freqs, layout, interleaved, cu_seqlens, start_positions, cp_size, cp_rank,
                    inplace, backward=True, names=("dq", "dk"))


def _qkv(arrays: dict, q_freqs, k_freqs, split, layout, num_q_heads, interleaved, cu_seqlens,
         start_positions, cp_size, cp_rank, backward: bool):
    first = next(iter(arrays.values()))
    key = None
    kind = _launch.cache_kind(first)
    if kind is None and _jax_route(first):
        fn = _jax_ops().apply_qkv_rope_backward if backward else _jax_ops().apply_qkv_rope
        return fn(*arrays.values(), q_freqs, k_freqs, split, layout, num_q_heads=num_q_heads,
                  interleaved=interleaved, cu_seqlens=cu_seqlens, start_positions=start_positions,
                  cp_size=cp_size, cp_rank=cp_rank)
    if kind is not None and not _DEBUG[0]:
        split_key = tuple(split) if isinstance(split, (tuple, list)) else split
        key, res = _launch.lookup(kind, ("qkv", backward, q_freqs is k_freqs),
                                  (layout, interleaved, cp_size, cp_rank, num_q_heads, split_key),
                                  (*arrays.values(), q_freqs, k_freqs, cu_seqlens, start_positions))
        if res is not None:
            return res[0] if backward else tuple(res)
    args = _Args(**arrays, q_freqs=q_freqs, k_freqs=k_freqs, cu_seqlens=cu_seqlens,
                 start_positions=start_positions)
    inf = args.infos
    common = (inf["q_freqs"], inf["k_freqs"], split, layout, num_q_heads, interleaved,
              inf["cu_seqlens"], inf["start_positions"], cp_size, cp_rank)
    if backward:
        plan = _plan.resolve_qkv_backward(inf["dq"], inf["dk"], inf["dv"], *common)
        ref = "dq"
    else:
        plan = _plan.resolve_qkv(inf["qkv"], *common)
        ref = "qkv"
    where = _device(args, ref)
    _check_contents(args, plan.pos, plan.lead_shape, {"q_freqs": plan.q_table.rows, "k_freqs": plan.k_table.rows},
                    where)
    kind, ri = args.kinds[ref], inf[ref]
    if where == "cpu":
        fn = _numpy_backend.qkv_backward if backward else _numpy_backend.qkv_forward
        res = fn(np, plan, *(args.numpy(n) for n in arrays), args.numpy("q_freqs"), args.numpy("k_freqs"),
                 args.numpy("cu_seqlens"), args.numpy("start_positions"))
        if backward:
            return _interop.from_numpy(np.ascontiguousarray(res), kind)
        return tuple(_interop.from_numpy(np.ascontiguousarray(r), kind) for r in res)
    dev = ri.device[1]
    native = args.native[ref]
    if backward:
        packed = _interop.empty_like(kind, native, plan.packed_shape)[0]
        pi = _interop.info(packed, kind)
        qi, ki, vi = inf["dq"], inf["dk"], inf["dv"]
        result = packed
    else:
        q, k, v = (_interop.empty_like(kind, native, shape)[0]
                   for shape in (plan.q_shape, plan.kv_shape, plan.kv_shape))
        pi, qi, ki, vi = ri, _interop.info(q, kind), _interop.info(k, kind), _interop.info(v, kind)
        result = (q, k, v)
    if where == "meta":
        return result
    if pi.size:
        spec = plan.launch(pi, qi, ki, vi, inf["q_freqs"], inf["k_freqs"], inf["cu_seqlens"],
                           inf["start_positions"], _launch.sm_count(dev))
        prepared = _launch_gpu(spec, kind, dev, _QKV_BWD_NAMES if backward else _QKV_FWD_NAMES)
        if backward:
            outputs = [(0, plan.packed_shape, False, pi.ptr & 15)]
        else:
            outputs = [(0, shape, False, a.ptr & 15) for shape, a in
                       ((plan.q_shape, qi), (plan.kv_shape, ki), (plan.kv_shape, vi))]
        _launch.cache_put(key, prepared, outputs)
    return result


def apply_qkv_rope(qkv, q_freqs, k_freqs, split=None, layout="sbhd", *, num_q_heads=None,
                   interleaved=False, cu_seqlens=None, start_positions=None, cp_size=1, cp_rank=0):
    """RoPE on a fused QKV projection (TransformerEngine's ``fused_qkv_rope_forward``).

    Args:
        qkv: ``[s, b, g, (n+2)*d]`` (sbhd), ``[b, s, g, ...]`` (bshd) or ``[t, g, ...]`` (thd),
            any strides: per KV group ``g``, ``n`` query heads, then one key and one value head
            of ``d`` channels each.
        q_freqs, k_freqs: float32 angle tables (as for :func:`apply_rope`), same ``d2``.
        split: ``(q_size, k_size, v_size)`` = ``(n*d, d, d)`` (TE's ``qkv_split_arg_list``),
            or give ``num_q_heads`` (= ``g*n``) instead; exactly one of the two.
        Other arguments as for :func:`apply_rope`.

    Returns:
        ``(q, k, v)``: ``q`` ``[.., g*n, d]`` rotated with ``q_freqs`` (head ``group*n + r``),
        ``k`` ``[.., g, d]`` rotated with ``k_freqs``, ``v`` ``[.., g, d]`` a copy; contiguous.

    Example:
        >>> import numpy as np, cupy_rope
        >>> f = cupy_rope.rope_freqs(64, 32)
        >>> qkv = np.random.rand(32, 2, 4, 6 * 64).astype(np.float32)   # 4 groups x 4 q heads
        >>> q, k, v = cupy_rope.apply_qkv_rope(qkv, f, f, split=(256, 64, 64))
        >>> q.shape, k.shape
        ((32, 2, 16, 64), (32, 2, 4, 64))
    """
    return _qkv({"qkv": qkv}, q_freqs, k_freqs, split, layout, num_q_heads, interleaved, cu_seqlens,
                start_positions, cp_size, cp_rank, backward=False)


def apply_qkv_rope_backward(dq, dk, dv, q_freqs, k_freqs, split=None, layout="sbhd", *,
                            num_q_heads=None, interleaved=False, cu_seqlens=None,
                            start_positions=None, cp_size=1, cp_rank=0):
    """Gradient of :func:`apply_qkv_rope`: ``(dq, dk, dv)`` (any strides) -> packed ``dqkv``.

    ``split``/``num_q_heads`` are optional here (the gradients' shapes define them); when given
    they must match. ``start_positions`` is honoured (TE's backward ignores it).

    Example:
        >>> import numpy as np, cupy_rope
        >>> f = cupy_rope.rope_freqs(64, 8)
        >>> dq, dk, dv = (np.ones((8, 1, h, 64), np.float32) for h in (8, 2, 2))
        >>> cupy_rope.apply_qkv_rope_backward(dq, dk, dv, f, f).shape
        (8, 1, 2, 384)
    """
    return _qkv({"dq": dq, "dk": dk, "dv": dv}, q_freqs, k_freqs, split, layout, num_q_heads,
                interleaved, cu_seqlens, start_positions, cp_size, cp_rank, backward=True)
