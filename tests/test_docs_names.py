"""Every file path and dotted name that the docs, the package's comments and the tests' mention exists.

Sources read: README.md, docs/*.md, and the comments, docstrings and prose strings of the package's and the
tests' .py files (tokenize; code is held by the imports themselves).

What counts as a mention, and where it must resolve:

- a path with a folder, `backends/cudnn/launch.py`, `tests/test_x.py`, `ffi/x.cc`, `tools/lm/` (a trailing
  slash names a folder): it resolves against the mentioning file's folder or any folder above it up to the
  repository root, the package folder, or the package's backends/ folder (so `cudnn/extents.py` and
  `shared/stats_grad.py` resolve from anywhere, `lm/training.py` from tools/). One of them must hold it.
- a bare file name, `_fa3.py`, `graph_build.cc`: some file of that name exists in the repository.
- a dotted name `jax_ragged_attn.x.y[.attr]`: the longest prefix that is a module imports, and the rest are
  attributes of it; `benchmarks.x` (`python -m benchmarks.x`): benchmarks/x.py or the package benchmarks/x/.

Left out: URLs, absolute paths (/usr/local/cuda/include), other projects' files (FOREIGN below, each named
with its project), what the tools write (OUTPUTS), file types this repository has none of (.cpp, .so), and
C++ symbols (no file suffix).
A mention that resolves nowhere fails with file:line.
"""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jax_ragged_attn"
SUFFIXES = ("py", "sh", "md", "cc", "h", "cu", "inc", "toml", "csv", "png", "json", "txt")

# Other projects' files these pages name, never this repository's: each with its project.
FOREIGN = {
    "cudnn.h": "cuDNN's header",
    "dew_flash_attn/__init__.py": "dew-flash-attn's Python wrapper",
    "conditional_thunk.cc": "XLA's conditional",
    "flash_attn_interface.py": "flash-attn's Python interface",
    "thunk_sequence.txt": "XLA's thunk dump",
    "bench_timing.py": "the source file named inside a captured HLO dump (tests/test_bench.py)",
}
# What the tools and builds write (.gitignore keeps them out of the repository).
OUTPUTS = {"dist/", "bench_out/", "lm_loss.png", "demo_loss.png", "bench.csv", "bench.png", "table.txt"}

_URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+")
_SUFFIX = "|".join(SUFFIXES)
_FOLDER = r"(?:[\w-][\w.-]*/)+"
# A path with a folder: a file with a suffix, a folder (trailing slash), or a module and one of its names
# (`cudnn/launch.attention`); or a bare file name with a suffix. Never part of a longer token: not after a
# word character, a dot, a slash (absolute paths, the tails of longer ones), `~`, `$` or `%`; a folder is
# followed by a space or punctuation (not `T/(2n)`).
_PATH = re.compile(
    rf"(?<![\w./~$%-])("
    rf"{_FOLDER}[\w.-]*\.(?:{_SUFFIX})(?![\w-])"
    rf"|{_FOLDER}(?=[\s`'\"),;:]|\.\s|\.?$)"
    rf"|{_FOLDER}\w+\.[A-Za-z_]\w*(?![\w/-])"
    rf"|[\w-][\w.-]*\.(?:{_SUFFIX})(?![\w/-]))"
)
_DOTTED = re.compile(r"(?<![\w./])((?:jax_ragged_attn|benchmarks)(?:\.[A-Za-z_]\w*)+)")
_FILE = re.compile(rf".*\.(?:{_SUFFIX})")
# Suffixes of files this repository holds none of: `folder/name.so` is a file, not a module and its attribute.
_OTHER_FILE = re.compile(r".*\.(?:so|whl|gz|zip|log|cpp|hpp|cuh|c|o|a|ptx|cubin|lock|ya?ml|html|pdf|svg|rst|bzl)")


def _blank_urls(text: str) -> str:
    return _URL.sub(lambda m: " " * len(m.group()), text)


