"""The benchmark's workloads, FLOP counting, timing loop and report; an end-to-end run on any machine.

The GPU systems cannot be exercised without a GPU; here they must report "skipped: <reason>" and leave
the portable system's rows intact.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jax_ragged_attn.testing import workloads
from jax_ragged_attn.testing.workloads import WORKLOADS

from benchmarks import attention as bench, report as bench_report, systems as bench_systems, timing as bench_timing
from benchmarks.timing import Measurement

pytestmark = pytest.mark.slow  # the tool end to end

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
        copies = [bench_timing.loop_copy_bytes(jax.jit(functools.partial(loop, case.attention, steps)).lower(
            *args).compile().as_text(), at_least=64 << 10) for steps in (1, 2)]
        # The op's own loops (the xla path's tile walks) may copy their state; the timing loop adds none.
        assert copies[1] == copies[0], copies

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
            Measurement("W1", "jax-packed", "forward", status="error: NotImplementedError: no"),
            _row("raw-cudnn", "forward", 2.0, method="plain"), _row("ours-hm", "forward", 2.2, method="plain")]
    limits = {"fori": 2e15, "plain": 1e15}  # dense matmul FLOP/s per method
    table = bench_report.table(rows, limits).splitlines()
    assert table[0].split()[:4] == ["workload", "system", "method", "dir"]
    assert "1.10x" in table[2] and "270.5 MB" in table[2] and "1000.0" in table[1]  # 1e12 FLOP in 1 ms
    assert " 50% " in table[1] and " 45% " in table[2]  # 1000 TFLOP/s of 2000; 909 of 2000
    assert table[3].endswith("error: NotImplementedError: no")
    # Ratios and fractions pair rows of the same method: plain over plain raw, over plain's limit.
    assert table[4].split()[:3] == ["W1", "raw-cudnn", "plain"] and " 50% " in table[4] and "1.00x" in table[4]
    assert "1.10x" in table[5] and " 45% " in table[5]
    bench_report.write_csv(tmp_path / "b.csv", rows, limits)
    with open(tmp_path / "b.csv") as f:
        written = list(csv.DictReader(f))
    assert [r["time_vs_raw"] for r in written] == ["1.0000", "1.1000", "", "1.0000", "1.1000"]
    assert [r["method"] for r in written] == ["fori", "fori", "fori", "plain", "plain"]
    assert [r["fraction_of_limit"] for r in written] == ["0.5000", "0.4545", "", "0.5000", "0.4545"]
    assert bench_report.table(rows[:1]).split("\n")[1].split()[6] == "-"  # no limit measured: no fraction


def test_both_methods_time_the_same_function():
    settings = bench_timing.Settings(iterations=2, target_call_s=0.001, max_steps=2, warmup_calls=1,
                                     assumed_flops_per_s=2e10, methods=("fori", "plain"))
    rows = bench_timing.measure_jax(bench_systems._ours_case(WORKLOADS["tiny"], implementation="xla"),
                                    WORKLOADS["tiny"], "xla", settings)
    assert [(m.method, m.direction) for m in rows] == [(m, d) for m in ("fori", "plain") for d in workloads.DIRECTIONS]
    measured = [m for m in rows if m.direction != "backward"]
    assert all(m.ok and m.median_s > 0 and m.peak_bytes for m in measured), measured
    assert all((m.loop_copy_bytes is None) == (m.method == "plain") for m in measured)  # no loop to copy into
    assert bench_timing.matmul_rate(64, settings, "plain") > 0 and bench_timing.matmul_rate(64, settings, "fori") > 0
    with pytest.raises(ValueError, match="method"):
        bench_timing.matmul_rate(64, settings, "sideways")


def test_cli_runs_end_to_end(tmp_path, capsys):
    status = bench.main(["--workloads", "tiny", "--systems", "raw-cudnn,ours-hm,jax-packed,xla", "--quick",
                         "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    with open(tmp_path / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert status == 0
    assert len(rows) == 4 * 3 * 2  # every system, every direction, both methods (the default)
    assert {r["method"] for r in rows} == {"fori", "plain"}
    assert all(r["status"] == "ok" or r["status"].startswith("skipped: ") for r in rows), rows
    measured = [r for r in rows if r["system"] == "xla" and r["direction"] != "backward"]  # backward is derived
    assert len(measured) == 4 and all(r["status"] == "ok" and float(r["median_ms"]) > 0 for r in measured)
    assert all(float(r["fraction_of_limit"]) > 0 for r in measured)
    assert "dense limit (fori): jitted bf16 [512, 512]" in printed and "dense limit (plain)" in printed
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
    table = lines[header + 1:]
    if jax.default_backend() == "cpu":  # the rows a CPU runs, then the GPU systems in one line
        assert table[-1] == ("skipped on CPU: 6 rows needing a GPU: raw-cudnn, ours-hm, jax-packed (in bench.csv "
                             "as skipped)"), table
        table = table[:-1]
        assert [line.split()[1] for line in table] == ["xla"] * 6, table  # ok (or a noisy derived backward)
        assert "the fraction of this limit means nothing here" in printed
        assert not any(line.startswith("tiny ours-hm (") for line in lines)  # not tried, so no progress line
    assert table and all(line.startswith("tiny ") for line in table)  # the table last


def test_cli_method_flag(tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--method", "fori,sideways", "--out", str(tmp_path)])
    assert bench.main(["--workloads", "tiny", "--systems", "raw-cudnn", "--method", "plain", "--quick",
                       "--matmul-size", "64", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "bench.csv") as f:
        assert {r["method"] for r in csv.DictReader(f)} == {"plain"}


# ---- the package's own bench (python -m jax_ragged_attn.bench, jax_ragged_attn/tools/bench.py) ------------------


def test_package_bench_times_your_shape_on_each_implementation(capsys):
    from jax_ragged_attn.tools import bench as package_bench

    assert package_bench.main(["--lengths", "5,0,9", "--kv-lengths", "7,3,9", "--heads", "4", "--kv-heads", "2",
                               "--head-dim", "32", "--dtype", "float32", "--calls", "2", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("your shape: 3 sequences of 0..9 (14 tokens), keys 3..9 (19 tokens), 4/2 heads")
    header = next(i for i, line in enumerate(lines) if line.startswith("implementation"))
    rows = {line.split()[0]: line for line in lines[header + 1:]}
    from jax_ragged_attn import backends

    assert set(rows) == set(backends.REGISTRY), lines  # each implementation a row (dew, fa3, cudnn, xla)
    assert rows["xla"].count(" ms ") == 2 and rows["xla"].count("TFLOP/s") == 2, rows["xla"]  # forward, fwd+bwd
    if jax.default_backend() == "cpu":
        assert rows["cudnn"].split(None, 1)[1] == "skipped: no CUDA device: JAX's backend is 'cpu'", rows["cudnn"]
    assert package_bench.forward_flops(dict(q=(5, 0, 9), kv=(7, 3, 9), heads=4, head_dim=32, causal=True)) == \
        (4.0 * 4 * 32 * (5 * 7 + 9 * 9)) / 2


def test_package_bench_entry_point_help_and_bad_flags():
    run = subprocess.run([sys.executable, "-m", "jax_ragged_attn.bench", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and "--lengths" in run.stdout and "--implementations" in run.stdout, run.stderr
    from jax_ragged_attn.tools import bench as package_bench

    with pytest.raises(SystemExit, match="unknown \\['sideways'\\]"):
        package_bench.main(["--implementations", "sideways"])
    with pytest.raises(SystemExit, match="one length per sequence"):
        package_bench.main(["--lengths", "4,4", "--kv-lengths", "4"])


# ---- the training-step benchmark (benchmarks/model_step.py) ----------------------------------------------------


def test_model_step_systems_compute_the_same_loss_and_gradients():
    # Every system must train the same block on the same real tokens: padding and pad/unpad only move them.
    # The padded systems run jax.nn's xla attention here (cudnn needs a GPU); same layout code, same loss.
    from benchmarks import model_step as ms

    config, lengths = ms.TINY, ms.LENGTHS["tiny"]
    params = ms.init_params(config)
    results = {}
    for name, system in ms.systems(config, padded_implementation="xla").items():
        if name == "ours-cudnn":
            continue
        batch = ms.make_batch(system, lengths, config)
        attention = functools.partial(system.attention(lengths), *batch.index)
        loss = functools.partial(ms._loss, attention=attention, config=config)
        results[name] = jax.jit(jax.value_and_grad(loss))(params, batch.x, batch.positions, batch.mask)
    reference_loss, reference_grads = results.pop("ours-xla")
    assert bool(jnp.isfinite(reference_loss)) and float(reference_loss) > 0
    for name, (loss, grads) in results.items():
        assert float(loss) == pytest.approx(float(reference_loss), rel=2e-2), name
        for key, g in grads.items():
            scale = float(jnp.abs(reference_grads[key]).max())
            assert float(jnp.abs(g - reference_grads[key]).max()) <= 5e-2 * scale, (name, key)


def test_model_step_bench_runs_on_cpu(tmp_path, capsys):
    from benchmarks import model_step as ms

    status = bench.main(["--model", "--quick", "--systems", "padded,ours-cudnn,ours-xla", "--matmul-size", "64",
                         "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    with open(tmp_path / "model_step.csv") as f:
        rows = {r["system"]: r for r in csv.DictReader(f)}
    assert list(rows) == ["padded", "ours-cudnn", "ours-xla"]
    xla = rows["ours-xla"]
    assert xla["status"] == "ok" and int(xla["tokens"]) == sum(ms.LENGTHS["tiny"])
    for field in ("step_ms", "tokens_per_s", "tflops", "fraction_of_limit", "attention_ms", "attention_share",
                  "step_bytes", "loss"):
        assert float(xla[field]) > 0, field  # printed, not judged: a CPU's timings mean nothing
    if jax.default_backend() == "cpu":
        assert rows["padded"]["status"].startswith("skipped: jax.nn's cudnn attention needs a CUDA GPU")
        assert rows["ours-cudnn"]["status"].startswith("skipped: the cuDNN path cannot run here")
        assert "the fraction means nothing" in printed
    lines = printed.rstrip().splitlines()
    assert lines[-4].startswith("lengths  system") and lines[-1].startswith("tiny     ours-xla")  # table last
    assert (tmp_path / "model_step.txt").exists()


# ---- command buffers (benchmarks/capture.py, benchmarks/command_buffers.py) ------------------------------------
# Synthetic XLA output, written after openxla/xla: CommandBufferScheduling's HLO (a `command_buffer`
# computation called through `call(...), to_apply=%command_buffer`) and the thunk dumps of
# CommandBufferConversionPass (`<indent><id>: <kind>`, a command buffer's thunks indented under it).

_FWD = 'custom_call_target="jax_ragged_attn_forward", api_version=API_VERSION_TYPED_FFI'
_BWD = 'custom_call_target="jax_ragged_attn_backward", api_version=API_VERSION_TYPED_FFI'
_HEADER = ("HloModule jit__forward_loop, is_scheduled=true, entry_computation_layout={(bf16[64,8,64]{2,1,0})->"
           "bf16[64,8,64]{2,1,0}}\n\nFileNames\n1 \"bench_timing.py\"\n\nStackFrames\n1 {file_location_id=1 "
           "parent_frame_id=1}\n\n")
_CALL = "(bf16[64,8,64]{2,1,0}, f32[8,64]{1,0}, u8[4096]{0}) custom-call(%p, %fusion)"

HLO_CAPTURED = _HEADER + f"""
%fused_computation (param_0: s32[5]) -> s32[5] {{
  ROOT %param_0 = s32[5]{{0}} parameter(0)
}}

