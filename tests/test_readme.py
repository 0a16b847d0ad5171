"""Every ```python block of README.md runs as written on a CPU.

Convention: the first ```python block (the Quickstart) is the prelude of every later block, which runs after
it, as a reader would after the Quickstart; each block runs in its own subprocess on the CPU with 4 host
devices (JAX_PLATFORMS=cpu, XLA_FLAGS=--xla_force_host_platform_device_count=4, for the sharding examples)
and a time limit. A ```python block that is not meant to run (a signature, an excerpt) is preceded by the
line `<!-- not run -->`. Blocks that import flax skip when flax is not installed. Shell commands and
outputs use other fences and are not run.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
NOT_RUN = "<!-- not run -->"
# Per block, including the subprocess's jax import and the prelude's compilation.
TIME_LIMIT_S = 120


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """(line number of the fence, code, marked not-run) of every ```python block, in order."""
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        blocks.append((line, match.group(1), before == NOT_RUN))
    return blocks


def test_block_extraction_follows_the_convention():
    text = "x\n```python\na = 1\n```\n<!-- not run -->\n```python\nf(\n```\n```bash\nls\n```\n"
    assert python_blocks(text) == [(2, "a = 1\n", False), (6, "f(\n", True)]


def _run(code: str, cache: pathlib.Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
               # One compilation cache for all blocks: the prelude's compilations are paid once, not per block.
               JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIME_LIMIT_S,
                          env=env, cwd=README.parent)


def test_readme_python_blocks_run_on_cpu(tmp_path):
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 2, "README.md should hold the Quickstart and more python blocks"
    (_, prelude, prelude_skipped), rest = blocks[0], blocks[1:]
    assert not prelude_skipped, "the Quickstart is the prelude of every block: it must run"
    has_flax = importlib.util.find_spec("flax") is not None
    runnable = [(line, code) for line, code, skipped in rest
                if not skipped and (has_flax or "import flax" not in code and "from flax" not in code)]
    first = _run(prelude, tmp_path)  # alone, so that it fills the compilation cache before the others read it
    assert first.returncode == 0, f"README.md:{blocks[0][0]} (the Quickstart):\n{first.stderr[-3000:]}"
    # The longest (sharding: most compilation) first, then two at a time: mostly compilation, one core each.
    programs = sorted(((line, prelude + "\n" + code) for line, code in runnable),
                      key=lambda program: "make_mesh" not in program[1])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda program: _run(program[1], tmp_path), programs))
    failures = [f"README.md:{line}:\n{result.stderr[-3000:]}"
                for (line, _), result in zip(programs, results) if result.returncode != 0]
    assert not failures, "\n\n".join(failures)
