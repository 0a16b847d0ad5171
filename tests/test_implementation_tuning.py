"""autotune=True choosing between cuDNN and FlashAttention-3 (backends/tuning.py).

On the CPU the two kernels cannot run, so their availability and timings are replaced; the choice, when it is
asked for, its margin, its disk cache and the thread that keeps the scratch computation out of an enclosing
jit trace are real. On a Hopper GPU with the wheel, the last test measures both for real.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ragged_attn
from jax_ragged_attn import backends
from jax_ragged_attn.backends import tuning as implementation_tuning
from jax_ragged_attn.backends.cudnn import autotune
from jax_ragged_attn.backends.cudnn import ragged as cudnn
from jax_ragged_attn.backends.fa3 import dew
from jax_ragged_attn.backends.fa3 import ragged as _fa3
from jax_ragged_attn.config import AttentionOptions, make_config
from jax_ragged_attn.index import RaggedIndex


def _config(**changes):
    q = jax.ShapeDtypeStruct((256, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((192, 2, 128), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((4,), jnp.int32)
    options = AttentionOptions(**{**dict(is_causal=True, diagonal_alignment="bottom_right"), **changes})
    return make_config(q, kv, kv, cu, cu, options, max_seqlen_q=96, max_seqlen_kv=64)


class Timings:
    """Stands in for the measurement; counts the configurations it was asked to time."""

    def __init__(self, cudnn_ms, fa3_ms):
        self.ms = dict(cudnn=cudnn_ms, fa3=fa3_ms)
        self.measured = []
        self.candidates = []  # the FA3 build each measurement timed

    def __call__(self, config, same_index, candidate="fa3"):
        self.measured.append((config, same_index))
        self.candidates.append(candidate)
        return dict(
            implementation=implementation_tuning.choose(self.ms["cudnn"], self.ms["fa3"]),
            cudnn_ms=self.ms["cudnn"],
            fa3_ms=self.ms["fa3"],
        )


@pytest.fixture
def both_serve(monkeypatch, tmp_path):
    """Both kernels serve every call; a cache file and process memory of this test's own. Returns install(
    timings), which makes `timings` the measurement."""
    monkeypatch.setattr(_fa3, "unsupported_reason", lambda config, *index, **kwargs: None)
    monkeypatch.setattr(cudnn, "unsupported_reason", lambda config, *index, **kwargs: None)
    # dew-flash-attn's build is timed instead where it serves (test_dew_is_the_build_timed_where_it_serves).
    monkeypatch.setattr(dew, "unsupported_reason", lambda config, *index, **kwargs: "not installed (this test)")
    monkeypatch.setattr(implementation_tuning, "_versions", lambda: (["NVIDIA H200", 91900, [1, 32, 0]], "0.2.3"))
    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path / "autotune.json"))
    monkeypatch.setattr(implementation_tuning, "_chosen", {})

    def install(timings):
        monkeypatch.setattr(implementation_tuning, "_measure_outside_any_trace", timings)
        return timings

    return install


def _choose(config, implementation=None, same=False):
    cu_q = jnp.zeros(4, jnp.int32)
    index = RaggedIndex(cu_q, cu_q if same else jnp.ones(4, jnp.int32), same=same)
    return backends.choose(implementation, config, index).NAME


@pytest.mark.parametrize(
    "cudnn_ms, fa3_ms, chosen",
    [
        (1.00, 0.90, "fa3"),  # 10 % faster: FA3
        (1.00, 0.98, "cudnn"),  # within the margin: timing noise, keep cuDNN (it serves every semantic)
        (1.00, 1.20, "cudnn"),
    ],
)
def test_fa3_is_chosen_only_when_clearly_faster(cudnn_ms, fa3_ms, chosen):
    assert implementation_tuning.choose(cudnn_ms, fa3_ms) == chosen


def test_the_choice_is_measured_once_then_read_from_disk(both_serve, monkeypatch, tmp_path):
    timings = both_serve(Timings(cudnn_ms=2.0, fa3_ms=1.5))
    config = _config(autotune=True)
    assert _choose(config) == "fa3"
    assert _choose(config) == "fa3"
    assert len(timings.measured) == 1  # the second call used this process's choice

    monkeypatch.setattr(implementation_tuning, "_chosen", {})  # a new process: the file answers
    assert _choose(config) == "fa3"
    assert len(timings.measured) == 1
    ((key, entry),) = json.loads((tmp_path / "autotune.json").read_text()).items()
    gpu, cudnn_version, frontend, kind, attributes = json.loads(key)  # laid out as cuDNN's plan entries
    assert (gpu, cudnn_version, frontend, kind) == ("NVIDIA H200", 91900, [1, 32, 0], "implementation")
    assert attributes["fa3_wheel"] == "0.2.3" and attributes["max_seqlen_q"] == 96
    assert entry == dict(implementation="fa3", cudnn_ms=2.0, fa3_ms=1.5)


def test_each_configuration_and_index_sharing_has_its_own_entry(both_serve):
    timings = both_serve(Timings(cudnn_ms=1.0, fa3_ms=2.0))
    assert _choose(_config(autotune=True)) == "cudnn"
    assert _choose(_config(autotune=True, is_causal=False)) == "cudnn"
    assert _choose(_config(autotune=True), same=True) == "cudnn"  # one cu_seqlens array: lengths provably equal
    assert [same for _, same in timings.measured] == [False, False, True]
    # Packing and sinks do not change what is timed: the same entry.
    _choose(dataclasses.replace(_config(autotune=True), packing="kv", has_sinks=True))
    assert len(timings.measured) == 3


def test_nothing_is_measured_unless_autotune_asks_with_implementation_none(both_serve):
    timings = both_serve(Timings(cudnn_ms=2.0, fa3_ms=1.0))
    assert _choose(_config()) == "cudnn"  # autotune off: cuDNN, FA3 only where asked for
    assert _choose(_config(autotune=True), implementation="cudnn") == "cudnn"
    assert _choose(_config(autotune=True), implementation="fa3") == "fa3"
    assert _choose(_config(autotune=True), implementation="xla") == "xla"
    assert timings.measured == []


def test_dew_is_the_build_timed_where_it_serves(both_serve, monkeypatch, tmp_path):
    """Both FA3 builds serve: cuDNN is timed against dew's (the one implementation=None prefers), the choice
    names it, and its entry is keyed by its build and wheel, apart from the other build's."""
    monkeypatch.setattr(dew, "unsupported_reason", lambda config, *index, **kwargs: None)
    monkeypatch.setattr(implementation_tuning, "_dew_version", lambda: "0.3.6")
    timings = both_serve(Timings(cudnn_ms=2.0, fa3_ms=1.5))
    assert _choose(_config(autotune=True)) == "fa3"
    assert timings.candidates == ["dew-flash-attn"]
    ((key, entry),) = json.loads((tmp_path / "autotune.json").read_text()).items()
    attributes = json.loads(key)[-1]
    assert attributes["fa3_build"] == "dew-flash-attn" and attributes["fa3_wheel"] == "0.3.6"
    assert entry["implementation"] == "fa3"
    slower = Timings(cudnn_ms=1.0, fa3_ms=1.5)
    both_serve(slower)
    assert _choose(_config(autotune=True, is_causal=False)) == "cudnn" and slower.candidates == ["dew-flash-attn"]


