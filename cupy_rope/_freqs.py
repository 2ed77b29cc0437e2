"""The standard angle table (spec section 2): TransformerEngine's ``RotaryPositionEmbedding``."""

from __future__ import annotations

import math

import numpy as np

from . import _interop, _plan


MAX_ROWS = 2**31  # bound on a table's rows and width (2^31 rows of one float32 pair: 16 GiB)


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
    dim = _plan.check_int("dim", dim, lo=1, hi=MAX_ROWS)
    max_seq_len = _plan.check_int("max_seq_len", max_seq_len, lo=0, hi=MAX_ROWS)
    interleaved = _plan.check_bool("interleaved", interleaved)
    rp = _plan.check_number("rotary_percent", rotary_percent, 0.0)
    if not rp <= 1.0:
        raise ValueError(f"cupy_rope: `rotary_percent`: expected 0 < rotary_percent <= 1, got {rotary_percent}")
    base = _plan.check_number("base", base, 0.0)
    offset = _plan.check_int("offset", offset)
    P, F = pretrained_max_position_embeddings, seq_len_interpolation_factor
    if F is not None:
        F = _plan.check_number("seq_len_interpolation_factor", F, 0.0)
    if P is not None:
        P = _plan.check_int("pretrained_max_position_embeddings", P, lo=1)
    dimp = int(dim * rp) if rp < 1.0 else dim
    if dimp < 1:
        raise ValueError(f"cupy_rope: `rotary_percent`: expected int(dim * rotary_percent) >= 1, got {dimp}")
    kind = _interop.kind_of(like, "like") if like is not None else "numpy"
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
        inv_freq = 1.0 / (base ** exps)
    else:  # powf correctly rounded (through float64), then the float32 reciprocal
        inv_freq = f32(1.0) / (np.float64(f32(base)) ** exps.astype(np.float64)).astype(f32)
    seq = arange(max_seq_len) + offset
    if P is not None and F is not None:
        scale = 1 / (max_seq_len / P) if max_seq_len > P * F else 1 / F
        seq = seq * (scale if kind == "torch" else f32(scale))
    f = xp.outer(seq, inv_freq)
    if interleaved:
        emb = xp.stack([f, f], -1).reshape(max_seq_len, 2 * f.shape[-1])  # (no -1: max_seq_len may be 0)
    else:
        emb = xp.concatenate([f, f], -1)
    emb = emb.reshape(max_seq_len, 1, 1, emb.shape[-1])
    if kind == "torch":
        return _interop.static_table(emb.contiguous())
    return to_like(np.ascontiguousarray(emb), like)


# ----------------------------------------------------------------------------- serving-side tables
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


