"""What only the cuDNN path does, on a CUDA GPU (skipped elsewhere, with the reason): its graphs and their
cache, the workspace, check mode's guard bands, clamping of garbage cu_seqlens, its limits and fallbacks.

The op's semantics (masks, empty sequences, padding, gradients, stats, determinism, jit / vmap / checkpoint)
are tested once for every implementation in test_semantics.py; its CudnnTest runs them on cuDNN.

Every test uses the same number of sequences, max_seqlen and capacities, so tests that differ only in
their lengths share one cuDNN graph: a graph build costs seconds, a cached call microseconds. Padding rows
of q, k, v and of the output cotangent are NaN, so any read of them shows up as NaN in a result.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ragged_attn as jra
from jax_ragged_attn.backends.cudnn import ragged as cudnn
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.config import AttentionOptions, make_config
from jax_ragged_attn.testing import assert_close, packed_batch, reference_attention
from jax_ragged_attn.testing.private_config import backend_options

_REASON = extension.cudnn_unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=f"cuDNN path unavailable: {_REASON}")]

NUM_SEQS = 6
MAX_SEQLEN_Q = 160
MAX_SEQLEN_KV = 192
CAPACITY_Q = NUM_SEQS * MAX_SEQLEN_Q + 37  # slack past every real token: padding rows
CAPACITY_KV = NUM_SEQS * MAX_SEQLEN_KV + 21


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: str = "bfloat16"
    heads: tuple[int, int] = (8, 8)
    dims: tuple[int, int] = (64, 64)
    is_causal: bool = False
    alignment: str = "top_left"
    window: int | tuple[int, int] | None = None
    layout: str = "head_major"
    empty: tuple[int, ...] = ()  # which sequences are empty in q and kv

    def __str__(self):
        return "-".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items() if v != getattr(Case, k))


def _batch(case: Case, seed: int):
    rng = np.random.default_rng(seed)
    lengths_q = rng.integers(1, MAX_SEQLEN_Q, size=NUM_SEQS, endpoint=True)
    lengths_kv = rng.integers(1, MAX_SEQLEN_KV, size=NUM_SEQS, endpoint=True)
    lengths_q[list(case.empty)] = 0
    lengths_kv[list(case.empty)] = 0
    (hq, hkv), (dqk, dv) = case.heads, case.dims
    batch = packed_batch(
        rng,
        lengths_q,
        lengths_kv,
        num_heads_q=hq,
        num_heads_kv=hkv,
        head_dim_qk=dqk,
        head_dim_v=dv,
        dtype=case.dtype,
        slack_q=CAPACITY_Q - int(lengths_q.sum()),
        slack_kv=CAPACITY_KV - int(lengths_kv.sum()),
    )
    d_out = rng.standard_normal((CAPACITY_Q, hq, dv)).astype(case.dtype)
    d_out[int(lengths_q.sum()) :] = np.nan  # never read: the cotangent of padding rows is not the op's business
    return batch, d_out


def _options(case: Case) -> dict:
    return dict(
        max_seqlen_q=MAX_SEQLEN_Q,
        max_seqlen_kv=MAX_SEQLEN_KV,
        is_causal=case.is_causal,
        diagonal_alignment=case.alignment,
        local_window_size=case.window,
    )


def _config(case: Case, batch, layout: str, strategy: str = "fastest"):
    options = AttentionOptions(
        is_causal=case.is_causal,
        diagonal_alignment=case.alignment,
        local_window_size=case.window,
        stats_layout=layout,
        strategy=strategy,
    )
    return make_config(*batch.args, options, max_seqlen_q=MAX_SEQLEN_Q, max_seqlen_kv=MAX_SEQLEN_KV)


def _run(case: Case, batch, d_out, layout: str | None = None, implementation: str = "cudnn", strategy: str = "fastest"):
    options = dict(_options(case), strategy=strategy)

    @jax.jit
    def step(q, k, v, cu_q, cu_kv, d_out):
        def attend(q, k, v):
            return jra.ragged_attention(
                q,
                k,
                v,
                cu_q,
                cu_kv,
                stats_layout=layout or case.layout,
                return_stats=True,
                implementation=implementation,
                **options,
            )

        # stats as aux: no cotangent flows into it (an explicit zero array would, and take the widened
        # backward of stats_grad.py); the tests at the end differentiate through stats.
        out, vjp, stats = jax.vjp(attend, q, k, v, has_aux=True)
        return out, stats, vjp(d_out)

    out, stats, grads = step(*batch.args, jnp.asarray(d_out))
    return np.asarray(out, np.float64), np.asarray(stats, np.float64), [np.asarray(g, np.float64) for g in grads]


@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_head_major_and_token_major_stats_give_the_same_gradients(heads):
    """The regression test for cudnn-frontend <= 1.27: head-major stats with max_total_seq_len set made the
    backward overwrite its own tile counter, and dQ/dK/dV came back all zero with no error."""
    case = Case(heads=heads, is_causal=True)
    batch, d_out = _batch(case, 1234)
    config = _config(case, batch, "head_major", strategy="lean_memory")  # the layout the bug shows in
    info = cudnn.graph_info("backward", config)
    assert info["max_total_seq_len_applied"] and not info["fell_back"], info
    assert info["frontend_region_bytes"] >= info["expected_intermediate_bytes"] > 0, info

    _, _, head_major = _run(case, batch, d_out, layout="head_major", strategy="lean_memory")
    _, _, token_major = _run(case, batch, d_out, layout="token_major", strategy="lean_memory")
    for name, a, b in zip(("dq", "dk", "dv"), head_major, token_major):
        assert np.abs(a).max() > 0, f"{name} is all zero with head-major stats"
        assert_close(a, b, case.dtype, f"{name}: head-major vs token-major")


def test_default_implementation_on_gpu_is_cudnn():
    case = Case(is_causal=True)
    batch, d_out = _batch(case, 11)
    auto = _run(case, batch, d_out, implementation=None)
    explicit = _run(case, batch, d_out, implementation="cudnn")
    np.testing.assert_array_equal(auto[0], explicit[0])
    hlo = jax.jit(lambda *a: jra.ragged_attention(*a, **_options(case))).lower(*batch.args).as_text()
    assert extension.FORWARD_TARGET in hlo


def test_float32_falls_back_to_xla_and_cudnn_refuses_it():
    case = Case(dtype="float32")
    batch, _ = _batch(case, 3)
    hlo = jax.jit(lambda *a: jra.ragged_attention(*a, **_options(case))).lower(*batch.args).as_text()
    assert extension.FORWARD_TARGET not in hlo
    with pytest.raises(NotImplementedError, match="bfloat16 or float16"):
        jra.ragged_attention(*batch.args, implementation="cudnn", **_options(case))


def test_workspace_is_an_xla_buffer_of_the_reported_size():
    case = Case(is_causal=True)
    batch, _ = _batch(case, 9)
    config = _config(case, batch, case.layout)
    workspace = cudnn.graph_info("forward", config)["workspace_bytes"]
    hlo = (
        jax.jit(lambda *a: jra.ragged_attention(*a, implementation="cudnn", **_options(case)))
        .lower(*batch.args)
        .as_text()
    )
    assert f"tensor<{workspace}xui8>" in hlo


def test_the_row_zeroing_kernel_is_ready_so_the_default_zeroes_only_unowned_rows():
    """The default row masking runs our PTX kernel (ffi/own_kernels.cu); were it unable to load, the handlers
    would quietly zero whole outputs instead (correct, slower): on a supported GPU that must not happen."""
    case = Case(is_causal=True)
    batch, _ = _batch(case, 10)
    assert cudnn.graph_info("forward", _config(case, batch, case.layout))["row_zeroing"] == "ready"


def test_graph_cache_hits_after_first_call_and_stays_bounded():
    ext = extension.module()
    case = Case(is_causal=True, layout="token_major")
    batch, d_out = _batch(case, 17)
    _run(case, batch, d_out)
    before = ext.graph_cache_stats()
    _run(case, _batch(case, 18)[0], d_out)  # new lengths, same configuration: no new graph
    after = ext.graph_cache_stats()
    assert after["misses"] == before["misses"] and after["hits"] > before["hits"]
    assert after["size"] <= after["capacity"]


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
def test_strategy_picks_the_backward_layout_and_changes_no_result(layout):
    """strategy="fastest" runs the backward with intermediates padded to [B, max_seqlen] (here B * max_seqlen
    < Tq, so no more workspace than the capacity-sized layout); "lean_memory" the capacity-sized one.
    Forward results are the same graph's; gradients agree up to the atomics' summation order."""
    case = Case(heads=(8, 2), is_causal=True, layout=layout)
    batch, d_out = _batch(case, 77)
    fastest = cudnn.graph_info("backward", _config(case, batch, layout))
    lean = cudnn.graph_info("backward", _config(case, batch, layout, strategy="lean_memory"))
    assert not fastest["max_total_seq_len_applied"] and lean["max_total_seq_len_applied"], (fastest, lean)
    out_f, stats_f, grads_f = _run(case, batch, d_out, strategy="fastest")
    out_l, stats_l, grads_l = _run(case, batch, d_out, strategy="lean_memory")
    np.testing.assert_array_equal(out_f, out_l)
    np.testing.assert_array_equal(stats_f, stats_l)
    for name, a, b in zip(("dq", "dk", "dv"), grads_f, grads_l):
        assert np.abs(a).max() > 0, f"{name} is all zero"
        assert_close(a, b, case.dtype, f"{name}: fastest vs lean_memory")


@pytest.mark.parametrize(
    "case",
    [Case(heads=(8, 2), is_causal=True, empty=(2,)), Case(is_causal=True, alignment="bottom_right", window=(16, 0))],
    ids=["causal-empty-sequence", "bottom-right-window"],
)
def test_poisoned_outputs_give_the_default_results(case):
    """The handler zeroes the rows cuDNN does not own before the graph runs (its row-zeroing kernel); with
    poison_outputs it fills every output with NaN first, so the results agree only if cuDNN writes every row
    the default leaves to it. Bottom-right alignment leaves the first rows of a sequence with more queries
    than keys without a key: cuDNN owns those rows, so they must read 0 from cuDNN itself."""
    batch, d_out = _batch(case, 41)
    default = _run(case, batch, d_out)
    with backend_options(poison_outputs=True):
        other = _run(case, batch, d_out)
    np.testing.assert_array_equal(other[0], default[0])
    np.testing.assert_array_equal(other[1], default[1])
    for name, a, b in zip(("dq", "dk", "dv"), other[2], default[2]):
        assert_close(a, b, case.dtype, f"{name}: poisoned vs default")
        assert np.all(a[batch.padding_q if name == "dq" else batch.padding_kv] == 0), name


def test_fastest_keeps_the_lean_layout_when_the_padded_one_exceeds_its_bound():
    """64 sequences bounded by 4096 in 8192 tokens: a padded layout would hold 32x the rows."""
    q = jax.ShapeDtypeStruct((8192, 8, 64), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((65,), jnp.int32)
    config = make_config(q, q, q, cu, cu, AttentionOptions(is_causal=True), max_seqlen_q=4096, max_seqlen_kv=4096)
    info = cudnn.graph_info("backward", config)
    assert info["max_total_seq_len_applied"], info


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
def test_check_mode_guard_bands_stay_intact_and_change_nothing(layout):
    """check=True surrounds every output with canary rows and the workspace with a canary tail; any write
    there raises. Here none may (the graph is built for the larger buffers, so results may differ in the
    last bit at most)."""
    case = Case(heads=(8, 2), is_causal=True, layout=layout)
    batch, d_out = _batch(case, 31)
    plain = _run(case, batch, d_out)

    @jax.jit
    def checked(q, k, v, d_out):
        def attend(q, k, v):
            return jra.ragged_attention(
                q, k, v, *batch.args[3:], implementation="cudnn", check=True, stats_layout=case.layout, **_options(case)
            )

        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(d_out)

    hlo = checked.lower(*batch.args[:3], jnp.asarray(d_out)).as_text()
    # Check mode calls the same two handlers, with the guarded buffers passed in aliased to the results.
    calls = [line for line in hlo.splitlines() if "custom_call @" in line]
    for target in (extension.FORWARD_TARGET, extension.BACKWARD_TARGET):
        assert any(f"@{target}(" in line and "output_operand_aliases" in line for line in calls), calls
    out, grads = checked(*batch.args[:3], jnp.asarray(d_out))
    assert_close(np.asarray(out, np.float64), plain[0], case.dtype, "check mode out")
    for a, b in zip(grads, plain[2]):
        assert_close(np.asarray(a, np.float64), b, case.dtype, "check mode gradient")


def test_garbage_cu_seqlens_stay_inside_the_buffers():
    """Unchecked garbage is clamped into the buffers: the guard band after the workspace stays intact and
    every result is finite (NaN padding would show any read outside the real rows)."""
    case = Case(heads=(8, 2), is_causal=True)
    batch, d_out = _batch(case, 41)
    config = dataclasses.replace(_config(case, batch, case.layout), guard_workspace=True)
    garbage = [
        jnp.array([5, -7, 2000, 3, 900, 10**9, -1], jnp.int32),
        jnp.array([0, 10**6, 4, 4, 1173, 0, 2**31 - 1], jnp.int32),
    ]

    @jax.jit
    def step(q, k, v, cu_q, cu_kv, d_out):
        out, vjp = jax.vjp(lambda q, k, v: cudnn.attention_cudnn(q, k, v, cu_q, cu_kv, config)[0], q, k, v)
        return out, vjp(d_out)

    finite_q = jnp.nan_to_num(batch.q)  # garbage offsets may point at any row, so give every row a value
    finite_kv = [jnp.nan_to_num(x) for x in (batch.k, batch.v)]
    out, grads = step(finite_q, *finite_kv, *garbage, jnp.nan_to_num(jnp.asarray(d_out)))
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in grads)


def _grads_through_stats(case: Case, batch, d_out, d_stats):
    """jax.grad of sum(out * d_out) + sum(stats * d_stats) (d_out None: stats alone), d_stats token-major."""
    weights = jnp.asarray(d_stats if case.layout == "token_major" else d_stats.T)

    @jax.jit
    def grads(q, k, v):
        def loss(q, k, v):
            out, stats = jra.ragged_attention(
                q,
                k,
                v,
                *batch.args[3:],
                stats_layout=case.layout,
                return_stats=True,
                implementation="cudnn",
                **_options(case),
            )
            # -inf stats rows get a zero weight through `where`, so the loss stays finite there.
            total = jnp.sum(jnp.where(jnp.isfinite(stats), stats * weights, 0.0))
            return total if d_out is None else total + jnp.sum(out.astype(jnp.float32) * jnp.asarray(d_out))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return [np.asarray(g, np.float64) for g in grads(*batch.args[:3])]


def test_stats_cotangent_past_the_head_dim_limit_raises():
    case = Case(dims=(256, 256))
    batch, _ = _batch(case, 5)
    with pytest.raises(NotImplementedError, match=r"Dv \+ 16 = 272 exceeds cuDNN's head dim limit of 256"):
        _grads_through_stats(case, batch, None, np.ones((CAPACITY_Q, 8), np.float32))


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
@pytest.mark.parametrize("check", [False, True], ids=["plain", "check"])
def test_split_bottom_right_backward_matches_the_reference(layout, check):
    """A causal bottom-right backward runs as rectangle + top-left square (launch._backward). Against the
    float64 reference: sequences with more keys than queries (a rectangle), fewer (rows without keys), equal,
    and empty ones; a stats cotangent too (the widened backward splits as well)."""
    case = Case(heads=(8, 2), is_causal=True, alignment="bottom_right", layout=layout, empty=(3,))
    batch, d_out = _batch(case, 77)
    rng = np.random.default_rng(78)
    d_stats = rng.standard_normal((CAPACITY_Q, 8)).astype(np.float32)
    options = dict(_options(case), stats_layout=layout, return_stats=True, implementation="cudnn", check=check)

    def grads():
        @jax.jit
        def step(q, k, v, cu_q, cu_kv, d_out, d_stats):
            attend = lambda q, k, v: jra.ragged_attention(q, k, v, cu_q, cu_kv, **options)
            (out, stats), vjp = jax.vjp(attend, q, k, v)
            g_stats = d_stats if layout == "token_major" else d_stats.T
            return vjp((d_out, g_stats))

        return [np.asarray(g, np.float64) for g in step(*batch.args, jnp.asarray(d_out), jnp.asarray(d_stats))]

    split = grads()
    reference = reference_attention(
        *batch.reference_args,
        max_seqlen_q=MAX_SEQLEN_Q,
        max_seqlen_kv=MAX_SEQLEN_KV,
        is_causal=True,
        diagonal_alignment="bottom_right",
        d_out=np.nan_to_num(d_out.astype(np.float64)) * ~batch.padding_q[:, None, None],
        d_stats=d_stats.astype(np.float64) * ~batch.padding_q[:, None],
    )
    lengths_q, lengths_kv = np.array(batch.seqlens_q), np.array(batch.seqlens_kv)
    assert np.any(lengths_kv > lengths_q) and np.any((lengths_q > lengths_kv) & (lengths_kv > 0))
    for name, a in zip(("dq", "dk", "dv"), split):
        assert np.abs(a).max() > 0, name
        assert_close(a, reference[name], case.dtype, f"{name}: split vs float64 reference")
        assert np.all(a[batch.padding_q if name == "dq" else batch.padding_kv] == 0), name
