"""Step-by-step bring-up of the cuDNN path, printing before each stage (to locate crashes)."""
import faulthandler, sys
faulthandler.enable()
import jax, jax.numpy as jnp, numpy as np
import jax_ragged_attn as jra
from jax_ragged_attn import cudnn, extension
from jax_ragged_attn.config import make_config

print("reason:", extension.cudnn_unavailable_reason(), flush=True)
cu = jnp.array([0, 5, 12], jnp.int32)
q = jnp.ones((16, 2, 64), jnp.bfloat16); k = jnp.ones((16, 2, 64), jnp.bfloat16); v = jnp.ones((16, 2, 64), jnp.bfloat16)
cfg = make_config(q, k, v, cu, cu, max_seqlen_q=7, max_seqlen_kv=7, scale=None, is_causal=True,
                  diagonal_alignment="top_left", local_window_size=None, stats_layout="head_major")
print("graph_info fwd", flush=True); print(cudnn.graph_info("forward", cfg), flush=True)
print("graph_info bwd", flush=True); print(cudnn.graph_info("backward", cfg), flush=True)
print("lower", flush=True)
f = jax.jit(lambda q, k, v: cudnn.attention_cudnn(q, k, v, cu, cu, cfg))
print(f.lower(q, k, v).as_text()[:3000], flush=True)
print("run fwd", flush=True)
out, st = f(q, k, v); jax.block_until_ready(out); print("fwd ok", out[:, 0, 0], st[0], flush=True)
g = jax.grad(lambda q, k, v: cudnn.attention_cudnn(q, k, v, cu, cu, cfg)[0].astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)
jax.block_until_ready(g); print("bwd ok", [float(jnp.abs(x.astype(jnp.float32)).sum()) for x in g], flush=True)