def mentions(text: str, aliases: dict[str, str] | None = None) -> list[tuple[int, str]]:
    """(line, name) of every path and dotted name in `text`, URLs left out. `aliases` (name -> module, the
    module names a Python file imports) turns `alias.attr` into `module.attr`."""
    found = []
    alias = re.compile(rf"(?<![\w.])({'|'.join(map(re.escape, aliases))})((?:\.[A-Za-z_]\w*)+)") if aliases else None
    for number, line in enumerate(_blank_urls(text).splitlines(), 1):
        for match in _PATH.finditer(line):
            if not match.group(1).startswith(("jax_ragged_attn.", "benchmarks.")):
                found.append((number, match.group(1)))
        found += [(number, m.group(1)) for m in _DOTTED.finditer(line) if not _FILE.fullmatch(m.group(1))]
        if alias is not None:
            found += [
                (number, aliases[m.group(1)] + m.group(2))
                for m in alias.finditer(line)
                if not _FILE.fullmatch(m.group())
            ]
    return found


def python_text(source: str) -> str:
    """The comments, docstrings and prose strings (those holding a space: a string without one is a value
    the code uses, such as a file name) of a Python source, each at its own line, the rest blanked."""
    lines = [""] * (source.count("\n") + 2)
    kinds = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in kinds and (token.type == tokenize.COMMENT or re.search(r"\s", token.string)):
            for offset, part in enumerate(token.string.split("\n")):
                lines[token.start[0] - 1 + offset] += " " + part
    return "\n".join(lines)