def test_a_call_fa3_cannot_serve_is_not_measured(both_serve, monkeypatch):
    timings = both_serve(Timings(cudnn_ms=2.0, fa3_ms=1.0))
    monkeypatch.setattr(_fa3, "unsupported_reason", lambda config, *index: "head dim 64")
    assert _choose(_config(autotune=True)) == "cudnn"
    assert timings.measured == []


def test_a_failed_measurement_warns_keeps_cudnn_and_is_not_stored(both_serve, tmp_path):
    def fail(config, same_index, candidate="fa3"):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory allocating scratch")

    both_serve(fail)
    with pytest.warns(RuntimeWarning, match="out of memory allocating scratch"):
        assert _choose(_config(autotune=True)) == "cudnn"
    assert _choose(_config(autotune=True)) == "cudnn"  # remembered in this process, not measured again
    assert not (tmp_path / "autotune.json").exists()


def test_the_measurement_runs_outside_an_enclosing_jit_trace(monkeypatch):
    # Tuning happens while the caller's function is traced; the scratch computation must run for real.
    seen = []

    def measure(config, same_index, candidate="fa3"):
        value = jnp.arange(4.0).sum()
        seen.append(isinstance(value, jax.core.Tracer))
        return dict(implementation="fa3" if float(value) == 6.0 else "cudnn")

    monkeypatch.setattr(implementation_tuning, "measure", measure)

    @jax.jit
    def traced(x):
        assert implementation_tuning._measure_outside_any_trace(_config(), False)["implementation"] == "fa3"
        return x + 1

    assert int(traced(jnp.int32(1))) == 2
    assert seen == [False]


