"""benchmarks/sweep_kvcache.py: its cases pass on the xla path, repeat from their JSON, and a wrong result, an
unlisted decline or a leaked NaN fails with a repro."""

from __future__ import annotations

import json
from unittest import mock

import jax.numpy as jnp
import pytest

from benchmarks import sweep_kvcache


def test_draws_are_deterministic_and_json():
    case = sweep_kvcache.draw_case(5)
    assert case == sweep_kvcache.draw_case(5) and json.loads(json.dumps(case)) == case
    kinds = {(c["packed"], c["paged"]) for c in (sweep_kvcache.draw_case(s) for s in range(40))}
    assert kinds == {(False, False), (False, True), (True, False), (True, True)}


@pytest.mark.parametrize("seed", range(6))
def test_cases_pass_on_the_xla_path(seed):
    case = sweep_kvcache.draw_case(seed)
    assert sweep_kvcache.run_case(case) == ("passed", ""), sweep_kvcache.describe(case)


def test_a_wrong_result_fails_with_its_repro(capsys):
    case = next(c for c in map(sweep_kvcache.draw_case, range(50)) if not c["sinks"])
    real = sweep_kvcache.ragged_attention_with_kvcache

    def off(*args, **kwargs):
        out, stats = real(*args, **kwargs)
        return out * 1.1 + 0.01, stats

    with mock.patch.object(sweep_kvcache, "ragged_attention_with_kvcache", off):
        status, message = sweep_kvcache.run_case(case)
    assert status == "failed" and "out:" in message and "--repro" in message, message
    repro = json.loads(message.split("--repro '")[1].rstrip("'"))
    assert repro == case
    assert sweep_kvcache.main(["--repro", json.dumps(case)]) == 0
    assert "1 cases: 1 passed" in capsys.readouterr().out


def test_an_unlisted_decline_fails():
    case = sweep_kvcache.draw_case(3)

    def declining(*args, **kwargs):
        raise NotImplementedError("implementation='xla' cannot serve this call: a new decline nobody listed")

    with mock.patch.object(sweep_kvcache, "ragged_attention_with_kvcache", declining):
        status, message = sweep_kvcache.run_case(case)
    assert status == "failed" and "new decline nobody listed" in message, message


def test_a_nan_in_an_unused_row_that_leaks_fails():
    case = next(c for c in map(sweep_kvcache.draw_case, range(50)) if c["packed"] and c["spare_rows"])
    real = sweep_kvcache.ragged_attention_with_kvcache

    def leaking(q, *args, **kwargs):  # reads q's rows past cu_seqlens_q[-1] (NaN) into the last row
        out, stats = real(q, *args, **kwargs)
        return out.at[-1].add(q[-1, :, : out.shape[-1]].astype(out.dtype) * jnp.nan), stats

    with mock.patch.object(sweep_kvcache, "ragged_attention_with_kvcache", leaking):
        status, message = sweep_kvcache.run_case(case)
    assert status == "failed", message
