"""The benchmark's workloads, FLOP counting, timing loop and report; an end-to-end run on any machine.

The GPU systems cannot be exercised without a GPU; here they must report "skipped: <reason>" and leave
the portable system's rows intact.
"""

from __future__ import annotations

import csv
import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

from jax_ragged_attn import bench, bench_report, bench_systems, bench_timing, workloads
from jax_ragged_attn.bench_timing import Measurement
from jax_ragged_attn.workloads import WORKLOADS

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


@pytest.mark.parametrize("name, change", [("W4-d64", dict(head_dim=64)), ("W4-d256", dict(head_dim=256)),
                                          ("W4-noncausal", dict(causal=False))])
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


def test_timing_loop_adds_no_copies_and_the_detector_sees_them():
    w = workloads.Workload("small", "", (300, 212), 4, 2, 64)  # q is 256 KiB; index arrays a few KiB
    case = bench_systems._ours_case(w, implementation="xla")
    out = jax.eval_shape(case.attention, case.q, case.k, case.v, *case.index)
    d_out = jnp.zeros(out.shape, out.dtype)
    for loop, args in ((bench_timing._forward_loop, (case.q, case.k, case.v, case.index)),
                       (bench_timing._forward_backward_loop, (case.q, case.k, case.v, case.index, d_out))):
        hlo = jax.jit(functools.partial(loop, case.attention, 2)).lower(*args).compile().as_text()
        assert bench_timing.loop_copy_bytes(hlo, at_least=64 << 10) == 0

    def swap(x):  # each step reads both carried values after overwriting them: XLA must copy
        return jax.lax.fori_loop(0, 3, lambda i, c: (c[1] * 2, c[0]), (x, x + 1))

    hlo = jax.jit(swap).lower(jnp.ones((512, 1024))).compile().as_text()
    assert bench_timing.loop_copy_bytes(hlo, at_least=64 << 10) >= 512 * 1024 * 4


def test_cudnn_scratch_bytes_reads_the_u8_outputs():
    line = ('  %custom-call.3 = (bf16[1,8,4,64]{3,2,1,0}, f32[1,4,8]{2,1,0}, u8[4096]{0}) custom-call(%p0), '
            'custom_call_target="__cudnn$fmhaSoftmax"')
    assert bench_timing.cudnn_scratch_bytes(line + "\n" + line) == 8192
    assert bench_timing.cudnn_scratch_bytes("%add = f32[] add(%a, %b)") is None


def _row(system, direction, ms, **fields):
    return Measurement("W1", system, direction, median_s=ms / 1e3, flops=1e12, iterations=20, steps=4, **fields)


def test_backward_is_forward_and_backward_minus_forward():
    backward = bench_timing.derive_backward(_row("x", "forward", 1.0), _row("x", "forward+backward", 3.5), 100)
    assert backward.ok and backward.median_s == pytest.approx(2.5e-3) and backward.workspace_bytes == 100
    failed = dataclasses.replace(_row("x", "forward+backward", 3.5), status="error: boom", median_s=None)
    assert bench_timing.derive_backward(_row("x", "forward", 1.0), failed, None).status.startswith("error")
    skipped = dataclasses.replace(failed, status="skipped: no GPU")
    assert bench_timing.derive_backward(skipped, skipped, None).status == "skipped: no GPU"
    noise = bench_timing.derive_backward(_row("x", "forward", 1.0), _row("x", "forward+backward", 0.9), None)
    assert noise.status.startswith("skipped: ") and noise.median_s is None


def test_report_ratios_table_and_csv(tmp_path):
    rows = [_row("raw-cudnn", "forward", 1.0), _row("ours-hm", "forward", 1.1, workspace_bytes=270_540_928),
            Measurement("W1", "jax-packed", "forward", status="error: NotImplementedError: no")]
    table = bench_report.table(rows).splitlines()
    assert table[0].split()[:3] == ["workload", "system", "dir"]
    assert "1.10x" in table[2] and "270.5 MB" in table[2] and "1000.0" in table[1]  # 1e12 FLOP in 1 ms
    assert table[3].endswith("error: NotImplementedError: no")
    bench_report.write_csv(tmp_path / "b.csv", rows)
    with open(tmp_path / "b.csv") as f:
        written = list(csv.DictReader(f))
    assert [r["time_vs_raw"] for r in written] == ["1.0000", "1.1000", ""]


def test_cli_runs_end_to_end(tmp_path, capsys):
    status = bench.main(["--workloads", "tiny", "--systems", "raw-cudnn,ours-hm,jax-packed,xla", "--quick",
                         "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    with open(tmp_path / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert status == 0
    assert len(rows) == 4 * 3  # every system, every direction
    assert all(r["status"] == "ok" or r["status"].startswith("skipped: ") for r in rows), rows
    measured = [r for r in rows if r["system"] == "xla" and r["direction"] != "backward"]  # backward is derived
    assert len(measured) == 2 and all(r["status"] == "ok" and float(r["median_ms"]) > 0 for r in measured)
    if jax.default_backend() == "cpu":
        assert all(r["status"].startswith("skipped: ") for r in rows if r["system"] != "xla")
    assert (tmp_path / "table.txt").exists()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no plot (matplotlib is not importable" in printed
    else:
        assert (tmp_path / "bench.png").stat().st_size > 0
    assert "host overhead of a cached jitted call" in printed
    lines = printed.rstrip().splitlines()
    header = max(i for i, line in enumerate(lines) if line.startswith("workload  system"))
    assert len(lines) > header + 1 and all(line.startswith("tiny ") for line in lines[header + 1:])  # table last
    if jax.default_backend() == "cpu":  # a system skipped for one reason reads as one line
        assert sum(" all " in line and "skipped: " in line for line in lines[header + 1:]) == 3
