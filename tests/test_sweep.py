"""Seeded random configurations against the float64 reference on the xla path (benchmarks/sweep.py for
`ragged_attention`, benchmarks/sweep_kvcache.py for `ragged_attention_with_kvcache`).

A failing case reproduces on its own with the command it prints; `pytest -k 'test_cpu_tier and 17'` reruns
seed 17 here.
"""

from __future__ import annotations

import pytest

from benchmarks import sweep, sweep_kvcache

CI_SEEDS = range(40)


@pytest.mark.slow  # 40 configurations
@pytest.mark.parametrize("seed", CI_SEEDS)
def test_cpu_tier(seed):
    case = sweep.draw_case(seed, "cpu")
    status, message = sweep.run_case(case)
    assert status == "passed", f"{sweep.describe(case)}: {status}: {message}"


@pytest.mark.parametrize("seed", range(6))
def test_cases_pass_on_the_xla_path(seed):
    case = sweep_kvcache.draw_case(seed)
    assert sweep_kvcache.run_case(case) == ("passed", ""), sweep_kvcache.describe(case)
