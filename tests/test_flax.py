"""RaggedSelfAttention: packed equals sequence by sequence, under nnx.jit / grad / remat, sharded, on cuDNN."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx", reason="the Flax module needs flax: pip install 'jax_ragged_attn[flax]'")

from tiers import some_fast  # noqa: E402  tests/ is on sys.path under pytest

from jax_ragged_attn.flax import RaggedSelfAttention, apply_rope, positions_from_cu_seqlens  # noqa: E402
from jax_ragged_attn.testing import assert_close  # noqa: E402

FEATURES = 24
LENGTHS = (5, 0, 9, 1, 7)  # a zero-length and a one-token sequence among them
SLACK = 4  # padding rows past the last sequence, poisoned with NaN
MAX_SEQLEN = 9

# name: RaggedSelfAttention keywords
CONFIGS = {
    "mha_causal": dict(num_heads=4),
    "gqa_causal": dict(num_heads=4, num_kv_heads=2),
    "mqa_window": dict(num_heads=4, num_kv_heads=1, local_window_size=(2, 0)),
    "mha_bidirectional_window": dict(num_heads=2, is_causal=False, local_window_size=3),
    "mha_sinks": dict(num_heads=4, sinks=True),
    "gqa_sinks": dict(num_heads=4, num_kv_heads=2, sinks=True),
    "gqa_no_rope_head_dim_10": dict(num_heads=4, num_kv_heads=2, head_dim=10, rope_base=None),
}


def _inputs(seed: int, lengths=LENGTHS, slack=SLACK, poison=np.nan):
    rng = np.random.default_rng(seed)
    total = sum(lengths)
    x = rng.standard_normal((total + slack, FEATURES)).astype(np.float32)
    x[total:] = poison
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lengths] + [np.zeros(slack, int)]).astype(np.int32)
    return jnp.asarray(x), jnp.asarray(cu), jnp.asarray(positions)


def _model(config: dict, seed: int = 0, **extra) -> RaggedSelfAttention:
    model = RaggedSelfAttention(FEATURES, **config, **extra, rngs=nnx.Rngs(seed))
    if model.sinks is not None:  # the zero initialisation would hide a sink applied to the wrong head
        model.sinks[...] = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(model.num_heads), jnp.float32)
    return model


# ---- An independent float64 reference: one sequence at a time, nothing packed, RoPE as complex rotation. ----


def _reference_sequence(model: RaggedSelfAttention, x: np.ndarray):
    """(y [L, F], lse [Hq, L]) for one sequence alone, in float64 from the module's parameters."""
    n = x.shape[0]
    h, hkv, d = model.num_heads, model.num_kv_heads, model.head_dim
    if model.packs_qkv:
        qkv = np.einsum("tf,fphd->tphd", x, np.asarray(model.qkv_kernel[...], np.float64))
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    else:
        q = np.einsum("tf,fhd->thd", x, np.asarray(model.q_kernel[...], np.float64))
        kv = np.einsum("tf,fphd->tphd", x, np.asarray(model.kv_kernel[...], np.float64))
        k, v = kv[:, 0], kv[:, 1]
    if model.rope_base is not None:
        half = d // 2
        angle = np.arange(n)[:, None, None] * model.rope_base ** (-2.0 * np.arange(half) / d)
        rotate = lambda t: (t[..., :half] + 1j * t[..., half:]) * np.exp(1j * angle)
        q, k = (np.concatenate([z.real, z.imag], axis=-1) for z in (rotate(q), rotate(k)))
    group = h // hkv
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # query head i reads kv head i // group
    scale = model.scale if model.scale is not None else d**-0.5
    logits = np.einsum("qhd,khd->hqk", q, k) * scale
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    keep = np.ones((n, n), bool)
    if model.is_causal:
        keep &= j <= i
    if model.local_window_size is not None:
        w = model.local_window_size
        left, right = (w, w) if isinstance(w, int) else w
        keep &= (j >= i - left) & (j <= i + right)
    logits = np.where(keep, logits, -np.inf)
    top = logits.max(axis=-1, keepdims=True)
    if model.sinks is not None:
        top = np.maximum(top, np.asarray(model.sinks[...], np.float64)[:, None, None])
    weights = np.exp(logits - top)
    total = weights.sum(axis=-1, keepdims=True)
    if model.sinks is not None:
        total = total + np.exp(np.asarray(model.sinks[...], np.float64)[:, None, None] - top)
    out = np.einsum("hqk,khd->qhd", weights / total, v)
    y = np.einsum("qhd,hdf->qf", out, np.asarray(model.out_kernel[...], np.float64))
    return y, (np.log(total) + top)[..., 0]


