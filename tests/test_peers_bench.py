"""benchmarks/peers.py on a CPU: every row of the table has a figure or a stated reason, the xla path is timed for
real on the unequal-head-dims row, dew-flash-attn's column is wired as its wheel's API takes it (a stand-in
module here), and several runs merge into one table."""

from __future__ import annotations

import json
import re
import types

import jax
import pytest

from benchmarks import peers

FIGURE = re.compile(r"^(\*\*)?\d+\.\d{3}(\*\*)? \(\d+\.\d\dx(, .+)?\)$")
NOTE = re.compile(r"^n/a \[(\d+)\]$")


def _table(output: str) -> tuple[list[list[str]], dict[int, str], list[str]]:
    """(the table's rows as cells, notes {n: reason}, the header's systems) of the last table printed."""
    lines = output[output.rindex("| workload | dir | inputs |"):].splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[2:] if line.startswith("|")]
    notes = {int(m.group(1)): m.group(2) for line in lines if (m := re.match(r"^\[(\d+)\] (.+)$", line))}
    return rows, notes, header[3:]


def _traced_only(fn, args, calls, loops):
    """median_loop_seconds' stand-in: traces the jitted step (the wrapper, its shapes, the custom_vjp's backward)
    without compiling it, and returns a figure that differs by function so the ratios are not all 1."""
    jax.eval_shape(fn, *args)
    _traced_only.count += 1
    return 1e-3 * (1 + _traced_only.count % 5)


def _check_every_cell(rows, notes, systems, names):
    expected = {(n, d, i) for n in names for d in peers.DIRECTIONS for i in peers.INPUTS}
    assert {(r[0].split(" ")[0], r[1], r[2]) for r in rows} == expected
    for row in rows:
        assert len(row) == 3 + len(systems), row
        for system, cell in zip(systems, row[3:]):
            note = NOTE.match(cell)
            assert FIGURE.match(cell) or note, (row[:3], system, cell)
            if note:  # a stated reason, attributed to this column
                reason = notes[int(note.group(1))]
                assert reason.startswith(f"{system}: ") and len(reason) > len(system) + 10, reason
        figures = [c for c in row[3:] if FIGURE.match(c)]
        assert figures and any(c.startswith("**") and "(1.00x" in c for c in figures), row


@pytest.mark.slow
def test_quick_table_has_every_row_with_a_figure_or_a_reason(monkeypatch, capsys, tmp_path):
    _traced_only.count = 0
    monkeypatch.setattr(peers, "median_loop_seconds", _traced_only)
    assert peers.main(["--quick", "--out", str(tmp_path)]) == 0
    rows, notes, systems = _table(capsys.readouterr().out)
    names = [f"{peers.workload(n).name}~tiny" for n in peers.DEFAULT_ROWS]
    assert systems == list(peers.SYSTEMS)
    _check_every_cell(rows, notes, systems, names)
    column = {s: i for i, s in enumerate(systems, 3)}
    for row in rows:  # the CPU's columns: the xla path serves every row, the default picks it
        assert FIGURE.match(row[column["ours xla"]]) and row[column["ours default"]].endswith(", xla)")
        assert NOTE.match(row[column["raw cuDNN"]]) and NOTE.match(row[column["dew-flash-attn"]])
    data = json.loads((tmp_path / "peers.json").read_text())
    assert len(data["cells"]) == len(names) * len(peers.SYSTEMS) * 4
    assert (tmp_path / "table.md").read_text().count("\n| ") == len(rows) + 2  # the header, its rule, the rows


@pytest.mark.slow
def test_quick_run_times_the_unequal_head_dims_row_for_real(capsys):
    assert peers.main(["--quick", "--workloads", "MLA", "--systems", "ours xla", "--calls", "1", "--loops", "1"]) == 0
    rows, _, systems = _table(capsys.readouterr().out)
    assert systems == ["ours xla"] and len(rows) == 4
    assert all(r[0].startswith("MLA~tiny") and "Dqk 192 / Dv 128" in r[0] and FIGURE.match(r[3]) for r in rows)


