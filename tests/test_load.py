"""Load on the cuDNN path: a long soak of training steps and concurrent callers (GPU only).

The soak is marked `soak` and left out of the default run (`pytest -m soak` runs it); it prints its
figures. Both skip with the reason where the cuDNN path is unavailable.
"""

from __future__ import annotations

import concurrent.futures
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ragged_attn as jra
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.index import cu_seqlens_from_lengths
from jax_ragged_attn.testing import assert_close, packed_batch
from jax_ragged_attn.testing.reference import reference_attention

_REASON = extension.cudnn_unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=f"cuDNN path unavailable: {_REASON}")]

NUM_SEQS, MAX_SEQLEN, CAPACITY, HEADS, DIM = 8, 512, 8 * 512, 8, 64


def _training_step():
    @jax.jit
    def step(q, k, v, cu):
        def loss(q, k, v):
            out = jra.ragged_attention(
                q,
                k,
                v,
                cu,
                cu,
                max_seqlen_q=MAX_SEQLEN,
                max_seqlen_kv=MAX_SEQLEN,
                is_causal=True,
                implementation="cudnn",
            )
            return jnp.sum(out.astype(jnp.float32) ** 2)

        value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
        # A small SGD step keeps the inputs changing, as in training.
        return value, *(x - 1e-4 * g.astype(x.dtype) for x, g in zip((q, k, v), grads))

    return step


@pytest.mark.soak
def test_soak_ten_thousand_steps_with_changing_cu_seqlens():
    rng = np.random.default_rng(0)
    step = _training_step()
    q, k, v = (jnp.asarray(rng.standard_normal((CAPACITY, HEADS, DIM)), jnp.bfloat16) for _ in range(3))
    device = jax.devices("gpu")[0]
    ext = extension.module()
    lengths = [rng.integers(0, MAX_SEQLEN, size=NUM_SEQS, endpoint=True) for _ in range(64)]
    cus = [jnp.asarray(cu_seqlens_from_lengths(n)) for n in lengths]

    value, q, k, v = step(q, k, v, cus[0])
    jax.block_until_ready(value)
    misses, memory = ext.graph_cache_stats()["misses"], device.memory_stats()["bytes_in_use"]
    start = time.perf_counter()
    for i in range(10_000):
        value, q, k, v = step(q, k, v, cus[i % len(cus)])
        if i % 1000 == 999:
            jax.block_until_ready(value)
            in_use = device.memory_stats()["bytes_in_use"]
            print(f"step {i + 1}: loss {float(value):.4g}, bytes in use {in_use:,} (first step {memory:,})")
            assert in_use <= memory * 1.01 + (1 << 20), "device memory grows with steps"
    jax.block_until_ready(value)
    elapsed = time.perf_counter() - start
    stats = ext.graph_cache_stats()
    print(
        f"10,000 steps in {elapsed:.1f} s ({elapsed / 1e4 * 1e3:.3f} ms/step); jit cache size "
        f"{step._cache_size()}; graph cache {stats}"
    )
    assert step._cache_size() == 1, "the step recompiled"
    assert stats["misses"] == misses, "a graph was rebuilt during the soak"
    assert np.isfinite(float(value))


def test_eight_threads_with_different_configurations_give_correct_results():
    configs = [
        dict(heads=(h, hkv), causal=causal, layout=layout)
        for h, hkv in ((8, 8), (8, 2))
        for causal in (False, True)
        for layout in ("head_major", "token_major")
    ]

    def work(index: int, config: dict):
        rng = np.random.default_rng(100 + index)
        lengths = rng.integers(1, 200, size=4, endpoint=True)
        batch = packed_batch(
            rng,
            lengths,
            lengths,
            num_heads_q=config["heads"][0],
            num_heads_kv=config["heads"][1],
            head_dim_qk=64,
            head_dim_v=64,
            dtype="bfloat16",
            slack_q=13,
            slack_kv=13,
        )
        options = dict(max_seqlen_q=200, max_seqlen_kv=200, is_causal=config["causal"])
        f = jax.jit(
            lambda *a: jra.ragged_attention(
                *a, stats_layout=config["layout"], return_stats=True, implementation="cudnn", **options
            )
        )
        results = [f(*batch.args) for _ in range(20)]  # many calls in flight from every thread at once
        out, stats = (np.asarray(x, np.float64) for x in results[-1])
        ref = reference_attention(*batch.reference_args, **options)
        return out, stats if config["layout"] == "token_major" else stats.T, ref

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(work, i, c) for i, c in enumerate(configs)]
        for config, future in zip(configs, futures):
            out, stats, ref = future.result()
            assert_close(out, ref["out"], "bfloat16", f"out {config}")
            assert_close(stats, ref["stats"], "float32", f"stats {config}")
    print(f"graph cache after the threads: {extension.module().graph_cache_stats()}")
