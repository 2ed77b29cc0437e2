"""The public API: dispatch by array type to the CUDA kernels or the NumPy backend."""

from __future__ import annotations

import os
import struct

import numpy as np

from . import _interop, _launch, _numpy_backend, _plan
from ._positions import check_cu_seqlens, check_index_contents

_DEBUG = [os.environ.get("CUPY_ROPE_DEBUG", "") not in ("", "0")]


def set_debug(enabled: bool) -> None:
    """Check index contents (``cu_seqlens``, ``start_positions``) against the table on every call.

    Off by default (the check copies the index tensors to the host and so synchronises).
    Also enabled by the environment variable ``CUPY_ROPE_DEBUG=1``. With it on, a position
    outside the table, a decreasing ``cu_seqlens`` or an odd context-parallel length raises
    ``ValueError``; without it such tokens are copied through unrotated (spec 5.4).
    """
    _DEBUG[0] = bool(enabled)


def debug_enabled() -> bool:
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

    def __init__(self, **arrays):
        self.native, self.kinds, self.infos = {}, {}, {}
        for name, a in arrays.items():
            if a is None and name in _OPTIONAL:
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


def _rope(x, freqs, layout, interleaved, cu_seqlens, start_positions, cp_size, cp_rank, out,
          transpose_output_memory, backward: bool, x_name: str):
    if _jax_route(x, out, transpose_output_memory):
        from . import jax as cj

        fn = cj.apply_rope_backward if backward else cj.apply_rope
        return fn(x, freqs, layout, interleaved=interleaved, cu_seqlens=cu_seqlens,
                  start_positions=start_positions, cp_size=cp_size, cp_rank=cp_rank)
    fast_key = None
    kind = _quick_kind(x)
    # cached launches skip validation: only for outputs that cannot overlap the input differently
    if kind is not None and not _DEBUG[0] and (out is None or out is x):
        opts = tuple((type(v), v) for v in ("rope", backward, layout, interleaved, cp_size, cp_rank,
                                            transpose_output_memory))
        fast_key, entry, ptrs = _cache_lookup(kind, dict(x=x, freqs=freqs, cu_seqlens=cu_seqlens,
                                                         start_positions=start_positions, out=out), opts)
        if entry is not None:
            if out is not None:
                ptrs["y"] = ptrs["out"]
            res = _cached_launch(kind, entry, ptrs, x)
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
        name, grid, block, params = plan.launch(xi, yi, args.infos["freqs"], args.infos["cu_seqlens"],
                                                args.infos["start_positions"], _launch.sm_count(dev))
        _launch.launch(name, grid, block, params, _interop.current_stream(kind, dev), dev)
        outputs = [] if out is not None else [("y", plan.shape, plan.transpose_output)]
        _cache_put(fast_key, name, grid, block, params, _plan.ROPE_PTR_SLOTS, outputs)
    return y


# ----------------------------------------------------------------------------- launch cache
# Repeated calls with the same shapes, strides, dtypes, devices, options and pointer alignment
# reuse the launch resolved (and validated) by the first call and only patch the addresses:
# the per-call host cost is then a few microseconds (decode-sized calls are host-bound).
_CACHE: dict = {}
_CACHE_MAX = 4096


def _desc(a, kind):
    """(layout of the array without its address, address) for the launch-cache key."""
    if a is None:
        return None, 0
    if kind == "torch":
        p = a.data_ptr()
        return (tuple(a.shape), a.stride(), a.dtype, a.device, p % 16), p
    p = a.data.ptr
    return (a.shape, a.strides, a.dtype, a.device.id, p % 16), p


def _quick_kind(a):
    mod = type(a).__module__
    if mod.startswith("torch") and type(a).__name__ == "Tensor":
        return "torch" if a.is_cuda else None
    if mod.startswith("cupy") and type(a).__name__ == "ndarray":
        return "cupy"
    return None


def _cache_lookup(kind, arrays: dict, opts):
    """(key, cached entry or None, addresses by name); key None when not cacheable. The key holds
    each option with its type, so only calls whose options a first call validated can hit; an
    unhashable option (a list, say) is not cacheable and goes to validation."""
    descs, ptrs = [], {}
    for name, a in arrays.items():
        if a is not None and _quick_kind(a) != kind:
            return None, None, None
        d, ptrs[name] = _desc(a, kind)
        descs.append(d)
    key = (kind, opts, tuple(descs))
    try:
        return key, _CACHE.get(key), ptrs
    except TypeError:
        return None, None, None


def _cache_put(key, name, grid, block, params, slots, outputs):
    """Remember a launch: ``slots`` = {array name: 64-bit slot}, ``outputs`` = [(name, shape, transposed)]."""
    if key is None:
        return
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.clear()
    _CACHE[key] = (name, grid, block, params, slots, outputs)


def _cached_launch(kind, entry, ptrs, like):
    """Allocate the outputs, patch every address into the cached parameters, launch."""
    name, grid, block, params, slots, outputs = entry
    results = []
    for oname, shape, transposed in outputs:
        y, p = _interop.empty_like(kind, like, shape, transposed)
        if p % 16:
            return None  # alignment differs from the cached plan's: take the full path
        ptrs[oname] = p
        results.append(y)
    buf = bytearray(params)
    for nm, slot in slots.items():
        struct.pack_into("<q", buf, 8 * slot, ptrs.get(nm, 0))
    dev = like.device.index if kind == "torch" else like.device.id
    _launch.launch(name, grid, block, bytes(buf), _interop.current_stream(kind, dev), dev)
    return results


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