def test_dew_column_calls_its_varlen_api_and_declines_unequal_head_dims(monkeypatch, capsys):
    from jax_ragged_attn import ragged_attention

    calls = []

    def flash_mha_varlen(query, key, value, cu_seqlens, max_seqlen, softmax_scale=None, is_causal=False,
                         window_size=(-1, -1), sinks=None, key_cu_seqlens=None, key_max_seqlen=None):
        # dew's signature (the wheel's package __init__, 0.3.6); one cu_seqlens, a static max_seqlen
        assert isinstance(max_seqlen, int) and key.shape == value.shape
        calls.append((query.shape, key.shape, max_seqlen, is_causal))
        return ragged_attention(query, key, value, cu_seqlens, cu_seqlens, max_seqlen_q=max_seqlen,
                                max_seqlen_kv=max_seqlen, is_causal=is_causal, implementation="xla")

    monkeypatch.setattr(peers, "_import_dew", lambda: (types.SimpleNamespace(flash_mha_varlen=flash_mha_varlen),
                                                       None))
    _traced_only.count = 0
    monkeypatch.setattr(peers, "median_loop_seconds", _traced_only)
    assert peers.main(["--quick", "--workloads", "W2,MLA", "--systems", "ours xla,dew-flash-attn"]) == 0
    rows, notes, systems = _table(capsys.readouterr().out)
    assert systems == ["ours xla", "dew-flash-attn"]
    _check_every_cell(rows, notes, systems, ["W2~tiny", "MLA~tiny"])
    dew = {(r[0].split(" ")[0], r[1], r[2]): r[4] for r in rows}
    assert all(FIGURE.match(cell) for (name, _, _), cell in dew.items() if name == "W2~tiny")
    reasons = {notes[int(NOTE.match(cell).group(1))] for (name, _, _), cell in dew.items() if name == "MLA~tiny"}
    assert len(reasons) == 1 and "Dqk 192 / Dv 128" in reasons.pop()
    w2 = peers.quick(peers.workload("W2"))
    assert calls and all(c == ((w2.total_tokens, 4, 128), (w2.total_tokens, 2, 128), w2.max_seqlen, True)
                         for c in calls)


def test_a_peer_that_is_not_installed_says_so():
    if peers.importlib.util.find_spec("dew_flash_attn") is not None:
        pytest.skip("dew_flash_attn is installed here")
    peers._import_dew.cache_clear()
    assert peers._dew_unavailable().startswith("not installed (dew-flash-attn-cu13==0.3.6")


def test_runs_merge_into_one_table(monkeypatch, capsys, tmp_path):
    _traced_only.count = 0
    monkeypatch.setattr(peers, "median_loop_seconds", _traced_only)
    for name in ("W1", "W4-d64"):
        assert peers.main(["--quick", "--workloads", name, "--systems", "ours xla,raw cuDNN",
                           "--out", str(tmp_path / name)]) == 0
    capsys.readouterr()
    assert peers.main(["--merge", str(tmp_path / "W1" / "peers.json"), str(tmp_path / "W4-d64" / "peers.json")]) == 0
    rows, notes, systems = _table(capsys.readouterr().out)
    assert systems == ["ours xla", "raw cuDNN"]
    assert [r[0].split(" ")[0] for r in rows] == ["W1~tiny"] * 4 + ["W4-d64~tiny"] * 4
    assert all(FIGURE.match(r[3]) and NOTE.match(r[4]) for r in rows)


@pytest.mark.slow
def test_interleave_times_a_rows_cells_together(monkeypatch, capsys):
    """--interleave compiles a row's JAX cells, then times them in shared rounds: one call of
    interleaved_loop_seconds per row, over every cell that compiled, each cell's figure its median round."""
    real, seen = peers.interleaved_loop_seconds, []

    def spy(entries, repetitions):
        times = real(entries, repetitions)
        seen.append((len(entries), repetitions, {k: len(v) for k, v in times.items()}))
        return times

    monkeypatch.setattr(peers, "interleaved_loop_seconds", spy)
    monkeypatch.setattr(peers, "median_loop_seconds", lambda *a, **k: pytest.fail("timed on its own"))
    assert peers.main(["--quick", "--workloads", "W1,MLA", "--systems", "ours default,ours xla,dew-flash-attn",
                       "--calls", "1", "--loops", "2", "--interleave"]) == 0
    rows, notes, systems = _table(capsys.readouterr().out)
    assert seen == [(8, 2, {i: 2 for i in range(8)})] * 2  # 2 systems x 2 inputs x 2 directions, each row
    _check_every_cell(rows, notes, systems, ["W1~tiny", "MLA~tiny"])
    assert all(FIGURE.match(r[3]) and FIGURE.match(r[4]) and NOTE.match(r[5]) for r in rows)
