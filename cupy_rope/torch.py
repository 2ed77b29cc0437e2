"""PyTorch shim: differentiable RoPE ops that work under ``torch.compile`` and CUDA graphs.

The ops are ``torch.library`` operators: ``cupy_rope::rope``, ``rope_qk`` (q and k in one
launch), in-place ``rope_qk_``, the positions API's ``rope_pos`` and in-place ``rope_pos_`` (defined on the dispatcher with CUDA, CPU and fake kernels and an
autograd kernel of their own), ``qkv_rope`` and ``qkv_rope_backward`` (``custom_op``). RoPE is
linear in its input, so each op's gradient is the other direction's op: gradients of any
order are exact. CUDA tensors run the CUDA kernels on torch's current stream, outputs come
from torch's caching allocator; CPU tensors run the NumPy backend. The angle tables,
``cu_seqlens`` and ``start_positions`` are not differentiated.

Example::

    import torch, cupy_rope.torch as crt
    rope = crt.RotaryPositionEmbedding(128)
    freqs = rope(4096).cuda()                                  # [4096, 1, 1, 128] float32
    q = torch.randn(4096, 2, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = crt.apply_rope(q, freqs, "sbhd")
    y.sum().backward()
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.autograd.forward_ad as _fwad

from . import _api, _freqs, _launch, _plan, _torch_ext

_I64 = 2**63  # the ops' int arguments are int64


# ----------------------------------------------------------------------------- ops
# The single-tensor and q+k ops are defined on the dispatcher directly (``torch.library.Library``):
# CUDA and CPU kernels that call the library, a fake kernel for meta/fake tensors and
# torch.compile, and an Autograd kernel of our own. A call that needs no gradient costs one
# dispatcher trip plus the launch; the CUDA kernels are C++ where that builds (_torch_ext),
# otherwise Python, which the eager public functions then call without the dispatcher for
# plain CUDA tensors. Under torch.compile the op is one node of the graph (fake kernel, no break).
_LIB = torch.library.Library("cupy_rope", "FRAGMENT")
_POS_SCHEMA = "str layout, bool interleaved, Tensor? cu_seqlens, Tensor? start_positions, int cp_size, int cp_rank"
_LIB.define(f"rope(Tensor x, Tensor freqs, {_POS_SCHEMA}, bool backward, bool transpose_output_memory) -> Tensor")
_LIB.define(f"rope_qk(Tensor q, Tensor k, Tensor freqs, {_POS_SCHEMA}, bool backward) -> (Tensor, Tensor)")
_LIB.define(f"rope_qk_(Tensor(a!) q, Tensor(b!) k, Tensor freqs, {_POS_SCHEMA}, bool backward) -> ()")
# The same kernels with no autograd kernel of their own: what torch.compile puts in its graphs
# (the autograd.Functions below are traced, so the compiled graphs need no autograd at run time,
# and a call from a compiled graph costs one C++ dispatch plus the launch).
_LIB.define(f"_rope_impl(Tensor x, Tensor freqs, {_POS_SCHEMA}, bool backward, bool transpose_output_memory) -> Tensor")
_LIB.define(f"_rope_qk_impl(Tensor q, Tensor k, Tensor freqs, {_POS_SCHEMA}, bool backward) -> (Tensor, Tensor)")


def _plain_cuda(x) -> bool:
    """A plain CUDA tensor with no dispatch mode active: the kernels can run on it directly."""
    return type(x) is torch.Tensor and x.is_cuda and not torch._C._len_torch_dispatch_stack()


def _rope_kernel(x, freqs, layout, interleaved, cu, sp, cp_size, cp_rank, backward, tom):
    return _api._rope(x, freqs, layout, interleaved, cu, sp, cp_size, cp_rank, None, tom, backward,
                      "grad" if backward else "x")


def _rope_qk_kernel(q, k, freqs, layout, interleaved, cu, sp, cp_size, cp_rank, backward):
    return _api._rope_qk(q, k, freqs, layout, interleaved, cu, sp, cp_size, cp_rank, False, backward,
                         ("dq", "dk") if backward else ("q", "k"))


def _rope_qk_inplace_kernel(q, k, freqs, layout, interleaved, cu, sp, cp_size, cp_rank, backward):
    _api._rope_qk(q, k, freqs, layout, interleaved, cu, sp, cp_size, cp_rank, True, backward,
                  ("dq", "dk") if backward else ("q", "k"))


# The Python kernels, also as the C++ launch path's miss handlers (ops ``_py_<op>``).
_LIB.define(f"_py_rope(Tensor x, Tensor freqs, {_POS_SCHEMA}, bool backward, bool transpose_output_memory) -> Tensor")
_LIB.define(f"_py_rope_qk(Tensor q, Tensor k, Tensor freqs, {_POS_SCHEMA}, bool backward) -> (Tensor, Tensor)")
_LIB.define(f"_py_rope_qk_(Tensor(a!) q, Tensor(b!) k, Tensor freqs, {_POS_SCHEMA}, bool backward) -> ()")
_PY_KERNELS = {"rope": _rope_kernel, "_rope_impl": _rope_kernel, "rope_qk": _rope_qk_kernel,
               "_rope_qk_impl": _rope_qk_kernel, "rope_qk_": _rope_qk_inplace_kernel}


@torch.library.register_fake("cupy_rope::_rope_impl", lib=_LIB)
@torch.library.register_fake("cupy_rope::rope", lib=_LIB)
def _rope_fake(x, freqs, layout, interleaved, cu, sp, cp_size, cp_rank, backward, tom):
    if tom:
        s, b, h, d = x.shape
        return x.new_empty((b, s, h, d)).permute(1, 0, 2, 3)
    return x.new_empty(x.shape)


@torch.library.register_fake("cupy_rope::_rope_qk_impl", lib=_LIB)
@torch.library.register_fake("cupy_rope::rope_qk", lib=_LIB)
def _rope_qk_fake(q, k, freqs, layout, interleaved, cu, sp, cp_size, cp_rank, backward):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.register_fake("cupy_rope::rope_qk_", lib=_LIB)
def _rope_qk_inplace_fake(q, k, freqs, layout, interleaved, cu, sp, cp_size, cp_rank, backward):
    return None


_ROPE = torch.ops.cupy_rope.rope.default
_ROPE_QK = torch.ops.cupy_rope.rope_qk.default
_ROPE_IMPL = torch.ops.cupy_rope._rope_impl.default
_ROPE_QK_IMPL = torch.ops.cupy_rope._rope_qk_impl.default
_ROPE_QK_ = torch.ops.cupy_rope.rope_qk_.default


def _fast(op, *args):
    """A plain-CUDA call of ``op`` (an OpOverload the C++ path serves) from the C++ launch cache
    without the dispatcher (:data:`cupy_rope._torch_ext.FAST`); None when it is not served there."""
    return None if _FAST is None else _FAST(_FAST_INDEX[op._opname], *args)


def _below_autograd(impl_op, kernel, op, lead, *args):
    """Run below autograd: traced by torch.compile, the autograd-free op ``impl_op``; for plain
    CUDA tensors a hit of the C++ launch cache, else ``impl_op`` (with the C++ path) or the Python
    ``kernel``; otherwise (fake, functional and other wrapper tensors, dispatch modes, CPU) the
    public ``op`` through the dispatcher."""
    if torch.compiler.is_compiling():
        return impl_op(*args)
    if _plain_cuda(lead):
        if not _EXT:
            return kernel(*args)
        res = _fast(impl_op, *args)
        return impl_op(*args) if res is None else res
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def _rope_call(x, *args):
    return _below_autograd(_ROPE_IMPL, _rope_kernel, _ROPE, x, x, *args)


def _rope_qk_call(q, *args):
    return _below_autograd(_ROPE_QK_IMPL, _rope_qk_kernel, _ROPE_QK, q, q, *args)


def _inplace_call(op, kernel, lead, *args):
    """An in-place op below autograd (the caller bumps the version counters): for plain CUDA
    tensors a hit of the C++ launch cache or, without the C++ path, the Python ``kernel``;
    otherwise (and on a miss) the op through the dispatcher."""
    if _plain_cuda(lead):
        if not _EXT:
            kernel(*args)
            return
        if _fast(op, *args) is not None:
            return
    with torch._C._AutoDispatchBelowAutograd():
        op(*args)


class _RopeFn(torch.autograd.Function):
    """RoPE is linear in x: the gradient is the other direction's op at the same positions; only
    the table and the index tensors are saved."""

    generate_vmap_rule = True  # torch.func.vmap: the op under torch's batching (per-sample fallback)

    @staticmethod
    def forward(x, freqs, cu, sp, static):
        return _rope_call(x, freqs, *static[:2], cu, sp, *static[2:])

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, freqs, cu, sp, ctx.static = inputs
        ctx.save_for_backward(freqs, cu, sp)

    @staticmethod
    def backward(ctx, g):
        freqs, cu, sp = ctx.saved_tensors
        layout, il, cp_size, cp_rank, backward, _ = ctx.static
        return _RopeFn.apply(g, freqs, cu, sp, (layout, il, cp_size, cp_rank, not backward, False)), \
            None, None, None, None


class _RopeQkFn(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, freqs, cu, sp, static):
        return _rope_qk_call(q, k, freqs, *static[:2], cu, sp, *static[2:])

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, _, freqs, cu, sp, ctx.static = inputs
        ctx.save_for_backward(freqs, cu, sp)

    @staticmethod
    def backward(ctx, gq, gk):
        freqs, cu, sp = ctx.saved_tensors
        layout, il, cp_size, cp_rank, backward = ctx.static
        dq, dk = _RopeQkFn.apply(gq, gk, freqs, cu, sp, (layout, il, cp_size, cp_rank, not backward))
        return dq, dk, None, None, None, None


def _needs_grad(*tensors) -> bool:
    """Whether a tensor (None: skipped) requires grad, with grad mode on."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _forward_mode(*tensors) -> bool:
    """Whether a tensor carries a forward-mode tangent (inside ``torch.autograd.forward_ad.dual_level``)."""
    return _fwad._current_level >= 0 and any(t is not None and _fwad.unpack_dual(t).tangent is not None
                                             for t in tensors)


