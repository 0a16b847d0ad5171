"""strategy=: which layout the cuDNN backward gives its intermediates (backends/cudnn/strategy.py), with the
extension's graphs replaced by their workspace sizes (CPU). On a GPU, test_cudnn.py runs both layouts and
compares their gradients, and test_semantics.py's CudnnLeanMemoryTest runs every semantic case on each."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.backends.cudnn import launch
from jax_ragged_attn.backends.cudnn import ragged as cudnn
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.config import AttentionOptions, make_config

MiB = 1 << 20


class FakeExtension:
    """Workspace sizes per layout, and (for autotune) a measured time per layout."""

    frontend_version = (1, 32, 0)

    def __init__(self, bounded_bytes, padded_bytes, bounded_ms=2.0, padded_ms=1.5, padded_status="ok"):
        self.bytes = {1: bounded_bytes, 0: padded_bytes}
        self.ms = {1: bounded_ms, 0: padded_ms}
        self.padded_status = padded_status
        self.tuned = []

    def cudnn_version(self):
        return 91900

    def graph_info(self, direction, device, attributes):
        bounded = attributes["use_max_total_seq_len"]
        if direction == "backward" and not bounded and self.padded_status != "ok":
            return dict(status=self.padded_status, message="no engine for this layout")
        return dict(status="ok", message="", workspace_bytes=self.bytes[bounded])

    def tune_plans(self, direction, device, attributes):
        bounded = attributes["use_max_total_seq_len"]
        self.tuned.append((direction, bounded))
        plan = dict(index=0, name="engine0", ok=True, message="", workspace_bytes=0, median_ms=self.ms[bounded])
        return dict(status="ok", message="", plans=[plan])


def _config(**options):
    q = jax.ShapeDtypeStruct((4096, 8, 64), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((17,), jnp.int32)
    return make_config(
        q, q, q, cu, cu, AttentionOptions(is_causal=True, **options), max_seqlen_q=512, max_seqlen_kv=512
    )


def _bounded(config, direction="backward") -> bool:
    return bool(cudnn.ffi_attributes(config, direction)["use_max_total_seq_len"])


def test_fastest_runs_the_padded_layout_within_twice_the_lean_workspace(install_extension):
    install_extension(FakeExtension(100 * MiB, 200 * MiB))
    assert not _bounded(_config())
    assert _bounded(_config(strategy="lean_memory"))


def test_fastest_allows_256_mib_more_for_small_workspaces(install_extension):
    install_extension(FakeExtension(10 * MiB, 10 * MiB + 256 * MiB))
    assert not _bounded(_config())
    install_extension(FakeExtension(10 * MiB, 10 * MiB + 257 * MiB))
    assert _bounded(_config())


def test_fastest_keeps_the_lean_layout_past_the_bound(install_extension):
    """Skewed lengths: B * max_seqlen rows far beyond the token buffer."""
    install_extension(FakeExtension(300 * MiB, 601 * MiB))
    assert _bounded(_config())


def test_a_padded_layout_cudnn_cannot_build_keeps_the_lean_one(install_extension):
    install_extension(FakeExtension(100 * MiB, 100 * MiB, padded_status="unsupported"))
    assert _bounded(_config())


def test_the_forward_has_no_layout_choice(install_extension):
    ext = install_extension(FakeExtension(100 * MiB, 100 * MiB))
    assert _bounded(_config(), "forward")
    assert _bounded(_config(strategy="lean_memory"), "forward")
    assert ext.tuned == []


@pytest.mark.parametrize(
    "padded_ms, bounded",
    [(1.5, False), (1.99, True), (2.5, True)],
    ids=["padded-clearly-faster", "within-the-margin", "padded-slower"],
)
def test_autotune_times_both_layouts_and_keeps_the_lean_one_unless_clearly_slower(
    install_extension, padded_ms, bounded
):
    ext = install_extension(FakeExtension(100 * MiB, 150 * MiB, bounded_ms=2.0, padded_ms=padded_ms))
    assert _bounded(_config(autotune=True)) == bounded
    assert sorted(ext.tuned) == [("backward", 0), ("backward", 1)]


def test_autotune_never_times_a_layout_past_the_bound(install_extension):
    ext = install_extension(FakeExtension(100 * MiB, 1000 * MiB, padded_ms=0.1))
    assert _bounded(_config(autotune=True))
    assert ext.tuned == [("backward", 1)]  # the plan of the layout that runs


def test_lean_memory_never_builds_the_padded_layout(install_extension):
    ext = install_extension(FakeExtension(100 * MiB, 100 * MiB))
    asked = []
    graph_info = ext.graph_info
    ext.graph_info = lambda d, dev, a: asked.append(a["use_max_total_seq_len"]) or graph_info(d, dev, a)
    assert _bounded(_config(strategy="lean_memory"))
    assert 0 not in asked


@pytest.mark.parametrize("strategy_name", ["fast", "", None, "FASTEST"])
def test_an_unknown_strategy_is_refused_naming_the_argument(strategy_name):
    q = jnp.zeros((8, 2, 16), jnp.float32)
    cu = jnp.array([0, 8], jnp.int32)
    with pytest.raises(ValueError, match=r"strategy must be one of \('fastest', 'lean_memory'\)"):
        ragged_attention(q, q, q, cu, cu, max_seqlen_q=8, max_seqlen_kv=8, strategy=strategy_name)


def test_check_mode_checks_the_layout_the_unguarded_call_runs(monkeypatch, install_extension):
    """Check mode enlarges every buffer by its canary rows. Here the padded layout fits the caller's
    buffers but not the enlarged ones (the fake's padded workspace grows with the capacity): the guarded
    backward must still run - and so check - the padded graph the unguarded call runs."""
    real = extension.module()
    q = jax.ShapeDtypeStruct((64, 4, 16), jnp.bfloat16)
    cu = jnp.array([0, 20, 40, 64], jnp.int32)

    class CapacityDependent(FakeExtension):
        def config_fields(self):
            return real.config_fields()

        def graph_info(self, direction, device, attributes):
            guarded = attributes["capacity_q"] > 64
            padded = 10 * MiB if not guarded else 10 * MiB + 300 * MiB
            self.bytes = {1: 1 * MiB, 0: padded}
            return super().graph_info(direction, device, attributes)

    install_extension(CapacityDependent(0, 0))
    monkeypatch.setattr(launch, "graph_info", lambda direction, config, layout=None: {"workspace_bytes": 64})
    options = AttentionOptions(is_causal=True)
    config = make_config(q, q, q, cu, cu, options, max_seqlen_q=32, max_seqlen_kv=32)
    assert not _bounded(config)  # the caller's buffers: padded

    def lowered(config):
        def loss(q, k, v):
            return jnp.sum(launch.attention((q, k, v), cu, cu, config)[0].astype(jnp.float32))

        zeros = jnp.zeros(q.shape, q.dtype)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(zeros, zeros, zeros).as_text()

    guarded = dataclasses.replace(config, guard_workspace=True)
    text = lowered(guarded)
    (backward,) = [line for line in text.splitlines() if f"@{extension.BACKWARD_TARGET}(" in line]
    assert re.search(r"use_max_total_seq_len = 0", backward), backward
