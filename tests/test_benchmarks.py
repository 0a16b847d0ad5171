"""Each benchmark in benchmarks/README.md runs: its smallest run on this machine prints its table, or, where it
needs a GPU, its `--help` prints its usage. The figures are not judged (a CPU's timings mean nothing)."""

from __future__ import annotations

import importlib

import pytest

# name: (arguments, a line of its output; "{out}" is a folder of this test's own)
RUNS = {
    "attention": (
        [
            "--workloads",
            "tiny",
            "--systems",
            "xla",
            "--quick",
            "--method",
            "plain",
            "--matmul-size",
            "64",
            "--out",
            "{out}",
        ],
        "workload  system  method  dir",
    ),
    "model_step": (["--quick", "--systems", "ours-xla", "--matmul-size", "64", "--out", "{out}"], "lengths  system"),
    "peers": (
        ["--quick", "--workloads", "MLA", "--systems", "ours xla", "--calls", "1", "--loops", "1", "--out", "{out}"],
        "| MLA~tiny",
    ),
    "decode": (["--quick", "--calls", "1", "--repetitions", "1"], "ours-xla"),
    "kvcache_mixed": (["--quick", "--calls", "1", "--repetitions", "1"], "ours-xla-packed"),
    "context_parallel": (
        ["--workloads", "tiny", "--implementation", "xla", "--calls", "1", "--repetitions", "1"],
        "| tiny | 1 GPU |",
    ),
    "sweep": (["--tier", "cpu", "--num-tests", "1"], "sweep: 1 passed, 0 skipped, 0 failed - OK"),
    "sweep_kvcache": (["--num-tests", "1"], "1 cases: 1 passed, 0 skipped, 0 failed"),
    "xla_path": (["--shape", "cpu-4k", "--repeats", "1", "--target", "0.001"], "jax.nn padded"),
    "xla_memory": (
        ["--workloads", "W3/8", "--max-seqlen", "exact", "--repeats", "1"],
        "| workload | max_seqlen | direction |",
    ),
}
GPU_ONLY = ("autotune", "command_buffers", "fa3_compare", "sinks", "softcap", "cudnn_bug_probe")
# The fast tier runs one benchmark for real (a few seconds); the others take 10-70 s each on 2 CPU cores.
FAST = ("sweep_kvcache", *GPU_ONLY)


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in [*RUNS, *GPU_ONLY]]
)
def test_the_benchmark_prints_its_table(name, tmp_path, capsys):
    main = importlib.import_module(f"benchmarks.{name}").main
    if name in GPU_ONLY:
        with pytest.raises(SystemExit) as exited:
            main(["--help"])
        assert exited.value.code == 0
        assert "usage: " in capsys.readouterr().out
        return
    argv, line = RUNS[name]
    status = main([a.format(out=tmp_path) for a in argv])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert line in printed, printed