def _linear_dual(fn, *duals):
    """Forward-mode AD of ``fn``, linear in its arguments ``duals`` (tensors, some dual, or None):
    ``fn`` of the primals, with ``fn`` of the tangents (zero where missing) as the tangent. Kept
    out of the autograd.Functions, whose custom ``jvp`` torch.compile cannot trace."""
    prim, tang = [], []
    for d in duals:
        p, t = (None, None) if d is None else _fwad.unpack_dual(d)
        prim.append(p)
        tang.append(torch.zeros_like(p) if t is None and p is not None else t)
    out, tout = fn(*prim), fn(*tang)
    if isinstance(out, torch.Tensor):
        return _fwad.make_dual(out, tout)
    return type(out)(o if o is None else _fwad.make_dual(o, t) for o, t in zip(out, tout))


def _differentiated(*tensors) -> bool:
    """Whether a tensor requires grad or carries a forward-mode tangent."""
    return _needs_grad(*tensors) or _forward_mode(*tensors)


def _refuse_inplace_grad(q, k) -> None:
    if _differentiated(q, k):
        raise ValueError("cupy_rope.torch: `inplace`: expected False when `q` or `k` requires grad or carries "
                         "a forward-mode tangent (an in-place rotation is not differentiable), got True")


def _rope_autograd(x, freqs, layout, interleaved, cu, sp, cp_size, cp_rank, backward, tom):
    if _forward_mode(x):
        return _linear_dual(lambda t: _rope_autograd(t, freqs, layout, interleaved, cu, sp, cp_size, cp_rank,
                                                     backward, tom), x)
    if _needs_grad(x):
        return _RopeFn.apply(x, freqs, cu, sp, (layout, interleaved, cp_size, cp_rank, backward, tom))
    return _rope_call(x, freqs, layout, interleaved, cu, sp, cp_size, cp_rank, backward, tom)


