"""Our handlers inside XLA's command buffers (CUDA graphs), GPU only.

XLA records custom calls into CUDA graphs by running their handlers inside a stream capture, where a cuDNN
graph cannot be built. The handlers pin the graphs their executable uses in an initialize stage that runs
outside the capture (ffi/pinned_graphs.h), so a graph the LRU evicted is never rebuilt inside one. Each check
runs tests/command_buffer_steps.py in a process of its own, since XLA reads XLA_FLAGS once.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jax_ragged_attn.backends.shared import extension

_REASON = extension.cudnn_unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=f"cuDNN path unavailable: {_REASON}")]

SCRIPT = pathlib.Path(__file__).with_name("command_buffer_steps.py")
# bfloat16 results compared with the xla path's: a few bfloat16 ulps of the largest value.
TOLERANCE = 4 * 2.0**-8
FLAGS = {
    "default": None,  # JAX's own defaults: command buffers on for custom calls in runs of 5+ operations
    "every_call": "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1",
    "loops": "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1",
}


def _run(checks: str, flags: str | None) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # The script runs from tests/: the package is found where this process found it.
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parent.parent), *filter(None, [env.get("PYTHONPATH")])])
    if flags is not None:
        env["XLA_FLAGS"] = flags
    done = subprocess.run(
        [sys.executable, str(SCRIPT), checks],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=SCRIPT.parent.parent,
    )
    assert done.returncode == 0, f"{checks} under XLA_FLAGS={flags!r} failed:\n{done.stdout}\n{done.stderr[-6000:]}"
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("mode", sorted(FLAGS))
def test_evicted_graphs_are_never_rebuilt_inside_a_capture(mode):
    (result,) = _run("evict", FLAGS[mode])
    assert result["evictions"] > 0, f"the cache of 2 graphs never evicted: the test proves nothing ({result})"
    assert result["max_relative_error"] <= TOLERANCE, result


@pytest.mark.parametrize("mode", ["default", "every_call"])
def test_threads_get_the_results_they_get_alone(mode):
    (result,) = _run("threads", FLAGS[mode])
    assert result["max_relative_error"] <= TOLERANCE, result


@pytest.mark.parametrize("mode", sorted(FLAGS))
def test_paged_decode_loop(mode):
    (result,) = _run("decode", FLAGS[mode])
    assert result["max_relative_error"] <= TOLERANCE, result