def _qkv(arrays: dict, q_freqs, k_freqs, split, layout, num_q_heads, interleaved, cu_seqlens,
         start_positions, cp_size, cp_rank, backward: bool):
    first = next(iter(arrays.values()))
    if _jax_route(first):
        from . import jax as cj

        fn = cj.apply_qkv_rope_backward if backward else cj.apply_qkv_rope
        return fn(*arrays.values(), q_freqs, k_freqs, split, layout, num_q_heads=num_q_heads,
                  interleaved=interleaved, cu_seqlens=cu_seqlens, start_positions=start_positions,
                  cp_size=cp_size, cp_rank=cp_rank)
    fast_key = None
    kind = _quick_kind(first)
    if kind is not None and not _DEBUG[0]:
        opts = tuple((type(v), v) for v in ("qkv", backward, layout, interleaved, cp_size, cp_rank,
                                            num_q_heads))
        opts += (tuple(split) if split is not None else None,)
        named = dict(arrays, q_freqs=q_freqs, k_freqs=k_freqs, cu_seqlens=cu_seqlens,
                     start_positions=start_positions)
        fast_key, entry, ptrs = _cache_lookup(kind, named, opts + ((q_freqs is k_freqs),))
        if entry is not None:
            if backward:
                ptrs.update(q=ptrs["dq"], k=ptrs["dk"], v=ptrs["dv"])
            else:
                ptrs["packed"] = ptrs["qkv"]
            res = _cached_launch(kind, entry, ptrs, first)
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
        name, grid, block, params = plan.launch(pi, qi, ki, vi, inf["q_freqs"], inf["k_freqs"],
                                                inf["cu_seqlens"], inf["start_positions"],
                                                _launch.sm_count(dev))
        _launch.launch(name, grid, block, params, _interop.current_stream(kind, dev), dev)
        outputs = [("packed", plan.packed_shape, False)] if backward else \
            [("q", plan.q_shape, False), ("k", plan.kv_shape, False), ("v", plan.kv_shape, False)]
        if all(_interop.info(r, kind).ptr % 16 == 0 for r in ((result,) if backward else result)):
            _cache_put(fast_key, name, grid, block, params, _plan.QKV_PTR_SLOTS, outputs)
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


def rope_freqs(dim, max_seq_len, *, rotary_percent=1.0, base=10000.0, interleaved=False,
               seq_len_interpolation_factor=None, pretrained_max_position_embeddings=None, offset=0,
               like=None):
    """TransformerEngine's standard angle table (spec section 2), in float32 throughout.

    Returns ``[max_seq_len, 1, 1, d2]`` float32 with ``d2 = 2*ceil(dim'/2)``,
    ``dim' = int(dim * rotary_percent)`` (when ``rotary_percent < 1``), in the array library of
    ``like`` (NumPy when ``None``). With a torch tensor as ``like`` the table is built with TE's
    own torch operations on that tensor's device, so it is bit-identical to TE's table there;
    otherwise NumPy builds it with a correctly rounded float32 ``pow`` (a platform's ``powf``
    may differ in the last bit of a few ``inv_freq`` entries) and CuPy/JAX get a copy on
    ``like``'s device.

    Example:
        >>> import cupy_rope
        >>> cupy_rope.rope_freqs(128, 4096, base=500000.0).shape
        (4096, 1, 1, 128)
    """
    dim = _plan.check_int("dim", dim, lo=1)
    max_seq_len = _plan.check_int("max_seq_len", max_seq_len, lo=0)
    interleaved = _plan.check_bool("interleaved", interleaved)
    rp = float(rotary_percent)
    if not 0.0 < rp <= 1.0:
        raise ValueError(f"cupy_rope: `rotary_percent`: expected 0 < rotary_percent <= 1, got {rotary_percent}")
    dimp = int(dim * rp) if rp < 1.0 else dim
    if dimp < 1:
        raise ValueError(f"cupy_rope: `rotary_percent`: expected int(dim * rotary_percent) >= 1, got {dimp}")
    kind = _interop.kind_of(like) if like is not None else "numpy"
    if kind == "torch":  # TE's own ops on the tensor's device: bit-identical to TE's table there
        import torch

        xp, f32 = torch, torch.float32

        def arange(*a):
            return torch.arange(*a, dtype=f32, device=like.device)
    else:
        xp, f32 = np, np.float32

        def arange(*a):
            return np.arange(*a, dtype=f32)
    # spec section 2, in float32 throughout (Python scalars act in float32, as in TE)
    exps = arange(0, dimp, 2) / dimp
    if kind == "torch":
        inv_freq = 1.0 / (float(base) ** exps)
    else:  # powf correctly rounded (through float64), then the float32 reciprocal
        inv_freq = f32(1.0) / (np.float64(f32(base)) ** exps.astype(np.float64)).astype(f32)
    seq = arange(max_seq_len) + offset
    P, F = pretrained_max_position_embeddings, seq_len_interpolation_factor
    if P is not None and F is not None:
        scale = 1 / (max_seq_len / P) if max_seq_len > P * F else 1 / F
        seq = seq * (scale if kind == "torch" else f32(scale))
    f = xp.outer(seq, inv_freq)
    if interleaved:
        emb = xp.stack([f, f], -1).reshape(max_seq_len, -1)
    else:
        emb = xp.concatenate([f, f], -1)
    emb = emb.reshape(max_seq_len, 1, 1, emb.shape[-1])
    if kind == "torch":
        return emb.contiguous()
    emb = np.ascontiguousarray(emb)
    if kind == "cupy":
        import cupy

        with cupy.cuda.Device(like.device.id):
            return cupy.asarray(emb)
    if kind == "jax":
        import jax

        return jax.device_put(emb, next(iter(like.devices())))
    return emb