def _rope_qk_autograd(q, k, freqs, layout, interleaved, cu, sp, cp_size, cp_rank, backward):
    if _forward_mode(q, k):
        return _linear_dual(lambda a, b: _rope_qk_autograd(a, b, freqs, layout, interleaved, cu, sp, cp_size,
                                                           cp_rank, backward), q, k)
    if _needs_grad(q, k):
        return _RopeQkFn.apply(q, k, freqs, cu, sp, (layout, interleaved, cp_size, cp_rank, backward))
    return _rope_qk_call(q, k, freqs, layout, interleaved, cu, sp, cp_size, cp_rank, backward)


def _rope_qk_inplace_autograd(q, k, freqs, layout, interleaved, cu, sp, cp_size, cp_rank, backward):
    _refuse_inplace_grad(q, k)
    _inplace_call(_ROPE_QK_, _rope_qk_inplace_kernel, q, q, k, freqs, layout, interleaved, cu, sp, cp_size, cp_rank,
                  backward)
    torch.autograd.graph.increment_version((q, k))


# The Python autograd kernels; where the C++ launch path loads, the out-of-place ops' CUDA and CPU
# autograd kernels are C++ (a call that needs no gradient goes below autograd without Python) and
# call these through ops ``_ag_<op>`` (the op's schema) for the calls that do.
_LIB.define(f"_ag_rope(Tensor x, Tensor freqs, {_POS_SCHEMA}, bool backward, bool transpose_output_memory) -> Tensor")
_LIB.define(f"_ag_rope_qk(Tensor q, Tensor k, Tensor freqs, {_POS_SCHEMA}, bool backward) -> (Tensor, Tensor)")
for _name, _kernel in (("rope", _rope_autograd), ("rope_qk", _rope_qk_autograd),
                       ("rope_qk_", _rope_qk_inplace_autograd)):
    _LIB.impl(_name, _kernel, "Autograd")
    if _name != "rope_qk_":
        _LIB.impl(f"_ag_{_name}", _kernel, "Autograd")


# ----------------------------------------------------------------------------- positions API ops
# q and k (optional) at per-token positions; ``table_name`` says which table ``table`` is
# (cos_sin_cache / freqs / inv_freq); head_size 0: q and k have a head dimension.
_PP_SCHEMA = "str table_name, int head_size, bool interleaved, int rope_dim_offset, bool inverse"
_LIB.define(f"rope_pos(Tensor positions, Tensor q, Tensor? k, Tensor table, {_PP_SCHEMA}) -> Tensor[]")
_LIB.define(f"_rope_pos_impl(Tensor positions, Tensor q, Tensor? k, Tensor table, {_PP_SCHEMA}) -> Tensor[]")
_LIB.define(f"rope_pos_(Tensor positions, Tensor(a!) q, Tensor(b!)? k, Tensor table, {_PP_SCHEMA}) -> ()")


def _tables(tname, table) -> dict:
    return {n: (table if n == tname else None) for n in _plan.TABLE_ARGS}


def _rope_pos_kernel(positions, q, k, table, tname, head_size, interleaved, rot_off, inverse):
    qo, ko = _api._rope_pos(positions, q, k, _tables(tname, table), head_size or None, interleaved, rot_off,
                            inverse, False)
    return [qo] if ko is None else [qo, ko]


def _rope_pos_inplace_kernel(positions, q, k, table, tname, head_size, interleaved, rot_off, inverse):
    _api._rope_pos(positions, q, k, _tables(tname, table), head_size or None, interleaved, rot_off, inverse, True)


_LIB.define(f"_py_rope_pos(Tensor positions, Tensor q, Tensor? k, Tensor table, {_PP_SCHEMA}) -> Tensor[]")
_LIB.define(f"_py_rope_pos_(Tensor positions, Tensor(a!) q, Tensor(b!)? k, Tensor table, {_PP_SCHEMA}) -> ()")
_PY_KERNELS.update({"rope_pos": _rope_pos_kernel, "_rope_pos_impl": _rope_pos_kernel,
                    "rope_pos_": _rope_pos_inplace_kernel})
