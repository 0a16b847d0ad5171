"""The package's architecture, held: layers import only downwards, and the top level stays small.

The layers, bottom up (jax_ragged_attn/__init__.py's docstring): config and index (both ops' configs and the
index arithmetic every layer shares), features (checks, sinks, the bottom-right rewrite, overflow counts),
backends (the kernels and their registry), ops (one module per op), parallel (several devices), inputs (other
input layouts and data helpers), flax, export (jax.export of steps), testing, tools; the entry points (__init__,
__main__, bench, selfcheck) sit on top.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jax_ragged_attn"
LAYERS = ["config", "index", "features", "backends", "ops", "parallel", "inputs", "flax", "export", "testing", "tools"]
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
    above = sorted(
        name
        for name in _imported_modules(path)
        if name.count(".") >= 1 and name.split(".")[1] in LAYERS and _rank(name.split(".")[1]) > mine
    )
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

    counted = [
        e.name
        for e in PACKAGE.iterdir()
        if (e.suffix == ".py" or (e.is_dir() and (e / "__init__.py").exists())) and lines(e) > 12
    ]
    assert len(counted) <= 12, sorted(counted)


def test_the_benchmarks_stay_outside_the_wheel():
    """The harnesses live in the repository's benchmarks/, which the wheel does not ship: no module of the package
    imports them, and tools/ beyond the main job (tools/lm/) and the self-check (selfcheck*) is the small bench of
    the user's own shapes (a few hundred lines)."""
    importers = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            if any(n == "benchmarks" or n.startswith("benchmarks.") for n in names):
                importers.append(str(path.relative_to(PACKAGE)))
    assert not importers, f"these import the repository's benchmarks/, which the wheel lacks: {sorted(importers)}"
    tools = PACKAGE / "tools"
    rest = {
        str(p.relative_to(tools)): len(p.read_text().splitlines())
        for p in tools.rglob("*.py")
        if p.relative_to(tools).parts[0] != "lm" and not p.relative_to(tools).parts[0].startswith("selfcheck")
    }
    assert sum(rest.values()) <= 400, f"tools/ beyond tools/lm/ and the self-check: {sum(rest.values())} lines: {rest}"


def test_the_checks_can_fail():
    # The AST reader sees the imports these tests look for, and the rule flags an upward one.
    assert "jax_ragged_attn.tools.lm" in _imported_modules(PACKAGE / "__main__.py")
    assert _rank("backends") > _rank("features") and _rank("inputs") > _rank("ops")
    assert any("jax_ragged_attn.backends" in n for n in _imported_modules(PACKAGE / "ops" / "common.py"))


BACKENDS = PACKAGE / "backends"
FAMILIES = {"cudnn", "fa3", "xla"}
REGISTRY_MODULES = {"__init__.py", "policy.py", "tuning.py", "protocol.py"}  # the registry's own, not kernels


def _backend_part(path: pathlib.Path) -> str | None:
    """ "cudnn" / "fa3" / "xla" / "shared" for a module under backends/ (None for the registry's own)."""
    parts = path.relative_to(BACKENDS).parts
    return parts[0] if len(parts) > 1 else None


def test_backends_are_three_kernel_families_and_one_shared_folder():
    folders = {p.name for p in BACKENDS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    flat = {p.name for p in BACKENDS.glob("*.py")}
    assert folders == FAMILIES | {"shared"}, sorted(folders)
    assert flat <= REGISTRY_MODULES, f"flat kernel modules in backends/: {sorted(flat - REGISTRY_MODULES)}"
    for family in FAMILIES:
        assert {"ragged.py", "kvcache.py"} <= {p.name for p in (BACKENDS / family).glob("*.py")}, family


@pytest.mark.parametrize(
    "path", sorted(p for p in BACKENDS.rglob("*.py") if _backend_part(p)), ids=lambda p: str(p.relative_to(BACKENDS))
)
def test_families_never_import_each_other(path):
    """A family imports only itself, shared/ and the layers below; shared/ imports no family (function-local
    imports included: a lazy import is still a dependency). The registry's own modules import the families."""
    mine = _backend_part(path)
    crossing = sorted(
        name
        for name in _imported_modules(path)
        if name.startswith("jax_ragged_attn.backends.")
        and len(name.split(".")) > 3
        and name.split(".")[2] in FAMILIES
        and name.split(".")[2] != mine
    )
    assert not crossing, f"backends/{path.relative_to(BACKENDS)} imports {crossing} across families"


def _module_name(path: pathlib.Path) -> str:
    parts = ("jax_ragged_attn",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """The package modules `path` imports when it is imported (module-level statements only)."""
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n in known}


def _import_graph(imports) -> dict[str, set[str]]:
    """module -> the package modules it imports (`imports(path, known)`). A package is initialised before any
    module in it, so an edge to one's own ancestor package is no cycle."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        name: {n for n in imports(path, set(modules)) if not (name + ".").startswith(n + ".")}
        for name, path in modules.items()
    }


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done, active = set(), []

    def visit(name):
        if name in active:
            return active[active.index(name) :] + [name]
        if name in done:
            return None
        active.append(name)
        for child in sorted(graph[name]):
            cycle = visit(child)
            if cycle:
                return cycle
        active.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        cycle = visit(name)
        if cycle:
            return cycle
    return None


def test_no_import_cycles():
    cycle = _find_cycle(_import_graph(_top_level_imports))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycles_through_function_local_imports():
    """A lazy import is still a dependency: no two modules import each other (nor any longer circle), counting
    the imports inside functions too."""
    cycle = _find_cycle(_import_graph(lambda path, known: {n for n in _imported_modules(path) if n in known}))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_check_can_fail():
    assert _find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    graph = _import_graph(lambda path, known: {n for n in _imported_modules(path) if n in known})
    assert "jax_ragged_attn.index" in graph["jax_ragged_attn.ops.ragged"]


@pytest.mark.parametrize("op", ["ragged", "kvcache"])
def test_every_registered_backend_satisfies_its_protocol(op):
    from jax_ragged_attn import backends
    from jax_ragged_attn.backends.protocol import PROTOCOLS

    for name in backends.REGISTRIES[op]:
        module = backends.get(name, op)
        assert isinstance(module, PROTOCOLS[op]), f"{module.__name__} lacks part of {PROTOCOLS[op].__name__}"
        assert module.NAME == name


def test_the_family_checks_can_fail():
    assert _backend_part(BACKENDS / "fa3" / "ragged.py") == "fa3" and _backend_part(BACKENDS / "policy.py") is None
    assert "jax_ragged_attn.index.packings" in _imported_modules(BACKENDS / "cudnn" / "launch.py")
    assert not isinstance(object(), __import__("jax_ragged_attn.backends.protocol").backends.protocol.RaggedBackend)
