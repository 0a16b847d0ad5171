"""The two builds of the extension compile the same C++: BUILD (Bazel) lists by hand the ffi/ sources and headers
that CMakeLists.txt's module compiles, so a file added to, renamed in or removed from one list must change the
other too. Nothing here builds: both files are parsed."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCE_SUFFIXES = (".cc", ".cpp", ".cu")
CMAKE_SOURCE_COMMANDS = ("nanobind_add_module", "target_sources", "add_library", "add_executable")


def _bazel_files() -> tuple[set[str], set[str]]:
    """(srcs, hdrs) of every cc_library and cc_binary in BUILD, which is Starlark and parses as Python."""
    srcs, hdrs = set(), set()
    for node in ast.walk(ast.parse((ROOT / "BUILD").read_text(), "BUILD")):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.startswith("cc_"):
            for keyword in node.keywords:
                if keyword.arg in ("srcs", "hdrs"):
                    # A glob() or a variable would fail here: this test reads literal lists only.
                    files = ast.literal_eval(keyword.value)
                    (srcs if keyword.arg == "srcs" else hdrs).update(files)
    return srcs, hdrs


def _cmake_code() -> str:
    """CMakeLists.txt without its comments (a # outside a quoted argument runs to the end of the line)."""
    lines = []
    for line in (ROOT / "CMakeLists.txt").read_text().splitlines():
        quoted = False
        for i, char in enumerate(line):
            if char == '"' and (i == 0 or line[i - 1] != "\\"):
                quoted = not quoted
            elif char == "#" and not quoted:
                line = line[:i]
                break
        lines.append(line)
    return "\n".join(lines)


def _cmake_sources() -> set[str]:
    """The ffi/ sources of the commands that give the module its sources."""
    sources = set()
    for command, arguments in re.findall(r"\b(\w+)\s*\(([^()]*)\)", _cmake_code()):
        if command not in CMAKE_SOURCE_COMMANDS:
            continue
        assert "${" not in arguments, f"CMakeLists.txt's {command} names sources through a variable: {arguments}"
        sources.update(word for word in arguments.split() if word.endswith(SOURCE_SUFFIXES))
    return sources


def _included_headers(sources: set[str]) -> set[str]:
    """Every ffi/ file the sources include with #include "...", directly or through another such header (the
    CMake build finds them through its include directory ffi/; other includes come from the pip packages)."""
    seen, pending = set(), sorted(sources)
    while pending:
        path = ROOT / pending.pop()
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(), re.MULTILINE):
            header = f"ffi/{name}"
            if header not in seen and (ROOT / header).is_file():
                seen.add(header)
                pending.append(header)
    return seen


def test_build_and_cmake_compile_the_same_sources():
    bazel_srcs, _ = _bazel_files()
    cmake = _cmake_sources()
    assert cmake, "no sources found in CMakeLists.txt"
    assert bazel_srcs == cmake, (
        f"only in BUILD: {sorted(bazel_srcs - cmake)}; only in CMakeLists.txt: {sorted(cmake - bazel_srcs)}"
    )


def test_every_ffi_source_is_compiled():
    on_disk = {f"ffi/{path.name}" for path in (ROOT / "ffi").glob("*.cc")}
    cmake = _cmake_sources()
    assert on_disk <= cmake, f"ffi/ sources neither build compiles: {sorted(on_disk - cmake)}"


def test_build_lists_the_headers_the_sources_include():
    bazel_srcs, bazel_hdrs = _bazel_files()
    included = _included_headers(_cmake_sources())
    assert not any(path.endswith(SOURCE_SUFFIXES) for path in bazel_hdrs), sorted(bazel_hdrs)
    # Bazel compiles in a sandbox holding only the listed files: a header missing from hdrs breaks its build
    # alone, and one listed but included by nothing is left over.
    assert bazel_hdrs == included, (
        f"missing from BUILD's hdrs: {sorted(included - bazel_hdrs)}; "
        f"listed but included by no compiled source: {sorted(bazel_hdrs - included)}"
    )
    assert all((ROOT / path).is_file() for path in bazel_srcs | bazel_hdrs)