# CPU: the Python kernels. CUDA: the C++ launch path where it loads (cupy_rope._torch_ext), its
# misses handled by the ``_py_`` ops; otherwise the Python kernels.
_EXT = _torch_ext.load()
_FAST, _FAST_INDEX = _torch_ext.FAST, _torch_ext.FAST_INDEX


for _name, _kernel in _PY_KERNELS.items():
    _LIB.impl(_name, _kernel, "CPU")
    if not _EXT:
        _LIB.impl(_name, _kernel, "CUDA")
for _name in ("rope", "rope_qk", "rope_qk_", "rope_pos", "rope_pos_"):
    _LIB.impl(f"_py_{_name}", _torch_ext.resolving(_PY_KERNELS[_name]), "CUDA")
# The autograd-free ops skip autograd altogether (a fallthrough, not torch's boxed autograd
# fallback: about 0.6 us of a compiled graph's call, benchmarks/NOTES.md); their results carry no
# autograd history, as the public API's.
for _name in ("_rope_impl", "_rope_qk_impl", "_rope_pos_impl"):
    _LIB.impl(_name, torch.library.fallthrough_kernel, "Autograd")


@torch.library.register_fake("cupy_rope::_rope_pos_impl", lib=_LIB)
@torch.library.register_fake("cupy_rope::rope_pos", lib=_LIB)
def _rope_pos_fake(positions, q, k, table, *static):
    return [q.new_empty(q.shape)] + ([k.new_empty(k.shape)] if k is not None else [])


@torch.library.register_fake("cupy_rope::rope_pos_", lib=_LIB)
def _rope_pos_inplace_fake(positions, q, k, table, *static):
    return None


_ROPE_POS = torch.ops.cupy_rope.rope_pos.default
_ROPE_POS_ = torch.ops.cupy_rope.rope_pos_.default
_ROPE_POS_IMPL = torch.ops.cupy_rope._rope_pos_impl.default


class _RopePosFn(torch.autograd.Function):
    """The gradient is the inverse rotation at the same positions (only they and the table are
    saved); q alone gives one output."""

    generate_vmap_rule = True

    @staticmethod
    def setup_context(ctx, inputs, output):
        positions, table, ctx.static, _, k = inputs
        ctx.save_for_backward(positions, table)
        ctx.has_k = k is not None

    @staticmethod
    def forward(positions, table, static, q, k):
        outs = _below_autograd(_ROPE_POS_IMPL, _rope_pos_kernel, _ROPE_POS, q, positions, q, k, table, *static)
        return tuple(outs) if k is not None else outs[0]

    @staticmethod
    def backward(ctx, gq, gk=None):
        positions, table = ctx.saved_tensors
        tname, head_size, il, off, inverse = ctx.static
        res = _RopePosFn.apply(positions, table, (tname, head_size, il, off, not inverse), gq,
                               gk if ctx.has_k else None)
        dq, dk = res if ctx.has_k else (res, None)
        return None, None, None, dq, dk


def _rope_pos_autograd(positions, q, k, table, *static):
    if _forward_mode(q, k):
        return _linear_dual(lambda a, b: _rope_pos_autograd(positions, a, b, table, *static), q, k)
    if _needs_grad(q, k):
        res = _RopePosFn.apply(positions, table, static, q, k)
        return list(res) if k is not None else [res]
    return _below_autograd(_ROPE_POS_IMPL, _rope_pos_kernel, _ROPE_POS, q, positions, q, k, table, *static)


def _rope_pos_inplace_autograd(positions, q, k, table, *static):
    _refuse_inplace_grad(q, k)
    _inplace_call(_ROPE_POS_, _rope_pos_inplace_kernel, q, positions, q, k, table, *static)
    torch.autograd.graph.increment_version((q,) if k is None else (q, k))


_LIB.define(f"_ag_rope_pos(Tensor positions, Tensor q, Tensor? k, Tensor table, {_PP_SCHEMA}) -> Tensor[]")
_LIB.impl("rope_pos", _rope_pos_autograd, "Autograd")
_LIB.impl("_ag_rope_pos", _rope_pos_autograd, "Autograd")
_LIB.impl("rope_pos_", _rope_pos_inplace_autograd, "Autograd")


def _schema_types(op) -> tuple:
    """The Python types each argument of ``op``'s schema takes (None: a tensor, or None where the
    schema says ``Tensor?``)."""
    kinds = {"Tensor": (torch.Tensor,), "Optional[Tensor]": (torch.Tensor, type(None)), "str": (str,),
             "bool": (bool,), "int": (int,)}
    return tuple(kinds[str(a.type)] for a in op._schema.arguments)


def _types_match(op, args) -> bool:
    """Whether ``args`` have exactly the types of ``op``'s schema (ints within int64); anything
    else (an array of another framework, a numpy bool) stays on the public API's path and errors."""
    types = _ROUTE_TYPES[op]
    return len(args) == len(types) and all(
        type(a) in t and (type(a) is not int or -2**63 <= a < 2**63) for a, t in zip(args, types))


# The public API's calls the C++ path serves: name -> (op, where the op's arguments hold the
# tensors it rotates). The in-place ops (names ending in "_") write into those tensors.
_ROUTES = {"rope": (_ROPE_IMPL, slice(0, 1)), "rope_qk": (_ROPE_QK_IMPL, slice(0, 2)),
           "rope_qk_": (_ROPE_QK_, slice(0, 2)), "rope_pos": (_ROPE_POS_IMPL, slice(1, 3)),
           "rope_pos_": (_ROPE_POS_, slice(1, 3))}