def _scaling_param(scaling: dict, name: str, default=None, required: bool = False):
    v = scaling.get(name, default)
    if v is None and required:
        raise ValueError(f"cupy_rope: `rope_scaling`: expected a {name!r} entry for rope_type "
                         f"{scaling.get('rope_type', scaling.get('type'))!r}, got none")
    if v is not None and not isinstance(v, (list, tuple, np.ndarray)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not float(v) > 0:
            raise ValueError(f"cupy_rope: `rope_scaling`: expected {name!r} a number > 0, got {v!r}")
    return v


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rotary_dim, base=10000.0, rope_scaling=None, *, max_position_embeddings=None,
                  seq_len=None):
    """Inverse frequencies of a model's RoPE, in float64, with Hugging Face's scaling types.

    ``rope_scaling`` is a model config's dict (``rope_type`` or ``type``: ``"default"``,
    ``"linear"`` (``factor``), ``"dynamic"`` (NTK; ``factor``, uses ``seq_len``),
    ``"yarn"`` (``factor``, ``beta_fast`` 32, ``beta_slow`` 1, ``mscale``, ``mscale_all_dim``,
    ``attention_factor``, ``original_max_position_embeddings``, ``truncate`` True),
    ``"llama3"`` (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``), ``"longrope"`` (``short_factor``, ``long_factor``,
    ``factor``, ``attention_factor``, ``original_max_position_embeddings``; the long factors when
    ``seq_len`` exceeds the original length)), with the transformers defaults; None means
    ``"default"``. ``max_position_embeddings`` is the config's (needed by dynamic, yarn, longrope).

    Returns ``(inv_freq, attention_factor)``: float64 NumPy ``[rotary_dim / 2]`` and the factor
    by which cos and sin are scaled (YaRN, LongRoPE; 1.0 otherwise). Computed in float64 (the
    published formulas, evaluated exactly where transformers uses float32).

    Example:
        >>> import cupy_rope
        >>> inv, att = cupy_rope.rope_inv_freq(128, 500000.0, {"rope_type": "llama3", "factor": 8.0,
        ...     "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
        >>> inv.shape, att
        ((64,), 1.0)
    """
    dim = _plan.check_int("rotary_dim", rotary_dim, lo=2, hi=MAX_ROWS)
    if dim % 2:
        raise ValueError(f"cupy_rope: `rotary_dim`: expected an even rotary width, got {dim}")
    base = _plan.check_number("base", base, 1.0)
    if seq_len is not None:
        seq_len = _plan.check_int("seq_len", seq_len, lo=0)
    if max_position_embeddings is not None:
        max_position_embeddings = _plan.check_int("max_position_embeddings", max_position_embeddings, lo=1)
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise TypeError(f"cupy_rope: `rope_scaling`: expected a dict or None, got {type(rope_scaling).__name__}")
    sc = dict(rope_scaling or {})
    rtype = sc.get("rope_type", sc.get("type", "default"))
    if rtype not in ROPE_TYPES:
        raise ValueError(f"cupy_rope: `rope_scaling`: expected rope_type one of {ROPE_TYPES}, got {rtype!r}")
    exps = np.arange(0, dim, 2, dtype=np.float64) / dim
    inv = 1.0 / base ** exps
    att = 1.0
    mpe = max_position_embeddings
    if rtype == "linear":
        inv = inv / float(_scaling_param(sc, "factor", required=True))
    elif rtype == "dynamic":
        factor = float(_scaling_param(sc, "factor", required=True))
        mpe = _need_mpe(mpe, rtype)
        L = seq_len if seq_len is not None and seq_len > mpe else mpe
        b = base * ((factor * L / mpe) - (factor - 1)) ** (dim / (dim - 2))
        inv = 1.0 / b ** exps
    elif rtype == "yarn":
        factor = float(_scaling_param(sc, "factor", required=True))
        omp = _scaling_param(sc, "original_max_position_embeddings")
        if omp is not None and mpe is not None:
            factor = mpe / omp  # transformers: the factor implied by the two lengths
        omp = omp if omp is not None else _need_mpe(mpe, rtype)
        att = _scaling_param(sc, "attention_factor")
        if att is None:
            ms, msa = sc.get("mscale"), sc.get("mscale_all_dim")
            att = _yarn_mscale(factor, ms) / _yarn_mscale(factor, msa) if ms and msa else _yarn_mscale(factor)
        beta_fast, beta_slow = _scaling_param(sc, "beta_fast") or 32, _scaling_param(sc, "beta_slow") or 1

        def corr_dim(rot):
            return dim * math.log(omp / (rot * 2 * math.pi)) / (2 * math.log(base))

        low, high = corr_dim(beta_fast), corr_dim(beta_slow)
        if sc.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extra = 1 - ramp  # the share of the unscaled (extrapolated) frequency
        inv = (inv / factor) * (1 - extra) + inv * extra
        att = float(att)
    elif rtype == "llama3":
        factor = float(_scaling_param(sc, "factor", required=True))
        lo_f = float(_scaling_param(sc, "low_freq_factor", required=True))
        hi_f = float(_scaling_param(sc, "high_freq_factor", required=True))
        old = float(_scaling_param(sc, "original_max_position_embeddings", required=True))
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / lo_f, inv / factor, inv)
        smooth = (old / wavelen - lo_f) / (hi_f - lo_f)
        medium = ~(wavelen < old / hi_f) & ~(wavelen > old / lo_f)
        inv = np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    elif rtype == "longrope":
        short = np.asarray(_scaling_param(sc, "short_factor", required=True), np.float64)
        long_ = np.asarray(_scaling_param(sc, "long_factor", required=True), np.float64)
        for name, f in (("short_factor", short), ("long_factor", long_)):
            if f.shape != (dim // 2,):
                raise ValueError(f"cupy_rope: `rope_scaling`: expected {name} of length rotary_dim / 2 = "
                                 f"{dim // 2}, got shape {f.shape}")
        omp = _scaling_param(sc, "original_max_position_embeddings")
        factor = _scaling_param(sc, "factor")
        if omp is not None:
            factor = _need_mpe(mpe, rtype) / omp
        else:
            omp = _need_mpe(mpe, rtype)
        att = _scaling_param(sc, "attention_factor")
        if att is None:
            att = 1.0 if factor is None or factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(omp))
        ext = long_ if seq_len is not None and seq_len > omp else short
        inv = 1.0 / (ext * base ** exps)
        att = float(att)
    return inv, float(att)


