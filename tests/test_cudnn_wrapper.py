"""The cuDNN path's Python layer on a CPU, with the FFI call replaced by a stand-in kernel.

Everything around the kernel is ours and runs in CI here: offsets, the custom_vjp with symbolic zeros, the
masking of rows cuDNN never writes, check mode's canary band. The stand-in computes attention with the xla
path from what the real handler receives (ragged offsets, lengths) and, like cuDNN, leaves every row it does
not own as garbage (NaN), so the wrapper must clean them up. It can also write past the workspace, to prove
the guard band catches it. The real kernels are held to the reference in tests/test_cudnn.py on a GPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiers import some_fast  # tests/ is on sys.path under pytest

from jax_ragged_attn.backends.cudnn import launch
from jax_ragged_attn.backends.cudnn import options as cudnn_options
from jax_ragged_attn.backends.cudnn import ragged as cudnn
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.backends.xla.ragged import attention_xla
from jax_ragged_attn.config import AttentionOptions, make_config
from jax_ragged_attn.features import checks
from jax_ragged_attn.index import row_positions
from jax_ragged_attn.testing import assert_close, packed_batch, stand_in_handler_args

OPTIONS = dict(is_causal=True, diagonal_alignment="bottom_right")
# The arguments a plain call passes (q, k, v [, out, d_out, stats], then 7 index arrays); a guarded call adds
# the workspace and one buffer per result, aliased to the results.
PLAIN_ARGS = {extension.FORWARD_TARGET: 3 + 7, extension.BACKWARD_TARGET: 6 + 7}


class StandInKernel:
    """Replaces jax.ffi.ffi_call for the two handlers. `overrun` bytes are written past the workspace; with
    `stray_row`, one row of `stray_row` (a result name) just before the first sequence is written too.
    Records each call's target and whether it was guarded (check mode: the canary buffers come in aliased)."""

    def __init__(self, overrun: int = 0, stray_row: str | None = None):
        self.overrun = overrun
        self.stray_row = stray_row
        self.targets = []

    def __call__(self, target, result_types, *, vmap_method=None, input_output_aliases=None):
        assert target in (extension.FORWARD_TARGET, extension.BACKWARD_TARGET), target
        guarded = bool(input_output_aliases)
        self.targets.append((target, guarded))
        forward = target == extension.FORWARD_TARGET

        def call(*args, **attributes):
            assert len(args) == PLAIN_ARGS[target] + len(input_output_aliases or {}), (target, len(args))
            args, workspace, initial = stand_in_handler_args(args, result_types, input_output_aliases, attributes)
            # The shapes say what the handler was configured for (guard mode adds rows).
            config = dataclasses.replace(self.config, capacity_q=args[0].shape[0], capacity_kv=args[1].shape[0])
            results, owned = (self._forward if forward else self._backward)(config, *args)
            # Like cuDNN, write only the rows of sequences; every other row keeps what was there.
            results = [jnp.where(mask, r, init) for r, mask, init in zip(results, owned, initial)]
            names = ("out", "stats") if forward else ("dq", "dk", "dv")
            if self.stray_row in names:
                i = names.index(self.stray_row)
                kv_side = self.stray_row in ("dk", "dv")
                offsets = args[(5 if forward else 8) + kv_side]  # offset_q or offset_k, in elements
                tensor = args[1 if kv_side else 0]
                first = offsets[0] // (tensor.shape[1] * tensor.shape[2])  # the first sequence's first row
                axis = 1 if forward and i == 1 and config.stats_layout == "head_major" else 0
                results[i] = results[i].at[(slice(None),) * axis + (first - 1,)].set(0)
            workspace_guarded = len(result_types) - 1 in (input_output_aliases or {}).values()
            size = result_types[-1].shape[0] - (checks.GUARD_BYTES if workspace_guarded else 0)
            if self.overrun:
                workspace = workspace.at[size : size + self.overrun].set(0)
            return (*results, workspace)

        return call

    @staticmethod
    def _cu(offsets, per_token):
        return (offsets // per_token).astype(jnp.int32)

    def _owned_rows(self, cu, capacity, max_seqlen):
        return row_positions(cu, capacity, max_seqlen)[2]

    def _forward(self, c, q, k, v, seq_len_q, seq_len_kv, off_q, off_k, *_):
        cu_q = self._cu(off_q, c.num_heads_q * c.head_dim_qk)
        cu_kv = self._cu(off_k, c.num_heads_kv * c.head_dim_qk)
        # The kernel always writes stats, whatever the caller keeps.
        out, stats = attention_xla(
            q, k, v, cu_q, cu_kv, dataclasses.replace(c, stats_layout="token_major", return_stats=True)
        )
        rows = self._owned_rows(cu_q, c.capacity_q, c.max_seqlen_q)
        if c.stats_layout == "head_major":
            return (out, stats.T), (rows[:, None, None], rows[None, :])
        return (out, stats), (rows[:, None, None], rows[:, None])

    def _backward(self, c, q, k, v, out, d_out, stats, seq_len_q, seq_len_kv, off_q, off_k, *_):
        cu_q = self._cu(off_q, c.num_heads_q * c.head_dim_qk)
        cu_kv = self._cu(off_k, c.num_heads_kv * c.head_dim_qk)
        _, vjp = jax.vjp(lambda q, k, v: attention_xla(q, k, v, cu_q, cu_kv, c)[0], q, k, v)
        rows_q = self._owned_rows(cu_q, c.capacity_q, c.max_seqlen_q)[:, None, None]
        rows_kv = self._owned_rows(cu_kv, c.capacity_kv, c.max_seqlen_kv)[:, None, None]
        # A NaN in an unowned row of d_out must not reach the owned rows (cuDNN never reads it).
        d_out = jnp.where(rows_q, d_out, 0)
        return vjp(d_out), (rows_q, rows_kv, rows_kv)


@pytest.fixture(autouse=True)
def single_bottom_right_backward(monkeypatch):
    """This stand-in recomputes the forward from the whole band instead of reading the passed out and stats,
    so it cannot serve a split backward's two partial calls: the backward runs as one bottom-right call here
    (launch._backward's path for masks it does not split). test_stats_grad.py's stand-in, which does cuDNN's
    arithmetic on the passed buffers, tests the split."""
    monkeypatch.setattr(launch, "_splits_bottom_right", lambda config: False)


@pytest.fixture
def batch():
    rng = np.random.default_rng(2024)
    return packed_batch(
        rng,
        [17, 0, 24, 3],
        [20, 5, 9, 0],
        num_heads_q=4,
        num_heads_kv=2,
        head_dim_qk=16,
        head_dim_v=8,
        dtype="bfloat16",
        slack_q=11,
        slack_kv=6,
    )


def _install(monkeypatch, config, overrun=0, stray_row=None):
    kernel = StandInKernel(overrun, stray_row)
    kernel.config = config
    monkeypatch.setattr(jax.ffi, "ffi_call", kernel)
    monkeypatch.setattr(launch, "graph_info", lambda direction, config, layout=None: {"workspace_bytes": 64})
    return kernel


def _config(batch, layout="head_major", **changes):
    config = make_config(
        *batch.args, AttentionOptions(stats_layout=layout, **OPTIONS), max_seqlen_q=24, max_seqlen_kv=20
    )
    return dataclasses.replace(config, **changes)


@some_fast(
    {"layout": ["head_major", "token_major"], "poison_outputs": {"unowned": False, "poisoned": True}},
    fast=["head_major-poisoned", "token_major-unowned"],
)
def test_outputs_and_gradients_match_the_xla_path_with_padding_cleaned(monkeypatch, batch, layout, poison_outputs):
    """The handler zeroes the rows it does not own first, with or without filling the outputs with NaN before
    (the stand-in starts from zeros when asked, and writes every row it owns)."""
    monkeypatch.setattr(cudnn_options, "OPTIONS", cudnn_options.CudnnOptions(poison_outputs=poison_outputs))
    config = _config(batch, layout)
    kernel = _install(monkeypatch, config)
    d_out = jnp.asarray(np.random.default_rng(1).standard_normal((batch.q.shape[0], 4, 8)), jnp.bfloat16)

    out, stats = cudnn.attention_cudnn(*batch.args, config)
    ref_out, ref_stats = attention_xla(*batch.args, config)
    assert_close(np.asarray(out, np.float64), np.asarray(ref_out, np.float64), "bfloat16", "out")
    assert_close(np.asarray(stats, np.float64), np.asarray(ref_stats, np.float64), "float32", "stats")

    grads = jax.vjp(lambda q, k, v: cudnn.attention_cudnn(q, k, v, *batch.args[3:], config)[0], *batch.args[:3])[1](
        d_out
    )
    ref_grads = jax.vjp(lambda q, k, v: attention_xla(q, k, v, *batch.args[3:], config)[0], *batch.args[:3])[1](d_out)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert np.isfinite(np.asarray(g, np.float32)).all(), f"{name}: garbage rows leaked"
        assert_close(np.asarray(g, np.float64), np.asarray(r, np.float64), "bfloat16", name)
    assert np.all(np.asarray(grads[0])[batch.padding_q] == 0)
    assert np.all(np.asarray(grads[1])[batch.padding_kv] == 0)
    assert {aliased for _, aliased in kernel.targets} == {False}


def test_rows_without_keys_read_zero_and_minus_inf(monkeypatch, batch):
    config = _config(batch)
    _install(monkeypatch, config)
    out, stats = jax.jit(lambda *a: cudnn.attention_cudnn(*a, config))(*batch.args)
    ref_out, ref_stats = attention_xla(*batch.args, config)
    # Sequence 3 has 3 queries and no keys; padding rows follow it.
    empty = ~np.isfinite(np.asarray(ref_stats)).any(axis=0)
    assert empty.sum() > batch.padding_q.sum()
    assert np.all(np.asarray(out)[empty] == 0) and np.all(np.asarray(stats)[:, empty] == -np.inf)


def test_stats_as_aux_take_the_plain_backward(monkeypatch, batch):
    """No cotangent reaches stats taken as aux, so the backward runs at Dv. A cotangent that does reach them
    is carried on widened value columns; this stand-in ignores O and so cannot check that: tests/
    test_stats_grad.py does, with a stand-in that does cuDNN's arithmetic."""
    config = _config(batch)
    _install(monkeypatch, config)
    shapes = []
    backward = launch._backward
    monkeypatch.setattr(
        launch, "_backward", lambda buffers, *rest: shapes.append(buffers[2].shape) or backward(buffers, *rest)
    )

    def loss_with_stats_aux(q):
        out, stats = cudnn.attention_cudnn(q, *batch.args[1:], config)
        return jnp.sum(out.astype(jnp.float32)), stats

    grad, _ = jax.grad(loss_with_stats_aux, has_aux=True)(batch.q)
    assert np.isfinite(np.asarray(grad, np.float32)).all()
    assert shapes == [batch.v.shape]


def test_check_mode_passes_the_guarded_buffers_to_the_same_handlers_and_an_intact_band(monkeypatch, batch):
    config = _config(batch, guard_workspace=True)
    kernel = _install(monkeypatch, config)
    plain = cudnn.attention_cudnn(*batch.args, dataclasses.replace(config, guard_workspace=False))
    grads = jax.grad(lambda q: jnp.sum(cudnn.attention_cudnn(q, *batch.args[1:], config)[0].astype(jnp.float32)))(
        batch.q
    )
    guarded = cudnn.attention_cudnn(*batch.args, config)
    np.testing.assert_array_equal(np.asarray(guarded[0]), np.asarray(plain[0]))
    assert np.isfinite(np.asarray(grads, np.float32)).all()
    assert (extension.FORWARD_TARGET, True) in kernel.targets
    assert (extension.BACKWARD_TARGET, True) in kernel.targets


def test_a_write_past_the_workspace_stops_the_computation(monkeypatch, batch):
    config = _config(batch, guard_workspace=True)
    _install(monkeypatch, config, overrun=5)
    with pytest.raises((RuntimeError, ValueError), match="5 of the 4096 guard bytes"):
        jax.block_until_ready(jax.jit(lambda *a: cudnn.attention_cudnn(*a, config))(*batch.args))


@some_fast({"result": ["out", "stats", "dq", "dk", "dv"]}, fast=["out", "dk"])
def test_a_write_outside_an_outputs_rows_stops_the_computation(monkeypatch, batch, result):
    config = _config(batch, guard_workspace=True)
    _install(monkeypatch, config, stray_row=result)

    def step(q, k, v):
        out, vjp, stats = jax.vjp(
            lambda q, k, v: cudnn.attention_cudnn(q, k, v, *batch.args[3:], config), q, k, v, has_aux=True
        )
        return out, stats, vjp(jnp.ones_like(out))

    with pytest.raises((RuntimeError, ValueError), match=f"cuDNN wrote outside the rows of {result}: "):
        jax.block_until_ready(jax.jit(step)(*batch.args[:3]))


@pytest.mark.slow  # as test_debug_infs.py
@pytest.mark.parametrize("flag", ["debug_nans", "debug_infs"])
@pytest.mark.parametrize("layout", ["head_major", "token_major"])
def test_quiet_under_jax_debug_flags_eagerly(monkeypatch, batch, flag, layout):
    """Quiet under the debug flags on the cuDNN wrapper: like cuDNN, the stand-in writes -inf stats for rows whose
    band is empty (bottom-right causal with more queries than keys) and leaves unowned rows as they were, and the
    inputs' padding holds NaN; an eager call under jax.debug_nans / debug_infs must still not stop, and must give
    what it gives without the flag."""
    config = _config(batch, layout, return_stats=False)
    _install(monkeypatch, config)
    d_out = jnp.asarray(np.random.default_rng(3).standard_normal((batch.q.shape[0], 4, 8)), jnp.bfloat16)

    def run():
        out, vjp = jax.vjp(lambda q, k, v: cudnn.attention_cudnn(q, k, v, *batch.args[3:], config)[0], *batch.args[:3])
        return out, vjp(d_out)

    expected = run()
    with getattr(jax, flag)(True):
        got = run()
    for name, g, e in zip(("out", "dq", "dk", "dv"), (got[0], *got[1]), (expected[0], *expected[1])):
        assert np.isfinite(np.asarray(g, np.float32)).all(), name
        # Equal up to rounding: under the flags the stand-in's arithmetic is compiled as one program.
        assert_close(np.asarray(g, np.float64), np.asarray(e, np.float64), "bfloat16", name)
