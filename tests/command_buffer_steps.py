"""Steps that XLA records into CUDA graphs (command buffers), run in a process of their own.

`python tests/command_buffer_steps.py MODE` prints one JSON line per check. XLA reads XLA_FLAGS once, when it
creates its backend, so tests/test_command_buffers.py runs this script once per flag setting:

- `evict`: six jitted forward+backward steps of different shapes, run round-robin three times with the graph
  cache shrunk to 2 graphs (every step's graphs are evicted by the others between its runs), compared with the
  same steps on the xla path;
- `threads`: the same six steps dispatched from six threads at once, each compared with its single-threaded result;
- `decode`: a paged decode loop (`jax.lax.fori_loop` over steps: append a token, attend the cache), compared with
  the same loop on the xla path.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_ragged_attn as jra
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.index import cu_seqlens_from_lengths

SHAPES = [(4, 96, 8, 64), (3, 160, 8, 64), (5, 64, 4, 128), (2, 256, 8, 128), (6, 48, 8, 64), (4, 128, 4, 64)]


def _step(implementation, num_seqs, max_seqlen, heads, dim):
    capacity = num_seqs * max_seqlen

    @jax.jit
    def step(q, k, v, cu):
        def loss(q, k, v):
            out = jra.ragged_attention(
                q,
                k,
                v,
                cu,
                cu,
                max_seqlen_q=max_seqlen,
                max_seqlen_kv=max_seqlen,
                is_causal=True,
                implementation=implementation,
            )
            return jnp.sum(out.astype(jnp.float32) ** 2)

        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    rng = np.random.default_rng(capacity + heads + dim)
    q, k, v = (jnp.asarray(rng.standard_normal((capacity, heads, dim)), jnp.bfloat16) for _ in range(3))
    cu = jnp.asarray(cu_seqlens_from_lengths(rng.integers(1, max_seqlen, size=num_seqs, endpoint=True)))
    return step, (q, k, v, cu)


def _max_error(got, want):
    (value, grads), (value_ref, grads_ref) = got, want
    errors = [abs(float(value) - float(value_ref)) / max(1.0, abs(float(value_ref)))]
    for g, r in zip(grads, grads_ref):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        errors.append(float(np.max(np.abs(g - r)) / max(1e-6, float(np.max(np.abs(r))))))
    return max(errors)


def evict(rounds=3):
    ext = extension.module()
    steps = [_step("cudnn", *shape) for shape in SHAPES]
    references = [_step("xla", *shape)[0](*args) for (_, args), shape in zip(steps, SHAPES)]
    ext.set_graph_cache_capacity(2)
    try:
        before = ext.graph_cache_stats()
        worst = 0.0
        for _ in range(rounds):
            for (step, args), reference in zip(steps, references):
                worst = max(worst, _max_error(jax.block_until_ready(step(*args)), reference))
        after = ext.graph_cache_stats()
    finally:
        ext.set_graph_cache_capacity(256)
    return {
        "check": "evict",
        "max_relative_error": worst,
        "evictions": after["evictions"] - before["evictions"],
        "handler_builds": after["handler_builds"] - before["handler_builds"],
    }


def threads(calls=10):
    ext = extension.module()
    steps = [_step("cudnn", *shape) for shape in SHAPES]
    alone = [jax.block_until_ready(step(*args)) for step, args in steps]
    ext.set_graph_cache_capacity(2)
    try:

        def work(index):
            step, args = steps[index]
            return [jax.block_until_ready(step(*args)) for _ in range(calls)]

        with concurrent.futures.ThreadPoolExecutor(max_workers=len(steps)) as pool:
            results = list(pool.map(work, range(len(steps))))
    finally:
        ext.set_graph_cache_capacity(256)
    worst = max(_max_error(r, a) for runs, a in zip(results, alone) for r in runs)
    return {"check": "threads", "max_relative_error": worst}


def _decode_loop(implementation, steps=16, batch=4, page_size=16, pages_per_seq=8, hq=8, hkv=2, dim=128):
    num_pages = batch * pages_per_seq
    rng = np.random.default_rng(7)
    page_table = jnp.asarray(rng.permutation(num_pages).reshape(batch, pages_per_seq).astype(np.int32))
    k_cache = jnp.zeros((num_pages, page_size, hkv, dim), jnp.bfloat16)
    v_cache = jnp.zeros((num_pages, page_size, hkv, dim), jnp.bfloat16)
    lengths = jnp.asarray(rng.integers(1, 40, size=batch), jnp.int32)
    new = jnp.asarray(rng.standard_normal((steps, 3, batch, 1, hq, dim)), jnp.bfloat16)

    @jax.jit
    def run(k_cache, v_cache, lengths):
        def body(i, carry):
            k_cache, v_cache, lengths, total = carry
            q, k, v = new[i, 0], new[i, 1, :, :, :hkv], new[i, 2, :, :, :hkv]
            k_cache, v_cache = jra.kvcache_append(k_cache, v_cache, k, v, lengths, page_table=page_table)
            out = jra.ragged_attention_with_kvcache(
                q, k_cache, v_cache, lengths + 1, page_table=page_table, implementation=implementation
            )
            return k_cache, v_cache, lengths + 1, total + out.astype(jnp.float32)

        zero = jnp.zeros((batch, 1, hq, dim), jnp.float32)
        return jax.lax.fori_loop(0, steps, body, (k_cache, v_cache, lengths, zero))[3]

    return run, (k_cache, v_cache, lengths)


def decode():
    reference, args = _decode_loop("xla")
    want = np.asarray(reference(*args))
    worst = 0.0
    for implementation in (None, "cudnn"):  # the default (FA3 where a provider is installed) and cuDNN's paged graph
        got = np.asarray(_decode_loop(implementation)[0](*args))
        worst = max(worst, float(np.max(np.abs(got - want)) / np.max(np.abs(want))))
    return {"check": "decode", "max_relative_error": worst}


if __name__ == "__main__":
    reason = extension.cudnn_unavailable_reason()
    if reason is not None:
        print(json.dumps({"skip": reason}))
        sys.exit(0)
    for name in sys.argv[1].split(","):
        print(json.dumps({**globals()[name](), "xla_flags": __import__("os").environ.get("XLA_FLAGS", "")}), flush=True)
