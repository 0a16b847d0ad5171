"""The xla path's memory is bounded whatever max_seqlen says, estimated before compiling, and
refused with a clear error past a bound; implementation=None says so when a GPU falls back to it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.backends.xla import memory as xla_memory
from jax_ragged_attn.backends.xla.ragged import WorkingSetTooLargeError, attention_xla
from jax_ragged_attn.config import AttentionOptions, make_config
from jax_ragged_attn.index import cu_seqlens_from_lengths
from jax_ragged_attn.testing import packed_batch

pytestmark = pytest.mark.slow  # children capped at +1 GiB of address space

# The child warms JAX up (thread pools, the compiler), then caps its address space at what it has plus
# 1 GiB (JAX reserves a lot of virtual memory up front, so an absolute cap would measure JAX, not us).
_CHILD = """
import re, resource, sys
import jax, jax.numpy as jnp
from jax_ragged_attn import ragged_attention

x = jnp.ones((64, 2, 16)); cu = jnp.array([0, 32, 64], jnp.int32)
warm = lambda x: ragged_attention(x, x, x, cu, cu, max_seqlen_q=32, max_seqlen_kv=32, implementation="xla").sum()
jax.block_until_ready(jax.jit(jax.grad(warm))(x))
vm = int(re.search(r"VmSize:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, vm + 2**30))
"""

# A call whose max_seqlen is far past its lengths, forward and gradient, eagerly: 10 tokens, max_seqlen 10**9.
ISSUE_CALL = """
x = jnp.ones((10, 2, 16), jnp.float32); cu = jnp.array([0, 5, 10], jnp.int32)
f = lambda x: ragged_attention(x, x, x, cu, cu, max_seqlen_q=10**9, max_seqlen_kv=10**9, implementation="xla")
jax.block_until_ready((f(x), jax.grad(lambda x: f(x).sum())(x)))
"""
# max_seqlen = T "to be safe" over 64 short sequences: the old padded path sized [64, 8, 2048, 2048] float32
# scores (8 GiB each) even with max_seqlen clamped to T; the blocked path needs a few MiB.
GENEROUS_MAX_SEQLEN = """
t = 2048; x = jax.random.normal(jax.random.key(0), (t, 8, 16)); cu = jnp.arange(0, t + 1, 32, dtype=jnp.int32)
f = lambda x: ragged_attention(x, x, x, cu, cu, max_seqlen_q=t, max_seqlen_kv=t, is_causal=True, implementation="xla")
jax.block_until_ready(jax.jit(jax.value_and_grad(lambda x: f(x).sum()))(x))
"""
# Proof that the cap bites: one buffer of the old path's score size cannot be allocated under it.
DENSE_SCORES = "jax.block_until_ready(jnp.zeros((64, 8, 2048, 2048)) + 1)"


def _run_capped(body: str) -> subprocess.CompletedProcess:
    code = _CHILD + body + '\nprint("completed")\n'
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status and caps RLIMIT_AS")
@pytest.mark.parametrize("body", [ISSUE_CALL, GENEROUS_MAX_SEQLEN], ids=["issue_call", "max_seqlen_T_short_seqs"])
def test_generous_max_seqlen_runs_in_under_a_gib(body):
    result = _run_capped(body)
    assert result.returncode == 0 and "completed" in result.stdout, result.stdout + result.stderr[-3000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status and caps RLIMIT_AS")
def test_the_memory_cap_bites():
    result = _run_capped(DENSE_SCORES)
    assert "completed" not in result.stdout, "an 8 GiB buffer fit under the cap: the cap proves nothing"


def _config(lengths, *, heads=(4, 4), dim=32, dtype=jnp.float32, max_seqlen=None, slack=0, **options):
    t = sum(lengths) + slack
    q = jax.ShapeDtypeStruct((t, heads[0], dim), dtype)
    k = jax.ShapeDtypeStruct((t, heads[1], dim), dtype)
    cu = jnp.asarray(cu_seqlens_from_lengths(lengths))
    max_seqlen = max(lengths) if max_seqlen is None else max_seqlen
    return (
        make_config(q, k, k, cu, cu, AttentionOptions(**options), max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen),
        q,
        k,
        cu,
    )


def test_max_seqlen_is_clamped_to_the_capacities_and_results_do_not_change():
    config, *_ = _config([5, 5], max_seqlen=10**9, slack=3)
    assert (config.max_seqlen_q, config.max_seqlen_kv) == (13, 13)
    batch = packed_batch(
        np.random.default_rng(0),
        (5, 0, 4),
        (3, 6, 2),
        num_heads_q=2,
        num_heads_kv=1,
        head_dim_qk=8,
        head_dim_v=8,
        dtype=jnp.float32,
        slack_q=2,
        slack_kv=1,
    )
    exact = ragged_attention(
        *batch.args, max_seqlen_q=5, max_seqlen_kv=6, is_causal=True, return_stats=True, implementation="xla"
    )
    generous = ragged_attention(
        *batch.args, max_seqlen_q=10**9, max_seqlen_kv=2**40, is_causal=True, return_stats=True, implementation="xla"
    )
    for a, b in zip(exact, generous):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _compiled_bytes(config, q, k, cu, direction: str) -> int:
    """What XLA itself allocates besides the arguments (temp + output) for the forward or forward+backward."""
    block_q, block_kv = xla_memory.block_sizes(config)

    def forward(q, k, v):
        return attention_xla(q, k, v, cu, cu, config, block_q=block_q, block_kv=block_kv)[0]

    def backward(q, k, v, d_out):
        return jax.vjp(forward, q, k, v)[1](d_out)

    if direction == "forward":
        compiled = jax.jit(forward).lower(q, k, k).compile()
    else:
        compiled = jax.jit(backward).lower(q, k, k, jax.ShapeDtypeStruct(q.shape, q.dtype)).compile()
    analysis = compiled.memory_analysis()
    return analysis.temp_size_in_bytes + analysis.output_size_in_bytes


@pytest.mark.parametrize(
    "shape",
    [
        dict(lengths=[509, 1, 1024, 300, 70], heads=(4, 2), dim=32, dtype=jnp.bfloat16, is_causal=True),
        dict(lengths=[40] * 30 + [800], heads=(2, 2), dim=64, dtype=jnp.float32),
        dict(lengths=[700, 700], heads=(8, 1), dim=16, dtype=jnp.float16, local_window_size=(64, 0)),
    ],
    ids=["w1_like_bf16", "many_short_f32", "mqa_window_f16"],
)
@pytest.mark.parametrize("blocks", [128, (32, 64)])
def test_the_estimate_bounds_what_xla_allocates(shape, blocks):
    """An upper bound, and not a wild one: within 4x of XLA's own accounting on the CPU."""
    config, q, k, cu = _config(**shape, xla_block_size=blocks)
    block_q, block_kv = xla_memory.block_sizes(config)
    for direction in ("forward", "backward"):
        estimate = xla_memory.estimate_bytes(config, block_q, block_kv, direction)
        measured = _compiled_bytes(config, q, k, cu, direction)
        assert measured <= estimate <= 4 * measured, (direction, measured, estimate)


def test_the_estimate_does_not_grow_with_max_seqlen_or_sequences():
    few, *_ = _config([2048, 2048])
    many, *_ = _config([16] * 256)
    generous, *_ = _config([16] * 256, max_seqlen=4096)
    estimates = {xla_memory.estimate_bytes(c, 128, 128, "backward") for c in (few, many, generous)}
    assert len(estimates) == 1, estimates


def test_a_working_set_past_the_bound_raises_before_compiling(monkeypatch):
    batch = packed_batch(
        np.random.default_rng(0),
        (300, 200),
        (300, 200),
        num_heads_q=4,
        num_heads_kv=2,
        head_dim_qk=16,
        head_dim_v=16,
        dtype=jnp.float32,
    )
    config = make_config(*batch.args, max_seqlen_q=300, max_seqlen_kv=300)
    forward = xla_memory.estimate_bytes(config, 128, 128, "forward")
    backward = xla_memory.estimate_bytes(config, 128, 128, "backward")
    assert forward < backward

    def call(q):  # 128-row blocks: the estimates above (the CPU's default is 64)
        return ragged_attention(
            q, *batch.args[1:], max_seqlen_q=300, max_seqlen_kv=300, implementation="xla", xla_block_size=128
        )

    monkeypatch.setenv(xla_memory.MEMORY_LIMIT_ENV, "1MiB")
    with pytest.raises(WorkingSetTooLargeError) as error:
        jax.jit(call).lower(batch.q)  # tracing is enough: nothing is compiled or allocated
    message = str(error.value)
    assert isinstance(error.value, MemoryError)
    for fragment in (
        "forward",
        "Tq=500",
        "Hq=4",
        "blocks 128x128",
        "bound of 1 MiB",
        "xla_block_size=16",
        "implementation='cudnn'",
        "split the batch",
        xla_memory.MEMORY_LIMIT_ENV,
    ):
        assert fragment in message, (fragment, message)

    # A bound between the two: the forward runs, the gradient is refused when its backward is traced.
    monkeypatch.setenv(xla_memory.MEMORY_LIMIT_ENV, str((forward + backward) // 2))
    call(batch.q)
    with pytest.raises(WorkingSetTooLargeError, match="backward"):
        jax.grad(lambda q: call(q).sum())(batch.q)
    monkeypatch.setenv(xla_memory.MEMORY_LIMIT_ENV, "off")
    jax.grad(lambda q: call(q).sum())(batch.q)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("off", None),
        ("8GiB", 8 * 2**30),
        ("512MB", 512 * 10**6),
        ("3e9", 3 * 10**9),
        ("1024", 1024),
        ("25%", "quarter"),
        (" 50 % ", "half"),
    ],
)
def test_memory_limit_settings(monkeypatch, text, expected):
    monkeypatch.setattr(xla_memory, "device_memory_bytes", lambda: 4 * 2**30)
    monkeypatch.setenv(xla_memory.MEMORY_LIMIT_ENV, text)
    want = {"quarter": 2**30, "half": 2 * 2**30}.get(expected, expected)
    assert xla_memory.memory_limit_bytes() == want


def test_default_memory_limit_is_half_the_device(monkeypatch):
    monkeypatch.delenv(xla_memory.MEMORY_LIMIT_ENV, raising=False)
    assert xla_memory.memory_limit_bytes() == int(xla_memory.device_memory_bytes() * 0.5)


@pytest.mark.parametrize("bad", ["lots", "-1GiB", "0", "12 parsecs", "%"])
def test_a_bad_memory_limit_names_the_variable(monkeypatch, bad):
    monkeypatch.setenv(xla_memory.MEMORY_LIMIT_ENV, bad)
    with pytest.raises(ValueError, match=xla_memory.MEMORY_LIMIT_ENV):
        xla_memory.memory_limit_bytes()


def test_fallback_on_a_gpu_warns_once_per_reason(monkeypatch):
    """implementation=None on a GPU that cuDNN declines (here: float32, and no GPU at all, as seen from a
    CPU made to look like one) warns once, naming the reason and the estimate; "xla" asked for is silent."""
    monkeypatch.setattr(xla_memory, "_on_gpu", lambda: True)
    monkeypatch.setattr(xla_memory, "_warned", set())
    batch = packed_batch(
        np.random.default_rng(0),
        (5, 3),
        (5, 3),
        num_heads_q=2,
        num_heads_kv=2,
        head_dim_qk=8,
        head_dim_v=8,
        dtype=jnp.float32,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            ragged_attention(*batch.args, max_seqlen_q=5, max_seqlen_kv=5)
        ragged_attention(*batch.args, max_seqlen_q=5, max_seqlen_kv=5, implementation="xla")
    fallbacks = [w for w in caught if issubclass(w.category, xla_memory.CudnnFallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]
    message = str(fallbacks[0].message)
    assert "not cuDNN" in message and re.search(r"about [0-9.e-]+ MiB forward and [0-9.e-]+ MiB backward", message)
    config = make_config(*batch.args, max_seqlen_q=5, max_seqlen_kv=5)
    from jax_ragged_attn.backends.cudnn import ragged as cudnn

    assert cudnn.unsupported_reason(config) in message
    assert fallbacks[0].filename == __file__  # points at the caller's line


def test_no_fallback_warning_off_a_gpu(monkeypatch):
    monkeypatch.setattr(xla_memory, "_warned", set())
    if xla_memory._on_gpu():
        pytest.skip("on a GPU the fallback warning is expected")
    batch = packed_batch(
        np.random.default_rng(0),
        (5,),
        (5,),
        num_heads_q=2,
        num_heads_kv=2,
        head_dim_qk=8,
        head_dim_v=8,
        dtype=jnp.float32,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", xla_memory.CudnnFallbackWarning)
        ragged_attention(*batch.args, max_seqlen_q=5, max_seqlen_kv=5)