@some_fast({"name": list(CONFIGS)}, fast=["gqa_causal", "mha_bidirectional_window", "mqa_window", "gqa_sinks"])
def test_packed_equals_each_sequence_alone(name):
    model = _model(CONFIGS[name])
    x, cu, positions = _inputs(1)

    @nnx.jit
    def packed(model, x, cu, positions):
        return model(x, cu, positions, max_seqlen=MAX_SEQLEN, return_stats=True)

    y, stats = packed(model, x, cu, positions)
    assert y.shape == x.shape and stats.shape == (model.num_heads, x.shape[0])
    total = int(cu[-1])
    np.testing.assert_array_equal(np.asarray(y[total:]), 0.0, "padding rows must read exactly 0")
    assert np.all(np.asarray(stats[:, total:]) == -np.inf)

    x64 = np.asarray(x, np.float64)
    for b, (start, end) in enumerate(zip(np.asarray(cu[:-1]), np.asarray(cu[1:]))):
        if end == start:
            continue
        expected_y, expected_lse = _reference_sequence(model, x64[start:end])
        assert_close(y[start:end], expected_y, np.float32, f"{name} sequence {b} out vs float64 reference")
        assert_close(stats[:, start:end], expected_lse, np.float32, f"{name} sequence {b} stats")
        # The same module on the sequence alone (no packing, positions derived from cu_seqlens).
        x_alone, cu_alone = _alone(x, cu, b)
        alone = packed(model, x_alone, cu_alone, positions_from_cu_seqlens(cu_alone, x.shape[0]))[0]
        assert_close(
            alone[: end - start], np.asarray(y[start:end], np.float64), np.float32, f"{name} sequence {b} vs alone"
        )
    assert float(jnp.abs(y[:total]).max()) > 0.1


def _alone(x, cu, b):
    """Sequence b by itself: its rows first in a buffer of x's shape, the rest NaN, cu [0, n, n, ...] (one
    compiled program for every sequence; nothing else is in the buffer to leak)."""
    start, end = int(cu[b]), int(cu[b + 1])
    alone = jnp.full_like(x, jnp.nan).at[: end - start].set(x[start:end])
    return alone, jnp.full_like(cu, end - start).at[0].set(0)


def _loss_packed(model, x, cu, positions, cotangent):
    return jnp.sum(model(x, cu, positions, max_seqlen=MAX_SEQLEN) * cotangent)


@some_fast(
    {"remat": {"plain": False, "remat": True}, "name": ["mha_causal", "gqa_sinks", "mqa_window"]},
    fast=["plain-mha_causal", "remat-gqa_sinks", "plain-mqa_window"],
)
def test_gradients_equal_the_sum_over_sequences_alone(name, remat):
    model = _model(CONFIGS[name], seed=3)
    x, cu, positions = _inputs(4)
    cotangent = jnp.asarray(np.random.default_rng(5).standard_normal(x.shape), jnp.float32)
    call = nnx.remat(_loss_packed) if remat else _loss_packed

    @nnx.jit
    def grads(model, x, cu, positions, cotangent):
        return nnx.grad(call, argnums=(0, 1))(model, x, cu, positions, cotangent)

    d_model, d_x = grads(model, x, cu, positions, cotangent)
    total = int(cu[-1])
    np.testing.assert_array_equal(np.asarray(d_x[total:]), 0.0, "padding rows get exactly zero gradient")

    # Sequence by sequence, nothing packed: parameter gradients add up over sequences.
    expected_params, expected_x = None, np.zeros(x.shape)
    for b, (start, end) in enumerate(zip(np.asarray(cu[:-1]), np.asarray(cu[1:]))):
        if end == start:
            continue
        x_alone, cu_alone = _alone(x, cu, b)
        cotangent_alone = jnp.zeros_like(cotangent).at[: end - start].set(cotangent[start:end])
        g_model, g_x = grads(model, x_alone, cu_alone, positions_from_cu_seqlens(cu_alone, x.shape[0]), cotangent_alone)
        leaves = jax.tree.leaves(nnx.state(g_model, nnx.Param))
        expected_params = leaves if expected_params is None else [a + b for a, b in zip(expected_params, leaves)]
        expected_x[start:end] = np.asarray(g_x[: end - start])
    got = jax.tree_util.tree_leaves_with_path(nnx.state(d_model, nnx.Param))
    assert len(got) == len(expected_params)
    for (path, a), b in zip(got, expected_params):
        assert_close(np.asarray(a, np.float64), np.asarray(b, np.float64), np.float32, f"{name} d{path}")
        assert float(jnp.abs(a).max()) > 0, f"d{path} is all zero"
    assert_close(np.asarray(d_x[:total], np.float64), expected_x[:total], np.float32, f"{name} dx")