%command_buffer (p: bf16[64,8,64], p.1: s32[5]) -> (bf16[64,8,64], f32[8,64], u8[4096]) {{
  %p = bf16[64,8,64]{{2,1,0}} parameter(0)
  %p.1 = s32[5]{{0}} parameter(1)
  %fusion = s32[5]{{0}} fusion(%p.1), kind=kLoop, calls=%fused_computation
  ROOT %custom-call.1 = {_CALL}, {_FWD}
}}

ENTRY %main.10 (q: bf16[64,8,64], cu: s32[5]) -> bf16[64,8,64] {{
  %q = bf16[64,8,64]{{2,1,0}} parameter(0)
  %cu = s32[5]{{0}} parameter(1)
  %call = (bf16[64,8,64]{{2,1,0}}, f32[8,64]{{1,0}}, u8[4096]{{0}}) call(%q, %cu), to_apply=%command_buffer
  ROOT %get-tuple-element = bf16[64,8,64]{{2,1,0}} get-tuple-element(%call), index=0
}}
"""

# A captured loop (WHILE enabled): the body is reached from the command buffer. The backward call sits
# outside, next to a second command buffer that does not hold it. Names printed without '%', as newer XLA does.
HLO_LOOP = _HEADER + f"""
region_0.2 (arg: (s32[], bf16[64,8,64])) -> (s32[], bf16[64,8,64]) {{
  arg = (s32[], bf16[64,8,64]{{2,1,0}}) parameter(0)
  p = bf16[64,8,64]{{2,1,0}} get-tuple-element(arg), index=1
  fusion = s32[5]{{0}} fusion(p), kind=kLoop, calls=fused_computation
  custom-call.7 = {_CALL.replace('%', '')}, {_FWD}
  ROOT tuple.3 = (s32[], bf16[64,8,64]{{2,1,0}}) tuple(fusion, custom-call.7)
}}