_ROUTE_TYPES = {op: _schema_types(op) for op, _ in _ROUTES.values()}


def _public_route(name, lead, *args):
    """The public API's calls on plain CUDA tensors (``cupy_rope._launch.NATIVE``) through the C++
    path: a hit of its cache (whose key holds the argument types of the call the op validated),
    else the op (the autograd-free op; an in-place op through its autograd kernel, which bumps the
    version counters, as a hit does here), whose miss validates, launches and prepares the C++
    launch. Returns the outputs (True for an in-place call), or None (the public API's own path)
    while this thread resolves a miss, for in-place calls on tensors that require grad or carry
    a forward-mode tangent (the public API writes them without autograd), and on a miss for
    arguments of other types than the op's or tensors that require grad (the public API returns
    tensors without autograd history)."""
    if _torch_ext.resolving_now() or not _plain_cuda(lead):
        return None
    op, rotated = _ROUTES[name]
    inplace = name.endswith("_")
    if inplace and _differentiated(*args[rotated]):
        return None
    res = _fast(op, *args)
    if res is not None:
        if inplace:
            torch.autograd.graph.increment_version(tuple(t for t in args[rotated] if t is not None))
        return res
    if not _types_match(op, args) or _needs_grad(*args[rotated]):
        return None
    res = op(*args)
    return True if inplace else res


if _EXT:
    _launch.NATIVE = _public_route


