"""implementation="fa3" on any backend: what it declines and why, and the wrapper's contracts (packed
gradients, check mode, sinks, the automatic choice) around dense stand-ins of FA3's kernels
(jax_ragged_attn/testing/fa3_emulator.py). The semantic suite runs on it in test_semantics.py (Fa3Test on a
Hopper GPU with the wheel, Fa3EmulatedTest anywhere)."""

from __future__ import annotations

import types
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import fa3_compare
from jax_ragged_attn import backends, ragged_attention
from jax_ragged_attn.backends.fa3 import ragged as _fa3
from jax_ragged_attn.config import AttentionOptions, make_config
from jax_ragged_attn.features.checks import RaggedAttentionInputError, input_errors
from jax_ragged_attn.index import RaggedIndex
from jax_ragged_attn.inputs.packed import ragged_attention_kvpacked, ragged_attention_qkvpacked
from jax_ragged_attn.testing import assert_close, fa3_emulator, reference_attention

CU = np.array([0, 5, 5, 12], np.int32)
T, H, D = 15, 4, 128


def _qkv(dtype=jnp.bfloat16, heads_kv=2, dim=D, dim_v=None, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((T, H, dim)), dtype)
    k = jnp.asarray(rng.standard_normal((T, heads_kv, dim)), dtype)
    v = jnp.asarray(rng.standard_normal((T, heads_kv, dim_v or dim)), dtype)
    return q, k, v


def _fa3_call(q, k, v, cu_q=CU, cu_kv=None, **options):
    cu_kv = cu_q if cu_kv is None else cu_kv
    return ragged_attention(q, k, v, cu_q, cu_kv, max_seqlen_q=8, max_seqlen_kv=8, implementation="fa3", **options)


@pytest.fixture
def emulated():
    with fa3_emulator.patched():
        yield


@pytest.mark.parametrize(
    "inputs,options,words",
    [
        (dict(dtype=jnp.float32), {}, "bfloat16 or float16"),
        (dict(dim=64), {}, "head dim 128"),
        (dict(dim_v=64), {}, "Dv=64"),
        ({}, dict(is_causal=True, cu_kv=np.array([0, 6, 6, 12], np.int32)), "bottom-right"),
        ({}, dict(local_window_size=3, cu_kv=np.array([0, 6, 6, 12], np.int32)), "bottom-right"),
    ],
)
def test_declines_with_the_reason(emulated, inputs, options, words):
    with pytest.raises(NotImplementedError, match="implementation='fa3' cannot serve this call") as error:
        _fa3_call(*_qkv(**inputs), **options)
    assert words in str(error.value)


def test_top_left_mask_is_served_where_the_lengths_are_provably_equal(emulated):
    q, k, v = _qkv()
    both = jax.jit(
        lambda q, k, v: (
            _fa3_call(q, k, v, is_causal=True),  # one array for both cu_seqlens
            _fa3_call(q, k, v, cu_kv=CU.copy(), is_causal=True),
        )
    )  # concrete and equal
    same, equal = both(q, k, v)
    np.testing.assert_array_equal(np.asarray(same, np.float32), np.asarray(equal, np.float32))
    # Traced cu_seqlens of two arrays prove nothing: declined.
    with pytest.raises(NotImplementedError, match="bottom-right"):
        jax.jit(lambda a, b: _fa3_call(q, k, v, a, b, is_causal=True))(CU, CU.copy())
    # Bottom-right, or no mask at all, needs no proof (traced: nothing is computed).
    jax.eval_shape(lambda a, b: _fa3_call(q, k, v, a, b, is_causal=True, diagonal_alignment="bottom_right"), CU, CU)
    jax.eval_shape(lambda a, b: _fa3_call(q, k, v, a, b), CU, CU.copy())


