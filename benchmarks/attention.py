"""`python -m benchmarks.attention`: packed attention timed side by side with raw cuDNN and JAX's own paths.

For each workload (jax_ragged_attn/testing/workloads.py) and system (benchmarks/systems.py) it measures
forward and forward+backward by each --method ("fori": a jitted loop of N steps per timed call; "plain": a
Python loop of N calls of the jitted op, then block_until_ready, as a training loop runs; the median of
--iterations timed calls or loops) and derives backward as their difference. It reports useful TFLOP/s
over real tokens, their fraction of a dense bf16 matmul's rate timed in the same run ("of limit"), the time
relative to raw cuDNN (same method), cuDNN's workspace and the step's device memory, then the host overhead
of one cached call. A system that cannot run prints "skipped: <reason>", one that fails "error: <message>";
the others still run. Writes bench.csv, bench.png and table.txt into --out; the table is printed last.

  python -m benchmarks.attention                                        # every workload and system
  python -m benchmarks.attention --workloads W3 --systems xla --quick   # a CPU smoke run
  python -m benchmarks.attention --model --quick                        # the training-step benchmark (model_step.py)

XLA's command buffers (CUDA graphs) off and on, and whether our custom calls are captured:
python -m benchmarks.command_buffers (benchmarks/capture.py explains how it is read).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import jax

from benchmarks import report as bench_report
from benchmarks import systems as bench_systems
from benchmarks.timing import METHODS, Measurement, Settings, error_status, host_overhead, matmul_rate, rows_with_status
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.testing import workloads
from jax_ragged_attn.testing.workloads import DIRECTIONS


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.attention", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workloads",
        default=None,
        help="comma-separated: W1, W2, W3, W4 (= W4-d64,W4-d256,W4-noncausal), tiny, or all "
        "(default: all but tiny on a GPU, tiny elsewhere)",
    )
    parser.add_argument(
        "--systems", default="all", help=f"comma-separated of {', '.join(bench_systems.SYSTEMS)}, or all (default)"
    )
    parser.add_argument(
        "--iterations",
        type=int,
        default=None,
        help="timed calls per measurement, median reported (default 20; 2 with --quick)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: one warm-up and 2 timed calls of at most 5 steps per measurement",
    )
    parser.add_argument("--out", default="bench_out", help="directory for bench.csv, bench.png, table.txt")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="skip measurements not started within this many seconds, so the run still ends with its table and files",
    )
    parser.add_argument(
        "--method",
        default=",".join(METHODS),
        help="comma-separated timing methods: fori (a device-side loop of N steps in one jitted "
        "call), plain (N jitted calls from Python, then block_until_ready); default both",
    )
    parser.add_argument(
        "--matmul-size",
        type=int,
        default=None,
        metavar="N",
        help="size of the dense bf16 [N, N] @ [N, N] matmul whose rate is the limit (default 8192 "
        "on a GPU, 512 elsewhere, where the fraction means nothing)",
    )
    parser.add_argument(
        "--model",
        action="store_true",
        help="run the training-step benchmark instead; the other arguments go to "
        "python -m benchmarks.model_step (see its --help)",
    )
    parser.add_argument("--list", action="store_true", help="list workloads and systems, then exit")
    args = parser.parse_args(argv)
    if args.iterations is not None and args.iterations < 1:
        parser.error(f"--iterations must be >= 1, got {args.iterations}")
    args.methods = tuple(dict.fromkeys(m.strip() for m in args.method.split(",") if m.strip()))
    if not args.methods or any(m not in METHODS for m in args.methods):
        parser.error(f"--method takes a comma-separated list of {', '.join(METHODS)}, got {args.method!r}")
    return args


def _settings(args) -> Settings:
    # The step count per timed call comes from a FLOP-rate guess; a wrong guess only costs a recompile.
    rate = 3e14 if jax.default_backend() == "gpu" else 2e10
    if args.quick:
        return Settings(
            iterations=args.iterations or 2,
            target_call_s=0.002,
            max_steps=5,
            warmup_calls=1,
            assumed_flops_per_s=rate,
            methods=args.methods,
        )
    return Settings(iterations=args.iterations or 20, assumed_flops_per_s=rate, methods=args.methods)


def limits(settings: Settings, size: int | None) -> tuple[dict[str, float], list[str]]:
    """(method -> dense bf16 matmul FLOP/s, lines saying so): the denominator of the "of limit" column."""
    on_gpu = jax.default_backend() == "gpu"
    size = size or (8192 if on_gpu else 512)
    rates, lines = {}, []
    for method in settings.methods:
        try:
            rates[method] = matmul_rate(size, settings, method)
            text = f"{rates[method] / 1e12:.1f} TFLOP/s"
        except Exception as error:  # noqa: BLE001 - the table still prints, without the column
            text = error_status(error)
        lines.append(
            f"dense limit ({method}): jitted bf16 [{size}, {size}] @ [{size}, {size}]: {text}"
            + ("" if on_gpu else " (not a GPU: the fraction of this limit means nothing here)")
        )
    return rates, lines


def _environment() -> list[str]:
    lines = [f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}"]
    lines += [f"  {key}: {value}" for key, value in extension.versions().items()]
    for module, label in (("torch", "torch"), ("cudnn", "cudnn-frontend Python module")):
        try:
            imported = __import__(module)
            backend = getattr(imported, "backend_version_string", None)  # the cuDNN raw-cudnn loaded
            lines.append(f"  {label}: {imported.__version__}" + (f", cuDNN {backend()}" if backend else ""))
        except Exception as error:  # noqa: BLE001 - informational only
            lines.append(f"  {label}: not importable ({type(error).__name__})")
    return lines


def _progress(items):
    """(iterable with a progress bar, function printing above it); plain prints without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items, print
    return tqdm(items, file=sys.stderr, unit="run", dynamic_ncols=True), tqdm.write


