"""Independent float64 reference for the tests (not the library's code paths).

Positions are built by literally cutting each global sequence into 2*cp_size chunks and
concatenating the rank's two chunks (spec 5.1), not by the closed formula; the rotation is
written per pair in float64 from the spec's equations, one token at a time.
"""

import numpy as np


def dual_chunk_positions(L_local, cp_size, cp_rank):
    """Global positions (0-based within the sequence) of the local rows of one sequence."""
    if cp_size == 1:
        return np.arange(L_local)
    Lg = L_local * cp_size
    chunks = np.array_split(np.arange(Lg), 2 * cp_size)
    return np.concatenate([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]])


def token_table(layout, lead_shape, cu_seqlens=None, start_positions=None, cp_size=1, cp_rank=0):
    """Dict token index tuple -> position (tokens in no sequence are absent)."""
    out = {}
    sp = None if start_positions is None else np.asarray(start_positions).astype(np.int64)
    if layout == "thd":
        cu = np.asarray(cu_seqlens).astype(np.int64)
        for i in range(len(cu) - 1):
            a, b = cu[i] // cp_size, cu[i + 1] // cp_size
            local = dual_chunk_positions(b - a, cp_size, cp_rank) if b > a else []
            for j, g in enumerate(local):
                out[(a + j,)] = int(g) + (0 if sp is None else int(sp[i]))
        return out
    if layout == "sbhd":
        s, b = lead_shape
    else:
        b, s = lead_shape
    local = dual_chunk_positions(s, cp_size, cp_rank)
    for si in range(s):
        for bi in range(b):
            key = (si, bi) if layout == "sbhd" else (bi, si)
            out[key] = int(local[si]) + (0 if sp is None else int(sp[bi]))
    return out


def pairs(d2, interleaved):
    if interleaved:
        return [(2 * k, 2 * k + 1) for k in range(d2 // 2)]
    return [(i, i + d2 // 2) for i in range(d2 // 2)]


def rope_ref(x, freqs, layout="sbhd", interleaved=False, cu_seqlens=None, start_positions=None,
             cp_size=1, cp_rank=0, backward=False):
    """float64 result of spec section 3 (forward) or 4 (backward); x any dtype."""
    x64 = np.asarray(x).astype(np.float64)
    f = np.asarray(freqs, np.float32).reshape(freqs.shape[0], -1).astype(np.float64)
    S, d2 = f.shape
    y = x64.copy()
    lead = x64.shape[:-2]
    table = token_table(layout, lead, cu_seqlens, start_positions, cp_size, cp_rank)
    for tok, p in table.items():
        if not 0 <= p < S:
            continue
        th = f[p]
        xt = x64[tok]  # [h, d]
        yt = y[tok]
        for a, b in pairs(d2, interleaved):
            if backward:
                yt[:, a] = xt[:, a] * np.cos(th[a]) + xt[:, b] * np.sin(th[b])
                yt[:, b] = xt[:, b] * np.cos(th[b]) - xt[:, a] * np.sin(th[a])
            else:
                yt[:, a] = xt[:, a] * np.cos(th[a]) - xt[:, b] * np.sin(th[a])
                yt[:, b] = xt[:, b] * np.cos(th[b]) + xt[:, a] * np.sin(th[b])
    return y


def term_scale(x, freqs_shape_d2):
    """Magnitude scale of the terms that make each output element (for tolerances)."""
    x64 = np.abs(np.asarray(x).astype(np.float64))
    d2 = freqs_shape_d2
    sc = x64.copy()
    if d2:
        m = x64[..., :d2].max(axis=-1, keepdims=True)
        sc[..., :d2] = x64[..., :d2] + m
    return sc


MANT = {"float32": 23, "float16": 10, "bfloat16": 7}


def assert_close_to_ref(y, ref, x, d2, dtype_name, what="", scale=None):
    """Each element within 1 ulp of the dtype of the reference plus float32 rounding noise.

    ``scale``: magnitude of the terms of each element (default: from ``x`` and ``d2``)."""
    y64 = np.asarray(y).astype(np.float64)
    assert y64.shape == ref.shape, (y64.shape, ref.shape)
    assert np.isfinite(y64).all(), f"{what}: non-finite output (unwritten element?)"
    mag = np.maximum(np.abs(ref), 2.0 ** -14)
    ulp = 2.0 ** (np.floor(np.log2(mag)) - MANT[dtype_name])
    tol = ulp + 16 * 2.0 ** -23 * (term_scale(x, d2) if scale is None else scale)
    err = np.abs(y64 - ref)
    bad = err > tol
    if bad.any():
        i = tuple(int(v[0]) for v in np.nonzero(bad))
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} elements off; first at {i}: "
                             f"got {y64[i]!r}, want {ref[i]!r} (tol {tol[i]:.3g})")


def qkv_split_ref(qkv, n, d):
    lead = qkv.shape[:-2]
    g = qkv.shape[-2]
    q = qkv[..., : n * d].reshape(lead + (g * n, d))
    k = qkv[..., n * d:(n + 1) * d]
    v = qkv[..., (n + 1) * d:]
    return q, k, v