def test_positions_default_to_cu_seqlens():
    cu = jnp.array([0, 2, 2, 5], jnp.int32)
    np.testing.assert_array_equal(positions_from_cu_seqlens(cu, 7), [0, 1, 0, 1, 2, 0, 0])
    model = _model(CONFIGS["gqa_causal"])
    x, cu, positions = _inputs(6, poison=0.0)
    np.testing.assert_array_equal(positions_from_cu_seqlens(cu, x.shape[0]), positions)
    call = nnx.jit(lambda model, positions: model(x, cu, positions, max_seqlen=MAX_SEQLEN))
    y = call(model, positions)
    np.testing.assert_array_equal(nnx.jit(lambda model: model(x, cu, max_seqlen=MAX_SEQLEN))(model), y)
    # RoPE sees only distances within a sequence: global row numbers give the same result as restarted
    # positions, and stretched distances do not.
    assert_close(
        call(model, jnp.arange(x.shape[0], dtype=jnp.int32)),
        np.asarray(y, np.float64),
        np.float32,
        "global row numbers as positions",
    )
    assert not np.allclose(call(model, 2 * positions)[1:5], y[1:5], atol=1e-3)


def test_rope_scores_depend_on_relative_position_only():
    rng = np.random.default_rng(7)
    q, k = (jnp.asarray(rng.standard_normal(16), jnp.float32) for _ in range(2))

    def score(m, n):
        return float(jnp.dot(apply_rope(q, jnp.asarray(m)), apply_rope(k, jnp.asarray(n))))

    assert score(5, 2) == pytest.approx(score(13, 10), rel=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)
    np.testing.assert_allclose(apply_rope(q, jnp.asarray(0)), q)


@pytest.mark.parametrize(
    "config, shapes",
    [
        (dict(num_heads=4), ("qkv", (11, 3, 4, 6))),
        (dict(num_heads=4, num_kv_heads=2), ("q", (11, 4, 6), "kv", (11, 2, 2, 6))),
    ],
)
def test_projection_is_laid_out_for_the_packed_ops(config, shapes):
    model = _model(config)
    x = jnp.ones((11, FEATURES), jnp.float32)  # float32 under x64 too: the reference einsum below is float32
    qkv, q, kv = model.project(x, jnp.arange(11))
    got = ("qkv", qkv.shape) if qkv is not None else ("q", q.shape, "kv", kv.shape)
    assert got == shapes
    # The packed buffer's v part is the projection itself (RoPE rotates q and k only).
    if qkv is not None:
        v = jnp.einsum("tf,fhd->thd", x, model.qkv_kernel[...][:, 2])
        np.testing.assert_allclose(qkv[:, 2], v, rtol=1e-6)


def test_bfloat16_activations_follow_dtype():
    model = _model(CONFIGS["gqa_causal"], dtype=jnp.bfloat16)
    x, cu, positions = _inputs(8, poison=0.0)
    call = nnx.jit(lambda model: model(x, cu, positions, max_seqlen=MAX_SEQLEN))
    y = call(model)
    assert y.dtype == jnp.bfloat16 and model.q_kernel[...].dtype == jnp.float32
    reference = call(_model(CONFIGS["gqa_causal"]))
    assert_close(np.asarray(y, np.float64), np.asarray(reference, np.float64), "bfloat16", "bfloat16 vs float32")