def _is_module(name: str) -> bool:
    path = ROOT / Path(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def module_aliases(source: str) -> dict[str, str]:
    """name -> module for every module of this repository a Python source imports under a name of its own
    (`from jax_ragged_attn.backends.xla import memory as xla_memory`)."""
    aliases = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for name in node.names:
                if _is_module(f"{node.module}.{name.name}"):
                    aliases[name.asname or name.name] = f"{node.module}.{name.name}"
        elif isinstance(node, ast.Import):
            aliases.update({n.asname: n.name for n in node.names if n.asname and _is_module(n.name)})
    return aliases


_NAMES: set[str] = set()


def _files_named() -> set[str]:
    if not _NAMES:
        for path in ROOT.rglob("*"):
            if not any(
                part.startswith(".") or part in ("build", "__pycache__") for part in path.relative_to(ROOT).parts
            ):
                _NAMES.add(path.name)
    return _NAMES


def _bases(source: Path) -> list[Path]:
    """Where a path with a folder may resolve: the mentioning file's folder and those above it up to the
    repository root, the package folder and its backends/."""
    folders = [folder for folder in (source.parent, *source.parent.parents) if folder == ROOT or ROOT in folder.parents]
    return folders + [PACKAGE, PACKAGE / "backends"]


def _resolve_dotted(name: str) -> str | None:
    """None where `name` exists (its longest module prefix imports and the rest are attributes), else why."""
    parts = name.split(".")
    if parts[0] == "benchmarks":  # scripts run as `python -m benchmarks.x`: the file is enough
        return None if _is_module(".".join(parts[:2])) else f"no module {'.'.join(parts[:2])}"
    for end in range(len(parts), 0, -1):
        module = ".".join(parts[:end])
        if not _is_module(module):
            continue
        try:
            value = importlib.import_module(module)
        except ImportError as error:
            return f"importing {module} failed: {error}"
        for attribute in parts[end:]:
            if not hasattr(value, attribute):
                return f"{module} has no {'.'.join(parts[end:])}"
            value = getattr(value, attribute)
        return None
    return f"no module {parts[0]}"


def _resolve_path(name: str, source: Path) -> str | None:
    """None where the path `name` exists under one of the bases, else why not."""
    bases = _bases(source)
    if any((base / name.rstrip("/")).exists() for base in bases):
        return None
    if not name.endswith("/") and not _FILE.fullmatch(name):  # folder/module.attr: the module must exist
        module, _, attribute = name.rpartition(".")
        for base in bases:
            path = base / f"{module}.py"
            if path.exists():
                if PACKAGE in path.parents:
                    dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                    return _resolve_dotted(f"{dotted}.{attribute}")
                return None
        return f"no module {module}.py"
    return "no such file or folder"


def unresolved(text: str, source: Path, aliases: dict[str, str] | None = None) -> list[str]:
    """'file:line: name (why)' for every mention in `text` (the contents of `source`) that resolves nowhere."""
    failures = []
    where = source.relative_to(ROOT) if ROOT in source.parents else source
    for number, name in mentions(text, aliases):
        if name in FOREIGN or name in OUTPUTS or name.startswith("../") or _OTHER_FILE.fullmatch(name):
            continue
        if _DOTTED.fullmatch(name):
            why = _resolve_dotted(name)
        elif "/" in name:
            why = _resolve_path(name, source)
        else:
            why = None if name in _files_named() else "no file of that name"
        if why is not None:
            failures.append(f"{where}:{number}: {name} ({why})")
    return failures


def sources() -> list[Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    tests = [path for path in sorted((ROOT / "tests").glob("*.py")) if path.name != Path(__file__).name]
    return pages + sorted(PACKAGE.rglob("*.py")) + tests


def check(source: Path) -> list[str]:
    text = source.read_text()
    if source.suffix == ".py":
        return unresolved(python_text(text), source, module_aliases(text))
    return unresolved(text, source)


def test_every_mentioned_name_exists():
    failures = [failure for source in sources() for failure in check(source)]
    assert not failures, f"{len(failures)} mentions resolve nowhere:\n" + "\n".join(failures)


def test_a_stale_mention_fails():
    text = "\n".join(
        [
            "see `_fa3.py` and backends/cudnn/launch.py",  # a module that moved; one that exists
            "jax_ragged_attn.backends.fa3.ragged.unsupported_reason, jax_ragged_attn.backends.fa3.ragged.nothing",
            "the tool (jax_ragged_attn/tools/bench/cli.py) and `cudnn/extents.py`, https://x.org/a/_gone.py",
            "python -m benchmarks.sweep; python -m benchmarks.gone; _cudnn/ and shared/; T/(2n) rows",
            "index/packings.TABLE and _cudnn/launch.attention; cudnn/launch.no_such_name; flash_api.cpp, cudnn.h",
            "memory.estimate_bytes and memory.gone; /usr/lib/x.py, ~/.cache/jax_ragged_attn/autotune.json",
        ]
    )
    aliases = {"memory": "jax_ragged_attn.backends.xla.memory"}
    assert unresolved(text, PACKAGE / "backends" / "fake.py", aliases) == [
        "jax_ragged_attn/backends/fake.py:1: _fa3.py (no file of that name)",
        "jax_ragged_attn/backends/fake.py:2: jax_ragged_attn.backends.fa3.ragged.nothing "
        "(jax_ragged_attn.backends.fa3.ragged has no nothing)",
        "jax_ragged_attn/backends/fake.py:3: jax_ragged_attn/tools/bench/cli.py (no such file or folder)",
        "jax_ragged_attn/backends/fake.py:4: _cudnn/ (no such file or folder)",
        "jax_ragged_attn/backends/fake.py:4: benchmarks.gone (no module benchmarks.gone)",
        "jax_ragged_attn/backends/fake.py:5: _cudnn/launch.attention (no module _cudnn/launch.py)",
        "jax_ragged_attn/backends/fake.py:5: cudnn/launch.no_such_name "
        "(jax_ragged_attn.backends.cudnn.launch has no no_such_name)",
        "jax_ragged_attn/backends/fake.py:6: jax_ragged_attn.backends.xla.memory.gone "
        "(jax_ragged_attn.backends.xla.memory has no gone)",
    ]


def test_a_relative_path_resolves_from_the_mentioning_folder_only():
    text = "lm/training.py"
    assert unresolved(text, PACKAGE / "tools" / "fake.py") == []
    assert unresolved(text, ROOT / "docs" / "fake.md") == ["docs/fake.md:1: lm/training.py (no such file or folder)"]


def test_module_aliases_are_the_repository_modules_a_file_imports():
    source = (
        "import numpy as np\nfrom jax_ragged_attn.backends.xla import memory as xla_memory\n"
        "from jax_ragged_attn.backends import policy\nfrom jax_ragged_attn.config import AttentionConfig\n"
    )
    assert module_aliases(source) == {
        "xla_memory": "jax_ragged_attn.backends.xla.memory",
        "policy": "jax_ragged_attn.backends.policy",
    }


def test_python_text_keeps_comments_and_strings_at_their_lines():
    source = 'import os  # see _gone.py\nx = """one\ntwo _also_gone.py"""\ny = os.path  # nothing\n'
    lines = python_text(source).splitlines()
    assert "_gone.py" in lines[0] and "import" not in lines[0]
    assert "_also_gone.py" in lines[2] and "os.path" not in lines[3]
