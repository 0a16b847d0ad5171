"""`python -m benchmarks.command_buffers`: W3 timed with XLA's command buffers (CUDA graphs) off and on.

XLA_FLAGS is read once, when JAX creates its backend, so each mode runs in a subprocess of its own:

    off      --xla_gpu_enable_command_buffer=                     (command buffers disabled)
    default  no command-buffer flag: XLA's defaults (FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL, CUDNN; runs of
             fewer than 5 operations left alone)
    on       --xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1
    on+while the same plus WHILE,CONDITIONAL: the timing loop itself becomes one graph (not run by default)

Each subprocess times ragged_attention(implementation="cudnn") (the ours-hm system of the benchmark) on the
workload with bench_timing's device-side loop: forward and forward+backward, backward derived. It also
compiles with --xla_dump_to and reports, from the very executables it timed, whether each of our custom
calls ran inside a command buffer (benchmarks/capture.py says how that is read). The table
gives the times, the capture and each mode's time relative to "off". Without a GPU it says so and exits 0.

    python -m benchmarks.command_buffers   # W3, modes off,default,on (~1 min)
    python -m benchmarks.command_buffers --modes off,on+while --out $OUT/cb
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

from benchmarks import capture as command_buffers
from benchmarks.timing import Measurement, Settings, error_status, measure_jax
from jax_ragged_attn.backends.shared.extension import BACKWARD_TARGET, FORWARD_TARGET
from jax_ragged_attn.testing import workloads

# The repository root: each mode's child runs `python -m benchmarks.command_buffers` from there.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {
    "off": ("--xla_gpu_enable_command_buffer=",),
    "default": (),
    "on": ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL", "--xla_gpu_graph_min_graph_size=1"),
    "on+while": (
        "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE,CONDITIONAL",
        "--xla_gpu_graph_min_graph_size=1",
    ),
}
DEFAULT_MODES = ("off", "default", "on")
SYSTEM = "ours-hm"
# Flags this tool sets itself; an inherited value of any of them is dropped from the child's XLA_FLAGS.
_OWN_FLAGS = (
    "--xla_gpu_enable_command_buffer",
    "--xla_gpu_graph_min_graph_size",
    "--xla_dump_to",
    "--xla_dump_hlo_as_text",
    "--xla_dump_hlo_module_re",
    "--xla_dump_include_timestamp",
)
_SHORT = {FORWARD_TARGET: "forward", BACKWARD_TARGET: "backward"}
_LOOPS = {"forward": "fwd loop", "forward+backward": "fwd+bwd loop"}


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.command_buffers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workload", default="W3", help=f"one of {', '.join(workloads.WORKLOADS)} (default W3)")
    parser.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated of {', '.join(MODES)} (default {','.join(DEFAULT_MODES)}); "
        "ratios are taken against the first",
    )
    parser.add_argument("--iterations", type=int, default=10, help="timed calls per measurement (default 10)")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds allowed per mode (default 150)")
    parser.add_argument(
        "--out",
        default=os.path.join("bench_out", "command_buffers"),
        help="directory for table.txt, results.json and per-mode logs and thunk dumps",
    )
    parser.add_argument("--keep-dumps", action="store_true", help="keep every XLA dump file (in --out/<mode>/xla)")
    parser.add_argument(
        "--allow-cpu",
        action="store_true",
        help="a smoke test of this tool without a GPU: time the xla path instead (no custom calls, "
        "so nothing to capture)",
    )
    # Internal: one mode, in the subprocess whose XLA_FLAGS the parent set.
    parser.add_argument("--child", choices=tuple(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--dump-dir", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.workload not in workloads.WORKLOADS:
        parser.error(f"unknown workload {args.workload!r}; choose from {', '.join(workloads.WORKLOADS)}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        parser.error(f"unknown mode(s) {unknown or args.modes!r}; choose from {', '.join(MODES)}")
    args.modes = list(dict.fromkeys(modes))
    if args.iterations < 1:
        parser.error(f"--iterations must be >= 1, got {args.iterations}")
    return args


def child_xla_flags(inherited: str, mode: str, dump_dir: str) -> str:
    """The child's XLA_FLAGS: the inherited ones but those this tool sets, the mode's, then the dump flags."""
    kept = [
        flag for flag in inherited.split() if not any(flag == own or flag.startswith(own + "=") for own in _OWN_FLAGS)
    ]
    return " ".join([*kept, *MODES[mode], f"--xla_dump_to={dump_dir}", "--xla_dump_hlo_as_text"])


def child_environment(mode: str, dump_dir: str, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env["XLA_FLAGS"] = child_xla_flags(env.get("XLA_FLAGS", ""), mode, dump_dir)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # a cached executable would be loaded without any dump
    env.pop("JAX_RAGGED_ATTN_CHECK", None)  # guard mode adds host checks that split the command buffers
    return env


# ---- the child: one mode ----------------------------------------------------------------------------------


class _DumpWatcher:
    """bench_timing's on_compiled hook: per direction, the timed executable's HLO and its new dump files."""

    def __init__(self, dump_dir: str | None):
        self.dump_dir = dump_dir
        self.seen = self._listing()
        self.records: dict[str, tuple[str, set[str]]] = {}

    def _listing(self) -> set[str]:
        if not self.dump_dir:
            return set()
        try:
            return {n for n in os.listdir(self.dump_dir) if os.path.isfile(os.path.join(self.dump_dir, n))}
        except OSError:
            return set()

    def __call__(self, direction: str, compiled) -> None:
        try:  # never let the probe fail a timing
            hlo = compiled.as_text() or ""
        except Exception as error:  # noqa: BLE001
            hlo = f"(as_text failed: {error_status(error)})"
        current = self._listing()
        new, self.seen = current - self.seen, current
        self.records[direction] = (hlo, new)

    def _read(self, name: str | None) -> str | None:
        if name is None:
            return None
        try:
            with open(os.path.join(self.dump_dir, name)) as f:
                return f.read()
        except OSError:
            return None

    def report(self, keep_dir: str | None) -> dict:
        report = {}
        for direction, (hlo, new) in self.records.items():
            module = command_buffers.module_name(hlo)
            files = command_buffers.module_dump_files(new, module)
            if not any(files.values()) and module is not None:  # written after the hook ran: the newest of its name
                latest = command_buffers.module_dump_files(self._listing(), module)
                if any(name and f".{module}." in name for name in latest.values()):
                    files = latest
            texts = {key: self._read(name) for key, name in files.items()}
            occurrences = command_buffers.classify(
                hlo, thunk_after=texts["after"], thunk_before=texts["before"], metadata=texts["metadata"]
            )
            if keep_dir:
                for name in filter(None, files.values()):
                    shutil.copy(os.path.join(self.dump_dir, name), keep_dir)
            report[direction] = {
                "module": module,
                "files": files,
                "occurrences": [dataclasses.asdict(o) for o in occurrences],
            }
        return report


def _child(args) -> int:
    result = {"mode": args.child, "xla_flags": os.environ.get("XLA_FLAGS", ""), "status": "ok"}
    keep_dir = os.path.dirname(os.path.abspath(args.json))
    try:
        import jax

        result["jax"] = jax.__version__
        backend = jax.default_backend()
        result["device"] = str(jax.devices()[0].device_kind)
        if backend != "gpu" and not args.allow_cpu:
            result["status"] = f"skipped: needs a CUDA GPU; JAX's backend is {backend!r}"
        else:
            from benchmarks import systems as bench_systems
            from jax_ragged_attn.backends.shared import extension

            implementation = "cudnn" if backend == "gpu" else "xla"
            reason = extension.cudnn_unavailable_reason() if implementation == "cudnn" else None
            if reason is not None:
                result["status"] = f"skipped: the cuDNN path cannot run here: {reason}"
            else:
                result["implementation"] = implementation
                result["versions"] = {k: str(v) for k, v in extension.versions().items()}
                workload = workloads.WORKLOADS[args.workload]
                # ~3e13 FLOP/s on W3's short sequences picks steps for which no loop has to be rebuilt.
                settings = Settings(iterations=args.iterations, assumed_flops_per_s=3e13 if backend == "gpu" else 2e10)
                case = bench_systems._ours_case(workload, implementation=implementation)
                watcher = _DumpWatcher(args.dump_dir)
                rows = measure_jax(case, workload, SYSTEM, settings, on_compiled=watcher)
                result["rows"] = [dataclasses.asdict(m) for m in rows]
                result["capture"] = watcher.report(keep_dir)
    except Exception as error:  # noqa: BLE001 - the parent reports it
        traceback.print_exc()
        result["status"] = error_status(error)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0


# ---- the parent: every mode, then the table -----------------------------------------------------------------


def _run_mode(mode: str, args) -> dict:
    mode_dir = os.path.join(args.out, mode.replace("+", "_"))
    os.makedirs(mode_dir, exist_ok=True)
    dump_dir = os.path.join(mode_dir, "xla") if args.keep_dumps else tempfile.mkdtemp(prefix="xla_dump_")
    json_path = os.path.join(mode_dir, "result.json")
    if os.path.exists(json_path):
        os.remove(json_path)
    command = [
        sys.executable,
        "-m",
        "benchmarks.command_buffers",
        "--child",
        mode,
        "--workload",
        args.workload,
        "--iterations",
        str(args.iterations),
        "--dump-dir",
        dump_dir,
        "--json",
        json_path,
    ] + (["--allow-cpu"] if args.allow_cpu else [])
    started = time.perf_counter()
    log_path = os.path.join(mode_dir, "child.log")
    try:
        with open(log_path, "w") as log:
            completed = subprocess.run(
                command,
                env=child_environment(mode, dump_dir),
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=args.timeout,
                check=False,
                cwd=ROOT,
            )
        returncode = completed.returncode
    except subprocess.TimeoutExpired:
        returncode = None
    finally:
        if not args.keep_dumps:
            shutil.rmtree(dump_dir, ignore_errors=True)
    seconds = time.perf_counter() - started
    try:
        with open(json_path) as f:
            result = json.load(f)
    except (OSError, ValueError):
        why = f"timed out after {args.timeout:.0f} s" if returncode is None else f"exited with status {returncode}"
        result = {"mode": mode, "status": f"error: the subprocess {why} without a result (see {log_path})"}
    result["seconds"] = seconds
    result["log"] = log_path
    return result


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path) as f:
            return "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return ""


def _rows(result: dict) -> dict[str, Measurement]:
    return {r["direction"]: Measurement(**r) for r in result.get("rows", [])}


def _ms(m: Measurement | None) -> str:
    return f"{m.median_s * 1e3:.3f}" if m is not None and m.ok and m.median_s else "-"


def _capture_phrase(result: dict, direction: str) -> str:
    entry = result.get("capture", {}).get(direction)
    if entry is None:
        return "-"
    occurrences = [command_buffers.Occurrence(**o) for o in entry["occurrences"]]
    return command_buffers.summary(occurrences, _SHORT)


def report(results: list[dict], workload: workloads.Workload) -> str:
    """The text table: per mode the times, what was captured, the ratios to the first mode, then details."""
    implementation = next((r["implementation"] for r in results if r.get("implementation")), "cudnn")
    lines = [
        f"command buffers on {workload.summary()}",
        f"system: ragged_attention(implementation={implementation!r}), stats head-major; per-step device time, "
        "the median of timed calls of an N-step jitted loop (bench_timing); bwd = fwd+bwd minus fwd",
        "",
    ]
    header = ("mode", "fwd ms", "fwd+bwd ms", "bwd ms", "captured in the fwd loop", "captured in the fwd+bwd loop")
    table = [header]
    for result in results:
        rows = _rows(result)
        table.append(
            (
                result["mode"],
                _ms(rows.get("forward")),
                _ms(rows.get("forward+backward")),
                _ms(rows.get("backward")),
                _capture_phrase(result, "forward"),
                _capture_phrase(result, "forward+backward"),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        lines.append(
            "  ".join(
                cell.ljust(w) if i in (0, 4) or i == len(row) - 1 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths))
            ).rstrip()
        )

    base = _rows(results[0]) if results else {}
    if len(results) > 1:
        lines += ["", f"time relative to {results[0]['mode']} (below 1.00x: faster):"]
        for result in results[1:]:
            rows, parts = _rows(result), []
            for direction, label in (("forward", "fwd"), ("forward+backward", "fwd+bwd"), ("backward", "bwd")):
                a, b = rows.get(direction), base.get(direction)
                ok = a is not None and b is not None and a.ok and b.ok and a.median_s and b.median_s
                parts.append(f"{label} {a.median_s / b.median_s:.2f}x" if ok else f"{label} -")
            lines.append(f"  {result['mode']:<9}" + "  ".join(parts))

    lines += ["", "XLA_FLAGS per mode (no command-buffer flag: XLA's defaults):"]
    for result in results:
        flags = result.get("xla_flags") or " ".join(MODES.get(result["mode"], ()))
        flags = re.sub(r"--xla_dump_to=\S+", "--xla_dump_to=<dir>", flags)
        lines.append(f"  {result['mode']:<9}{flags}")

    lines += ["", "how the capture was read:"]
    for result in results:
        for direction, entry in result.get("capture", {}).items():
            loop = _LOOPS.get(direction, direction)
            for o in entry["occurrences"]:
                lines.append(
                    f"  {result['mode']}, {loop}: {_SHORT.get(o['target'], o['target'])} "
                    f"({o['instruction']}): {o['status']}: {o['reason']}"
                )
            if not entry["occurrences"]:
                lines.append(f"  {result['mode']}, {loop}: none of our custom calls in module {entry['module']}")

    problems = []
    for result in results:
        if result["status"] != "ok":
            problems.append(f"  {result['mode']}: {result['status']}")
        for m in _rows(result).values():
            if not m.ok:
                problems.append(f"  {result['mode']}, {m.direction}: {m.status}")
    if problems:
        lines += ["", "problems:", *problems]
    details = [f"{r['mode']} {r.get('seconds', 0):.0f} s" for r in results]
    first = next((r for r in results if r.get("jax")), {})
    lines += ["", f"jax {first.get('jax', '?')}, {first.get('device', '?')}; " + ", ".join(details)]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.child:
        return _child(args)
    workload = workloads.WORKLOADS[args.workload]
    os.makedirs(args.out, exist_ok=True)
    print(f"command buffers on {workload.summary()}: modes {', '.join(args.modes)}", flush=True)
    results = []
    for mode in args.modes:
        result = _run_mode(mode, args)
        failures = [f"{m.direction} {m.status}" for m in _rows(result).values() if m.status.startswith("error")]
        print(f"  {mode}: {'; '.join(failures) or result['status']} ({result['seconds']:.0f} s)", flush=True)
        if result["status"].startswith("skipped"):
            # No GPU or no cuDNN path: every mode would say the same.
            print(f"not measured: {result['status'].removeprefix('skipped: ')}")
            return 0
        if result["status"] != "ok" or failures or not result.get("rows"):
            tail = _tail(result["log"])
            if tail:
                print(f"  last lines of {result['log']}:\n" + "\n".join("    " + l for l in tail.splitlines()))
        results.append(result)
    text = report(results, workload)
    with open(os.path.join(args.out, "table.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print()
    print(text, flush=True)
    failed = any(
        r["status"] != "ok" or any(not m.ok and m.status.startswith("error") for m in _rows(r).values())
        for r in results
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
