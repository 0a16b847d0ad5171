"""A call too large for cuDNN's int32 ragged offsets runs as several over head groups (backends/shared/head_groups.py,
backends/cudnn/extents.py). On a CPU: the group arithmetic, the per-tensor bounds, and the cuDNN backend's
split with its launch replaced by the xla path at a lowered limit, against the unsplit call. The real kernels
on tensors past 2**31 elements: tests/test_large_tensors.py (H200)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiers import some_fast  # tests/ is on sys.path under pytest

from jax_ragged_attn.backends.cudnn import extents, launch
from jax_ragged_attn.backends.cudnn import ragged as cudnn
from jax_ragged_attn.backends.shared import head_groups
from jax_ragged_attn.backends.xla import ragged as xla
from jax_ragged_attn.config import AttentionOptions, make_config
from jax_ragged_attn.index import RaggedIndex
from jax_ragged_attn.index.packings import TABLE
from jax_ragged_attn.testing import assert_close, packed_batch

HEADS = [(8, 8), (8, 2), (8, 1), (12, 4), (6, 3)]


@pytest.mark.parametrize("num_heads_q,num_heads_kv", HEADS + [(32, 8), (64, 64)])
def test_every_group_count_keeps_each_query_head_with_its_kv_head(num_heads_q, num_heads_kv):
    counts = head_groups.group_counts(num_heads_q, num_heads_kv)
    assert counts[0] == 1 and counts[-1] == num_heads_q
    group_size = num_heads_q // num_heads_kv
    for groups in counts:
        width = num_heads_q // groups
        covered = []
        for g in range(groups):
            kv = range(num_heads_kv)[head_groups._kv_heads(g, groups, num_heads_kv)]
            q_heads = range(g * width, (g + 1) * width)
            # The group's kv heads are exactly those its query heads read, in order.
            assert sorted({h // group_size for h in q_heads}) == list(kv), (groups, g)
            covered.extend(q_heads)
        assert covered == list(range(num_heads_q))


def _config(tq, tkv, hq, hkv, d, **changes):
    q = jax.ShapeDtypeStruct((tq, hq, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((tkv, hkv, d), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((3,), jnp.int32)
    config = make_config(q, kv, kv, cu, cu, AttentionOptions(is_causal=True), max_seqlen_q=tq, max_seqlen_kv=tkv)
    return dataclasses.replace(config, **changes)


def test_each_tensor_is_bounded_by_its_own_extent():
    # The serving decode case: one query per sequence against 256 x 2,048 cache rows, GQA 32/8, d 128. K and
    # V hold 5.4e8 elements: the forward fits (the old bound, max(Tq, Tkv) * Hq * D, refused it).
    decode = _config(256, 256 * 2048, 32, 8, 128)
    assert extents.fits(decode, backward=False)
    assert extents.groups(decode, backward=False) == 1
    # Its backward keeps dK/dV per query head: 2**31 elements, one past the int32 range -> two groups.
    assert extents.tensor_extents(decode)["dk/dv per query head"] == 2**31
    assert extents.groups(decode) == 2
    # Training at 262,144 tokens x 64 heads x 128: every tensor is 2**31 -> two groups of 32 heads.
    training = _config(2**18, 2**18, 64, 64, 128)
    assert extents.groups(training) == 2
    assert extents.groups(_config(2**18 - 8, 2**18 - 8, 64, 64, 128)) == 1
    # Packed qkv rows stride three parts: the same call passes at a third of the tokens.
    assert extents.tensor_extents(_config(2**17, 2**17, 64, 64, 128, packing="qkv"))["q"] == 3 * 2**30
    # One query head alone past 2**31: no head split serves, and the reason says so.
    huge = _config(2**25, 2**25, 2, 2, 128)
    assert extents.groups(huge) is None
    assert "one query head per call" in extents.too_large_reason(huge)


def test_check_mode_and_stats_gradient_count_in_the_bound():
    at_edge = _config(2**18 - 8, 2**18 - 8, 64, 64, 128)
    assert extents.fits(at_edge)
    assert not extents.fits(dataclasses.replace(at_edge, guard_workspace=True))
    assert not extents.fits(at_edge, stats_gradient=True)
    assert extents.fits(at_edge, backward=False, stats_gradient=True)  # no backward, no widened columns


def _xla_launch(calls):
    """Stands in for launch.attention: the xla path on the same buffers, recording each call's config."""

    def attention(buffers, cu_q, cu_kv, config, seqused=(None, None)):
        calls.append(config)
        return xla.attention_xla(
            *TABLE[config.packing].split(buffers),
            cu_q,
            cu_kv,
            config,
            return_stats=True,
            seqused_q=seqused[0],
            seqused_kv=seqused[1],
        )

    return attention


def _packed_buffers(batch, packing):
    if packing == "none":
        return (batch.q, batch.k, batch.v)
    if packing == "kv":
        return (batch.q, jnp.stack([batch.k, batch.v], axis=1))
    return (jnp.stack([batch.q, batch.k, batch.v], axis=1),)


# Each head shape once, the stats layouts alternating; a packed buffer holds q, k and v at one head count.
SPLITS = [("none", *heads, layout) for heads, layout in zip(HEADS, ["head_major", "token_major"] * 3)]
SPLITS += [("kv", 8, 8, "token_major"), ("qkv", 6, 6, "head_major")]