def _summary(rows: list[Measurement], seconds: float) -> str:
    if all(not m.ok and m.status == rows[0].status for m in rows):
        parts = [rows[0].status]
    else:
        parts = [
            f"{m.method} {m.direction} {m.median_s * 1e3:.3f} ms ({bench_report.format_tflops(m.tflops)} TFLOP/s)"
            if m.tflops is not None
            else f"{m.method} {m.direction} {m.status}"
            for m in rows
        ]
    text = f"{rows[0].workload} {rows[0].system} ({seconds:.1f} s): " + ", ".join(parts)
    return text if len(text) <= 400 else text[:397] + "..."


def _measure(system, workload, settings) -> list[Measurement]:
    reason = system.unavailable() or system.unsupported(workload)
    if reason:
        return rows_with_status(workload, system.name, f"skipped: {reason}", DIRECTIONS, settings.methods)
    try:
        return system.measure(workload, settings)
    except Exception as error:  # noqa: BLE001 - one failing system must not stop the others
        traceback.print_exc(file=sys.stderr)  # the rows keep the message; stderr keeps where it came from
        return rows_with_status(workload, system.name, error_status(error), DIRECTIONS, settings.methods)


def _overhead_lines() -> list[str]:
    implementation = "cudnn" if extension.cudnn_unavailable_reason() is None else "xla"
    tiny = workloads.WORKLOADS["tiny"]
    try:
        results = host_overhead(tiny, implementation)
    except Exception as error:  # noqa: BLE001
        return [f"host overhead: {error_status(error)}"]
    (ours_async, ours_sync), (base_async, base_sync) = results.values()
    ours, base = results
    return [
        f"host overhead of a cached jitted call ({tiny.summary()}):",
        f"  {ours}: {ours_async * 1e6:.1f} us/call back-to-back, {ours_sync * 1e6:.1f} us call+sync",
        f"  {base} (same shapes): {base_async * 1e6:.1f} us/call back-to-back, {base_sync * 1e6:.1f} us call+sync",
        f"  difference: {(ours_async - base_async) * 1e6:.1f} us back-to-back, "
        f"{(ours_sync - base_sync) * 1e6:.1f} us call+sync",
    ]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--model" in argv:  # the training-step benchmark has its own arguments
        from benchmarks import model_step

        return model_step.main([a for a in argv if a != "--model"])
    args = _parse(argv)
    if args.list:
        for w in workloads.WORKLOADS.values():
            print(w.summary())
        for s in bench_systems.SYSTEMS.values():
            print(f"{s.name}: {s.description}")
        return 0
    # torch shares the GPU with JAX in this process (raw-cudnn): keep JAX from preallocating 75% of it.
    # Read when JAX creates its GPU client, which nothing has done yet.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    if args.workloads is None:
        # W1..W4 are GPU-sized: on a CPU one of them takes minutes per measurement.
        args.workloads = "all" if jax.default_backend() == "gpu" else "tiny"
        if args.workloads == "tiny":
            print(
                f"backend {jax.default_backend()}: benchmarking the tiny workload only "
                "(pass --workloads all for the GPU-sized W1..W4)",
                flush=True,
            )
    chosen_workloads = workloads.select(args.workloads)
    systems = bench_systems.select(args.systems)
    # Off a GPU, the GPU systems are not tried: their rows go to the CSV as skipped, and to one line of the
    # table's, not a row each.
    on_gpu = jax.default_backend() == "gpu"
    gpu_only = [] if on_gpu else [s for s in systems if not s.runs_on_cpu]
    systems = [s for s in systems if s not in gpu_only]
    settings = _settings(args)
    os.makedirs(args.out, exist_ok=True)
    header = _environment()
    print("\n".join(header), flush=True)
    rates, limit_lines = limits(settings, args.matmul_size)
    header += limit_lines
    print("\n".join(limit_lines), flush=True)

    started = time.perf_counter()
    measurements: list[Measurement] = []
    not_run = [
        row
        for w in chosen_workloads
        for s in gpu_only
        for row in rows_with_status(
            w, s.name, f"skipped: needs a GPU; JAX's backend is {jax.default_backend()!r}", DIRECTIONS, settings.methods
        )
    ]
    pairs, say = _progress([(w, s) for w in chosen_workloads for s in systems])
    for workload, system in pairs:
        if hasattr(pairs, "set_description"):
            pairs.set_description(f"{workload.name} {system.name}")
        begun = time.perf_counter()
        if args.time_budget is not None and begun - started > args.time_budget:
            rows = rows_with_status(
                workload,
                system.name,
                f"skipped: time budget of {args.time_budget:.0f} s spent",
                DIRECTIONS,
                settings.methods,
            )
        else:
            rows = _measure(system, workload, settings)
        measurements += rows
        say(_summary(rows, time.perf_counter() - begun))
        bench_report.write_csv(os.path.join(args.out, "bench.csv"), measurements + not_run, rates)  # survives a kill
    if hasattr(pairs, "close"):
        pairs.close()
    bench_report.write_csv(os.path.join(args.out, "bench.csv"), measurements + not_run, rates)

    overhead = _overhead_lines()
    plot_path = os.path.join(args.out, "bench.png")
    try:
        plot_problem = bench_report.plot(plot_path, measurements)
    except Exception as error:  # noqa: BLE001 - the table and CSV matter more than the picture
        plot_problem = error_status(error)
    text = bench_report.table(measurements, rates)
    if gpu_only:
        rows = len(chosen_workloads) * len(gpu_only) * len(settings.methods)  # one table row per method each
        text += (
            f"\nskipped on {jax.default_backend().upper()}: {rows} rows needing a GPU: "
            f"{', '.join(s.name for s in gpu_only)} (in bench.csv as skipped)"
        )
    footer = [
        f"wrote {os.path.join(args.out, 'bench.csv')}, "
        + (f"no plot ({plot_problem})" if plot_problem else plot_path)
        + f"; {time.perf_counter() - started:.0f} s"
    ]
    with open(os.path.join(args.out, "table.txt"), "w") as f:
        f.write("\n".join(header + overhead + ["", text, ""] + footer) + "\n")
    print("\n".join(overhead + footer))
    print()
    print(text, flush=True)
    return 1 if any(m.status.startswith("error") for m in measurements) else 0


if __name__ == "__main__":
    sys.exit(main())