def _need_mpe(mpe, rtype):
    if mpe is None:
        raise ValueError(f"cupy_rope: `max_position_embeddings`: expected the model config's value for "
                         f"rope_type {rtype!r}, got None")
    return mpe


def rope_cos_sin_cache(rotary_dim, max_position, base=10000.0, rope_scaling=None, *,
                       max_position_embeddings=None, seq_len=None, dtype="float32", offset=0, like=None):
    """A cos/sin cache ``[max_position, rotary_dim]`` (cos of pair i in column i, sin in column
    ``rotary_dim/2 + i``: vLLM's and FlashInfer's layout) for :func:`apply_rope_pos`; row r holds
    position ``offset + r``.

    Every entry is the float64 cos/sin of the float64 angle ``position * inv_freq[i]``
    (:func:`rope_inv_freq`, same scaling arguments), times the attention factor, rounded once to
    ``dtype`` (float32, float16 or bfloat16): correct at any position below 2^24, where a float32
    angle is off by up to ~0.03 rad at position 10^6. In ``like``'s array library and device
    (NumPy when None).

    Example:
        >>> import cupy_rope
        >>> cupy_rope.rope_cos_sin_cache(64, 2048, 1e6).shape
        (2048, 64)
    """
    inv, att = rope_inv_freq(rotary_dim, base, rope_scaling, max_position_embeddings=max_position_embeddings,
                             seq_len=seq_len)
    n = _plan.check_int("max_position", max_position, lo=0, hi=MAX_ROWS)
    offset = _plan.check_int("offset", offset, lo=0)
    dtype = _dtype_name(dtype)
    ang = (offset + np.arange(n, dtype=np.float64))[:, None] * inv[None, :]
    cache = np.concatenate([np.cos(ang) * att, np.sin(ang) * att], axis=1)
    if dtype == "bfloat16":
        import ml_dtypes

        cache = cache.astype(ml_dtypes.bfloat16)  # from float64: rounded once
    else:
        cache = cache.astype(dtype)
    return to_like(np.ascontiguousarray(cache), like)


def _dtype_name(dtype) -> str:
    """``dtype`` (a name, NumPy dtype or scalar type) as one of the float dtypes' names."""
    try:
        if not isinstance(dtype, (str, np.dtype, type)):
            raise TypeError
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    except TypeError:
        raise TypeError(f"cupy_rope: `dtype`: expected a dtype (e.g. 'bfloat16'), got {type(dtype).__name__}") from None
    if name not in _plan.FLOAT_DTYPES:
        raise ValueError(f"cupy_rope: `dtype`: expected one of {_plan.FLOAT_DTYPES}, got {dtype!r}")
    return name


def to_like(a: np.ndarray, like):
    """``a`` in ``like``'s array library, on its device (NumPy when None)."""
    if like is None:
        return a
    kind = _interop.kind_of(like, "like")
    if kind == "numpy":
        return a
    if kind == "cupy":
        import cupy

        with cupy.cuda.Device(like.device.id):
            return cupy.asarray(a)
    if kind == "jax":
        import jax

        return jax.device_put(a, next(iter(like.devices())))
    if kind == "torch":
        return _interop.static_table(_interop.from_numpy(a, "torch").to(like.device))
    raise TypeError(f"cupy_rope: `like`: expected a NumPy, CuPy, torch or JAX array, got {type(like).__name__}")