def test_implementation_cudnn_without_gpu_says_why():
    from jax_ragged_attn import cudnn_unavailable_reason

    if cudnn_unavailable_reason() is None:
        pytest.skip("a GPU with cuDNN is here; test_cudnn_path_equals_xla_path covers it")
    model = _model(CONFIGS["mha_causal"], implementation="cudnn", dtype=jnp.bfloat16)
    x, cu, positions = _inputs(9, poison=0.0)
    with pytest.raises(NotImplementedError, match="implementation='cudnn' cannot serve this call"):
        model(x, cu, positions, max_seqlen=MAX_SEQLEN)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_heads=0), r"num_heads must be an int >= 1, got 0"),
        (dict(num_heads=4, num_kv_heads=3), r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
        (dict(num_heads=5), r"features \(24\) must be a multiple of num_heads \(5\), or pass head_dim"),
        (dict(num_heads=4, head_dim=5), r"RoPE needs an even head_dim"),
        (dict(num_heads=4, is_causal=1), r"is_causal and sinks must be Python bools"),
        (dict(num_heads=2.0), r"num_heads must be an int, got float"),
        (dict(num_heads=4, strategy="fast"), r"strategy must be one of \('fastest', 'lean_memory'\), got 'fast'"),
    ],
)
def test_bad_construction_raises_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RaggedSelfAttention(FEATURES, **kwargs, rngs=nnx.Rngs(0))


def test_bad_call_raises_naming_the_argument():
    model = _model(CONFIGS["mha_causal"])
    x, cu, positions = _inputs(0, poison=0.0)
    with pytest.raises(ValueError, match=r"x must be \[T, features=24\], got shape \(1, 26, 24\)"):
        model(x[None], cu, max_seqlen=MAX_SEQLEN)
    with pytest.raises(ValueError, match=r"positions must be \[T=26\], got shape \(25,\)"):
        model(x, cu, positions[:-1], max_seqlen=MAX_SEQLEN)