@torch.library.custom_op("cupy_rope::qkv_rope", mutates_args=())
def _qkv_op(qkv: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor, split: Sequence[int],
            layout: str, interleaved: bool, cu_seqlens: Optional[torch.Tensor],
            start_positions: Optional[torch.Tensor], cp_size: int,
            cp_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = _api.apply_qkv_rope(qkv, q_freqs, k_freqs, tuple(split), layout, interleaved=interleaved,
                                  cu_seqlens=cu_seqlens, start_positions=start_positions,
                                  cp_size=cp_size, cp_rank=cp_rank)
    return q, k, v


@_qkv_op.register_fake
def _(qkv, q_freqs, k_freqs, split, layout, interleaved, cu_seqlens, start_positions, cp_size, cp_rank):
    q_size, k_size, _ = split
    lead, g = tuple(qkv.shape[:-2]), qkv.shape[-2]
    return (qkv.new_empty(lead + (g * (q_size // k_size), k_size)), qkv.new_empty(lead + (g, k_size)),
            qkv.new_empty(lead + (g, k_size)))


@torch.library.custom_op("cupy_rope::qkv_rope_backward", mutates_args=())
def _qkv_bwd_op(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, q_freqs: torch.Tensor,
                k_freqs: torch.Tensor, split: Sequence[int], layout: str, interleaved: bool,
                cu_seqlens: Optional[torch.Tensor], start_positions: Optional[torch.Tensor],
                cp_size: int, cp_rank: int) -> torch.Tensor:
    return _api.apply_qkv_rope_backward(dq, dk, dv, q_freqs, k_freqs, tuple(split), layout,
                                        interleaved=interleaved, cu_seqlens=cu_seqlens,
                                        start_positions=start_positions, cp_size=cp_size, cp_rank=cp_rank)


@_qkv_bwd_op.register_fake
def _(dq, dk, dv, q_freqs, k_freqs, split, layout, interleaved, cu_seqlens, start_positions, cp_size,
      cp_rank):
    return dq.new_empty(tuple(dq.shape[:-2]) + (dk.shape[-2], sum(split)))


def _qkv_setup(ctx, inputs, output):
    _, qf, kf, split, layout, il, cu, sp, cp_size, cp_rank = inputs
    ctx.save_for_backward(qf, kf, cu, sp)
    ctx.args = (tuple(split), layout, il, cp_size, cp_rank)


def _qkv_grad(ctx, dq, dk, dv):
    qf, kf, cu, sp = ctx.saved_tensors
    split, layout, il, cp_size, cp_rank = ctx.args
    g = _qkv_bwd_op(dq, dk, dv, qf, kf, split, layout, il, cu, sp, cp_size, cp_rank)
    return g, None, None, None, None, None, None, None, None, None


def _qkv_bwd_setup(ctx, inputs, output):
    _, _, _, qf, kf, split, layout, il, cu, sp, cp_size, cp_rank = inputs
    ctx.save_for_backward(qf, kf, cu, sp)
    ctx.args = (tuple(split), layout, il, cp_size, cp_rank)


def _qkv_bwd_grad(ctx, g):
    qf, kf, cu, sp = ctx.saved_tensors
    split, layout, il, cp_size, cp_rank = ctx.args
    q, k, v = _qkv_op(g, qf, kf, split, layout, il, cu, sp, cp_size, cp_rank)
    return (q, k, v) + (None,) * 9


_qkv_op.register_autograd(_qkv_grad, setup_context=_qkv_setup)
_qkv_bwd_op.register_autograd(_qkv_bwd_grad, setup_context=_qkv_bwd_setup)


# ----------------------------------------------------------------------------- public
def _check_tensors(**named) -> None:
    """The ops take tensors only: a ``TypeError`` naming the argument (not a dispatcher schema
    dump) for anything else; ``cu_seqlens``/``start_positions`` may be None."""
    _plan.check_arrays(torch.Tensor, "a torch.Tensor", ("cu_seqlens", "start_positions"), **named)


def _options(layout, interleaved, cp_size, cp_rank) -> tuple:
    """The ops' options checked as the public API checks them, before torch's argument parser
    sees them (it would take None or 1.5 as a bool, and reject others with an unnamed error);
    the common case by type alone."""
    if (type(layout) is str and type(interleaved) is bool and type(cp_size) is int and type(cp_rank) is int
            and 0 <= cp_rank < cp_size < _plan.MAX_CP_SIZE):
        return layout, interleaved, cp_size, cp_rank
    if torch.compiler.is_compiling():  # symbolic ints (dynamic shapes) go to the op as they are
        return layout, interleaved, cp_size, cp_rank
    return _plan.check_options(layout, interleaved, cp_size, cp_rank)


def _flag(name: str, v) -> bool:
    return v if type(v) is bool else _plan.check_bool(name, v)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor, layout: str = "sbhd", *, interleaved: bool = False,
               cu_seqlens: Optional[torch.Tensor] = None, start_positions: Optional[torch.Tensor] = None,
               cp_size: int = 1, cp_rank: int = 0, out: Optional[torch.Tensor] = None,
               transpose_output_memory: bool = False) -> torch.Tensor:
    """Differentiable :func:`cupy_rope.apply_rope` for torch tensors (CUDA or CPU).

    Shapes, dtypes and keywords as :func:`cupy_rope.apply_rope`. Differentiable with respect
    to ``x`` only (``freqs`` is not differentiated). ``out=`` is not differentiable: it raises
    when ``x`` requires grad under autograd.

    Example:
        >>> import torch, cupy_rope, cupy_rope.torch as crt
        >>> f = torch.from_numpy(cupy_rope.rope_freqs(64, 16))
        >>> x = torch.randn(16, 2, 4, 64, requires_grad=True)
        >>> crt.apply_rope(x, f).sum().backward(); x.grad.shape
        torch.Size([16, 2, 4, 64])
    """
    _check_tensors(x=x, freqs=freqs, cu_seqlens=cu_seqlens, start_positions=start_positions)
    if out is not None:
        if _differentiated(x):
            raise ValueError("cupy_rope.torch.apply_rope: `out`: expected None when `x` requires grad or "
                             "carries a forward-mode tangent (an explicit output is not differentiable), "
                             "got a tensor")
        return _api.apply_rope(x, freqs, layout, interleaved=interleaved, cu_seqlens=cu_seqlens,
                               start_positions=start_positions, cp_size=cp_size, cp_rank=cp_rank, out=out,
                               transpose_output_memory=transpose_output_memory)
    return _dispatch_rope(x, freqs, layout, interleaved, cu_seqlens, start_positions, cp_size, cp_rank, False,
                          transpose_output_memory)


def _dispatch_rope(x, freqs, layout, interleaved, cu, sp, cp_size, cp_rank, backward, tom):
    """The autograd kernel's logic without the dispatcher trip. Under torch.compile the
    autograd.Function is traced and the graph calls the autograd-free op."""
    layout, interleaved, cp_size, cp_rank = _options(layout, interleaved, cp_size, cp_rank)
    return _rope_autograd(x, freqs, layout, interleaved, cu, sp, cp_size, cp_rank, backward,
                          _flag("transpose_output_memory", tom))


def apply_rope_backward(grad: torch.Tensor, freqs: torch.Tensor, layout: str = "sbhd", **kw) -> torch.Tensor:
    """Differentiable :func:`cupy_rope.apply_rope_backward` (its gradient is the forward).

    ``grad`` has the forward input's shape (any strides, stride 0 included), float32/16/bf16;
    keywords as :func:`apply_rope`. Returns dL/dx, contiguous.

    Example:
        >>> import torch, cupy_rope, cupy_rope.torch as crt
        >>> f = torch.from_numpy(cupy_rope.rope_freqs(64, 16))
        >>> crt.apply_rope_backward(torch.ones(16, 2, 4, 64), f).shape
        torch.Size([16, 2, 4, 64])
    """
    unknown = set(kw) - {"interleaved", "cu_seqlens", "start_positions", "cp_size", "cp_rank",
                         "transpose_output_memory"}
    if unknown:
        raise TypeError(f"cupy_rope.torch.apply_rope_backward: unexpected keyword `{sorted(unknown)[0]}`")
    _check_tensors(grad=grad, freqs=freqs, cu_seqlens=kw.get("cu_seqlens"), start_positions=kw.get("start_positions"))
    return _dispatch_rope(grad, freqs, layout, kw.get("interleaved", False), kw.get("cu_seqlens"),
                          kw.get("start_positions"), kw.get("cp_size", 1), kw.get("cp_rank", 0), True,
                          kw.get("transpose_output_memory", False))


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, freqs: torch.Tensor, layout: str = "sbhd", *,
                  interleaved: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
                  start_positions: Optional[torch.Tensor] = None, cp_size: int = 1, cp_rank: int = 0,
                  inplace: bool = False):
    """Differentiable :func:`cupy_rope.apply_rope_qk`: q and k rotated in one launch.

    ``q`` ``[.., hq, dq]`` and ``k`` ``[.., hk, dk]`` share the token dimensions, dtype, positions
    and table; any strides (e.g. views ``qkv[:, :, 0]``, ``qkv[:, :, 1]`` of a fused projection).
    Returns ``(q_out, k_out)``, differentiable in ``q`` and ``k``. ``inplace=True`` rotates ``q``
    and ``k`` themselves (not differentiable: raises when either requires grad) and returns them.

    Example:
        >>> import torch, cupy_rope, cupy_rope.torch as crt
        >>> f = torch.from_numpy(cupy_rope.rope_freqs(64, 16))
        >>> qkv = torch.randn(2, 16, 3, 4, 64, requires_grad=True)
        >>> q, k = crt.apply_rope_qk(qkv[:, :, 0], qkv[:, :, 1], f, "bshd")
        >>> (q.sum() + k.sum()).backward(); qkv.grad.shape
        torch.Size([2, 16, 3, 4, 64])
    """
    return _dispatch_qk(q, k, freqs, layout, interleaved, cu_seqlens, start_positions, cp_size, cp_rank,
                        inplace, False)


def apply_rope_qk_backward(dq: torch.Tensor, dk: torch.Tensor, freqs: torch.Tensor, layout: str = "sbhd", *,
                           interleaved: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
                           start_positions: Optional[torch.Tensor] = None, cp_size: int = 1,
                           cp_rank: int = 0, inplace: bool = False):
    """Differentiable :func:`cupy_rope.apply_rope_qk_backward` (its gradient is the forward).

    Example:
        >>> import torch, cupy_rope, cupy_rope.torch as crt
        >>> f = torch.from_numpy(cupy_rope.rope_freqs(64, 16))
        >>> gq, gk = crt.apply_rope_qk_backward(torch.ones(16, 1, 4, 64), torch.ones(16, 1, 2, 64), f)
        >>> gk.shape
        torch.Size([16, 1, 2, 64])
    """
    return _dispatch_qk(dq, dk, freqs, layout, interleaved, cu_seqlens, start_positions, cp_size, cp_rank,
                        inplace, True)


def _dispatch_qk(q, k, freqs, layout, interleaved, cu, sp, cp_size, cp_rank, inplace, backward):
    names = ("dq", "dk") if backward else ("q", "k")
    _check_tensors(**{names[0]: q, names[1]: k}, freqs=freqs, cu_seqlens=cu, start_positions=sp)
    layout, interleaved, cp_size, cp_rank = _options(layout, interleaved, cp_size, cp_rank)
    if _flag("inplace", inplace):
        if torch.compiler.is_compiling():
            torch.ops.cupy_rope.rope_qk_.default(q, k, freqs, layout, interleaved, cu, sp, cp_size, cp_rank,
                                                 backward)
        else:
            _rope_qk_inplace_autograd(q, k, freqs, layout, interleaved, cu, sp, cp_size, cp_rank, backward)
        return q, k
    return _rope_qk_autograd(q, k, freqs, layout, interleaved, cu, sp, cp_size, cp_rank, backward)


def apply_rope_pos(positions: torch.Tensor, q: torch.Tensor, k: Optional[torch.Tensor] = None, *,
                   cos_sin_cache: Optional[torch.Tensor] = None, freqs: Optional[torch.Tensor] = None,
                   inv_freq: Optional[torch.Tensor] = None, head_size: Optional[int] = None,
                   interleaved: bool = False, rope_dim_offset: int = 0, inverse: bool = False,
                   inplace: bool = False):
    """Differentiable :func:`cupy_rope.apply_rope_pos`: q (and k) at per-token positions in one
    launch; works eagerly, under ``torch.compile`` and in CUDA graphs.

    Shapes, dtypes and keywords as :func:`cupy_rope.apply_rope_pos`. Returns ``(q_out, k_out)``
    (``k_out`` None without ``k``), differentiable in ``q`` and ``k`` (the gradient is the inverse
    rotation; tables and positions get none). ``inplace=True`` rotates ``q`` and ``k`` themselves
    (not differentiable: raises when either requires grad) and returns them.

    Example:
        >>> import torch, cupy_rope, cupy_rope.torch as crt
        >>> cache = torch.from_numpy(cupy_rope.rope_cos_sin_cache(64, 256))
        >>> pos = torch.tensor([0, 7, 255])
        >>> q = torch.randn(3, 4 * 64, requires_grad=True)
        >>> qo, ko = crt.apply_rope_pos(pos, q, torch.randn(3, 1, 64), cos_sin_cache=cache, head_size=64)
        >>> qo.sum().backward(); q.grad.shape
        torch.Size([3, 256])
    """
    tname, table = _plan.pick_table({"cos_sin_cache": cos_sin_cache, "freqs": freqs, "inv_freq": inv_freq})
    _check_tensors(positions=positions, q=q, **{tname: table}, **({"k": k} if k is not None else {}))
    static = (tname, 0 if head_size is None else _plan.check_int("head_size", head_size, lo=1, hi=_I64),
              _plan.check_bool("interleaved", interleaved),
              _plan.check_int("rope_dim_offset", rope_dim_offset, lo=0, hi=_I64), _plan.check_bool("inverse", inverse))
    if _plan.check_bool("inplace", inplace):
        if torch.compiler.is_compiling():
            torch.ops.cupy_rope.rope_pos_.default(positions, q, k, table, *static)
        else:
            _rope_pos_inplace_autograd(positions, q, k, table, *static)
        return q, k
    outs = _rope_pos_autograd(positions, q, k, table, *static)
    return outs[0], (outs[1] if k is not None else None)


def apply_qkv_rope(qkv: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor, split=None,
                   layout: str = "sbhd", *, num_q_heads: Optional[int] = None, interleaved: bool = False,
                   cu_seqlens: Optional[torch.Tensor] = None, start_positions: Optional[torch.Tensor] = None,
                   cp_size: int = 1, cp_rank: int = 0):
    """Differentiable :func:`cupy_rope.apply_qkv_rope`: ``(q, k, v)``, gradient to ``qkv``.

    Example:
        >>> import torch, cupy_rope, cupy_rope.torch as crt
        >>> f = torch.from_numpy(cupy_rope.rope_freqs(64, 8))
        >>> qkv = torch.randn(8, 1, 2, 6 * 64, requires_grad=True)
        >>> q, k, v = crt.apply_qkv_rope(qkv, f, f, split=(256, 64, 64))
        >>> (q.sum() + k.sum() + v.sum()).backward(); qkv.grad.shape
        torch.Size([8, 1, 2, 384])
    """
    _check_tensors(qkv=qkv, q_freqs=q_freqs, k_freqs=k_freqs, cu_seqlens=cu_seqlens, start_positions=start_positions)
    sp = list(_plan.qkv_split(qkv.shape, split, num_q_heads, layout))
    layout, interleaved, cp_size, cp_rank = _options(layout, interleaved, cp_size, cp_rank)
    args = (q_freqs, k_freqs, sp, layout, interleaved, cu_seqlens, start_positions, cp_size, cp_rank)
    if _forward_mode(qkv):
        return _linear_dual(lambda t: _qkv_op(t, *args), qkv)
    return _qkv_op(qkv, *args)


def apply_qkv_rope_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, q_freqs: torch.Tensor,
                            k_freqs: torch.Tensor, split=None, layout: str = "sbhd", *,
                            num_q_heads: Optional[int] = None, interleaved: bool = False,
                            cu_seqlens: Optional[torch.Tensor] = None,
                            start_positions: Optional[torch.Tensor] = None, cp_size: int = 1, cp_rank: int = 0):
    """Differentiable :func:`cupy_rope.apply_qkv_rope_backward`: ``dq [.., g*n, d]``,
    ``dk``/``dv [.., g, d]`` (one dtype: float32, float16 or bfloat16; CUDA or CPU) -> the
    packed gradient ``dqkv [.., g, (n+2)*d]`` in that dtype (its gradient is the forward).
    ``split``/``num_q_heads`` as :func:`cupy_rope.apply_qkv_rope_backward` (optional: the
    gradients' shapes give the split when there are KV groups).

    Example:
        >>> import torch, cupy_rope, cupy_rope.torch as crt
        >>> f = torch.from_numpy(cupy_rope.rope_freqs(64, 8))
        >>> crt.apply_qkv_rope_backward(torch.ones(8, 1, 8, 64), torch.ones(8, 1, 2, 64),
        ...                             torch.ones(8, 1, 2, 64), f, f).shape
        torch.Size([8, 1, 2, 384])
    """
    _check_tensors(dq=dq, dk=dk, dv=dv, q_freqs=q_freqs, k_freqs=k_freqs, cu_seqlens=cu_seqlens,
                   start_positions=start_positions)
    infos = [_plan.compact_info(t.shape, str(t.dtype).replace("torch.", "")) for t in (dq, dk, dv)]
    n, d = _plan.qkv_backward_heads(*infos, split, _plan.check_layout(layout), num_q_heads)
    layout, interleaved, cp_size, cp_rank = _options(layout, interleaved, cp_size, cp_rank)
    args = (q_freqs, k_freqs, [n * d, d, d], layout, interleaved, cu_seqlens, start_positions, cp_size, cp_rank)
    if _forward_mode(dq, dk, dv):
        return _linear_dual(lambda a, b, c: _qkv_bwd_op(a, b, c, *args), dq, dk, dv)
    return _qkv_bwd_op(dq, dk, dv, *args)


# ----------------------------------------------------------------------------- module
class RotaryPositionEmbedding(torch.nn.Module):
    """TransformerEngine's ``RotaryPositionEmbedding``: ``forward(max_seq_len, offset=0)``
    returns the ``[max_seq_len, 1, 1, d2]`` float32 angle table on the module's device
    (see :func:`cupy_rope.rope_freqs`; spec section 2).

    Example:
        >>> import cupy_rope.torch as crt
        >>> crt.RotaryPositionEmbedding(128, rotary_percent=0.5)(16).shape
        torch.Size([16, 1, 1, 64])
    """

    def __init__(self, dim: int, rotary_percent: float = 1.0, seq_len_interpolation_factor=None,
                 pretrained_max_position_embeddings=None, rotary_base: float = 10000.0,
                 interleaved: bool = False):
        super().__init__()
        self.dim, self.rotary_percent = dim, rotary_percent
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        self.rotary_base, self.interleaved = rotary_base, interleaved
        _plan.check_number("rotary_base", rotary_base, 0.0)
        _freqs.rope_freqs(dim, 0, rotary_percent=rotary_percent, base=rotary_base, interleaved=interleaved,
                          seq_len_interpolation_factor=seq_len_interpolation_factor,
                          pretrained_max_position_embeddings=pretrained_max_position_embeddings)  # validate now
        self.register_buffer("_device_anchor", torch.empty(0), persistent=False)

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        return _freqs.rope_freqs(self.dim, max_seq_len, rotary_percent=self.rotary_percent,
                               base=self.rotary_base, interleaved=self.interleaved,
                               seq_len_interpolation_factor=self.seq_len_interpolation_factor,
                               pretrained_max_position_embeddings=self.pretrained_max_position_embeddings,
                               offset=offset, like=self._device_anchor)
