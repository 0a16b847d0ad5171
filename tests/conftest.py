"""Test-session settings, applied before any test module imports jax.

`--jax-config=NAME[,NAME...]` runs the whole session (and the child processes tests start, which inherit the
environment) under the global JAX settings large codebases run with, so the library is tested the way it is
adopted, not only under JAX's defaults:

    pytest --jax-config=strict tests/test_semantics.py     # rank promotion "raise" + dtype promotion "strict"
    pytest --jax-config=x64 tests/test_semantics.py        # jax_enable_x64: jnp.array([0, 3]) is int64

The settings travel as JAX's own environment variables (read when jax is first imported, here and in every
subprocess), and are applied with jax.config.update too in case a plugin imported jax first.
"""

import faulthandler
import os
import signal
import threading

# `pytest -n 2` starts two processes; on a GPU each would otherwise preallocate 75 % of its memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _cuda_plugin_installed() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(name) for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


# Most of a CPU test's time is XLA compiling programs that then run on a few hundred rows. Two settings cut it:
# LLVM's -O0 (tests take 30-45 % less time on 2 cores) and XLA's older CPU fusion emitters, which compile in
# about half the time of the MLIR ones (test_seqused.py + test_sinks.py + test_stats_grad.py, -n 2: 118 s ->
# 65 s on top of -O0). The programs do the same operations (XLA's CPU fast-math is off at every level): at most
# rounding differs, inside the dtype's tolerances. Only where JAX runs on the CPU (no CUDA plugin installed, or
# JAX_PLATFORMS=cpu): GPU kernels keep XLA's defaults. Children inherit them (XLA_FLAGS); a setting the caller
# made is kept, and a flag this jaxlib's XLA does not know (XLA aborts on one) is left out.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def _xla_knows(*flags: str) -> bool:
    import subprocess
    import sys

    probe = "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0


if os.environ.get("JAX_PLATFORMS") == "cpu" or not _cuda_plugin_installed():
    _missing = [f for f in TEST_XLA_FLAGS if f.split("=")[0] not in os.environ.get("XLA_FLAGS", "")]
    # One probe for all of them; one per flag only where XLA refused the set.
    _known = _missing if not _missing or _xla_knows(*_missing) else [f for f in _missing if _xla_knows(f)]
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_known]).strip()

import pytest  # noqa: E402 - after the environment above, which must be set before jax is imported

# Each name: JAX's environment variables and the jax.config values they stand for.
JAX_CONFIGS = {
    "strict": {
        "JAX_NUMPY_RANK_PROMOTION": ("jax_numpy_rank_promotion", "raise"),
        "JAX_NUMPY_DTYPE_PROMOTION": ("jax_numpy_dtype_promotion", "strict"),
    },
    "x64": {"JAX_ENABLE_X64": ("jax_enable_x64", True)},
    "checks": {"JAX_ENABLE_CHECKS": ("jax_enable_checks", True)},
    "matmul_bf16": {"JAX_DEFAULT_MATMUL_PRECISION": ("jax_default_matmul_precision", "bfloat16")},
    "matmul_highest": {"JAX_DEFAULT_MATMUL_PRECISION": ("jax_default_matmul_precision", "highest")},
}


def pytest_addoption(parser):
    parser.addoption(
        "--jax-config",
        default=os.environ.get("JAX_RAGGED_ATTN_TEST_CONFIG", ""),
        help="comma-separated global JAX settings for the whole session (and its subprocesses): "
        + ", ".join(JAX_CONFIGS),
    )


def _requested(config) -> list[str]:
    names = [n.strip() for n in config.getoption("--jax-config").split(",") if n.strip()]
    unknown = [n for n in names if n not in JAX_CONFIGS]
    if unknown:
        raise pytest.UsageError(f"--jax-config: unknown {unknown}, choose from {sorted(JAX_CONFIGS)}")
    return names


def pytest_configure(config):
    names = _requested(config)
    if not names:
        return
    os.environ["JAX_RAGGED_ATTN_TEST_CONFIG"] = ",".join(names)  # pytest-xdist workers read it back
    settings = {}
    for name in names:
        for env, (option, value) in JAX_CONFIGS[name].items():
            os.environ[env] = str(value).lower() if isinstance(value, bool) else value
            settings[option] = value
    import jax

    for option, value in settings.items():
        jax.config.update(option, value)


def pytest_report_header(config):
    names = _requested(config)
    if names:
        return "jax configuration: " + ", ".join(
            f"{n} ({', '.join(f'{o}={v}' for o, v in JAX_CONFIGS[n].values())})" for n in names
        )
    return None


# A test that runs away (an endless generator, a wait on a collective that never comes) must fail with its
# name and a traceback, not use up CI's time limit in silence. The longest tests (4-device children) take a
# couple of minutes on 2 cores (test_readme, test_multiprocess: about 100 s).
TEST_TIME_LIMIT_ENV = "JAX_RAGGED_ATTN_TEST_TIME_LIMIT"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    limit = int(os.environ.get(TEST_TIME_LIMIT_ENV, "600"))
    if limit <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        faulthandler.dump_traceback(all_threads=True)
        raise TimeoutError(f"{item.nodeid} ran past {limit} s ({TEST_TIME_LIMIT_ENV}); the stacks are above")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def install_extension(monkeypatch, tmp_path):
    """install(ext): trace-time questions go to `ext` instead of the compiled extension, on device 0, with an
    autotune cache of this test's own (file and process). For tests of the Python layer's choices on a CPU."""
    from jax_ragged_attn.backends.cudnn import autotune, graphs
    from jax_ragged_attn.backends.shared import extension

    monkeypatch.setattr(graphs, "device_ordinal", lambda: 0)
    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path / "autotune.json"))
    monkeypatch.setattr(autotune, "_chosen", {})

    def install(ext):
        monkeypatch.setattr(extension, "module", lambda: ext)
        return ext

    return install
