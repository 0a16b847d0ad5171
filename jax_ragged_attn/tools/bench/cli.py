"""`python -m jax_ragged_attn.bench`: packed attention timed side by side with raw cuDNN and JAX's own paths.

For each workload (jax_ragged_attn/tools/workloads.py) and system (jax_ragged_attn/tools/bench/systems.py) it measures
forward and forward+backward on the device (a jitted loop of N steps per timed call, the median of
--iterations calls) and derives backward as their difference. It reports useful TFLOP/s over real tokens,
the time relative to raw cuDNN, cuDNN's workspace and the step's device memory, then the host overhead of
one cached call. A system that cannot run prints "skipped: <reason>", one that fails "error: <message>";
the others still run. Writes bench.csv, bench.png and table.txt into --out; the table is printed last.

  python -m jax_ragged_attn.bench                                   # every workload and system
  python -m jax_ragged_attn.bench --workloads W3 --systems xla --quick   # a CPU smoke run

XLA's command buffers (CUDA graphs) off and on, and whether our custom calls are captured:
python -m jax_ragged_attn.tools.bench.command_buffers (jax_ragged_attn/tools/bench/capture.py explains how it is read).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import jax

from jax_ragged_attn._cudnn import extension
from jax_ragged_attn.tools import workloads
from jax_ragged_attn.tools.bench import report as bench_report, systems as bench_systems
from jax_ragged_attn.tools.bench.timing import Measurement, Settings, error_status, host_overhead, rows_with_status
from jax_ragged_attn.tools.workloads import DIRECTIONS


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m jax_ragged_attn.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="all",
                        help="comma-separated: W1, W2, W3, W4 (= W4-d64,W4-d256,W4-noncausal), tiny, or all "
                             "(default: all but tiny)")
    parser.add_argument("--systems", default="all", help=f"comma-separated of {', '.join(bench_systems.SYSTEMS)}, "
                                                         "or all (default)")
    parser.add_argument("--iterations", type=int, default=None,
                        help="timed calls per measurement, median reported (default 20; 2 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: one warm-up and 2 timed calls of at most 5 steps per measurement")
    parser.add_argument("--out", default="bench_out", help="directory for bench.csv, bench.png, table.txt")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="skip measurements not started within this many seconds, so the run still ends "
                             "with its table and files")
    parser.add_argument("--list", action="store_true", help="list workloads and systems, then exit")
    args = parser.parse_args(argv)
    if args.iterations is not None and args.iterations < 1:
        parser.error(f"--iterations must be >= 1, got {args.iterations}")
    return args


def _settings(args) -> Settings:
    # The step count per timed call comes from a FLOP-rate guess; a wrong guess only costs a recompile.
    rate = 3e14 if jax.default_backend() == "gpu" else 2e10
    if args.quick:
        return Settings(iterations=args.iterations or 2, target_call_s=0.002, max_steps=5, warmup_calls=1,
                        assumed_flops_per_s=rate)
    return Settings(iterations=args.iterations or 20, assumed_flops_per_s=rate)


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
        parts = [f"{m.direction} {m.median_s * 1e3:.3f} ms ({bench_report.format_tflops(m.tflops)} TFLOP/s)" if m.tflops is not None
                 else f"{m.direction} {m.status}" for m in rows]
    text = f"{rows[0].workload} {rows[0].system} ({seconds:.1f} s): " + ", ".join(parts)
    return text if len(text) <= 400 else text[:397] + "..."


def _measure(system, workload, settings) -> list[Measurement]:
    reason = system.unavailable() or system.unsupported(workload)
    if reason:
        return rows_with_status(workload, system.name, f"skipped: {reason}", DIRECTIONS)
    try:
        return system.measure(workload, settings)
    except Exception as error:  # noqa: BLE001 - one failing system must not stop the others
        traceback.print_exc(file=sys.stderr)  # the rows keep the message; stderr keeps where it came from
        return rows_with_status(workload, system.name, error_status(error), DIRECTIONS)


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
    chosen_workloads = workloads.select(args.workloads)
    systems = bench_systems.select(args.systems)
    settings = _settings(args)
    os.makedirs(args.out, exist_ok=True)
    header = _environment()
    print("\n".join(header), flush=True)

    started = time.perf_counter()
    measurements: list[Measurement] = []
    pairs, say = _progress([(w, s) for w in chosen_workloads for s in systems])
    for workload, system in pairs:
        if hasattr(pairs, "set_description"):
            pairs.set_description(f"{workload.name} {system.name}")
        begun = time.perf_counter()
        if args.time_budget is not None and begun - started > args.time_budget:
            rows = rows_with_status(workload, system.name,
                                    f"skipped: time budget of {args.time_budget:.0f} s spent", DIRECTIONS)
        else:
            rows = _measure(system, workload, settings)
        measurements += rows
        say(_summary(rows, time.perf_counter() - begun))
        bench_report.write_csv(os.path.join(args.out, "bench.csv"), measurements)  # partial results survive a kill
    if hasattr(pairs, "close"):
        pairs.close()

    overhead = _overhead_lines()
    plot_path = os.path.join(args.out, "bench.png")
    try:
        plot_problem = bench_report.plot(plot_path, measurements)
    except Exception as error:  # noqa: BLE001 - the table and CSV matter more than the picture
        plot_problem = error_status(error)
    text = bench_report.table(measurements)
    footer = [f"wrote {os.path.join(args.out, 'bench.csv')}, "
              + (f"no plot ({plot_problem})" if plot_problem else plot_path)
              + f"; {time.perf_counter() - started:.0f} s"]
    with open(os.path.join(args.out, "table.txt"), "w") as f:
        f.write("\n".join(header + overhead + ["", text, ""] + footer) + "\n")
    print("\n".join(overhead + footer))
    print()
    print(text, flush=True)
    return 1 if any(m.status.startswith("error") for m in measurements) else 0


if __name__ == "__main__":
    sys.exit(main())
