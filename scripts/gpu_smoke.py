"""Quick cuDNN-vs-xla comparison across a few configurations (used for the first GPU bring-up)."""
import itertools, sys, traceback
import jax, jax.numpy as jnp, numpy as np
import jax_ragged_attn as jra

rng = np.random.default_rng(0)
fails = 0
for causal, align, window, layout, (hq, hkv), dv, zero in itertools.product(
        [False, True], ["top_left", "bottom_right"], [None, (16, 4)], ["head_major", "token_major"], [(4, 4), (8, 2)], [64, 128], [False, True]):
    lq = rng.integers(1, 200, size=5); lkv = rng.integers(1, 200, size=5)
    if zero: lq[1] = 0; lkv[3] = 0
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32); ckv = np.concatenate([[0], np.cumsum(lkv)]).astype(np.int32)
    tq, tkv = int(cq[-1]) + 17, int(ckv[-1]) + 9
    q = jnp.asarray(rng.standard_normal((tq, hq, 64)), jnp.bfloat16).at[int(cq[-1]):].set(jnp.nan)
    k = jnp.asarray(rng.standard_normal((tkv, hkv, 64)), jnp.bfloat16).at[int(ckv[-1]):].set(jnp.nan)
    v = jnp.asarray(rng.standard_normal((tkv, hkv, dv)), jnp.bfloat16).at[int(ckv[-1]):].set(jnp.nan)
    kw = dict(max_seqlen_q=int(lq.max()), max_seqlen_kv=int(lkv.max()), is_causal=causal, diagonal_alignment=align,
              local_window_size=window, stats_layout=layout, return_stats=True)
    def loss(q, k, v, impl):
        o, s = jra.ragged_attention(q, k, v, jnp.asarray(cq), jnp.asarray(ckv), implementation=impl, **kw)
        return jnp.sum(o.astype(jnp.float32) ** 2), (o, s)
    name = f"causal={causal} align={align} window={window} layout={layout} h={hq}/{hkv} dv={dv} zero={zero}"
    try:
        (l1, (o1, s1)), g1 = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, "cudnn")
        (l2, (o2, s2)), g2 = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), "xla")
        eo = float(jnp.nanmax(jnp.abs(o1.astype(jnp.float32) - o2)))
        fin = jnp.isfinite(s2)
        es = float(jnp.max(jnp.where(fin, jnp.abs(s1 - s2), 0))) if bool(fin.any()) else 0.0
        same_inf = bool(jnp.all(jnp.isfinite(s1) == fin))
        eg = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))) / (float(jnp.max(jnp.abs(b))) + 1e-6) for a, b in zip(g1, g2)]
        finite = all(bool(jnp.isfinite(a).all()) for a in (o1,) + tuple(g1))
        ok = eo < 0.05 and es < 0.05 and same_inf and max(eg) < 0.05 and finite
        fails += not ok
        print(("OK  " if ok else "BAD ") + name + f" out={eo:.3g} stats={es:.3g} inf_match={same_inf} grads={[round(e,4) for e in eg]} finite={finite}")
    except Exception as e:
        fails += 1
        print("ERR " + name + f" {type(e).__name__}: {str(e)[:300]}")
print("smoke failures:", fails)
