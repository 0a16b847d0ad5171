"""The package's architecture, held: imports run one way (tools -> library -> _cudnn -> extension)."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jax_ragged_attn"
# Entry points run a tool by design; nothing imports them.
ENTRY_POINTS = {"__main__.py", "bench.py", "selfcheck.py"}
# The library modules that sit above the cuDNN backend: _cudnn must never import them (it may import the
# leaf modules config, packing and checks).
ABOVE_CUDNN = {"api", "packed", "segments", "sharding", "xla"}


def _imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n.startswith("jax_ragged_attn")}


def _modules(folder: pathlib.Path):
    return sorted(p for p in folder.rglob("*.py"))


@pytest.mark.parametrize("path", [p for p in _modules(PACKAGE)
                                  if "tools" not in p.relative_to(PACKAGE).parts and p.name not in ENTRY_POINTS],
                         ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_library_never_imports_a_tool(path):
    tools = sorted(n for n in _imported_modules(path) if n.startswith("jax_ragged_attn.tools"))
    assert not tools, f"{path.relative_to(PACKAGE)} imports {tools}"


@pytest.mark.parametrize("path", _modules(PACKAGE / "_cudnn"), ids=lambda p: p.name)
def test_the_cudnn_backend_never_imports_the_layers_above_it(path):
    above = sorted(n for n in _imported_modules(path)
                   if n.split(".")[1:2] and n.split(".")[1] in ABOVE_CUDNN or n in {"jax_ragged_attn.ragged_attention"})
    assert not above, f"_cudnn/{path.name} imports {above}"


def test_the_checks_can_fail():
    # The AST reader sees the imports these tests look for (otherwise they would pass on anything).
    assert "jax_ragged_attn.tools.lm" in _imported_modules(PACKAGE / "__main__.py")
