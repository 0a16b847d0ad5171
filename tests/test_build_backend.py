"""The build backend's switch for the C++ extension (pyproject.toml's [tool.scikit-build.config-setting]): by
default a build asks for the extension's requirements (nanobind, jaxlib's FFI headers, the CUDA header wheels);
with `-C jax-ragged-attn.extension=false` or JAX_RAGGED_ATTN_BUILD_EXTENSION=0 it asks for nothing beyond
scikit-build-core, runs no CMake and makes a pure-Python wheel. The backend's hooks run in this process, as pip
calls them, from the repository root; nothing is downloaded."""

import pathlib
import tomllib
import zipfile

import pytest

pytest.importorskip("scikit_build_core", minversion="1.1")  # the config-setting table is 1.1's
from scikit_build_core import build
from scikit_build_core.settings.skbuild_read_settings import SettingsReader

ROOT = pathlib.Path(__file__).resolve().parents[1]
SWITCH = "jax-ragged-attn.extension"
ENV = "JAX_RAGGED_ATTN_BUILD_EXTENSION"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTENSION_REQUIRES = PYPROJECT["tool"]["scikit-build"]["build"]["requires"]


@pytest.fixture(autouse=True)
def _repository_root(monkeypatch):
    """The hooks read ./pyproject.toml, as under pip; a switch in the caller's environment must not leak in."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv(ENV, raising=False)


def _requires(state: str, config: dict[str, str] | None = None) -> list[str]:
    """The hook's requirements less CMake and ninja, which scikit-build-core adds only where none is installed."""
    hook = getattr(build, f"get_requires_for_build_{state}")
    return [r for r in hook(config) if not r.startswith(("cmake", "ninja"))]


def test_static_requires_are_what_every_build_needs():
    assert PYPROJECT["build-system"]["requires"] == ["scikit-build-core>=1.1"]
    assert PYPROJECT["build-system"]["build-backend"] == "scikit_build_core.build"


def test_extension_requires_name_every_header_package_the_cmake_build_reads():
    names = {r.split(";")[0].split(">")[0].split("<")[0].strip() for r in EXTENSION_REQUIRES}
    assert names == {
        "nanobind",
        "jaxlib",
        "nvidia-cudnn-cu13",
        "nvidia-cuda-runtime",
        "nvidia-cuda-crt",
        "nvidia-cuda-cccl",
        "nvidia-cuda-nvrtc",
    }


@pytest.mark.parametrize("state", ["wheel", "editable"])
def test_default_build_asks_for_the_extension_requirements(state):
    assert _requires(state) == EXTENSION_REQUIRES
    settings = SettingsReader.from_file("pyproject.toml", {}, state=state).settings
    assert settings.wheel.cmake
    assert settings.wheel.py_api == "cp312"


@pytest.mark.parametrize("state", ["wheel", "editable"])
@pytest.mark.parametrize("value", ["false", "0", "off", "no"])
def test_config_setting_off_asks_for_nothing_and_runs_no_cmake(state, value):
    hook = getattr(build, f"get_requires_for_build_{state}")
    assert hook({SWITCH: value}) == []  # no CMake or ninja either
    settings = SettingsReader.from_file("pyproject.toml", {SWITCH: value}, state=state).settings
    assert not settings.wheel.cmake
    assert settings.wheel.py_api == "py3"


@pytest.mark.parametrize("value", ["0", "false"])
def test_environment_variable_off_asks_for_nothing(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    assert build.get_requires_for_build_wheel() == []


@pytest.mark.parametrize("value", ["true", "1"])
def test_switch_on_is_the_default(monkeypatch, value):
    assert _requires("wheel", {SWITCH: value}) == EXTENSION_REQUIRES
    monkeypatch.setenv(ENV, value)
    assert _requires("wheel") == EXTENSION_REQUIRES


def test_environment_variable_wins_over_the_config_setting(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    assert _requires("wheel", {SWITCH: "false"}) == EXTENSION_REQUIRES


def test_wheel_without_the_extension_is_pure_python(tmp_path):
    """The hook pip calls, offline: no compiler, a py3-none-any wheel of the package's Python files only (a
    compiled _ext*.so left in the source tree by a developer build stays out)."""
    name = build.build_wheel(str(tmp_path), {SWITCH: "false"})
    assert name.endswith("-py3-none-any.whl")
    files = zipfile.ZipFile(tmp_path / name).namelist()
    assert "jax_ragged_attn/__init__.py" in files
    assert not [f for f in files if f.endswith((".so", ".pyd"))]