command_buffer.1 (p.2: (s32[], bf16[64,8,64])) -> (s32[], bf16[64,8,64]) {{
  p.2 = (s32[], bf16[64,8,64]{{2,1,0}}) parameter(0)
  ROOT while.1 = (s32[], bf16[64,8,64]{{2,1,0}}) while(p.2), condition=region_1.3, body=region_0.2
}}

command_buffer.2 (p.3: bf16[64,8,64]) -> bf16[64,8,64] {{
  p.3 = bf16[64,8,64]{{2,1,0}} parameter(0)
  ROOT fusion.9 = bf16[64,8,64]{{2,1,0}} fusion(p.3), kind=kLoop, calls=fused_computation.2
}}

ENTRY main.10 (q: bf16[64,8,64]) -> bf16[64,8,64] {{
  q = bf16[64,8,64]{{2,1,0}} parameter(0)
  call = (s32[], bf16[64,8,64]{{2,1,0}}) call(q), to_apply=command_buffer.1
  custom-call.8 = (bf16[64,8,64]{{2,1,0}}, u8[64]{{0}}) custom-call(q, q), {_BWD}
  ROOT call.1 = bf16[64,8,64]{{2,1,0}} call(q), to_apply=command_buffer.2
}}
"""

# What newer XLA prints: no command_buffer computation (they are formed later, on thunks); a `call` to a
# computation that is not a command buffer; our forward in a loop body and the backward in ENTRY.
HLO_PLAIN = _HEADER + f"""
%region_0.2 (arg: (s32[], bf16[64,8,64])) -> (s32[], bf16[64,8,64]) {{
  %arg = (s32[], bf16[64,8,64]{{2,1,0}}) parameter(0)
  %p = bf16[64,8,64]{{2,1,0}} get-tuple-element(%arg), index=1
  %fusion = s32[5]{{0}} fusion(%p), kind=kLoop, calls=%fused_computation
  %custom-call.3 = {_CALL}, {_FWD}
  ROOT %tuple.3 = (s32[], bf16[64,8,64]{{2,1,0}}) tuple(%fusion, %custom-call.3)
}}

