"""The work split: vector width, threads per unit of work, grid; and the launch specs built from
a resolved plan and the arrays' descriptors (framework-neutral, no device needed).

The rope and QKV kernels (``kernels_cu/rope.cu``, ``qkv_rope.cu``) share one split: each token
has sets of rows (rope: heads; QKV: a group's n + 2 heads), each row units of channels; a thread
takes one unit of the rows c, c + C, ... of one set and computes that unit's cos/sin once.
"""

from __future__ import annotations

from . import _abi, _kernels
from ._plan import ITEMSIZE, norm_strides, split_tokens, token_strides

# Resident threads per SM the grid aims at; the rest of the rows loop inside threads. Like
# _MAX_VEC_BYTES (widest vector; 0: 16 bytes), a fixed constant of the library: only the
# benchmark harness changes it, in its own process (benchmarks/run.py --tune).
_THREADS_PER_SM = 512
_MAX_VEC_BYTES = 0
# Launches where every thread gets one row (C = heads) take a one-row kernel (the same
# arithmetic, less code and latency per thread): ``rope1`` with an angle table, ``rope1c`` with a
# cos/sin cache; inverse frequencies stay on the streaming kernel. Fixed like the constants above;
# tests set it False to run the streaming kernel on every shape.
_ONE_ROW = True
_ONE_ROW_THREADS = 2**31  # one-row launches index threads in 32 bits (their fast division)
_ONE_ROW_KINDS = {_abi.ANGLES: "rope1", _abi.COS_SIN32: "rope1c", _abi.COS_SIN_T: "rope1c"}
# Streaming launches of 16-byte vectors whose rows hold copied units as well as rotated ones (a
# rotary slice narrower than the head) take the mixed kernels (``ropem``: one loop for both, so
# that a warp's lanes stream together; benchmarks/NOTES.md). Tests set it False to run ``rope``.
_MIXED = True
# Threads per block of a one-row launch (at most _kernels.BLOCK, a multiple of 32): blocks of 64
# spread a decode step's few blocks over more SMs (H200, one session, forward us of the decode rows
# with an angle table / a cos/sin cache: 64: 1.88 / 1.52-1.53; 128: 1.89-1.92 / 1.54-1.60; 256:
# 2.04-2.05 / 1.73-1.75; 32: 1.94-1.97 / 1.79; benchmarks/NOTES.md).
# Fixed like the constants above; the benchmark harness's --tune ONE_ROW_BLOCK=N changes it in
# its own process.
_ONE_ROW_BLOCK = 64
# The widest vector (elements; 0: any) of a small one-row launch with an angle table (``rope1``),
# whose threads compute one sincosf per rotary pair they hold: 16-bit dtypes take 8-byte vectors
# (four sincosf per thread, twice the threads) when the launch still has one row per thread with
# them and at most _NARROW_THREADS_PER_SM threads per SM. A decode step leaves about one warp per
# scheduler, and each thread's chain is what it waits for; with more warps the doubled memory
# instructions cost more than the shorter chains save. H200, one session, forward us of decode
# steps (32 heads, d 128, bf16) with 16- / 8-byte vectors: 32 sequences 1.78-1.81 / 1.57, 64
# sequences 1.89-1.90 / 1.77-1.78, 128 sequences 2.13-2.17 / 2.39 (benchmarks/NOTES.md). Fixed like
# the constants above; the benchmark harness's --tune ONE_ROW_ANGLE_VEC=N changes it.
# Where the wide launch's threads share their sincosf (shares_sincos: one per thread at any width)
# only the narrow launch's extra threads remain, and the limit is _NARROW_SHARED_THREADS_PER_SM:
# H200, one session, forward us with 8- / 16-byte vectors, both sharing: 32 sequences 1.65 / 1.69-1.70,
# 64 sequences 1.86-1.87 / 1.80-1.81, 128 sequences 1.98 (16-byte; not sharing 2.20-2.21).
_ONE_ROW_ANGLE_VEC = 4
_NARROW_THREADS_PER_SM = 256
_NARROW_SHARED_THREADS_PER_SM = 128
# Rope rows of a unit count that is not a power of two (head sizes 80, 96, 112 with 16-byte
# vectors) aim at _ODD_UNITS_FACTOR times _THREADS_PER_SM, as long as every thread keeps at least
# _ODD_UNITS_MIN_ROWS rows: at 512 threads per SM their launches had 2.4-2.9 blocks per SM and 8-16
# rows per thread, and the fastest splits had 4-6 rows. H200, one session, forward us at 512 /
# 1024 / 2048 / 4096 threads per SM: sbhd 4096x2x32x80 30.2-31.1 / 28.7-28.9 / 27.6-27.7 /
# 30.7-31.2; sbhd 4096x2x32x96 32.5-33.3 / 32.1-32.2 / 31.5-31.8 / 33.0-33.3; bshd 4x4096x16x80
# 32.1-32.8 / 29.6-29.7 / 27.2-27.6 / 31.3-31.4; bshd 2x8192x8x80 16.7-17.2 / 15.9-16.0 / 16.9-17.3 /
# 22.7-23.0; head size 128 (8 units) best at 512 (benchmarks/NOTES.md). Fixed like the constants
# above; --tune ODD_UNITS_FACTOR=N / ODD_UNITS_MIN_ROWS=N change them.
_ODD_UNITS_FACTOR = 4
_ODD_UNITS_MIN_ROWS = 4
# One-row launches with an angle table (``rope1``) share each token's sincosf among the threads
# of its heads (each thread computes one pair and reads its unit's from shared memory; the kernel's
# RopeParams.share) where ``shares_sincos`` allows it. Fixed like the constants above; tests and the
# benchmark harness's --tune SHARE_SINCOS=0 turn it off.
_SHARE_SINCOS = True
# Launches of 16-byte vectors with a cos/sin cache that the split leaves to the streaming kernel
# take the two-row kernel (``rope2c``: every thread two rows of its token, loaded up front, in
# blocks of _kernels.BLOCK) where _TWO_ROWS is set: H200, one session, forward us of the serving
# prefill row (16K tokens, 32 q + 8 k heads, d 128, bf16 cache): 91.5 / 92.0 against 95.1 / 95.6.
# With an angle table the same two-row split (computing the unit's sincosf once per two rows)
# was slower than the streaming kernel on every row: sbhd 4096x2x32x128 45.1 against 39.8, thd
# 32K tokens 164.2 against 146.6 (benchmarks/NOTES.md). Fixed like the constants above; the
# benchmark harness's --tune TWO_ROWS=0|1 changes it.
_TWO_ROWS = True
_TWO_ROW_KINDS = {_abi.COS_SIN32: "rope2c", _abi.COS_SIN_T: "rope2c"}
# Launches of 16-byte vectors with an angle table that the split leaves to the streaming kernel take
# the lean kernel (``ropel``: at most CUPY_ROPE_LEAN_ROWS rows of one token per thread, the kernel's
# define, loaded up front; 32-bit offsets) where _LEAN is set and ``lean_fits`` allows: H200, one
# session, forward us, streaming / lean: sbhd 4096x2x32x128 40.0-41.0 / 38.6-39.0; thd 32K tokens in
# 16 sequences 147.8-148.1 / 138.5-138.7; sbhd fp32 d 64 19.1-19.2 / 18.5-18.6; sbhd d 80 28.7-28.8
# / 27.7-27.8; sbhd cp_size 4 40.2-40.3 / 38.7-38.8; but thd 65536 tokens in 1024 sequences
# 149.3-150.2 / 153.0-153.4 (every thread's binary search over cu_seqlens). With the body without
# per-row branches (H200, medians): 65536 tokens in 1024 / 2048 / 4096 sequences 150.5 / 147.9,
# 150.5 / 154.1, 150.8 / 159.5; q32+k8, 16384 tokens in 1024 sequences 97.0 / 99.5; 8192 tokens in
# 512 sequences 42.3 / 46.1 (an H100 favours lean up to 2048 sequences): hence at most
# _LEAN_MAX_SEQS sequences, 64. Where the search runs in 32 bits (contiguous int32 cu_seqlens,
# cp_size 1; the kernels' token_position), H200, medians, streaming / lean: 65536 tokens in 1024 /
# 2048 / 4096 sequences 149.8 / 140.9, 149.9 / 146.1, 150.0 / 151.9; q32+k8, 16384 tokens in 1024 /
# 4096 sequences 96.4 / 93.4, 96.5 / 99.0; 8192 tokens in 512 sequences 41.8 / 43.1: so such
# launches also take it up to _LEAN_MAX_FAST_SEQS sequences, 2048, of _LEAN_MIN_SEQ_TOKENS tokens,
# 32, or more on average (benchmarks/NOTES.md, thirty-sixth session). Two rows per thread:
# 40.0-40.2, 22.3, 149-151, 166-168, 18.6, 27.1-27.4, 40.3. The first lean body lost on 8 heads
# (bshd 2x8192x8x128, 20.9 / 21.7); the one without per-row branches does not: H200, bshd
# 2x8192x8x128 forward 21.08, 20.82 / 21.06, 20.59; q+k of 32 + 8 heads (GQA: the 8-head k kept the
# whole launch off the lean kernel) H200 49.0 / 46.3, H100 64.5 / 60.5; 64 + 8 heads H200 86.0 /
# 79.9; 12 + 12 heads H200 57.7 / 54.0, bit-identical. Fewer heads (H100, thirty-eighth session,
# medians, streaming / lean, bit-identical): q+k of 32 + 4 heads sbhd 4096x2 58.7 / 54.8, 28 + 4 as
# views of one projection 52.8 / 49.2, 32 + 2 55.9 / 51.9, 32 + 1 54.4 / 50.7, 8 + 1 31.5 / 29.6,
# 4 + 4 28.9 / 27.0; k alone of 4 / 2 heads 13.9 / 13.3, 8.9 / 8.6: hence _LEAN_MIN_HEADS is 1, any
# tensor with heads (the tuning knob stays). Rows with pass-through channels stay on the mixed
# kernel: a lean variant that copied tail units ran sbhd d2 64 of 128 interleaved at 47.0-47.6
# against 43.0-43.9 (benchmarks/NOTES.md). Fixed like the constants above; --tune LEAN=0|1,
# LEAN_MIN_HEADS=N, LEAN_MAX_SEQS=N, LEAN_MAX_FAST_SEQS=N, LEAN_MIN_SEQ_TOKENS=N change them,
# DEFINES=-DCUPY_ROPE_LEAN_ROWS=N the rows per thread.
_LEAN = True
_LEAN_MIN_HEADS = 1
_LEAN_MAX_SEQS = 64
_LEAN_MAX_FAST_SEQS = 2048
_LEAN_MIN_SEQ_TOKENS = 32
_OFFSET_LIMIT = 2**31  # the lean kernel's 32-bit element offsets


