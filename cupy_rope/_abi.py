"""The kernel parameter blocks (the launch ABI), packed from the one definition in the CUDA source.

The field order of ``RopeParams``, ``QkvParams`` and ``PosArgs`` is read from ``kernels_cu/``
(:func:`cupy_rope._kernels.struct_fields`); every field is a little-endian int64. A launch passes
``blocks`` parameter blocks by value (the rope kernels take two, e.g. q and k: the first tensor
runs in the grid's first ``blocks`` blocks, its block's field, the second in the rest; a one-tensor
launch sends the second block zeroed and never reads it). :class:`LaunchSpec`
records where each address sits, so the launch cache patches addresses without re-packing.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from . import _kernels
from ._plan import LAYOUTS, norm_strides

ROPE_FIELDS = _kernels.struct_fields("RopeParams")
QKV_FIELDS = _kernels.struct_fields("QkvParams")
INDEX_ARGS = ("cu_seqlens", "start_positions", "positions")  # addresses inside PosArgs
# RopeParams.f_kind (kernels_cu/rope_common.cuh TableKind) of a table's (kind, dtype); a cos/sin
# cache in the tensors' own dtype is kind 2 (the kernel reads it as T).
TABLE_KINDS = {("angles", "float32"): 0, ("cos_sin", "float32"): 1, ("inv_freq", "float64"): 3,
               ("inv_freq", "float32"): 4}
ANGLES = TABLE_KINDS[("angles", "float32")]
COS_SIN32 = TABLE_KINDS[("cos_sin", "float32")]
COS_SIN_T = 2  # a cos/sin cache in the tensors' own dtype (table_kind's default)


def table_kind(table) -> int:
    return TABLE_KINDS.get((table.kind, table.dtype), COS_SIN_T)


def pack(fields, vals: dict) -> bytes:
    """One parameter block: ``vals[f]`` for every field ``f`` in order, as little-endian int64."""
    return struct.pack(f"<{len(fields)}q", *(int(vals[f]) for f in fields))


def index_stride(a) -> int:
    """Element stride of a 1-D index tensor (any sign, 0 included); 1 when absent."""
    return 1 if a is None or not a.strides else a.strides[0]


def pos_values(pos, cu, sp, ids=None) -> dict:
    """The ``pos.*`` fields of a parameter block (the kernels' PosArgs) from a resolved
    :class:`cupy_rope._plan.Positions` and the index tensors' descriptors (``ids``: per-token
    positions ``[t]`` or ``[b, s]``)."""
    ps = norm_strides(ids.shape, ids.strides) + (0,) if ids is not None else (0, 0)
    return {"pos.positions": ids.ptr if ids is not None else 0, "pos.ps_is64": pos.ids_is64,
            "pos.ps0": ps[0], "pos.ps1": ps[1], "pos.layout": LAYOUTS[pos.layout], "pos.seq_len": pos.seq_len,
            "pos.nseq": pos.nseq,
            "pos.cu_seqlens": cu.ptr if cu is not None else 0, "pos.cu_is64": pos.cu_is64,
            "pos.cu_stride": index_stride(cu), "pos.start_positions": sp.ptr if sp is not None else 0,
            "pos.sp_is64": pos.sp_is64, "pos.sp_stride": index_stride(sp), "pos.cp_size": pos.cp_size,
            "pos.cp_rank": pos.cp_rank}


def ptr_slots(fields, names, base: int = 0) -> dict:
    """{address name: 64-bit word index} of one block starting at word ``base``."""
    slots = {n: base + fields.index(n) for n in names}
    slots.update({n: base + fields.index(f"pos.{n}") for n in INDEX_ARGS})
    return slots


ROPE_PTR_SLOTS = ptr_slots(ROPE_FIELDS, ("x", "y", "freqs"))
QKV_PTR_SLOTS = ptr_slots(QKV_FIELDS, ("packed", "q", "k", "v", "q_freqs", "k_freqs"))


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a launch needs: kernel, geometry, the packed parameter blocks, and the word
    indices of each named address in them (an address may sit in several blocks)."""

    name: str
    grid: tuple  # (x, y)
    block: int
    params: bytes
    slots: dict  # address name -> tuple of 64-bit word indices

    def __iter__(self):  # name, grid, block, params = spec
        return iter((self.name, self.grid, self.block, self.params))


def rope_blocks(vals0: dict, vals1: dict | None) -> tuple[bytes, dict]:
    """The rope kernels' two blocks: (params, slots). Tensor 0's addresses are named ``x``/``y``,
    tensor 1's ``x2``/``y2``; the table and index tensors are shared (patched in both blocks)."""
    n = len(ROPE_FIELDS)
    b0 = pack(ROPE_FIELDS, vals0)
    b1 = pack(ROPE_FIELDS, vals1) if vals1 is not None else bytes(8 * n)
    slots = {k: (v,) for k, v in ROPE_PTR_SLOTS.items()}
    if vals1 is not None:
        slots["x2"], slots["y2"] = (n + ROPE_PTR_SLOTS["x"],), (n + ROPE_PTR_SLOTS["y"],)
        for k in ("freqs",) + INDEX_ARGS:
            slots[k] += (n + ROPE_PTR_SLOTS[k],)
    return b0 + b1, slots
