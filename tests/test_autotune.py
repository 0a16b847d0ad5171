"""autotune=True's choice of plan and its disk cache, with the extension's measurement replaced (CPU).

The measurement itself (ffi/autotune.cc) needs a GPU: tests/test_cudnn.py runs it there.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from jax_ragged_attn.backends.cudnn import autotune
from jax_ragged_attn.backends.cudnn import ragged as cudnn
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.config import AttentionOptions, make_config


def _plan(index, ms, ok=True, message=""):
    return dict(index=index, name=f"engine{index}", ok=ok, message=message, workspace_bytes=64 * index, median_ms=ms)


@pytest.mark.parametrize(
    "plans, chosen",
    [
        ([_plan(0, 1.00), _plan(1, 0.90)], 1),  # 10 % faster: replaces the heuristic's choice
        ([_plan(0, 1.00), _plan(1, 0.98)], 0),  # within the margin: timing noise, keep the heuristic's
        ([_plan(0, 1.00), _plan(1, 1.50)], 0),  # never slower than the heuristic's
        ([_plan(0, 0.0, ok=False, message="no"), _plan(1, 2.0), _plan(2, 1.0)], 2),  # heuristic = first that ran
    ],
)
def test_choose_keeps_the_heuristic_unless_another_plan_is_clearly_faster(plans, chosen):
    assert autotune.choose(plans)["index"] == chosen


def test_choose_without_a_plan_that_ran_names_why():
    with pytest.raises(RuntimeError, match="plan 0: unsupported layout"):
        autotune.choose([_plan(0, 0.0, ok=False, message="unsupported layout")])


class FakeExtension:
    """The extension's measurement and versions; counts how often it was asked to measure."""

    frontend_version = (1, 32, 0)

    def __init__(self, plans):
        self.plans = plans
        self.tuned = []

    def cudnn_version(self):
        return 91900

    def tune_plans(self, direction, device, attributes):
        assert attributes["plan_index"] == -1  # the candidates of the heuristic's graph
        self.tuned.append(direction)
        return dict(status="ok", message="", plans=self.plans)

    def graph_info(self, direction, device, attributes):
        # The backward's layout choice (strategy.py) reads both layouts' workspace: the padded one too large
        # here, so strategy="fastest" keeps the capacity-sized graph and autotune measures that one alone.
        return dict(
            status="ok", message="", workspace_bytes=100 << 30 if not attributes["use_max_total_seq_len"] else 1 << 20
        )


@pytest.fixture
def fake(install_extension):
    return install_extension(FakeExtension([_plan(0, 1.0), _plan(1, 0.5), _plan(2, 0.7)]))


