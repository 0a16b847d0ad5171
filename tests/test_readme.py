"""The documentation's code runs as a reader would run it.

- Every ```python block of README.md runs top to bottom in ONE fresh Python process on the CPU, as if pasted
  in order into one session: a block that rebinds a name a later block reads, or that needs a setting made
  before jax is imported, fails here. A failure names the block (its number and line) and shows its traceback.
- The same for each page under docs/ that has runnable blocks, each page in a process of its own.
- examples/*.py (the several-device examples, which set XLA's flags before importing jax) run as scripts.

A ```python block that is not meant to run (a signature, an excerpt of an example script) is preceded by a
line starting `<!-- not run`. Blocks that import flax are left out when flax is not installed. Shell commands
and outputs use other fences and are not run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOC_PAGES = sorted((ROOT / "docs").glob("*.md"))
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
NOT_RUN = "<!-- not run"
# A whole page, including the process's jax import and every block's compilation, on 2 busy cores.
TIME_LIMIT_S = 400

# Runs the blocks given as JSON on stdin in one namespace, in order; stops at the first failure, naming it.
DRIVER = r"""
import json, sys, traceback
blocks = json.load(sys.stdin)
namespace = {"__name__": "__main__"}
for number, (where, code) in enumerate(blocks, 1):
    try:
        exec(compile(code, where, "exec"), namespace)
    except BaseException:
        traceback.print_exc()
        print(f"\nblock {number} of {len(blocks)} ({where}) failed; the blocks before it ran", file=sys.stderr)
        sys.exit(1)
print(f"{len(blocks)} blocks ran", file=sys.stderr)
"""


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """(line number of the fence, code, marked not-run) of every ```python block, in order."""
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        blocks.append((line, match.group(1), before.startswith(NOT_RUN)))
    return blocks


def runnable_blocks(path: pathlib.Path) -> list[tuple[str, str]]:
    """(where, code) of the blocks of `path` that run, in order."""
    has_flax = importlib.util.find_spec("flax") is not None
    name = path.relative_to(ROOT)
    return [
        (f"{name}:{line}", code)
        for line, code, skipped in python_blocks(path.read_text())
        if not skipped and (has_flax or ("import flax" not in code and "from flax" not in code))
    ]


def _cpu_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    # The test session's compile setting (tests/conftest.py) without its other flags (a forced device count).
    kept = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if flag.startswith("--xla_backend_optimization")]
    if kept:
        env["XLA_FLAGS"] = " ".join(kept)
    env["JAX_PLATFORMS"] = "cpu"  # what a reader without a GPU gets; no extra devices: the examples make theirs
    return env


def test_block_extraction_follows_the_convention():
    text = "x\n```python\na = 1\n```\n<!-- not run: why -->\n```python\nf(\n```\n```bash\nls\n```\n"
    assert python_blocks(text) == [(2, "a = 1\n", False), (6, "f(\n", True)]


def test_driver_names_the_failing_block():
    blocks = [("README.md:3", "q = 1\n"), ("README.md:9", "q = q.shape\n")]
    result = subprocess.run(
        [sys.executable, "-c", DRIVER], input=json.dumps(blocks), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert "block 2 of 2 (README.md:9) failed" in result.stderr, result.stderr


def test_readme_has_a_quickstart_first():
    text = README.read_text()
    blocks = python_blocks(text)
    assert len(blocks) >= 2 and not blocks[0][2], "README.md's first python block is the Quickstart: it must run"
    headings = re.findall(r"^## (.*)$", text.split("```python", 1)[0], flags=re.MULTILINE)
    assert headings and headings[-1].startswith("Quickstart"), headings
    assert text[: text.index("```python")].count("\n") < 40, "the Quickstart belongs on the first screen"


# The docs pages' blocks run in the slow tier, the README's in the fast tier.
@pytest.mark.parametrize(
    "page",
    [README, *(pytest.param(p, marks=pytest.mark.slow) for p in DOC_PAGES)],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_python_blocks_run_in_order_in_one_process(page):
    blocks = runnable_blocks(page)
    if not blocks:
        pytest.skip(f"{page.relative_to(ROOT)} has no runnable python block")
    result = subprocess.run(
        [sys.executable, "-c", DRIVER],
        input=json.dumps(blocks),
        capture_output=True,
        text=True,
        timeout=TIME_LIMIT_S,
        env=_cpu_env(),
        cwd=ROOT,
    )
    assert result.returncode == 0, (
        f"{page.relative_to(ROOT)}, run top to bottom in one process:\n{result.stderr[-4000:]}"
    )


@pytest.mark.slow  # 4 devices; the same calls run fast above
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_script_runs(script):
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=TIME_LIMIT_S, env=_cpu_env(), cwd=ROOT
    )
    assert result.returncode == 0, (
        f"python {script.relative_to(ROOT)}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    )
