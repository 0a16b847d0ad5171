"""Heads split over 4 devices: `sharded_ragged_attention(..., head_axis=...)` against the op on one device.

    python examples/sharding.py                        # 4 virtual CPU devices, on any machine
    JAX_PLATFORMS=cuda python examples/sharding.py     # the first 4 GPUs of a host that has them

Each device attends its share of the heads with the same op (no collective in the compiled program); Hkv
must be a multiple of the mesh axis. XLA reads its flags when jax is imported, so they are set first.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax
import jax.numpy as jnp

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.parallel.sharding import sharded_ragged_attention

cu_seqlens = jnp.array([0, 5, 5, 8], jnp.int32)  # sequences of 5, 0 and 3 tokens in 10 rows
keys = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(keys[0], (10, 8, 64), jnp.bfloat16)  # [Tq, Hq, D]
k = jax.random.normal(keys[1], (10, 4, 64), jnp.bfloat16)  # [Tkv, Hkv, D]: Hkv = 4, one kv head per device
v = jax.random.normal(keys[2], (10, 4, 64), jnp.bfloat16)

mesh = jax.make_mesh((4,), ("model",), devices=jax.devices()[:4])
out = sharded_ragged_attention(
    q, k, v, cu_seqlens, cu_seqlens, mesh=mesh, head_axis="model", max_seqlen_q=5, max_seqlen_kv=5, is_causal=True
)
alone = ragged_attention(q, k, v, cu_seqlens, cu_seqlens, max_seqlen_q=5, max_seqlen_kv=5, is_causal=True)
error = float(jnp.abs(out.astype(jnp.float32) - alone.astype(jnp.float32)).max())
print(
    f"heads over {mesh.devices.size} devices: out {out.shape}, sharding {out.sharding.spec}; "
    f"largest difference to one device {error}"
)
assert error == 0.0, error