%while.5_computation (tuple.4: (s32[], bf16[64,8,64])) -> (s32[], bf16[64,8,64]) {{
  %tuple.4 = (s32[], bf16[64,8,64]{{2,1,0}}) parameter(0)
  ROOT %while.0 = (s32[], bf16[64,8,64]{{2,1,0}}) while(%tuple.4), condition=%region_1.3, body=%region_0.2
}}

ENTRY %main.10 (q: bf16[64,8,64]) -> bf16[64,8,64] {{
  %q = bf16[64,8,64]{{2,1,0}} parameter(0)
  %call = (s32[], bf16[64,8,64]{{2,1,0}}) call(%q), to_apply=%while.5_computation
  ROOT %custom-call.9 = (bf16[64,8,64]{{2,1,0}}, u8[64]{{0}}) custom-call(%q, %q), {_BWD}
}}
"""

# Thunk dumps of HLO_PLAIN's module: forward (thunk 5) in a command buffer inside the loop body, backward
# (thunk 9) outside every command buffer.
THUNKS_AFTER = """000: kSequential\t
001: kWhile        \t
  condition:
    002: kKernel\t
  body:
    010: kCommandBuffer\t
        003: kKernel     \t
        005: kCustomCall \t
        006: kKernel     \t
007: kKernel       \t
009: kCustomCall   \t
"""
THUNKS_BEFORE = """001: kWhile\t
  body:
    003: kKernel\t
    005: kCustomCall\t
