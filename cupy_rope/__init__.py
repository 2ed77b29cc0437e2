"""cupy_rope: fused Rotary Position Embedding kernels for any framework's arrays.

CUDA kernels compiled at run time through CuPy (NVRTC), applied zero-copy to CuPy, PyTorch
and JAX arrays (or any ``__dlpack__`` object), with a NumPy backend for CPU arrays. Semantics:
TransformerEngine's fused RoPE (see ``docs/SPEC.md``).

Public API::

    apply_rope(x, freqs, layout="sbhd", *, interleaved=False, cu_seqlens=None,
               start_positions=None, cp_size=1, cp_rank=0, out=None,
               transpose_output_memory=False) -> y
    apply_rope_backward(grad, freqs, layout="sbhd", **same keywords) -> grad_x
    apply_rope_qk(q, k, freqs, layout="sbhd", *, ..., inplace=False) -> (q_out, k_out)  # one launch
    apply_rope_qk_backward(dq, dk, freqs, layout="sbhd", ...) -> (grad_q, grad_k)
    apply_qkv_rope(qkv, q_freqs, k_freqs, split=None, layout="sbhd", *, num_q_heads=None, ...)
        -> (q, k, v)
    apply_qkv_rope_backward(dq, dk, dv, q_freqs, k_freqs, split=None, layout="sbhd", ...) -> dqkv
    apply_rope_pos(positions, q, k=None, *, cos_sin_cache=None | freqs=None | inv_freq=None,
                   head_size=None, interleaved=False, rope_dim_offset=0, inverse=False,
                   inplace=False) -> (q_out, k_out)     # per-token positions (serving)
    rope_freqs(dim, max_seq_len, *, rotary_percent=1.0, base=10000.0, interleaved=False,
               seq_len_interpolation_factor=None, pretrained_max_position_embeddings=None,
               offset=0, like=None) -> [max_seq_len, 1, 1, d2] float32
    set_debug(enabled)  # check index-tensor contents (synchronises)

Framework shims: ``cupy_rope.torch`` (custom ops, autograd, torch.compile),
``cupy_rope.jax`` (custom_vjp, jit), ``cupy_rope.te`` (TransformerEngine drop-in).
"""

from ._api import (apply_qkv_rope, apply_qkv_rope_backward, apply_rope, apply_rope_backward,
                   apply_rope_pos, apply_rope_qk, apply_rope_qk_backward, debug_enabled, set_debug)
from ._freqs import rope_cos_sin_cache, rope_freqs, rope_inv_freq

__version__ = "0.1.0"

__all__ = ["apply_rope", "apply_rope_backward", "apply_rope_qk", "apply_rope_qk_backward", "apply_qkv_rope", "apply_qkv_rope_backward",
           "apply_rope_pos", "rope_freqs", "rope_cos_sin_cache", "rope_inv_freq", "set_debug", "debug_enabled", "__version__"]