def _config(**changes):
    q = jax.ShapeDtypeStruct((64, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((48, 2, 64), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((4,), jnp.int32)
    options = AttentionOptions(**{**dict(is_causal=True, diagonal_alignment="bottom_right"), **changes})
    return make_config(q, kv, kv, cu, cu, options, max_seqlen_q=32, max_seqlen_kv=32)


def test_the_choice_is_measured_once_then_read_from_disk(fake, monkeypatch, tmp_path):
    config = _config(autotune=True)
    assert cudnn.ffi_attributes(config, "forward")["plan_index"] == 1
    assert cudnn.ffi_attributes(config, "forward")["plan_index"] == 1
    assert fake.tuned == ["forward"]  # the second call used this process's choice

    monkeypatch.setattr(autotune, "_chosen", {})  # a new process: the file answers
    assert cudnn.ffi_attributes(config, "forward")["plan_index"] == 1
    assert fake.tuned == ["forward"]
    entries = json.loads((tmp_path / "autotune.json").read_text())
    (entry,) = entries.values()
    assert entry["plan_name"] == "engine1" and entry["heuristic_ms"] == 1.0 and entry["chosen_ms"] == 0.5

    assert cudnn.ffi_attributes(config, "backward")["plan_index"] == 1  # its own graph, its own measurement
    assert fake.tuned == ["forward", "backward"]
    assert len(json.loads((tmp_path / "autotune.json").read_text())) == 2


def test_each_configuration_has_its_own_entry_and_plain_calls_never_tune(fake):
    assert cudnn.ffi_attributes(_config(), "forward")["plan_index"] == -1
    assert fake.tuned == []
    cudnn.ffi_attributes(_config(autotune=True), "forward")
    cudnn.ffi_attributes(_config(autotune=True, is_causal=False), "forward")
    assert fake.tuned == ["forward", "forward"]


def test_an_unreadable_cache_file_is_measured_again(fake, tmp_path):
    (tmp_path / "autotune.json").write_text("{half a file")
    assert cudnn.ffi_attributes(_config(autotune=True), "forward")["plan_index"] == 1
    assert fake.tuned == ["forward"]
    assert len(json.loads((tmp_path / "autotune.json").read_text())) == 1


def test_a_graph_cudnn_cannot_run_falls_back_to_the_heuristic_index(fake, monkeypatch):
    monkeypatch.setattr(fake, "tune_plans", lambda *a: dict(status="unsupported", message="no engine", plans=[]))
    assert cudnn.ffi_attributes(_config(autotune=True), "forward")["plan_index"] == -1


@pytest.mark.gpu
def test_autotuned_plans_run_and_match_the_reference(monkeypatch, tmp_path):
    """On a GPU: the real measurement, then the chosen plans running inside a jitted forward+backward."""
    reason = extension.cudnn_unavailable_reason()
    if reason is not None:
        pytest.skip(f"cuDNN path unavailable: {reason}")
    import numpy as np

    import jax_ragged_attn as jra
    from jax_ragged_attn.testing import assert_close, packed_batch
    from jax_ragged_attn.testing.reference import reference_attention

    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path / "autotune.json"))
    monkeypatch.setattr(autotune, "_chosen", {})
    rng = np.random.default_rng(7)
    batch = packed_batch(
        rng,
        [300, 17, 0, 211],
        [280, 40, 5, 211],
        num_heads_q=8,
        num_heads_kv=2,
        head_dim_qk=128,
        head_dim_v=128,
        dtype="bfloat16",
        slack_q=29,
        slack_kv=3,
    )
    options = dict(max_seqlen_q=300, max_seqlen_kv=280, is_causal=True, diagonal_alignment="bottom_right")
    d_out = rng.standard_normal((batch.q.shape[0], 8, 128)).astype("bfloat16")

    @jax.jit
    def step(q, k, v, d_out):
        attend = lambda q, k, v: jra.ragged_attention(
            q, k, v, *batch.args[3:], implementation="cudnn", autotune=True, **options
        )
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(d_out)

    out, grads = step(*batch.args[:3], jnp.nan_to_num(jnp.asarray(d_out)))
    expected = reference_attention(*batch.reference_args, d_out=np.nan_to_num(d_out.astype(np.float64)), **options)
    assert_close(np.asarray(out, np.float64), expected["out"], "bfloat16", "out")
    for name, grad in zip(("dq", "dk", "dv"), grads):
        assert_close(np.asarray(grad, np.float64), expected[name], "bfloat16", name)
    entries = json.loads((tmp_path / "autotune.json").read_text())
    # One forward graph, and the backward in both intermediate layouts (strategy="fastest" times both
    # where the padded one fits its workspace bound, as it does here).
    directions = sorted(json.loads(key)[3] for key in entries)
    # A causal bottom-right backward runs as two graphs (rectangle + square, launch._backward), each timed in
    # both layouts, besides the bottom-right one the support check builds: 6.
    assert directions == ["backward"] * 6 + ["forward"], entries.keys()
    assert sorted(
        json.loads(key)[4]["use_max_total_seq_len"] for key in entries if json.loads(key)[3] == "backward"
    ) == [0, 0, 0, 1, 1, 1]
    for entry in entries.values():
        assert any(p["ok"] for p in entry["plans"]) and entry["chosen_ms"] <= entry["heuristic_ms"]
        print(
            f"autotune: {len(entry['plans'])} plans, heuristic {entry['heuristic_ms']:.3f} ms, chosen "
            f"{entry['plan_name']} {entry['chosen_ms']:.3f} ms"
        )


def test_a_failed_measurement_warns_and_keeps_the_heuristic(fake, monkeypatch):
    def fail(*args):
        return dict(status="error", message="cudaMalloc of 4096 bytes failed", plans=[])

    monkeypatch.setattr(fake, "tune_plans", fail)
    with pytest.warns(RuntimeWarning, match="cudaMalloc of 4096 bytes failed"):
        assert cudnn.ffi_attributes(_config(autotune=True), "forward")["plan_index"] == -1
    assert cudnn.ffi_attributes(_config(autotune=True), "forward")["plan_index"] == -1  # not measured again
