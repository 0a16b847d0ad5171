"""The seeded configuration sweep: its CPU tier (the xla path) in CI, and proof that it can fail.

A failing sweep case reproduces on its own with the command it prints; `pytest -k 'test_cpu_tier and 17'`
reruns seed 17 here.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
import shlex
import subprocess
import sys

import jax.numpy as jnp
import pytest

from jax_ragged_attn.backends.cudnn import ragged as cudnn
from jax_ragged_attn.backends.xla import ragged as xla
from jax_ragged_attn.backends.shared import extension, stats_grad
from jax_ragged_attn.backends.cudnn import launch

from benchmarks import sweep

pytestmark = pytest.mark.slow  # the tool end to end

ROOT = pathlib.Path(__file__).resolve().parent.parent  # where `python -m benchmarks.sweep` runs from
CI_SEEDS = range(40)

# A hand-written case in which every deliberate bug below shows: GQA, causal bottom-right with sq != skv
# (so the alignment matters), an empty sequence, capacity padding and float32 (tight tolerances).
CASE = dict(seed=1234, tier="cpu", implementation="xla", lengths="uniform", seqlens_q=[5, 0, 7],
            seqlens_kv=[6, 0, 4], slack_q=3, slack_kv=2, max_seqlen_q=7, max_seqlen_kv=6, num_heads_q=4,
            num_heads_kv=2, head_dim_qk=16, head_dim_v=16, dtype="float32", scale=None, is_causal=True,
            diagonal_alignment="bottom_right", local_window_size=None, stats_layout="head_major",
            stats_cotangent=True)


@pytest.mark.parametrize("seed", CI_SEEDS)
def test_cpu_tier(seed):
    case = sweep.draw_case(seed, "cpu")
    status, message = sweep.run_case(case)
    assert status == "passed", f"{sweep.describe(case)}: {status}: {message}"


@pytest.mark.parametrize("tier", sweep.TIERS)
def test_draw_case_is_deterministic_json_and_varied(tier):
    cases = [sweep.draw_case(seed, tier) for seed in range(300)]
    assert cases == [sweep.draw_case(seed, tier) for seed in range(300)]
    assert all(json.loads(json.dumps(case)) == case for case in cases)
    assert len({json.dumps(case) for case in cases}) == len(cases)
    # Every weighted choice is actually drawn: a broken weight table would silently drop an axis.
    seen = collections.defaultdict(set)
    for case in cases:
        for key in ("lengths", "dtype", "is_causal", "diagonal_alignment", "stats_layout", "head_dim_qk", "strategy"):
            seen[key].add(case[key])
        hq, hkv = case["num_heads_q"], case["num_heads_kv"]
        seen["heads"].add("mha" if hq == hkv else "mqa" if hkv == 1 else "gqa")
        seen["window"].add(type(case["local_window_size"]).__name__)
        seen["slack"].add(case["slack_q"] > 0)
        seen["empty"].add(0 in case["seqlens_q"])
        seen["cut"].add(case["max_seqlen_q"] < max(case["seqlens_q"]))
        seen["batch"].add(len(case["seqlens_q"]))
        seen["check"].add(case["check"])
        seen["stats_cotangent"].add(case["stats_cotangent"])
    spec = sweep.TIERS[tier]
    assert seen["lengths"] == {name for name, _ in sweep.LENGTHS}
    assert seen["dtype"] == {name for name, _ in spec["dtypes"]}
    assert seen["head_dim_qk"] == {dims[0] for dims, _ in spec["dims"]}
    assert seen["heads"] == {"mha", "gqa", "mqa"} and seen["window"] == {"NoneType", "int", "list"}
    for key in ("is_causal", "slack", "empty", "cut"):
        assert seen[key] == {False, True}, key
    assert seen["diagonal_alignment"] == {"top_left", "bottom_right"}
    assert seen["stats_layout"] == {"head_major", "token_major"}
    assert seen["strategy"] == {"fastest", "lean_memory"}
    assert {1, 64} <= seen["batch"]
    assert seen["check"] == ({False, True} if spec["implementation"] == "cudnn" else {False})
    assert seen["stats_cotangent"] == {False, True}
    for case in cases:
        assert case["implementation"] == spec["implementation"]
        assert sum(case["seqlens_q"]) <= spec["tokens"] and sum(case["seqlens_kv"]) <= spec["tokens"]
        assert sum(case["seqlens_q"]) + case["slack_q"] >= 1 and sum(case["seqlens_kv"]) + case["slack_kv"] >= 1
        if spec["implementation"] == "cudnn" and case["stats_cotangent"]:  # cuDNN widens Dv for it (stats_grad.py)
            assert case["head_dim_v"] + stats_grad.EXTRA_COLUMNS <= cudnn.MAX_HEAD_DIM


_ATTENTION_XLA = xla.attention_xla  # the unpatched one: the tests below patch the backend's own name


def _broken(change=None, after=None):
    """The xla path with a deliberate bug: `change` edits the static config, `after` edits (out, stats)."""

    def attention(q, k, v, cu_q, cu_kv, config, sinks=None, **kwargs):
        out, stats = _ATTENTION_XLA(q, k, v, cu_q, cu_kv, change(config) if change else config, sinks, **kwargs)
        return after(out, stats) if after else (out, stats)

    return attention


BUGS = {
    "drops_the_scale": (_broken(change=lambda c: dataclasses.replace(c, scale=1.0)), "AssertionError: out: "),
    "flips_the_diagonal": (_broken(change=lambda c: dataclasses.replace(
        c, diagonal_alignment="top_left" if c.diagonal_alignment == "bottom_right" else "bottom_right")),
        "AssertionError: out: "),
    # Within every tolerance, so only the exact-zero check on rows without keys can catch it.
    "padding_rows_not_exactly_zero": (_broken(after=lambda o, s: (jnp.where(o == 0, 1e-30, o), s)),
                                      "that attend no key are not exactly 0"),
}


@pytest.fixture(scope="module")
def case_passes():
    """CASE passes as it is, so what fails with a bug planted is the bug."""
    assert sweep.run_case(CASE) == ("passed", "")


@pytest.mark.parametrize("bug", BUGS)
def test_a_wrong_implementation_fails_with_a_repro(monkeypatch, case_passes, bug):
    attention, expected = BUGS[bug]
    monkeypatch.setattr(xla, "attention_xla", attention)
    status, message = sweep.run_case(CASE)
    assert status == "failed", message
    assert expected in message, message
    command = shlex.split(message.split("repro: ")[1])
    assert command[:4] == ["python", "-m", "benchmarks.sweep", "--repro"]
    assert json.loads(command[4]) == CASE


def test_repro_reruns_the_printed_case(monkeypatch, capsys, case_passes):
    monkeypatch.setattr(xla, "attention_xla", BUGS["drops_the_scale"][0])
    argv = shlex.split(sweep.run_case(CASE)[1].split("repro: ")[1])[3:]
    assert sweep.main(argv) == 1
    printed = capsys.readouterr().out
    assert f"seed={CASE['seed']} FAILED  {sweep.describe(CASE)}" in printed
    assert "1 cases: 0 passed, 0 skipped, 1 failed" in printed
    assert printed.splitlines()[-1] == "sweep: 0 passed, 0 skipped, 1 failed - FAILED"
    monkeypatch.undo()  # the same command passes once the bug is gone
    assert sweep.main(argv) == 0
    printed = capsys.readouterr().out
    assert "1 cases: 1 passed, 0 skipped, 0 failed" in printed
    assert printed.splitlines()[-1] == "sweep: 1 passed, 0 skipped, 0 failed - OK"


@pytest.mark.parametrize("message, status", [
    ("cuDNN cannot run this forward configuration: no engine", "skipped"),
    ("the cuDNN path cannot differentiate through stats", "failed"),
])
def test_only_an_unsupported_cudnn_graph_is_a_skip(monkeypatch, message, status):
    def refuse(*args, **kwargs):
        raise NotImplementedError(message)

    monkeypatch.setattr(xla, "attention_xla", refuse)
    got, reason = sweep.run_case(CASE)
    assert got == status
    assert message in reason


def test_gpu_tier_without_a_gpu_reports_every_case_skipped():
    reason = extension.cudnn_unavailable_reason()
    if reason is None:
        pytest.skip("cuDNN can run here, so the GPU tier runs for real (python -m benchmarks.sweep --tier gpu)")
    result = subprocess.run([sys.executable, "-m", "benchmarks.sweep", "--tier", "gpu", "--num-tests", "3"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 cases: 0 passed, 3 skipped, 0 failed" in result.stdout, result.stdout
    assert f"skipped 3: cuDNN path unavailable: {reason}" in result.stdout, result.stdout


def test_jobs_report_the_same_cases_in_order_as_one_process():
    command = [sys.executable, "-m", "benchmarks.sweep", "--tier", "cpu", "--num-tests", "3", "--seed", "5"]
    serial = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    parallel = subprocess.run(command + ["--jobs", "2"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert serial.returncode == parallel.returncode == 0, serial.stdout + parallel.stdout + parallel.stderr
    assert parallel.stdout == serial.stdout
    assert "3 cases: 3 passed, 0 skipped, 0 failed" in parallel.stdout
