"""The benchmark's outputs: a text table, a CSV with every field, and a bar plot of TFLOP/s.

`limits` (method -> FLOP/s of a dense bf16 matmul timed in the same run by that method) gives the "of limit"
column: useful TFLOP/s over what the device's matmul units reached, the fraction of the limit.
"""

from __future__ import annotations

import csv
import os

from benchmarks.cudnn_raw import PADDED_SYSTEM as RAW_PADDED_SYSTEM
from benchmarks.cudnn_raw import SYSTEM as RAW_SYSTEM
from benchmarks.timing import Measurement
from jax_ragged_attn.testing.workloads import DIRECTIONS

_SHORT = {"forward": "fwd", "backward": "bwd", "forward+backward": "fwd+bwd"}


# The alternatives a user has (the target: ours <= 1.02x the fastest of them): raw cuDNN ragged, with
# either backward layout, and jax.nn.dot_product_attention on the padded batch.
BEST_OF = (RAW_SYSTEM, RAW_PADDED_SYSTEM, "jax-padded")


def _ratios(measurements: list[Measurement], systems) -> dict[int, float]:
    """id(row) -> its time over the fastest of `systems` on the same workload, direction and method."""
    best = {}
    for m in measurements:
        if m.system in systems and m.ok and m.median_s:
            key = (m.workload, m.direction, m.method)
            best[key] = min(best.get(key, m.median_s), m.median_s)
    return {
        id(m): m.median_s / best[(m.workload, m.direction, m.method)]
        for m in measurements
        if m.ok and (m.workload, m.direction, m.method) in best
    }


def ratios_to_raw(measurements: list[Measurement]) -> dict[int, float]:
    """id(row) -> its time over raw cuDNN's (the faster backward layout) on the same workload, direction and
    method (1.10 = 10% slower)."""
    return _ratios(measurements, (RAW_SYSTEM, RAW_PADDED_SYSTEM))


def ratios_to_best(measurements: list[Measurement]) -> dict[int, float]:
    """id(row) -> its time over the fastest alternative (BEST_OF) on the same workload, direction and method."""
    return _ratios(measurements, BEST_OF)


def fraction_of_limit(m: Measurement, limits: dict[str, float] | None) -> float | None:
    """Useful FLOP/s over the dense matmul rate measured by the same method, or None."""
    rate = (limits or {}).get(m.method)
    return m.tflops * 1e12 / rate if m.tflops is not None and rate else None


def format_fraction(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:.0%}" if fraction >= 0.01 else f"{fraction:.1g}"


def format_tflops(tflops: float) -> str:
    return f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.2g}"  # CPU smoke runs reach only GFLOP/s


def _megabytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f} MB"


def _status(m: Measurement, width: int = 110) -> str:
    text = m.status
    if m.ok:
        flags = [part.strip() for part in m.note.split(";") if "WARNING" in part]
        if m.loop_copy_bytes:
            flags.append(f"XLA copies {_megabytes(m.loop_copy_bytes)} per step in the loop")
        text = "; ".join(["ok", *flags])
    return text if len(text) <= width else text[: width - 3] + "..."


def _collapsed(measurements: list[Measurement]) -> list[tuple[Measurement, str]]:
    """(row, direction label): a system's three rows sharing one skip or error reason become one "all" row."""
    rows, i = [], 0
    while i < len(measurements):
        first = measurements[i]
        group = [
            m
            for m in measurements[i : i + len(DIRECTIONS)]
            if (m.workload, m.system, m.method) == (first.workload, first.system, first.method)
        ]
        if len(group) == len(DIRECTIONS) and not group[0].ok and len({m.status for m in group}) == 1:
            rows.append((group[0], "all"))
            i += len(group)
        else:
            rows.append((measurements[i], _SHORT.get(measurements[i].direction, measurements[i].direction)))
            i += 1
    return rows


