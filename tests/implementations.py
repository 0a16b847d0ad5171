"""The implementations a test runs on here, as pytest params: the xla path everywhere, cuDNN marked `gpu` and
skipped with its reason where it cannot run. Test modules import this module by name (tests/ is on sys.path
under pytest)."""

from __future__ import annotations

import pytest

from jax_ragged_attn.backends.shared import extension


def xla_and_cudnn() -> list:
    reason = extension.cudnn_unavailable_reason()
    cudnn_marks = [pytest.mark.gpu, pytest.mark.skipif(reason is not None, reason=f"cuDNN path unavailable: {reason}")]
    return [pytest.param("xla", id="xla"), pytest.param("cudnn", id="cudnn", marks=cudnn_marks)]
