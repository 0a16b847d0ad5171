"""Test-session settings, applied before any test module imports jax."""

import os

# `pytest -n 2` starts two processes; on a GPU each would otherwise preallocate 75 % of its memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


import pytest  # noqa: E402 - after the environment above, which must be set before jax is imported


@pytest.fixture
def install_extension(monkeypatch, tmp_path):
    """install(ext): trace-time questions go to `ext` instead of the compiled extension, on device 0, with an
    autotune cache of this test's own (file and process). For tests of the Python layer's choices on a CPU."""
    from jax_ragged_attn._cudnn import autotune, extension, graphs

    monkeypatch.setattr(graphs, "device_ordinal", lambda: 0)
    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path / "autotune.json"))
    monkeypatch.setattr(autotune, "_chosen", {})

    def install(ext):
        monkeypatch.setattr(extension, "module", lambda: ext)
        return ext

    return install