def table(measurements: list[Measurement], limits: dict[str, float] | None = None) -> str:
    """One line per measurement in the order measured (one per system where all its rows share a reason)."""
    ratio, best = ratios_to_raw(measurements), ratios_to_best(measurements)
    header = (
        "workload",
        "system",
        "method",
        "dir",
        "ms",
        "TFLOP/s",
        "of limit",
        "t/t_raw",
        "t/t_best",
        "workspace",
        "device mem",
        "status",
    )
    lines = [header]
    for m, direction in _collapsed(measurements):
        lines.append(
            (
                m.workload,
                m.system,
                m.method,
                direction,
                "-" if m.median_s is None else f"{m.median_s * 1e3:.3f}",
                "-" if m.tflops is None else format_tflops(m.tflops),
                format_fraction(fraction_of_limit(m, limits)),
                f"{ratio[id(m)]:.2f}x" if id(m) in ratio else "-",
                f"{best[id(m)]:.2f}x" if id(m) in best else "-",
                _megabytes(m.workspace_bytes),
                _megabytes(m.peak_bytes),
                _status(m),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    right = {4, 5, 6, 7, 8, 9, 10}
    return "\n".join(
        "  ".join(cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths)))
        + "  "
        + line[-1]
        for line in lines
    )


CSV_FIELDS = (
    "workload",
    "system",
    "method",
    "direction",
    "status",
    "median_ms",
    "min_ms",
    "max_ms",
    "iterations",
    "steps",
    "gflop",
    "tflops",
    "fraction_of_limit",
    "time_vs_raw",
    "time_vs_best",
    "workspace_bytes",
    "device_bytes",
    "loop_copy_bytes",
    "note",
)


def write_csv(path: str, measurements: list[Measurement], limits: dict[str, float] | None = None) -> None:
    ratio, best = ratios_to_raw(measurements), ratios_to_best(measurements)

    def ms(seconds):
        return "" if seconds is None else f"{seconds * 1e3:.6f}"

    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_FIELDS)
        for m in measurements:
            fraction = fraction_of_limit(m, limits)
            writer.writerow(
                (
                    m.workload,
                    m.system,
                    m.method,
                    m.direction,
                    m.status,
                    ms(m.median_s),
                    ms(m.min_s),
                    ms(m.max_s),
                    m.iterations,
                    m.steps,
                    f"{m.flops / 1e9:.3f}",
                    "" if m.tflops is None else f"{m.tflops:.2f}",
                    "" if fraction is None else f"{fraction:.4f}",
                    f"{ratio[id(m)]:.4f}" if id(m) in ratio else "",
                    f"{best[id(m)]:.4f}" if id(m) in best else "",
                    "" if m.workspace_bytes is None else m.workspace_bytes,
                    "" if m.peak_bytes is None else m.peak_bytes,
                    "" if m.loop_copy_bytes is None else m.loop_copy_bytes,
                    m.note,
                )
            )


def plot(path: str, measurements: list[Measurement]) -> str | None:
    """Bars of TFLOP/s, one panel per direction; returns why no plot was written, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: the GPU host has no display
        import matplotlib.pyplot as plt
    except ImportError as error:
        return f"matplotlib is not importable ({error})"
    workloads = list(dict.fromkeys(m.workload for m in measurements))
    methods = {m.method for m in measurements}

    def label(m: Measurement) -> str:
        return m.system if len(methods) == 1 else f"{m.system} ({m.method})"

    systems = list(dict.fromkeys(label(m) for m in measurements if m.tflops is not None))
    found = {(m.workload, label(m), m.direction): m.tflops for m in measurements}
    width = 0.8 / max(len(systems), 1)
    figure, axes = plt.subplots(
        len(DIRECTIONS),
        1,
        figsize=(max(7, 1.3 * len(workloads) * max(len(systems), 2) / 2), 3.2 * len(DIRECTIONS)),
        squeeze=False,
    )
    for axis, direction in zip(axes[:, 0], DIRECTIONS):
        for j, system in enumerate(systems):
            xs = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(workloads))]
            heights = [found.get((w, system, direction)) or 0.0 for w in workloads]  # skipped or failed: no bar
            axis.bar(xs, heights, width, label=system)
        axis.set_xticks(range(len(workloads)), workloads)
        axis.set_ylabel("useful TFLOP/s")
        axis.set_title(direction)
        axis.grid(axis="y", alpha=0.3)
    figure.legend(*axes[0, 0].get_legend_handles_labels(), loc="upper center", ncol=max(len(systems), 1))
    figure.tight_layout(rect=(0, 0, 1, 0.96))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return None
