"""Tests that need several devices on a CPU: the checks run in a child process started with virtual CPU
devices (XLA's device count is fixed when a process first uses JAX, so the parent cannot grow its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback


def report_checks(cases: dict, run) -> None:
    """In the child: run(index, name, case) for every case, printing one JSON line each - {"check": name,
    "ok": true, **what run returned} or {"check": name, "ok": false, "detail": traceback} - and carrying on
    after a failure, so the parent reports them all."""
    for index, (name, case) in enumerate(cases.items()):
        try:
            extra = run(index, name, case) or {}
            print(json.dumps({"check": name, "ok": True, **extra}), flush=True)
        except Exception:  # noqa: BLE001  report every failure, keep checking the rest
            print(json.dumps({"check": name, "ok": False, "detail": traceback.format_exc()}), flush=True)


def run_checks_in_child(path: str, cases: dict, *, devices: int = 4, timeout: float = 600) -> dict:
    """Runs `python path` (whose __main__ calls report_checks) on `devices` virtual CPU devices; fails unless
    it exits 0 and reports every case in `cases` as passed. Returns {name: record}."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip(),
    )
    run = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, timeout=timeout)
    results = {}
    for line in run.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            results[record["check"]] = record
    assert run.returncode == 0, f"child exited {run.returncode}:\n{run.stdout}\n{run.stderr[-4000:]}"
    assert sorted(results) == sorted(cases), f"the child reported {sorted(results)}, expected {sorted(cases)}"
    failed = [f"--- {name}:\n{record['detail']}" for name, record in results.items() if not record["ok"]]
    assert not failed, "\n".join(failed)
    return results


def cudnn_gpus(count: int) -> list:
    """The first `count` GPUs for a multi-GPU cuDNN test; skips (pytest.skip, with the reason) when the cuDNN
    path cannot run here or the host has fewer GPUs."""
    import jax
    import pytest

    from jax_ragged_attn.backends.shared import extension

    reason = extension.cudnn_unavailable_reason()
    if reason is not None:
        pytest.skip(f"cuDNN path unavailable: {reason}")
    gpus = jax.devices("gpu")
    if len(gpus) < count:
        pytest.skip(f"needs {count} GPUs, this host has {len(gpus)}")
    return gpus[:count]
