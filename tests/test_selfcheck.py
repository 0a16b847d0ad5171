"""The self-check names the cuDNN and CUDA runtime libraries it loaded, and ends with a one-line verdict."""

from __future__ import annotations

import jax
import pytest

from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.testing import declines
from jax_ragged_attn.tools import selfcheck

# A fabricated /proc/self/maps: two mappings of one library, a sub-library, a deleted file, a path with a
# space, anonymous mappings and look-alikes that are not the libraries asked for.
MAPS = """\
55d0c0000000-55d0c0001000 r--p 00000000 fd:01 1 /usr/bin/python3.11
7f0000000000-7f0000100000 r-xp 00000000 fd:01 2 /venv/lib/nvidia/cudnn/lib/libcudnn.so.9
7f0000100000-7f0000200000 r--p 00100000 fd:01 2 /venv/lib/nvidia/cudnn/lib/libcudnn.so.9
7f0000200000-7f0000300000 r-xp 00000000 fd:01 3 /venv/lib/nvidia/cudnn/lib/libcudnn_graph.so.9.8.0
7f0000300000-7f0000400000 r-xp 00000000 fd:01 4 /opt/my cuda/lib64/libcudart.so.12.8.90 (deleted)
7f0000400000-7f0000500000 rw-p 00000000 00:00 0
7f0000500000-7f0000600000 r-xp 00000000 fd:01 5 /usr/lib/libcudnn_fake.txt
7f0000600000-7f0000700000 r-xp 00000000 fd:01 6 /usr/lib/libcudart_static.a
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]
"""


def test_maps_parser_finds_the_libraries_and_their_file_versions():
    assert selfcheck.loaded_libraries(MAPS) == {
        "libcudnn": ("/venv/lib/nvidia/cudnn/lib/libcudnn.so.9", "9"),
        "libcudnn_graph": ("/venv/lib/nvidia/cudnn/lib/libcudnn_graph.so.9.8.0", "9.8.0"),
        "libcudart": ("/opt/my cuda/lib64/libcudart.so.12.8.90", "12.8.90"),
    }
    assert selfcheck.loaded_libraries("") == {}
    unversioned = "7f00-7f01 r-xp 00000000 fd:01 7 /lib/libcudart.so\n"
    assert selfcheck.loaded_libraries(unversioned) == {"libcudart": ("/lib/libcudart.so", "")}


def test_headers_note_only_where_the_library_is_newer_than_the_headers():
    note = selfcheck.headers_note(92801, 91900)  # the GPU host's own build running pip's 9.28.1
    assert "built against cuDNN 9.19.0 headers" in note and "libcudnn 9.28.1 on 9.19.0's paths" in note, note
    assert selfcheck.headers_note(91900, 92801) is None  # a pip build on an older library: the library decides
    assert selfcheck.headers_note(92801, 92800) is None  # the same minor version
    assert selfcheck.headers_note(0, 92801) is None  # cuDNN not loaded


def test_upgrade_note_only_below_the_fastest_measured_cudnn():
    assert "9.28" in selfcheck.upgrade_note(91900) and "9.19.0 is loaded" in selfcheck.upgrade_note(91900)
    assert selfcheck.upgrade_note(92801) is None
    assert selfcheck.upgrade_note(0) is None  # version unknown: no advice


def test_cudnn_version_encoding():
    assert selfcheck._cudnn_version_text(90800) == "9.8.0"
    assert selfcheck._cudnn_version_text(91002) == "9.10.2"


def test_cpu_run_reports_no_libraries_and_ends_with_the_verdict(capsys):
    if jax.default_backend() == "gpu":
        pytest.skip("this checks the CPU report; on a GPU the libraries are loaded")
    status = selfcheck.main(
        [
            "--num-seqs",
            "2",
            "--min-len",
            "4",
            "--max-len",
            "16",
            "--heads",
            "2",
            "--head-dim",
            "16",
            "--iterations",
            "1",
        ]
    )
    lines = capsys.readouterr().out.splitlines()
    assert "  libcudnn: not loaded (no CUDA device)" in lines
    assert "  libcudart: not loaded (no CUDA device)" in lines
    assert status == 0 and lines[-1].startswith("selfcheck: OK (xla path, bfloat16, "), lines[-1]


