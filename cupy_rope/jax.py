"""JAX shim: RoPE for JAX arrays, eager and under ``jax.jit``, differentiable (``jax.grad``,
``jax.vjp``) through custom VJPs whose backward is the library's backward kernel.

On a GPU XLA launches the CUDA kernel itself, on its own stream, into buffers it allocated (no
copies): through an XLA FFI custom call whose C++ handler is built once with the host compiler,
else through a ``buffer_callback`` (``cupy_rope._xla``; ``CUPY_ROPE_XLA_FFI`` chooses). On the
CPU the same functions run the NumPy backend's formulas in ``jax.numpy`` (jittable, same
semantics). ``jax.vmap`` maps the kernel sequentially; inside ``shard_map`` each shard passes its
own ``cp_rank``.

Static arguments (``layout``, ``interleaved``, ``cp_size``, ``cp_rank``, ``split``) are Python
values; ``cu_seqlens`` and ``start_positions`` are arrays. The angle tables, ``cu_seqlens``
and ``start_positions`` get no gradient.

Example::

    import jax, jax.numpy as jnp, cupy_rope, cupy_rope.jax as crj
    freqs = jnp.asarray(cupy_rope.rope_freqs(128, 2048))
    x = jax.random.normal(jax.random.key(0), (2048, 2, 8, 128), jnp.bfloat16)
    y = jax.jit(lambda x: crj.apply_rope(x, freqs, "sbhd"))(x)
    g = jax.grad(lambda x: crj.apply_rope(x, freqs).astype(jnp.float32).sum())(x)
    qkv = jax.random.normal(jax.random.key(1), (2, 2048, 3, 8, 128), jnp.bfloat16)
    q, k = jax.jit(lambda t: crj.apply_rope_qk_fused(t, freqs, "bshd"))(qkv)   # one launch
"""

from ._jax_ops import (apply_qkv_rope, apply_qkv_rope_backward, apply_rope, apply_rope_backward,
                       apply_rope_pos, apply_rope_qk, apply_rope_qk_backward, apply_rope_qk_fused)

__all__ = ["apply_rope", "apply_rope_backward", "apply_rope_pos", "apply_rope_qk", "apply_rope_qk_backward",
           "apply_rope_qk_fused", "apply_qkv_rope", "apply_qkv_rope_backward"]