def test_measure_times_both_on_scratch_shaped_as_the_call(monkeypatch):
    config = _config(autotune=True)
    monkeypatch.setattr(_fa3, "unsupported_reason", lambda config, *index, **kwargs: None)
    calls = []

    def loop_ms(step, args):
        calls.append(step)
        q, k, v, d_out, scale = args  # the step makes its inputs x * scale, as a model's step makes them
        assert scale.shape == () and float(scale) == 1.0
        assert (q.shape, k.shape, v.shape, d_out.shape) == ((256, 4, 128), (192, 2, 128), (192, 2, 128), (256, 4, 128))
        assert q.dtype == jnp.bfloat16 and bool(jnp.isfinite(q.astype(jnp.float32)).all())
        return 3.0 if len(calls) == 1 else 1.0

    steps = []
    monkeypatch.setattr(implementation_tuning, "_loop_ms", loop_ms)
    monkeypatch.setattr(
        implementation_tuning,
        "_step",
        lambda name, config, cu_q, cu_kv: (
            steps.append((name, np.asarray(cu_q).tolist(), np.asarray(cu_kv).tolist())) or name
        ),
    )
    entry = implementation_tuning.measure(config, same_index=False)
    assert entry == dict(implementation="fa3", cudnn_ms=3.0, fa3_ms=1.0)
    # Equal-length sequences filling the capacities, bounded by max_seqlen: 3 of min(96, 256 // 3) queries and
    # min(64, 192 // 3) keys.
    assert steps == [("cudnn", [0, 85, 170, 255], [0, 64, 128, 192]), ("fa3", [0, 85, 170, 255], [0, 64, 128, 192])]


def test_measure_keeps_cudnn_where_fa3_declines_the_scratch_lengths(monkeypatch):
    monkeypatch.setattr(_fa3, "unsupported_reason", lambda config, *index: "top-left mask not proven")
    monkeypatch.setattr(implementation_tuning, "_loop_ms", lambda step, args: pytest.fail("nothing to time"))
    entry = implementation_tuning.measure(_config(autotune=True), same_index=False)
    assert entry == dict(implementation="cudnn", fa3_declined="top-left mask not proven")


def test_the_timing_loop_reports_the_median_per_call():
    ms = implementation_tuning._loop_ms(jax.jit(lambda x: x * 2), (jnp.ones(8),))
    assert 0 < ms < 1e3


@pytest.mark.gpu
def test_on_hopper_with_the_wheel_autotune_runs_the_faster_and_matches_the_reference(monkeypatch, tmp_path):
    reason = jax_ragged_attn.cudnn_unavailable_reason() or _fa3.unavailable_reason()
    if reason is not None:
        pytest.skip(f"needs both cuDNN and FlashAttention-3 here: {reason}")
    from jax_ragged_attn.testing import assert_close, packed_batch
    from jax_ragged_attn.testing.reference import reference_attention

    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path / "autotune.json"))
    monkeypatch.setattr(implementation_tuning, "_chosen", {})
    monkeypatch.setattr(autotune, "_chosen", {})
    rng = np.random.default_rng(11)
    batch = packed_batch(
        rng,
        [700, 0, 300, 1024],
        [700, 0, 300, 1024],
        num_heads_q=8,
        num_heads_kv=2,
        head_dim_qk=128,
        head_dim_v=128,
        dtype="bfloat16",
        slack_q=64,
        slack_kv=64,
    )
    options = dict(max_seqlen_q=1024, max_seqlen_kv=1024, is_causal=True, diagonal_alignment="bottom_right")
    d_out = np.nan_to_num(rng.standard_normal((batch.q.shape[0], 8, 128))).astype("bfloat16")

    @jax.jit
    def step(q, k, v, d_out):
        attend = lambda q, k, v: jax_ragged_attn.ragged_attention(q, k, v, *batch.args[3:], autotune=True, **options)
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(d_out)

    out, grads = step(*batch.args[:3], jnp.asarray(d_out))
    expected = reference_attention(*batch.reference_args, d_out=d_out.astype(np.float64), **options)
    assert_close(np.asarray(out, np.float64), expected["out"], "bfloat16", "out")
    for name, grad in zip(("dq", "dk", "dv"), grads):
        assert_close(np.asarray(grad, np.float64), expected[name], "bfloat16", name)
    entries = {
        json.loads(k)[3]: v
        for k, v in json.loads((tmp_path / "autotune.json").read_text()).items()
        if json.loads(k)[3] == "implementation"
    }
    (entry,) = entries.values()
    # The FA3 candidate is the build implementation=None would take: dew-flash-attn's where installed, else
    # the flash-attn3-jax wheel's (backends/tuning.py); fa3_ms is its time.
    assert entry["implementation"] in ("cudnn", "fa3", "dew") and entry["cudnn_ms"] > 0 and entry["fa3_ms"] > 0
    print(
        f"implementation autotune: cuDNN {entry['cudnn_ms']:.3f} ms, FA3 {entry['fa3_ms']:.3f} ms -> "
        f"{entry['implementation']}"
    )
