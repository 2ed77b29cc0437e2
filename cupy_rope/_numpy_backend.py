"""The NumPy backend: the spec's arithmetic, vectorised, for arrays on the CPU.

Functions take the array module ``xp`` (NumPy, or ``jax.numpy`` for the jittable CPU path of
``cupy_rope.jax``) and never update arrays in place. Arithmetic in float32 with one rounding
at the end, as the kernels do; bf16 through ``ml_dtypes`` (NumPy) or JAX's own bf16.
"""

from __future__ import annotations

from ._plan import QkvPlan, RopePlan, Table
from ._positions import table_mask, token_positions


def _channels(xp, half, interleaved: bool):
    """Per-pair values [.., d2/2] -> per-channel [.., d2] (both members of a pair alike)."""
    if interleaved:
        return xp.stack([half, half], axis=-1).reshape(half.shape[:-1] + (2 * half.shape[-1],))
    return xp.concatenate([half, half], axis=-1)


def _cos_sin(xp, table_arr, table: Table, p, mask, interleaved: bool):
    """cos and sin per channel, float32, [lead..., 1, d2], for tokens at positions ``p`` (rows
    outside ``mask`` arbitrary): from angles (cos/sin of the float32 angle), a cos/sin cache (its
    values), or inverse frequencies (the float64 angle p * inv_freq, rounded once)."""
    d2 = table.d2
    if table.kind == "inv_freq":
        inv = xp.asarray(table_arr).astype(xp.float64)
        ang = xp.where(mask, p, 0).astype(xp.float64)[..., None] * inv
        c, s = (_channels(xp, f(ang).astype(xp.float32), interleaved) for f in (xp.cos, xp.sin))
        return c[..., None, :], s[..., None, :]
    f2 = xp.asarray(table_arr).reshape(table_arr.shape[0], d2)
    if table.rows == 0:  # an empty table: every token is outside it and copied
        f2 = xp.zeros((1, d2), f2.dtype)
    row = f2[xp.where(mask, p, 0)][..., None, :].astype(xp.float32)  # lead..., 1, d2
    if table.kind == "cos_sin":
        h2 = d2 // 2
        return _channels(xp, row[..., :h2], interleaved), _channels(xp, row[..., h2:], interleaved)
    return xp.cos(row), xp.sin(row)


def _rotate(xp, x, freqs, table: Table, positions, interleaved: bool, backward: bool, off: int = 0):
    """Rotate ``x`` [lead..., h, d] at ``positions`` = (p, in_seq), channels off .. off + d2;
    tokens outside a sequence or the table are copied (spec 5.4)."""
    p, in_seq = positions
    mask = table_mask(xp, p, in_seq, table.rows)
    d2 = table.d2
    c, s = _cos_sin(xp, freqs, table, p, mask, interleaved)
    xr = x[..., off:off + d2].astype(xp.float32)
    if interleaved:
        sl_f, sl_s = (Ellipsis, slice(0, d2, 2)), (Ellipsis, slice(1, d2, 2))
    else:
        sl_f, sl_s = (Ellipsis, slice(0, d2 // 2)), (Ellipsis, slice(d2 // 2, d2))
    xf, xs, cf, cs, sf, ss = xr[sl_f], xr[sl_s], c[sl_f], c[sl_s], s[sl_f], s[sl_s]
    if backward:
        yf = xf * cf + xs * ss
        ys = xs * cs - xf * sf
    else:
        yf = xf * cf - xs * sf
        ys = xs * cs + xf * ss
    if interleaved:
        yr = xp.stack([yf, ys], axis=-1).reshape(xr.shape)
    else:
        yr = xp.concatenate([yf, ys], axis=-1)
    yr = xp.where(mask[..., None, None], yr.astype(x.dtype), x[..., off:off + d2])
    parts = [x[..., :off], yr, x[..., off + d2:]]
    return xp.concatenate([q for q in parts if q.shape[-1]], axis=-1) if d2 < x.shape[-1] else yr


def rope(xp, plan: RopePlan, x, freqs, cu=None, sp=None, ids=None):
    """Spec 3 (forward) or 4 (backward, ``plan.backward``) for one tensor ``[tokens.., h, d]``;
    ``ids``: the positions API's per-token positions. New array."""
    positions = token_positions(xp, plan.pos, tuple(x.shape[:-2]), cu, sp, ids=ids)
    return _rotate(xp, x, freqs, plan.table, positions, plan.interleaved, plan.backward, plan.rot_off)


def _rotate_qk(xp, plan: QkvPlan, q, k, q_freqs, k_freqs, cu, sp, backward: bool):
    """q and k rotated with their own tables at the same positions (computed once)."""
    positions = token_positions(xp, plan.pos, plan.lead_shape, cu, sp)
    return (_rotate(xp, q, q_freqs, plan.q_table, positions, plan.interleaved, backward),
            _rotate(xp, k, k_freqs, plan.k_table, positions, plan.interleaved, backward))


def qkv_forward(xp, plan: QkvPlan, qkv, q_freqs, k_freqs, cu=None, sp=None):
    """Spec 6 forward: packed [lead..., g, (n+2)d] -> (q, k, v)."""
    lead, g, n, d = plan.lead_shape, plan.groups, plan.n_q, plan.d
    q = qkv[..., : n * d].reshape(lead + (g * n, d))
    k = qkv[..., n * d: (n + 1) * d]
    v = qkv[..., (n + 1) * d:]
    q, k = _rotate_qk(xp, plan, q, k, q_freqs, k_freqs, cu, sp, False)
    return q, k, xp.array(v, copy=True)


def qkv_backward(xp, plan: QkvPlan, dq, dk, dv, q_freqs, k_freqs, cu=None, sp=None):
    """Spec 6 backward: (dq, dk, dv) -> packed dqkv."""
    lead, g, n, d = plan.lead_shape, plan.groups, plan.n_q, plan.d
    gq, gk = _rotate_qk(xp, plan, dq, dk, q_freqs, k_freqs, cu, sp, True)
    return xp.concatenate([gq.reshape(lead + (g, n * d)), gk, dv.astype(gk.dtype)], axis=-1)
