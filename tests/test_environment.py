"""Every environment variable the package reads is documented in docs/ENVIRONMENT.md, and every variable documented
there is read: the Python package's os.environ / os.getenv reads (jax_ragged_attn/**/*.py) and the extension's
getenv calls (ffi/). A read whose name the scan cannot resolve to a string fails too, so no read hides."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jax_ragged_attn"
FFI = ROOT / "ffi"
DOC = ROOT / "docs" / "ENVIRONMENT.md"
READS = ("get", "setdefault", "pop", "__getitem__", "__contains__")  # environ methods that read a name


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _is_getenv(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "getenv") or (
        isinstance(node, ast.Name) and node.id == "getenv"
    )


def python_reads(source: str, where: str) -> set[str]:
    """The names a module's source reads from the environment; a read of an unresolvable name raises."""
    tree = ast.parse(source, where)
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for target in node.targets
        if isinstance(target, ast.Name)
    }

    def name_of(node: ast.AST, line: int) -> str:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name) and node.id in constants:
            return constants[node.id]
        raise AssertionError(
            f"{where}:{line}: an environment read whose name the scan cannot resolve "
            f"({ast.unparse(node)}); use a string literal or a module-level constant"
        )

    names, seen = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_getenv(node.func) and node.args:  # os.getenv(NAME)
            names.add(name_of(node.args[0], node.lineno))
            seen.add(id(node.func))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and _is_environ(node.func.value)
            and node.func.attr in READS
            and node.args
        ):  # os.environ.get(NAME), .setdefault, .pop
            names.add(name_of(node.args[0], node.lineno))
            seen.add(id(node.func.value))
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):  # os.environ[NAME]
            names.add(name_of(node.slice, node.lineno))
            seen.add(id(node.value))
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):  # NAME in os.environ
            names.add(name_of(node.left, node.lineno))
            seen.update(id(c) for c in node.comparators)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "dict"
            and (node.args and _is_environ(node.args[0]))
        ):  # dict(os.environ, ...): a copy for a child process
            seen.add(id(node.args[0]))
    for node in ast.walk(tree):  # any other use of os.environ could read a name the patterns above miss
        if (
            _is_environ(node)
            and id(node) not in seen
            and not (isinstance(node, ast.Name) and isinstance(getattr(node, "ctx", None), ast.Store))
        ):
            if isinstance(node, ast.Attribute) and not (isinstance(node.value, ast.Name) and node.value.id == "os"):
                continue  # some other object's .environ
            raise AssertionError(
                f"{where}:{node.lineno}: a use of os.environ the scan does not read: {ast.unparse(node)}"
            )
    return names


def cpp_reads(source: str, where: str) -> set[str]:
    calls = re.findall(r"\bgetenv\s*\(([^)]*)\)", source)
    for argument in calls:
        assert re.fullmatch(r'\s*"[^"]+"\s*', argument), f"{where}: getenv({argument}) is not a string literal"
    return {argument.strip().strip('"') for argument in calls}


def read_by_the_package() -> dict[str, list[str]]:
    """name -> the files that read it."""
    reads: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in python_reads(path.read_text(), str(path.relative_to(ROOT))):
            reads.setdefault(name, []).append(str(path.relative_to(ROOT)))
    for path in sorted(p for p in FFI.rglob("*") if p.suffix in (".cc", ".h", ".cu", ".cuh")):
        for name in cpp_reads(path.read_text(), str(path.relative_to(ROOT))):
            reads.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return reads


def documented() -> set[str]:
    """The names in the first column of docs/ENVIRONMENT.md's table under "## Variables"."""
    text = DOC.read_text()
    section = text.split("\n## Variables", 1)[1].split("\n## ", 1)[0]
    return {m.group(1) for m in re.finditer(r"^\|\s*`([A-Za-z_][A-Za-z0-9_]*)`\s*\|", section, re.MULTILINE)}


def test_every_variable_read_is_documented():
    reads = read_by_the_package()
    missing = {name: files for name, files in reads.items() if name not in documented()}
    assert not missing, f"read but not in docs/ENVIRONMENT.md's table: {missing}"


def test_every_documented_variable_is_read():
    stale = documented() - set(read_by_the_package())
    assert not stale, f"in docs/ENVIRONMENT.md's table but read nowhere: {sorted(stale)}"


def test_the_scan_finds_each_kind_of_read():
    source = """
import os
from os import environ, getenv
ENV = "A_CONSTANT"
os.environ.get(ENV, "")
os.environ["B_SUBSCRIPT"]
"C_IN" in os.environ
os.getenv("D_GETENV")
environ.setdefault("E_SETDEFAULT", "1")
getenv("F_BARE")
env = dict(os.environ, CHILD="1")
"""
    assert python_reads(source, "t.py") == {"A_CONSTANT", "B_SUBSCRIPT", "C_IN", "D_GETENV", "E_SETDEFAULT", "F_BARE"}
    for hidden in ("os.environ.get(name)", "os.environ.keys()", "os.getenv(prefix + 'X')"):
        try:
            python_reads(f"import os\n{hidden}\n", "t.py")
        except AssertionError:
            continue
        raise AssertionError(f"the scan missed {hidden}")
    assert cpp_reads('if (std::getenv("G_CPP") != nullptr) setenv("H", "1", 0);', "t.cc") == {"G_CPP"}
    assert "JAX_RAGGED_ATTN_CHECK" in read_by_the_package() and "JAX_RAGGED_ATTN_CHECK" in documented()
