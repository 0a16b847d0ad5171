"""The range pyproject.toml promises is the range that was run: docs/INSTALL.md's table of tested combinations
starts at the lowest Python and JAX that requires-python and the jax requirement allow (no bound below what
was tested), and CI's newest-JAX stage is the one release-check script a person runs by hand."""

import itertools
import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _tested() -> list[dict[str, str]]:
    """docs/INSTALL.md's "Tested combinations" table, one dict per row keyed by the header's cells."""
    text = (ROOT / "docs" / "INSTALL.md").read_text()
    section = text.split("\n## Tested combinations\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]


def test_pyproject_floors_are_the_lowest_tested_python_and_jax():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    rows = _tested()
    assert rows, "docs/INSTALL.md's table of tested combinations is empty"
    python_floor = re.fullmatch(r">=\s*(\d+\.\d+)", project["requires-python"]).group(1)
    assert min(_version(row["Python"])[:2] for row in rows) == _version(python_floor)
    jax_floors = {
        re.fullmatch(r"jax(\[\w+\])?>=([\d.]+)", requirement).group(2)
        for requirement in itertools.chain(project["dependencies"], *project["optional-dependencies"].values())
        if re.match(r"jax(\[|>|$)", requirement)
    }
    assert len(jax_floors) == 1, f"the jax requirements disagree on the floor: {sorted(jax_floors)}"
    assert min(_version(row["jax"]) for row in rows) == _version(jax_floors.pop())


def test_ci_checks_the_newest_jax_with_the_release_script():
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^bash scripts/check_release\.sh .*--jax latest", ci, re.MULTILINE)
