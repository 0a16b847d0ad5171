"""The shared workloads (jax_ragged_attn/testing/workloads.py: the benchmarks', the tests' and the self-check's
shapes and FLOP counts) and the package's own bench (`python -m jax_ragged_attn.bench`). The benchmarks
themselves: tests/test_benchmarks.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from benchmarks import systems as bench_systems
from jax_ragged_attn.testing import workloads
from jax_ragged_attn.testing.workloads import WORKLOADS

pytestmark = pytest.mark.slow  # the package's bench end to end

# The README's reference batch: numpy.random.default_rng(0).integers(128, 4096, size=16, endpoint=True),
# the last sequence trimmed from 3023 to 1722 so the batch holds 32,768 tokens.
W1_LENGTHS = (3504, 2656, 2156, 1198, 1349, 290, 426, 193, 823, 3355, 2705, 3750, 2126, 2535, 3980, 1722)


def test_w1_is_the_reference_batch():
    w1 = WORKLOADS["W1"]
    assert w1.seqlens == W1_LENGTHS
    assert w1.total_tokens == 32768 and w1.num_seqs == 16
    assert all(128 <= n <= 4096 for n in w1.seqlens)
    assert (min(w1.seqlens), w1.max_seqlen) == (193, 3980)
    assert (w1.num_heads_q, w1.num_heads_kv, w1.head_dim, w1.dtype, w1.causal) == (16, 16, 128, "bfloat16", True)


def test_w2_w3_shapes():
    w2, w3 = WORKLOADS["W2"], WORKLOADS["W3"]
    assert w2.num_seqs == 4 and all(8192 <= n <= 16384 for n in w2.seqlens)
    assert (w2.num_heads_q, w2.num_heads_kv, w2.head_dim, w2.causal) == (32, 8, 128, True)
    assert w3.num_seqs == 512 and all(16 <= n <= 256 for n in w3.seqlens)
    assert (w3.num_heads_q, w3.num_heads_kv, w3.head_dim, w3.causal) == (8, 8, 64, True)


@pytest.mark.parametrize(
    "name, change",
    [("W4-d64", dict(head_dim=64)), ("W4-d256", dict(head_dim=256)), ("W4-noncausal", dict(causal=False))],
)
def test_w4_differs_from_w1_only_where_named(name, change):
    expected = dataclasses.replace(WORKLOADS["W1"], name=name, description=WORKLOADS[name].description, **change)
    assert WORKLOADS[name] == expected


def test_trimming_keeps_every_sequence_and_hits_the_total():
    untrimmed = workloads.seeded_lengths(5, 10, 20, seed=3)
    trimmed = workloads.seeded_lengths(5, 10, 20, total=sum(untrimmed) - 25, seed=3)
    assert sum(trimmed) == sum(untrimmed) - 25 and min(trimmed) >= 1
    assert trimmed[:-3] == untrimmed[:-3]  # only the tail is cut
    with pytest.raises(ValueError, match="every one of the 5 sequences"):
        workloads.seeded_lengths(5, 10, 20, total=4)


def test_flop_counting():
    # Sequences of 2 and 3 tokens, 4 heads, head dim 8: 4 * (4 + 9) * 4 * 8 = 1664 FLOPs forward.
    assert workloads.attention_flops((2, 3), 4, 8, causal=False) == 1664
    assert workloads.attention_flops((2, 3), 4, 8, causal=True) == 832
    assert workloads.direction_flops(832, "backward") == 2080
    assert workloads.direction_flops(832, "forward+backward") == 2912
    with pytest.raises(ValueError, match="direction"):
        workloads.direction_flops(1.0, "sideways")
    w1 = WORKLOADS["W1"]
    assert w1.flops("forward") == sum(2.0 * s * s * 16 * 128 for s in W1_LENGTHS)  # causal halves 4 s^2 h d
    assert WORKLOADS["W2"].flops() == sum(2.0 * s * s * 32 * 128 for s in WORKLOADS["W2"].seqlens)  # query heads


def test_workload_selection():
    assert [w.name for w in workloads.select("W1,W4")] == ["W1", "W4-d64", "W4-d256", "W4-noncausal"]
    assert [w.name for w in workloads.select("all")] == list(workloads.DEFAULT_WORKLOADS)
    with pytest.raises(ValueError, match="unknown workload 'W9'"):
        workloads.select("W9")
    with pytest.raises(ValueError, match="unknown system"):
        bench_systems.select("cudnn-magic")


def test_packed_inputs():
    tiny = WORKLOADS["tiny"]
    q, k, v, cu = tiny.packed_inputs()
    assert q.shape == (tiny.total_tokens, 4, 32) and k.shape == v.shape == (tiny.total_tokens, 2, 32)
    assert q.dtype == jnp.bfloat16 and cu.dtype == jnp.int32
    assert cu.tolist() == [0, *jnp.cumsum(jnp.asarray(tiny.seqlens)).tolist()]


# ---- the package's own bench (python -m jax_ragged_attn.bench, jax_ragged_attn/tools/bench.py) ------------------


def test_package_bench_times_your_shape_on_each_implementation(capsys):
    from jax_ragged_attn.tools import bench as package_bench

    assert (
        package_bench.main(
            [
                "--lengths",
                "5,0,9",
                "--kv-lengths",
                "7,3,9",
                "--heads",
                "4",
                "--kv-heads",
                "2",
                "--head-dim",
                "32",
                "--dtype",
                "float32",
                "--calls",
                "2",
                "--repeats",
                "1",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("your shape: 3 sequences of 0..9 (14 tokens), keys 3..9 (19 tokens), 4/2 heads")
    header = next(i for i, line in enumerate(lines) if line.startswith("implementation"))
    rows = {line.split()[0]: line for line in lines[header + 1 :]}
    from jax_ragged_attn import backends

    assert set(rows) == set(backends.REGISTRY), lines  # each implementation a row (fa3, cudnn, xla)
    assert rows["xla"].count(" ms ") == 2 and rows["xla"].count("TFLOP/s") == 2, rows["xla"]  # forward, fwd+bwd
    if jax.default_backend() == "cpu":
        assert rows["cudnn"].split(None, 1)[1] == "skipped: no CUDA device: JAX's backend is 'cpu'", rows["cudnn"]
    assert (
        package_bench.forward_flops(dict(q=(5, 0, 9), kv=(7, 3, 9), heads=4, head_dim=32, causal=True))
        == (4.0 * 4 * 32 * (5 * 7 + 9 * 9)) / 2
    )


def test_package_bench_entry_point_help_and_bad_flags():
    run = subprocess.run(
        [sys.executable, "-m", "jax_ragged_attn.bench", "--help"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and "--lengths" in run.stdout and "--implementations" in run.stdout, run.stderr
    from jax_ragged_attn.tools import bench as package_bench

    with pytest.raises(SystemExit, match="unknown \\['sideways'\\]"):
        package_bench.main(["--implementations", "sideways"])
    with pytest.raises(SystemExit, match="one length per sequence"):
        package_bench.main(["--lengths", "4,4", "--kv-lengths", "4"])