@some_fast(
    {"packing,num_heads_q,num_heads_kv,layout": SPLITS},
    fast=["kv-8-8-token_major", "none-8-1-head_major", "qkv-6-6-head_major"],
)
def test_the_cudnn_backend_splits_a_call_past_the_limit_into_head_groups(
    monkeypatch, packing, num_heads_q, num_heads_kv, layout
):
    rng = np.random.default_rng(num_heads_q * 10 + num_heads_kv)
    lengths_q = [13, 0, 20, 7]
    lengths_kv = lengths_q if packing != "none" else [9, 4, 20, 11]  # a packed row holds its token's q, k, v
    batch = packed_batch(
        rng,
        lengths_q,
        lengths_kv,
        num_heads_q=num_heads_q,
        num_heads_kv=num_heads_kv,
        head_dim_qk=16,
        head_dim_v=16,
        dtype="float32",
        slack_q=5,
        slack_kv=5,
    )
    buffers = _packed_buffers(batch, packing)
    options = AttentionOptions(
        is_causal=True, diagonal_alignment="bottom_right", stats_layout=layout, return_stats=True
    )
    config = make_config(
        batch.q,
        batch.k,
        batch.v,
        batch.cu_seqlens_q,
        batch.cu_seqlens_kv,
        options,
        max_seqlen_q=batch.max_seqlen_q,
        max_seqlen_kv=batch.max_seqlen_kv,
        packing=packing,
    )
    index = RaggedIndex(batch.cu_seqlens_q, batch.cu_seqlens_kv)
    calls = []
    monkeypatch.setattr(launch, "attention", _xla_launch(calls))
    # A limit the whole call passes but half of its heads do not (the xla stand-in has no int32 offsets).
    whole = max(extents.tensor_extents(config, stats_gradient=True).values())
    monkeypatch.setattr(extents, "INT32_LIMIT", whole // 2)
    expected_groups = extents.groups(config, stats_gradient=True)
    assert expected_groups is not None and expected_groups > 1

    weights = jnp.asarray(rng.standard_normal((batch.q.shape[0], num_heads_q, 16)), jnp.float32)
    stats_weights = jnp.asarray(rng.standard_normal(config.num_heads_q * batch.q.shape[0]), jnp.float32)

    def loss(attend, buffers):
        out, stats = attend(buffers, index, config, stats=True)
        finite = jnp.where(jnp.isfinite(stats), stats, 0.0).reshape(-1)
        return jnp.sum(out * weights) + jnp.sum(finite * stats_weights), (out, stats)

    (_, (out, stats)), grads = jax.value_and_grad(lambda b: loss(cudnn.attend, b), has_aux=True)(buffers)
    (_, (ref_out, ref_stats)), ref_grads = jax.value_and_grad(lambda b: loss(xla.attend, b), has_aux=True)(buffers)

    assert len(calls) == expected_groups
    for inner in calls:
        assert inner.num_heads_q == num_heads_q // expected_groups and inner.packing == "none"
        assert extents.fits(inner, stats_gradient=True)
    assert_close(np.asarray(out), np.asarray(ref_out), "float32", "out")
    np.testing.assert_array_equal(np.isfinite(np.asarray(stats)), np.isfinite(np.asarray(ref_stats)))
    finite = np.isfinite(np.asarray(ref_stats))
    assert_close(np.asarray(stats)[finite], np.asarray(ref_stats)[finite], "float32", "stats")
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.shape
        assert_close(np.asarray(g), np.asarray(r), "float32", "gradient")


def test_sinks_are_split_with_their_heads(monkeypatch):
    rng = np.random.default_rng(7)
    batch = packed_batch(
        rng,
        [6, 9],
        [6, 9],
        num_heads_q=4,
        num_heads_kv=2,
        head_dim_qk=8,
        head_dim_v=8,
        dtype="float32",
        slack_q=3,
        slack_kv=3,
    )
    config = make_config(
        batch.q,
        batch.k,
        batch.v,
        batch.cu_seqlens_q,
        batch.cu_seqlens_kv,
        AttentionOptions(is_causal=True),
        max_seqlen_q=9,
        max_seqlen_kv=9,
    )
    seen = []

    def with_sinks(buffers, cu_q, cu_kv, sinks, config, seqused=(None, None)):
        seen.append((buffers[0].shape[1], np.asarray(sinks).tolist()))
        return jnp.zeros(buffers[0].shape[:2] + (config.head_dim_v,), buffers[0].dtype) + sinks[None, :, None]

    monkeypatch.setattr(cudnn.folded_sinks, "attention_with_sinks", with_sinks)
    monkeypatch.setattr(extents, "INT32_LIMIT", max(extents.tensor_extents(config).values()) // 2)
    sinks = jnp.asarray([1.0, 2.0, 3.0, 4.0])
    out = cudnn.attend_with_sinks(
        (batch.q, batch.k, batch.v), RaggedIndex(batch.cu_seqlens_q, batch.cu_seqlens_kv), sinks, config
    )
    assert seen == [(2, [1.0, 2.0]), (2, [3.0, 4.0])]
    np.testing.assert_array_equal(np.asarray(out[0, :, 0]), [1.0, 2.0, 3.0, 4.0])


def test_a_launch_past_the_limit_raises_rather_than_wrapping_its_offsets():
    # The launches themselves refuse a config whose tensors pass 2**31 elements (only cudnn.attend splits):
    # a caller that skips the split gets a NotImplementedError, never an int32 offset that wraps in the kernel.
    training = _config(2**18, 2**18, 64, 64, 128)
    with pytest.raises(NotImplementedError, match="int32 offsets"):
        launch._refuse_int32_overflow(training, backward=False)
    decode = _config(256, 256 * 2048, 32, 8, 128)
    launch._refuse_int32_overflow(decode, backward=False)  # its forward fits
    with pytest.raises(NotImplementedError, match="dk/dv per query head"):
        launch._refuse_int32_overflow(decode, backward=True)