def test_missing_flax_names_the_extra():
    code = (
        "import sys; sys.modules['flax'] = None\n"
        "try:\n    import jax_ragged_attn.flax\nexcept ImportError as e:\n    print(e)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert run.returncode == 0, run.stderr
    assert "pip install 'jax_ragged_attn[flax]'" in run.stdout, run.stdout


# ---- Sharded parameters on 4 virtual CPU devices (a child interpreter, as in tests/test_sharding.py). ----

SHARDED_CASES = {"mha": dict(num_heads=4), "gqa_sinks": dict(num_heads=8, num_kv_heads=4, head_dim=6, sinks=True)}


def _sharded_check(config: dict) -> None:
    assert len(jax.devices()) == 4, f"expected 4 virtual devices, got {jax.devices()}"
    mesh = jax.make_mesh((4,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    x, cu, positions = _inputs(11)
    cotangent = jnp.asarray(np.random.default_rng(12).standard_normal(x.shape), jnp.float32)
    plain = _model(config, seed=2)
    with jax.set_mesh(mesh):
        sharded = _model(config, seed=2, head_axis="model")
    # Created split over heads: each device holds a quarter of every kernel's heads.
    for name in ("qkv_kernel", "q_kernel", "kv_kernel", "out_kernel", "sinks"):
        param = getattr(sharded, name, None)
        if param is None:
            continue
        value = param[...]
        axis = {"qkv_kernel": 2, "q_kernel": 1, "kv_kernel": 2, "out_kernel": 0, "sinks": 0}[name]
        assert value.addressable_shards[0].data.shape[axis] == value.shape[axis] // 4, (name, value.sharding)
        np.testing.assert_array_equal(np.asarray(value), np.asarray(getattr(plain, name)[...]))

    @nnx.jit
    def step(model, x, cu, positions, cotangent):
        loss, grads = nnx.value_and_grad(_loss_packed)(model, x, cu, positions, cotangent)
        return model(x, cu, positions, max_seqlen=MAX_SEQLEN), loss, grads

    expected = step(plain, x, cu, positions, cotangent)
    with jax.set_mesh(mesh):
        got = step(sharded, x, cu, positions, cotangent)
        # The attention runs inside shard_map over heads, and nothing gathers the heads: the one collective
        # is the all-reduce of the output projection's sum over heads.
        graphdef, state = nnx.split(sharded)
        plain_step = lambda state, *args: step(nnx.merge(graphdef, state), *args)
        assert "shard_map" in str(jax.make_jaxpr(plain_step)(state, x, cu, positions, cotangent))
        hlo = jax.jit(plain_step).lower(state, x, cu, positions, cotangent).compile().as_text()
    found = [c for c in ("all-gather", "all-to-all", "collective-permute", "reduce-scatter") if c in hlo]
    assert not found, f"collectives that move heads between devices: {found}"
    assert_close(got[0], np.asarray(expected[0], np.float64), np.float32, "sharded y")
    assert_close(got[1], np.asarray(expected[1], np.float64), np.float32, "sharded loss")
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(nnx.state(got[2], nnx.Param)),
        jax.tree.leaves(nnx.state(expected[2], nnx.Param)),
    ):
        assert_close(np.asarray(a, np.float64), np.asarray(b, np.float64), np.float32, f"sharded d{path}")


def _child() -> None:
    for name, config in SHARDED_CASES.items():
        try:
            _sharded_check(config)
            print(json.dumps({"check": name, "ok": True}), flush=True)
        except Exception:  # noqa: BLE001  report every failure, keep checking the rest
            print(json.dumps({"check": name, "ok": False, "detail": traceback.format_exc()}), flush=True)


@pytest.mark.slow  # 4 devices; test_sharding.py is fast
def test_sharded_parameters_match_unsharded():
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip(),
    )
    run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    results = {json.loads(line)["check"]: json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")}
    assert run.returncode == 0, f"child exited {run.returncode}:\n{run.stdout}\n{run.stderr[-4000:]}"
    assert sorted(results) == sorted(SHARDED_CASES), f"child reported {sorted(results)}:\n{run.stderr[-4000:]}"
    failed = [f"--- {name}:\n{record['detail']}" for name, record in results.items() if not record["ok"]]
    assert not failed, "\n".join(failed)


if __name__ == "__main__":
    _child()


# ---- GPU: the cuDNN path inside the module equals the xla path. ----


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [
        dict(num_heads=8),
        dict(num_heads=8, num_kv_heads=2),
        dict(num_heads=8, num_kv_heads=2, local_window_size=(64, 0)),
    ],
    ids=["mha", "gqa", "gqa_window"],
)
def test_cudnn_path_equals_xla_path(config):
    from jax_ragged_attn import cudnn_unavailable_reason

    reason = cudnn_unavailable_reason()
    if reason is not None:
        pytest.skip(f"cuDNN path unavailable: {reason}")
    features, lengths, slack = 512, (300, 0, 517, 64, 1), 40
    rng = np.random.default_rng(13)
    total = sum(lengths)
    x = rng.standard_normal((total + slack, features)).astype(np.float32)
    x[total:] = np.nan
    x = jnp.asarray(x, jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    cotangent = jnp.asarray(rng.standard_normal(x.shape), jnp.bfloat16)
    results = {}
    for implementation in ("cudnn", "xla"):
        model = RaggedSelfAttention(
            features, **config, dtype=jnp.bfloat16, implementation=implementation, rngs=nnx.Rngs(0)
        )

        @nnx.jit
        def run(model, x):
            def loss(model, x):
                y = model(x, cu, max_seqlen=max(lengths))
                return jnp.sum((y * cotangent).astype(jnp.float32)), y

            (_, y), grads = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(model, x)
            return y, grads

        results[implementation] = run(model, x)
    (y_cudnn, (g_cudnn, dx_cudnn)), (y_xla, (g_xla, dx_xla)) = results["cudnn"], results["xla"]
    assert_close(np.asarray(y_cudnn, np.float64), np.asarray(y_xla, np.float64), "bfloat16", "y")
    np.testing.assert_array_equal(np.asarray(y_cudnn[total:], np.float32), 0.0)
    assert_close(np.asarray(dx_cudnn[:total], np.float64), np.asarray(dx_xla[:total], np.float64), "bfloat16", "dx")
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(nnx.state(g_cudnn, nnx.Param)), jax.tree.leaves(nnx.state(g_xla, nnx.Param))
    ):
        assert_close(np.asarray(a, np.float64), np.asarray(b, np.float64), "bfloat16", f"d{path}")
