"""The package's architecture, held: layers import only downwards, and the top level stays small.

The layers, bottom up (jax_ragged_attn/__init__.py's docstring): config and index (what every layer shares),
features (checks, sinks, the bottom-right rewrite, overflow counts), backends (the kernels and their
registry), api (the entry point), parallel (several devices), inputs (other input layouts and data helpers),
flax, testing, tools; the entry points (__init__, __main__, bench, selfcheck) sit on top.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jax_ragged_attn"
LAYERS = ["config", "index", "features", "backends", "api", "parallel", "inputs", "flax", "testing", "tools"]
SHARED = {"config", "index"}  # one layer: neither imports the other's layer above it
ENTRY_POINTS = {"__init__", "__main__", "bench", "selfcheck"}


def _rank(top: str) -> int:
    return 0 if top in SHARED else LAYERS.index(top)


def _imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n.startswith("jax_ragged_attn")}


def _top(path: pathlib.Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def _library_modules():
    return sorted(p for p in PACKAGE.rglob("*.py") if _top(p) not in ENTRY_POINTS)


@pytest.mark.parametrize("path", _library_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_downwards(path):
    mine = _rank(_top(path))
    above = sorted(name for name in _imported_modules(path)
                   if name.count(".") >= 1 and name.split(".")[1] in LAYERS and _rank(name.split(".")[1]) > mine)
    assert not above, f"{path.relative_to(PACKAGE)} (layer {_top(path)}) imports {above}, a layer above it"


def test_every_top_level_module_has_a_layer():
    tops = {_top(p) for p in PACKAGE.rglob("*.py")}
    assert tops <= set(LAYERS) | ENTRY_POINTS, sorted(tops - set(LAYERS) - ENTRY_POINTS)


def test_at_most_twelve_top_level_modules():
    """Modules and packages at the top level over 12 lines (the short aliases bench / selfcheck / __main__
    are not counted)."""
    def lines(entry: pathlib.Path) -> int:
        files = [entry] if entry.is_file() else list(entry.rglob("*.py"))
        return sum(len(f.read_text().splitlines()) for f in files)

    counted = [e.name for e in PACKAGE.iterdir()
               if (e.suffix == ".py" or (e.is_dir() and (e / "__init__.py").exists())) and lines(e) > 12]
    assert len(counted) <= 12, sorted(counted)


def test_the_checks_can_fail():
    # The AST reader sees the imports these tests look for, and the rule flags an upward one.
    assert "jax_ragged_attn.tools.lm" in _imported_modules(PACKAGE / "__main__.py")
    assert _rank("backends") > _rank("features") and _rank("inputs") > _rank("api")
    assert any("jax_ragged_attn.backends" in n for n in _imported_modules(PACKAGE / "api.py"))


@pytest.mark.parametrize("old, new", [("jax_ragged_attn.packed", "jax_ragged_attn.inputs.packed"),
                                      ("jax_ragged_attn._cudnn.launch", "jax_ragged_attn.backends.cudnn.launch"),
                                      ("jax_ragged_attn._cudnn.packings", "jax_ragged_attn.backends.packings"),
                                      ("jax_ragged_attn.packing", "jax_ragged_attn.index"),
                                      ("jax_ragged_attn.sharding", "jax_ragged_attn.parallel.sharding")])
def test_old_import_paths_resolve_to_the_moved_modules(old, new):
    import importlib

    moved = importlib.import_module(old)
    assert moved is importlib.import_module(new)
    assert moved.__spec__.name == new, "the module keeps its own spec"


def test_moved_modules_are_attributes_of_the_package():
    import jax_ragged_attn

    assert jax_ragged_attn.checks.RaggedAttentionInputError.__module__ == "jax_ragged_attn.features.checks"
