"""Which part of implementation="fa3"'s fwd+bwd costs what on W1 with computed inputs, against raw FA3.
A measurement aid: the variants with a part removed are unsafe with NaN padding and exist only here.

    python -m benchmarks.fa3_bwd_parts      # on the H200, with flash-attn3-jax installed
"""
import jax, jax.numpy as jnp
from jax_ragged_attn import ragged_attention
from jax_ragged_attn.backends.fa3 import ragged as fa3
from jax_ragged_attn.testing import workloads

from benchmarks import fa3_compare
from benchmarks.timing import median_loop_seconds

w = workloads.WORKLOADS["W1"]
q, k, v, cu = w.packed_inputs()
d_out = jax.random.normal(jax.random.key(1), q.shape, q.dtype)
s = jnp.float32(1.0)

def ours(q, k, v, cu):
    return ragged_attention(q, k, v, cu, cu, max_seqlen_q=w.max_seqlen, max_seqlen_kv=w.max_seqlen,
                            implementation="fa3", is_causal=True)

def raw(q, k, v, cu):
    from flash_attn3_jax import flash_mha_varlen
    return flash_mha_varlen(q, k, v, cu, cu, max_seqlen_q=w.max_seqlen, max_seqlen_k=w.max_seqlen, is_causal=True)

def t(f):
    fn = fa3_compare.steps(f, "computed")[1]
    jax.block_until_ready(fn(q, k, v, cu, s, d_out))
    return median_loop_seconds(fn, (q, k, v, cu, s, d_out), 20, 7) * 1e3

identity = lambda buffers, *a, **kw: tuple(buffers)
results = {"raw": t(raw), "ours": t(ours)}
orig_zero = fa3.zero_unused_rows
orig_cleared = fa3._cleared
fa3._cleared = lambda buffers, cu, used: tuple(buffers); jax.clear_caches()
results["no input clearing"] = t(ours)
fa3.zero_unused_rows = identity; jax.clear_caches()
results["no clearing, no output zeroing"] = t(ours)
fa3._cleared = orig_cleared; fa3.zero_unused_rows = orig_zero; jax.clear_caches()
results["ours again"] = t(ours)
for name, ms in results.items():
    print(f"{name:<55} {ms:8.3f} ms  {ms - results['raw']:+.3f}")
lowered = fa3_compare.steps(ours, "computed")[1].lower(q, k, v, cu, s, d_out).compile().as_text()
print("copies in the compiled fwd+bwd:", lowered.count(" copy("), "custom-calls:", lowered.count("custom-call("))
for line in lowered.splitlines():
    if " copy(" in line or "copy-start" in line:
        print(line.strip()[:200])