009: kCustomCall\t
"""
METADATA = "".join(
    f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{name}"\n    thunk_id: {thunk_id}\n  }}\n'
    f'  thunk_kind: "{kind}"\n}}\n'
    for thunk_id, name, kind in ((1, "while.0", "kWhile"), (10, "", "kCommandBuffer"), (3, "fusion", "kKernel"),
                                 (5, "custom-call.3", "kCustomCall"), (9, "custom-call.9", "kCustomCall")))


def _statuses(occurrences):
    return [(o.target, o.instruction, o.status) for o in occurrences]


def test_hlo_classifier_reads_command_buffer_computations():
    from benchmarks import capture as cb

    (captured,) = cb.classify_hlo(HLO_CAPTURED)
    assert (captured.target, captured.instruction, captured.computation) == (
        "jax_ragged_attn_forward", "custom-call.1", "command_buffer")
    assert captured.status == cb.CAPTURED and "command_buffer" in captured.reason
    assert _statuses(cb.classify_hlo(HLO_LOOP)) == [
        ("jax_ragged_attn_forward", "custom-call.7", cb.CAPTURED),  # a loop body reached from command_buffer.1
        ("jax_ragged_attn_backward", "custom-call.8", cb.NOT_CAPTURED)]
    plain = cb.classify_hlo(HLO_PLAIN)  # a `call` to a non-command-buffer computation does not count
    assert [o.status for o in plain] == [cb.UNKNOWN, cb.UNKNOWN]
    assert all("no command_buffer computation" in o.reason for o in plain)
    assert cb.module_name(HLO_PLAIN) == "jit__forward_loop"


def test_hlo_classifier_matches_targets_exactly():
    from benchmarks import capture as cb

    # A name that only starts with ours is not ours, and is found once it is named.
    renamed = HLO_CAPTURED.replace('"jax_ragged_attn_forward"', '"jax_ragged_attn_forward_other"')
    assert cb.classify_hlo(renamed) == []
    assert _statuses(cb.classify_hlo(renamed, targets=("jax_ragged_attn_forward_other",))) == [
        ("jax_ragged_attn_forward_other", "custom-call.1", cb.CAPTURED)]
    other = HLO_CAPTURED.replace('"jax_ragged_attn_forward"', '"__cudnn$fmhaSoftmax"')
    assert cb.classify_hlo(other) == [] and cb.summary([]) == "none of our calls"


def test_thunk_classifier_reads_nesting_and_metadata():
    from benchmarks import capture as cb

    lines = {t.thunk_id: t for t in cb.parse_thunk_sequence(THUNKS_AFTER)}
    assert lines[5].kind == "kCustomCall" and lines[5].in_command_buffer
    assert not lines[9].in_command_buffer and not lines[2].in_command_buffer and lines[3].in_command_buffer
    expected = [("jax_ragged_attn_forward", "custom-call.3", cb.CAPTURED),
                ("jax_ragged_attn_backward", "custom-call.9", cb.NOT_CAPTURED)]
    occurrences = cb.classify_thunks(HLO_PLAIN, THUNKS_AFTER, METADATA)
    assert _statuses(occurrences) == expected
    assert "thunk 005" in occurrences[0].reason and "kCommandBuffer" in occurrences[0].reason
    # Text protos leave out default fields: an entry without thunk_id is thunk 0.
    assert cb.parse_thunk_metadata('thunk_metadata {\n  thunk_info {\n    profile_annotation: "a"\n  }\n'
                                   '  thunk_kind: "kKernel"\n}\n') == [(0, "a", "kKernel")]
    # classify: the HLO cannot tell, so the dump answers.
    assert _statuses(cb.classify(HLO_PLAIN, thunk_after=THUNKS_AFTER, metadata=METADATA)) == expected
    # Only thunk_sequence.txt (the thunk passes changed nothing): no command buffer anywhere.
    before = cb.classify(HLO_PLAIN, thunk_before=THUNKS_BEFORE, metadata=METADATA)
    assert [o.status for o in before] == [cb.NOT_CAPTURED] * 2 and "changed nothing" in before[0].reason
    # Older XLA printed the kind then the annotation, without ids or metadata.
    older = ("kWhile:\t\n  body:\n    kCommandBuffer:\t\n      kCustomCall:\tcustom-call.3\n"
             "kCustomCall:\tcustom-call.9\n")
    assert _statuses(cb.classify_thunks(HLO_PLAIN, older)) == expected
    assert cb.summary(occurrences, {"jax_ragged_attn_forward": "forward", "jax_ragged_attn_backward": "backward"}) \
        == "forward captured, backward not captured"


def test_thunk_classifier_says_unknown_rather_than_guess():
    from benchmarks import capture as cb

    # No metadata and the custom-call thunks disagree: which one is ours cannot be told.
    unknown = cb.classify_thunks(HLO_PLAIN, THUNKS_AFTER, None)
    assert [o.status for o in unknown] == [cb.UNKNOWN] * 2 and "1 of 2" in unknown[0].reason
    # No metadata, but every custom-call thunk is captured: by elimination.
    all_in = THUNKS_AFTER.replace("007: kKernel       \t\n009: kCustomCall",
                                  "011: kCommandBuffer\t\n  009: kCustomCall")
    assert [o.status for o in cb.classify_thunks(HLO_PLAIN, all_in)] == [cb.CAPTURED] * 2
    # Not a thunk dump at all, or no dump.
    assert [o.status for o in cb.classify_thunks(HLO_PLAIN, "something else\n")] == [cb.UNKNOWN] * 2
    missing = cb.classify(HLO_PLAIN)
    assert [o.status for o in missing] == [cb.UNKNOWN] * 2 and "--xla_dump_to" in missing[0].reason
    # The HLO's answer wins where it has one.
    assert [o.status for o in cb.classify(HLO_CAPTURED, thunk_after="")] == [cb.CAPTURED]


def test_dump_files_of_the_timed_module():
    from benchmarks import capture as cb

    names = ["module_0040.jit__forward_loop.thunk_sequence.txt",
             "module_0042.jit__forward_loop.thunk_sequence_after_thunk_passes.txt",
             "module_0042.jit__forward_loop.thunk_sequence.txt",
             "module_0042.jit__forward_loop.thunk_metadata.txt",
             "module_0042.jit__forward_loop.sm_9.0_gpu_after_optimizations.txt",
             "module_0043.jit_normal.thunk_sequence.txt"]
    assert cb.module_dump_files(names, "jit__forward_loop") == {
        "after": names[1], "before": names[2], "metadata": names[3]}
    assert cb.module_dump_files(names, "jit_unnamed")["before"] == names[5]  # no name match: the newest module
    assert cb.module_dump_files([], "jit__forward_loop") == {"after": None, "before": None, "metadata": None}


def test_command_buffer_modes_set_xla_flags_for_the_child():
    from benchmarks import command_buffers as bcb

    inherited = "--xla_gpu_enable_command_buffer=CUBLAS --xla_dump_to=/old --xla_gpu_autotune_level=0"
    assert bcb.child_xla_flags(inherited, "off", "/d").split() == [
        "--xla_gpu_autotune_level=0", "--xla_gpu_enable_command_buffer=", "--xla_dump_to=/d", "--xla_dump_hlo_as_text"]
    assert bcb.child_xla_flags("", "on", "/d").split()[:2] == [
        "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL", "--xla_gpu_graph_min_graph_size=1"]
    assert "enable_command_buffer" not in bcb.child_xla_flags("", "default", "/d")
    env = bcb.child_environment("on", "/d", {"JAX_RAGGED_ATTN_CHECK": "1", "PATH": "/bin"})
    assert "JAX_RAGGED_ATTN_CHECK" not in env and env["JAX_ENABLE_COMPILATION_CACHE"] == "false"


def test_command_buffer_report_table():
    from benchmarks import command_buffers as bcb
    from benchmarks import capture as cb

    def result(mode, fwd, both, status):
        rows = [_row("ours-hm", "forward", fwd), _row("ours-hm", "backward", both - fwd),
                _row("ours-hm", "forward+backward", both)]
        capture = {d: {"module": "m", "files": {}, "occurrences": [dataclasses.asdict(cb.Occurrence(
            "jax_ragged_attn_forward", "custom-call.3", "region_0.2", status, "thunks: ..."))]}
            for d in ("forward", "forward+backward")}
        return {"mode": mode, "status": "ok", "rows": [dataclasses.asdict(r) for r in rows], "capture": capture,
                "seconds": 12.0, "jax": "0.11.2", "device": "NVIDIA H200"}

    text = bcb.report([result("off", 0.4, 1.4, cb.NOT_CAPTURED), result("on", 0.36, 1.33, cb.CAPTURED)],
                      WORKLOADS["W3"])
    lines = text.splitlines()
    off = next(line for line in lines if line.startswith("off "))
    on = next(line for line in lines if line.startswith("on "))
    assert "0.400" in off and "1.400" in off and "forward not captured" in off
    assert "0.360" in on and "forward captured" in on
    assert any(line.strip().startswith("on") and "fwd 0.90x" in line and "fwd+bwd 0.95x" in line for line in lines)
    assert "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" in text


def test_command_buffer_bench_without_a_gpu_exits_cleanly(tmp_path, capsys):
    if jax.default_backend() != "cpu":
        pytest.skip("this checks the path taken without a GPU")
    from benchmarks import command_buffers as bcb

    assert bcb.main(["--out", str(tmp_path), "--modes", "off,on"]) == 0
    printed = capsys.readouterr().out
    assert "needs a CUDA GPU" in printed and "not measured" in printed
    assert not (tmp_path / "on").exists()  # stopped after the first mode said why


def test_command_buffer_bench_runs_end_to_end_on_the_xla_path(tmp_path, capsys):
    # --allow-cpu: the same subprocess, timing and dump plumbing, timing the xla path (no custom calls).
    if jax.default_backend() != "cpu":
        pytest.skip("on a GPU the real run is `python -m benchmarks.command_buffers`")
    from benchmarks import command_buffers as bcb

    status = bcb.main(["--out", str(tmp_path), "--modes", "on", "--workload", "tiny", "--iterations", "1",
                       "--allow-cpu"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    row = next(line for line in printed.splitlines() if line.startswith("on "))
    assert "none of our calls" in row and float(row.split()[1]) > 0  # fwd ms
    assert "implementation='xla'" in printed
    assert (tmp_path / "table.txt").exists() and (tmp_path / "results.json").exists()


def test_context_parallel_simulation_prints_a_row_per_device_count_and_order(capsys, monkeypatch):
    """bench/context_parallel --simulate on the xla path (CPU): the exact per-device function of the sharded
    op (context_parallel.device_chunks_attention), timed per device, with its work shares."""
    from benchmarks import context_parallel as bcp
    from jax_ragged_attn.testing.workloads import Workload

    tiny = Workload("tiny-cp", "tiny", (40, 23, 1, 60), 4, 2, 16, dtype="float32")
    monkeypatch.setitem(bcp.CP_WORKLOADS, "tiny-cp", tiny)
    assert bcp.main(["--workloads", "tiny-cp", "--simulate", "2", "--calls", "1", "--repetitions", "1",
                     "--implementation", "xla"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny-cp")]
    assert [row.split("|")[3].strip() for row in rows] == ["natural", "balanced", "packer+balanced"]
    for row in rows:
        per_device = row.split("|")[5].split("/")
        shares = [float(x) for x in row.split("|")[9].split("/")]
        assert len(per_device) == 2 and abs(sum(shares) - 1) < 0.02