def test_unavailable_reasons():
    _fa3.unavailable_reason.cache_clear()
    try:
        with mock.patch.object(_fa3, "_installed", lambda: False):
            assert "not installed" in _fa3.unavailable_reason()
            assert "pip install 'jax_ragged_attn[fa3]'" in _fa3.unavailable_reason()
        _fa3.unavailable_reason.cache_clear()
        ampere = types.SimpleNamespace(compute_capability="8.0", device_kind="NVIDIA A100")
        with (
            mock.patch.object(_fa3, "_installed", lambda: True),
            mock.patch.object(jax, "default_backend", lambda: "gpu"),
            mock.patch.object(jax, "devices", lambda *a: [ampere]),
        ):
            assert "Hopper" in _fa3.unavailable_reason() and "8.0" in _fa3.unavailable_reason()
        _fa3.unavailable_reason.cache_clear()
        with (
            mock.patch.object(_fa3, "_installed", lambda: True),
            mock.patch.object(jax, "default_backend", lambda: "cpu"),
        ):
            assert "CUDA GPU" in _fa3.unavailable_reason()
    finally:
        _fa3.unavailable_reason.cache_clear()
    if jax.default_backend() == "cpu":  # and through the op, unpatched: the call says why
        with pytest.raises(NotImplementedError, match="implementation='fa3' cannot serve this call"):
            _fa3_call(*_qkv())


def test_automatic_choice_never_picks_fa3_until_measured_faster(emulated):
    q, k, v = _qkv()
    config = make_config(q, k, v, CU, CU, AttentionOptions(), max_seqlen_q=8, max_seqlen_kv=8)
    assert _fa3.unsupported_reason(config) is None
    assert backends.choose(None, config, RaggedIndex(CU, CU)).NAME != "fa3"
    assert backends.choose("fa3", config, RaggedIndex(CU, CU)).NAME == "fa3"


def _loss(f):
    def loss(*args):
        out, stats = f(*args)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(jnp.where(jnp.isfinite(stats), stats, 0.0) ** 2)

    return loss


def test_packed_gradients_in_the_packed_shape(emulated):
    """qkv- and kv-packed buffers: the gradients come back in the packed shape, equal to the separate q, k, v
    gradients (which the semantic suite holds to the reference) stacked the same way."""
    q, k, v = _qkv(heads_kv=H)
    options = dict(is_causal=True, return_stats=True, stats_layout="token_major", implementation="fa3")
    separate = _loss(lambda q, k, v: ragged_attention(q, k, v, CU, CU, max_seqlen_q=8, max_seqlen_kv=8, **options))
    qkv = _loss(lambda x: ragged_attention_qkvpacked(x, CU, max_seqlen=8, **options))
    kv = _loss(lambda a, b: ragged_attention_kvpacked(a, b, CU, CU, max_seqlen_q=8, max_seqlen_kv=8, **options))

    @jax.jit
    def grads(q, k, v):
        return (
            jax.grad(separate, argnums=(0, 1, 2))(q, k, v),
            jax.grad(qkv)(jnp.stack([q, k, v], axis=1)),
            jax.grad(kv, argnums=(0, 1))(q, jnp.stack([k, v], axis=1)),
        )

    (dq, dk, dv), dqkv, (dq_kv, dkv) = grads(q, k, v)
    assert dqkv.shape == (T, 3, H, D) and dkv.shape == (T, 2, H, D) and dqkv.dtype == dkv.dtype == q.dtype
    for got, want in ((dqkv, jnp.stack([dq, dk, dv], axis=1)), (dq_kv, dq), (dkv, jnp.stack([dk, dv], axis=1))):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_check_mode_raises_for_bad_cu_seqlens_and_passes_good_ones(emulated):
    q, k, v = _qkv()
    f = jax.jit(
        lambda q, k, v, cu_q, cu_kv: _fa3_call(
            q, k, v, cu_q, cu_kv, check=True, is_causal=True, diagonal_alignment="bottom_right"
        )
    )
    jax.block_until_ready(f(q, k, v, CU, CU.copy()))
    bad = np.array([0, 9, 5, 12], np.int32)
    with pytest.raises(RaggedAttentionInputError, match="cu_seqlens"):
        with input_errors():
            jax.block_until_ready(f(q, k, v, bad, bad.copy()))