def pick_vec(dtype: str, ds, d2: int, arrays, off: int = 0) -> int:
    """Widest vector (elements, at most 16 bytes, or ``_MAX_VEC_BYTES``) valid for every
    head dim in ``ds``, the rotary slice (width ``d2`` from channel ``off``) and every
    (ptr, row strides, channel stride) in ``arrays``."""
    isz = ITEMSIZE[dtype]
    max_bytes = _MAX_VEC_BYTES or 16
    h2 = d2 // 2
    for v in sorted(_kernels.vector_widths(dtype), reverse=True):
        if v == 1:
            return 1
        if h2 % v or off % v or any(d % v for d in ds) or v * isz > max_bytes:
            continue
        if all(sd == 1 and not ptr % (v * isz) and not any(s % v for s in row_strides)
               for ptr, row_strides, sd in arrays):
            return v
    return 1


def split_work(n_tok: int, n_sets: int, rows: int, d: int, d2: int, vec: int, sm_count: int,
               odd_units: bool = False):
    """Each token has ``n_sets`` sets (rope: 1; QKV: groups) of ``rows`` rows (heads; a group's
    n + 2 rows), each row ``n_units`` units: rotary units of 2 ``vec``-wide vectors, then tail
    units of ``tail_w`` vectors (the pass-through channels; with the rotary slice at an offset,
    those before it, then those after it: the kernel places each vector on its own, and the
    offset is a multiple of ``vec``, so no vector spans both). A thread takes one
    unit of the rows c, c + C, ... of one set (chunk c of C) and computes its cos/sin once: C is
    the fewest chunks that give the device ``_THREADS_PER_SM`` threads per SM; where ``n_units``
    is not a power of two and ``odd_units`` is set (rope launches), ``_ODD_UNITS_FACTOR`` times as
    many, as long as every thread keeps ``_ODD_UNITS_MIN_ROWS`` rows or more. Returns
    (n_rot, n_units, tail_w, C, threads) where threads = n_tok * n_sets * C * n_units.
    """
    n_rot = d2 // 2 // vec
    tail = d - d2
    tail_w = 2 if tail % (2 * vec) == 0 else 1
    n_units = n_rot + tail // (tail_w * vec)
    per_chunk = n_tok * n_sets * n_units

    def fewest(threads_per_sm):
        return max(1, min(rows, -(-sm_count * threads_per_sm // max(per_chunk, 1))))

    chunks = fewest(_THREADS_PER_SM)
    if odd_units and n_units & (n_units - 1):
        chunks = max(chunks, min(fewest(_THREADS_PER_SM * _ODD_UNITS_FACTOR), rows // _ODD_UNITS_MIN_ROWS))
    return n_rot, n_units, tail_w, chunks, per_chunk * chunks


def fast_divisor(d: int) -> int:
    """The kernels' ``fast_div`` constant of divisor ``1 <= d <= 2**31``: multiplier ``m`` in the
    low 32 bits, shift ``s`` above, with ``n // d == (((n * m) >> 32) + n) >> s`` for every
    ``0 <= n < 2**31`` (s = ceil(log2 d), m = floor(2^32 (2^s - d) / d) + 1)."""
    if not 1 <= d <= 2**31:
        raise ValueError(f"cupy_rope: fast divisor out of range: {d}")
    s = (d - 1).bit_length()
    m = ((1 << 32) * ((1 << s) - d)) // d + 1
    return m | s << 32


def one_row_vec(kind: str, vec: int) -> int:
    """The vector width (elements) a launch of kernel ``kind`` planned with ``vec`` may take:
    ``rope1`` (small launches, ``rope_launch``) at most ``_ONE_ROW_ANGLE_VEC``."""
    return min(vec, _ONE_ROW_ANGLE_VEC) if kind == "rope1" and _ONE_ROW_ANGLE_VEC else vec


def launch_alternatives(name: str) -> tuple[str, ...]:
    """The kernels a launch planned as ``name`` may run, whichever the work split picks on the
    device that runs it (a traced JAX call plans without the device's SM count): a rope launch a
    streaming kernel (``rope_``, ``ropem_``, as its rows pick), a one-row kernel (``rope1_``,
    ``rope1c_``, as the table kind picks; ``rope1_`` also at its narrower width, ``one_row_vec``)
    or the two-row kernel (``rope2c_``, cos/sin caches, 16-byte vectors)."""
    kind, dtype, vec, il, bw = _kernels.parse_name(name)
    if kind not in _kernels.ROPE_KINDS:
        return (name,)
    names = [_kernels.kernel_name(k, dtype, vec, il, bw) for k in _kernels.ROPE_KINDS]
    names.append(_kernels.kernel_name("rope1", dtype, one_row_vec("rope1", vec), il, bw))
    return tuple(n for n in dict.fromkeys(names) if n in _kernels.ALL)


def shares_sincos(vals: dict, vec: int, block: int) -> bool:
    """Whether the threads of a one-row ``rope1`` launch of one tensor (``vals``: its parameter
    block's values; ``vec``-element vectors, blocks of ``block`` threads) can share their token's
    sincosf: every unit of a row rotated, heads and chunks in groups of ``vec`` (the V heads of a
    group need the d2 / 2 pairs of their token, one per thread), groups whole within a block (of
    at most ``_kernels.BLOCK`` threads: the kernels' exchange slots)."""
    pairs = vec * vals["n_units"]
    return (_SHARE_SINCOS and vals["n_rot_units"] == vals["n_units"] and vals["n_heads"] % vec == 0
            and vals["n_chunks"] % vec == 0 and block % pairs == 0 and block <= _kernels.BLOCK)


def lean_fits(vals: dict, arrays) -> bool:
    """Whether the lean kernel (``ropel``) runs a rope launch's tensor: its parameter block's
    values ``vals`` (an angle table with contiguous columns, every unit of a row rotated, at least
    ``_LEAN_MIN_HEADS`` heads (1) and never none: the kernel has no thread without a row, at most
    ``_LEAN_MAX_SEQS`` sequences of ``cu_seqlens``, or at most ``_LEAN_MAX_FAST_SEQS`` of
    ``_LEAN_MIN_SEQ_TOKENS`` tokens or more on average where the kernels search ``cu_seqlens`` in
    32 bits: contiguous int32, ``cp_size`` 1) and its ``arrays`` (input, output: every element
    offset below ``_OFFSET_LIMIT``)."""
    if vals["f_kind"] != _abi.ANGLES or vals["f_scol"] != 1 or vals["n_rot_units"] != vals["n_units"]:
        return False
    if vals["n_heads"] < max(_LEAN_MIN_HEADS, 1):
        return False
    nseq = vals["pos.nseq"] if vals["pos.cu_seqlens"] else 0
    if nseq > _LEAN_MAX_SEQS:
        fast = not vals["pos.cu_is64"] and vals["pos.cu_stride"] == 1 and vals["pos.cp_size"] == 1
        if not (fast and nseq <= _LEAN_MAX_FAST_SEQS and vals["n_tok"] >= _LEAN_MIN_SEQ_TOKENS * nseq):
            return False
    return all(sum(abs(s) * (n - 1) for n, s in zip(a.shape, norm_strides(a.shape, a.strides))) < _OFFSET_LIMIT
               for a in arrays)


def blocks_for(threads: int, block: int = 0) -> int:
    return -(-threads // (block or _kernels.BLOCK))


def one_row_indices(threads: int, block: int = 0) -> bool:
    """Whether every thread index of a one-row launch of ``threads`` threads (blocks of ``block``,
    default ``_ONE_ROW_BLOCK``) fits the one-row kernels' 32-bit index arithmetic (below
    ``_ONE_ROW_THREADS``)."""
    block = block or _ONE_ROW_BLOCK
    return blocks_for(threads, block) * block <= _ONE_ROW_THREADS


def _vec_arrays(*arrays):
    """(ptr, row strides, channel stride) of each array, size-1 strides zeroed."""
    out = []
    for a in arrays:
        st = norm_strides(a.shape, a.strides)
        out.append((a.ptr, st[:-1], st[-1]))
    return out


def _rope_vals(plan, x, y, freqs, vec: int, sm_count: int, rows_per_thread: int = 0):
    """(block values, threads) of one tensor of a rope launch; ``rows_per_thread``: the chunks
    that give each thread at most that many rows (the two-row and lean kernels) instead of the
    work split's."""
    n_tok, n_inner, _ = split_tokens(plan.layout, x.shape)
    xs0, xs1 = token_strides(plan.layout, x)
    ys0, ys1 = token_strides(plan.layout, y)
    xst, yst = norm_strides(x.shape, x.strides), norm_strides(y.shape, y.strides)
    n_rot, n_units, tail_w, chunks, threads = split_work(n_tok, 1, plan.heads, plan.d, plan.table.d2,
                                                         vec, sm_count, odd_units=True)
    block = 0
    if rows_per_thread:  # the two-row or lean kernel's split, in blocks of _kernels.BLOCK
        chunks, block = -(-plan.heads // rows_per_thread), _kernels.BLOCK
        threads = n_tok * chunks * n_units
    vals = dict(x=x.ptr, y=y.ptr, freqs=freqs.ptr, n_tok=n_tok, n_inner=n_inner,
                xs0=xs0, xs1=xs1, xsh=xst[-2], xsd=xst[-1], ys0=ys0, ys1=ys1, ysh=yst[-2], ysd=yst[-1],
                n_heads=plan.heads, d2=plan.table.d2, n_chunks=chunks, n_units=n_units,
                n_rot_units=n_rot, tail_w=tail_w, f_rows=plan.table.rows, f_srow=plan.table.srow,
                f_scol=plan.table.scol, f_kind=_abi.table_kind(plan.table), rot_off=plan.rot_off,
                dv_item=0, dv_unit=0, dv_inner=0, share=0, blocks=0)
    if one_row_indices(threads, block):  # the one-row kernels' divisors
        vals.update(dv_item=fast_divisor(max(chunks * n_units, 1)), dv_unit=fast_divisor(max(n_units, 1)),
                    dv_inner=fast_divisor(max(n_inner, 1)))
    return vals, threads


def rope_launch(plans, tensors, freqs, cu, sp, sm_count: int, ids=None) -> _abi.LaunchSpec:
    """One rope launch for one or two resolved tensors (``plans`` and ``tensors`` = [(x, y), ...]
    alike; two plans share dtype, direction, layout, positions, table and rotary slice): each
    tensor's blocks one after the other in a grid of one row (its block's ``blocks``, the kernels'
    ``first_part``), so that no block of the grid is idle. The vector width is the widest valid
    for every array of the launch; a one-row kernel runs it (in blocks of ``_ONE_ROW_BLOCK``
    threads) when every thread of every tensor has a single row and the table holds angles or
    cos/sin, with an angle table at most ``one_row_vec`` wide where the launch still has one row
    per thread with it and is small (``_NARROW_THREADS_PER_SM``; ``_NARROW_SHARED_THREADS_PER_SM``
    where the wide launch's threads share their sincosf), and sharing each token's sincosf where
    ``shares_sincos`` allows; a launch left to the streaming kernel with 16-byte vectors takes,
    where its thread indices fit 32 bits, the two-row kernel with a cos/sin cache (``_TWO_ROWS``),
    the lean kernel with an angle table where ``lean_fits`` allows (``_LEAN``). ``ids``: the
    positions API's per-token positions."""
    p0 = plans[0]
    arrays = [a for xy in tensors for a in xy]
    vec = pick_vec(p0.dtype, [p.d for p in plans], p0.table.d2, _vec_arrays(*arrays), p0.rot_off)
    pos = _abi.pos_values(p0.pos, cu, sp, ids)

    def split(v, rows_kind=None, rows=0):
        """(kind, parameter blocks, threads) of the launch with vectors of ``v`` elements; with
        ``rows_kind``, that kernel's split of at most ``rows`` rows of a token per thread."""
        blocks, threads = [], []
        for plan, (x, y) in zip(plans, tensors):
            vals, nt = _rope_vals(plan, x, y, freqs, v, sm_count, rows)
            blocks.append({**vals, **pos})
            threads.append(nt)
        kind = rows_kind or "rope"
        one_row = all(b["n_chunks"] >= b["n_heads"] for b in blocks)  # every thread a single row
        if not rows_kind and _ONE_ROW and one_row_indices(max(threads)) and one_row:
            kind = _ONE_ROW_KINDS.get(blocks[0]["f_kind"], kind)  # one table: one kind for both blocks
        return kind, blocks, threads

    kind, blocks, threads = split(vec)
    narrow = one_row_vec(kind, vec)
    if narrow != vec:  # valid too: a narrower vector divides whatever the wider one divides
        alt = split(narrow)
        shared = all(shares_sincos(b, vec, _ONE_ROW_BLOCK) for b in blocks)
        limit = _NARROW_SHARED_THREADS_PER_SM if shared else _NARROW_THREADS_PER_SM
        if alt[0] == kind and max(alt[2]) <= sm_count * limit:  # one row per thread, few threads
            vec, (kind, blocks, threads) = narrow, alt
    wide = vec * ITEMSIZE[p0.dtype] == _kernels.MIXED_BYTES
    rows_kind, rows = None, 0  # a kernel of a few rows of a token per thread, for large launches
    if kind == "rope" and wide and _TWO_ROWS and blocks[0]["f_kind"] in _TWO_ROW_KINDS:
        rows_kind, rows = _TWO_ROW_KINDS[blocks[0]["f_kind"]], 2
    elif kind == "rope" and wide and _LEAN and all(lean_fits(b, xy) for b, xy in zip(blocks, tensors)):
        rows_kind, rows = "ropel", _kernels.define_value("CUPY_ROPE_LEAN_ROWS")
    if rows_kind:
        alt = split(vec, rows_kind, rows)
        if one_row_indices(max(alt[2]), _kernels.BLOCK):
            kind, blocks, threads = alt
    if kind == "rope" and _MIXED and wide and any(b["n_rot_units"] < b["n_units"] for b in blocks):
        kind = "ropem"
    # the streaming kernels (rope, ropem) in the blocks their shared-memory ring is sized for, the
    # two-row kernel in the same
    block = _ONE_ROW_BLOCK if kind in _ONE_ROW_KINDS.values() else _kernels.BLOCK
    if kind == "rope1":
        for b in blocks:
            b["share"] = int(shares_sincos(b, vec, block))
    parts = [blocks_for(t, block) for t in threads]
    for b, n in zip(blocks, parts):
        b["blocks"] = n
    params, slots = _abi.rope_blocks(blocks[0], blocks[1] if len(blocks) > 1 else None)
    name = _kernels.kernel_name(kind, p0.dtype, vec, p0.interleaved, p0.backward)
    return _abi.LaunchSpec(name, (sum(parts), 1), block, params, slots)


def qkv_launch(plan, packed, q, k, v, q_freqs, k_freqs, cu, sp, sm_count: int) -> _abi.LaunchSpec:
    """The packed-QKV launch (one parameter block)."""
    n_tok, n_inner, _ = split_tokens(plan.layout, packed.shape)
    vec = pick_vec(plan.dtype, [plan.d], plan.q_table.d2, _vec_arrays(packed, q, k, v))
    n_rot, n_units, tail_w, chunks, threads = split_work(n_tok, plan.groups, plan.n_q + 2, plan.d,
                                                         plan.q_table.d2, vec, sm_count)
    vals = dict(packed=packed.ptr, q=q.ptr, k=k.ptr, v=v.ptr, q_freqs=q_freqs.ptr,
                k_freqs=k_freqs.ptr, n_tok=n_tok, n_inner=n_inner, n_groups=plan.groups,
                n_q=plan.n_q, d=plan.d, d2=plan.q_table.d2, n_chunks=chunks, n_units=n_units,
                n_rot_units=n_rot, tail_w=tail_w, k_same_table=plan.k_same_table)
    for pre, a in (("p", packed), ("q", q), ("k", k), ("v", v)):
        s0, s1 = token_strides(plan.layout, a)
        st = norm_strides(a.shape, a.strides)
        vals.update({f"{pre}s0": s0, f"{pre}s1": s1, f"{pre}s{'g' if pre == 'p' else 'h'}": st[-2],
                     f"{pre}sd": st[-1]})
    for pre, t in (("qf", plan.q_table), ("kf", plan.k_table)):
        vals.update({f"{pre}_rows": t.rows, f"{pre}_srow": t.srow, f"{pre}_scol": t.scol})
    params = _abi.pack(_abi.QKV_FIELDS, {**vals, **_abi.pos_values(plan.pos, cu, sp)})
    name = _kernels.kernel_name("qkv", plan.dtype, vec, plan.interleaved, plan.backward)
    slots = {k_: (v_,) for k_, v_ in _abi.QKV_PTR_SLOTS.items()}
    return _abi.LaunchSpec(name, (blocks_for(threads), 1), _kernels.BLOCK, params, slots)