@pytest.mark.gpu
def test_gpu_run_names_the_loaded_cudnn():
    reason = extension.cudnn_unavailable_reason()
    if reason is not None:
        pytest.skip(f"cuDNN path unavailable: {reason}")
    lines = selfcheck.library_lines(on_gpu=True)
    cudnn = next(line for line in lines if line.startswith("  libcudnn: "))
    # The version comes from the loaded library itself, the path from this process's memory map.
    major = extension.module().cudnn_version() // 10000
    assert cudnn.startswith(f"  libcudnn: {major}.") and "/libcudnn.so" in cudnn, lines
    cudart = next(line for line in lines if line.startswith("  libcudart: "))
    assert " at /" in cudart or cudart == "  libcudart: not loaded in this process", lines


# ---- --deep: every feature of every backend against the float64 reference (tools/selfcheck_deep.py) ----------


def _assert_rows_passed_or_declined(rows):
    assert rows, "no rows"
    for row in rows:
        assert row.status in ("passed", "declined"), f"{row.backend}, {row.op}: {row.feature}: {row.detail}"
        assert row.status == "passed" or row.detail, f"{row.backend}, {row.feature}: declined without a reason"
    if jax.default_backend() != "gpu":  # a CPU checks the xla path; the GPU backends say why not
        assert all(row.status == "passed" for row in rows if row.backend == "xla"), rows
        assert all(row.status == "declined" for row in rows if row.backend != "xla"), rows
        return
    # On a GPU a declined row is a backend that cannot run here at all (no wheel), or a decline the list of
    # expected ones names (testing/declines.py, the known-issues fences included): anything else is a kernel
    # that started declining, which must fail rather than read as a quiet "declined".
    for row in rows:
        if row.status != "declined":
            continue
        unavailable = declines.unavailable_reason(row.backend)
        listed = any(
            entry.backend == row.backend and entry.op == row.op and entry.says in row.detail
            for entry in declines.EXPECTED
        )
        assert (unavailable is not None and unavailable in row.detail) or listed, (
            f"{row.backend}, {row.op}: {row.feature} declined for a reason testing/declines.py does not list: "
            f"{row.detail}"
        )


def test_deep_check_of_a_few_features_on_every_backend():
    rows = selfcheck.deep_check(features=["head-major", "seqused", "decode, paged cache"])
    assert [(r.feature, r.backend) for r in rows] == [
        (f, b)
        for f in ("causal, head-major stats", "seqused (slots with unused rows)", "decode, paged cache")
        for b in ("cudnn", "fa3", "xla")
    ]
    _assert_rows_passed_or_declined(rows)


@pytest.mark.slow  # about 2 minutes of compiling on 2 cores
def test_deep_check_of_every_feature():
    _assert_rows_passed_or_declined(selfcheck.deep_check())


def test_deep_table_and_exit_status(monkeypatch, capsys):
    from jax_ragged_attn.tools import selfcheck_deep

    rows = [
        selfcheck_deep.Row("ragged", "causal", "cudnn", "declined", "no CUDA device", 0.0),
        selfcheck_deep.Row("ragged", "causal", "xla", "passed", "", 1.0),
        selfcheck_deep.Row("kvcache", "decode", "cudnn", "declined", "no CUDA device", 0.0),
        selfcheck_deep.Row("kvcache", "decode", "xla", "failed", "out: 3 of 8 entries off\ndetails", 1.0),
    ]
    monkeypatch.setattr(selfcheck_deep, "deep_check", lambda: rows)
    assert selfcheck.main(["--deep"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("jax ") and any(line.startswith("known issues of the loaded versions") for line in lines)
    assert any(line.startswith("  libcudnn: ") for line in lines), lines  # which library the process mapped
    table = lines.index(next(line for line in lines if line.startswith("feature")))
    assert lines[table].split() == ["feature", "cudnn", "xla"]
    assert lines[table + 1].split()[-2:] == ["declined", "passed"]
    assert lines[table + 2].split()[-2:] == ["declined", "FAILED"]
    assert "  xla, kvcache: decode: out: 3 of 8 entries off" in lines
    assert "  cudnn, every row: no CUDA device" in lines
    assert lines[-1].startswith("selfcheck --deep: FAILED (1 passed, 1 failed, 2 declined in ")
    monkeypatch.setattr(selfcheck_deep, "deep_check", lambda: rows[:2])
    assert selfcheck.main(["--deep"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("selfcheck --deep: OK (1 passed, 0 failed, 1 declined")