def test_sinks_through_the_stats_gradient(emulated):
    """Sinks are an epilogue through the stats (sinks.py): their gradients need FA3's stats gradient."""
    q, k, v = _qkv()
    sinks = jnp.asarray([0.5, -1.0, 0.0, 2.0], jnp.float32)
    d_out = jnp.asarray(np.random.default_rng(1).standard_normal((T, H, D)), jnp.float32)

    def loss(q, k, v, sinks):
        out = ragged_attention(
            q, k, v, CU, CU, max_seqlen_q=8, max_seqlen_kv=8, implementation="fa3", is_causal=True, sinks=sinks
        )
        return jnp.sum(out.astype(jnp.float32) * d_out)

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    want = reference_attention(
        q,
        k,
        v,
        CU,
        CU,
        max_seqlen_q=8,
        max_seqlen_kv=8,
        is_causal=True,
        sinks=sinks,
        d_out=np.asarray(d_out.astype(jnp.bfloat16), np.float64),
    )
    for g, name in zip(got, ("dq", "dk", "dv", "dsinks")):
        assert_close(np.asarray(g, np.float64), want[name], "bfloat16", name)


@pytest.mark.gpu
def test_training_on_computed_inputs_copies_none_of_them():
    """Where q, k, v are intermediates (a projection's output), the padding clearing zeroes them in place: the
    compiled forward + backward holds no copy of a [T, H, D] tensor. (Clearing Q and K in the backward, after
    the forward kernel had read them, made XLA copy both: 0.12 ms of W1's 3.3 ms on the H200.)"""
    reason = _fa3.unavailable_reason()
    if reason is not None:
        pytest.skip(f"FA3: {reason}")
    tokens, heads = 1024, 4
    cu = jnp.asarray([0, 300, 1000], jnp.int32)  # 24 rows of capacity padding
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, d_out = (jax.random.normal(key, (tokens, heads, D), jnp.bfloat16) for key in keys)

    def attend(q, k, v, cu):
        return ragged_attention(
            q, k, v, cu, cu, max_seqlen_q=700, max_seqlen_kv=700, is_causal=True, implementation="fa3"
        )

    # q, k, v and d_out enter as x * s: intermediates, as a projection and a loss's backward make them.
    step = fa3_compare.steps(attend, "computed")[1]
    text = step.lower(q, k, v, cu, jnp.float32(1), d_out).compile().as_text()
    copies = _copies_of(text, f"bf16[{tokens},{heads},{D}]")
    assert not copies, copies


def _copies_of(hlo_text: str, shape: str) -> list[str]:
    """The instructions of compiled HLO text that copy a tensor of `shape` (the shape right after the '=')."""
    copies = []
    for line in hlo_text.splitlines():
        _, equals, rest = line.partition("=")
        if equals and shape in rest[:60] and (" copy(" in rest or " copy-start(" in rest):
            copies.append(line.strip())
    return copies


def test_copies_of_finds_the_copies_the_h200_compiled():
    # Two lines of the H200's compiled W1 step where Q and K are cleared in the backward, after the forward read them.
    text = """
  %copy.10 = bf16[32768,16,128]{2,1,0} copy(%loop_multiply_fusion.2), metadata={scheduling_name="copy.10"}
  %copy-start.1 = (bf16[32768,16,128]{2,1,0}, bf16[32768,16,128]{2,1,0}, u32[]) copy-start(%p.3)
  %copy.3 = bf16[16,32768]{1,0} copy(%fusion.7), metadata={scheduling_name="copy.3"}
  %fusion.2 = bf16[32768,16,128]{2,1,0} fusion(%copy.1), kind=kLoop, calls=%fused_computation.2
"""
    found = _copies_of(text, "bf16[32768,16,128]")
    assert [line.split(" ")[0] for line in found] == ["%copy.10", "%copy-start.1"], found
