"""benchmarks/decode_pieces.py: the page-table pieces and their merge give the one-call result (xla path, any
machine), so the GPU table's P > 1 rows time the same attention; and the quick run prints every row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ragged_attn import ragged_attention_with_kvcache
from jax_ragged_attn.testing import assert_close

from benchmarks import decode_pieces


@pytest.mark.parametrize("pieces", [2, 3, 6])
def test_pieces_merge_to_the_one_call_result(pieces):
    rng = np.random.default_rng(pieces)
    batch, max_pages, page, hq, hkv, d = 3, 6, 8, 4, 2, 16
    lengths = jnp.asarray([max_pages * page, 1, 29], jnp.int32)  # full, one row, a piece boundary inside a page
    table = jnp.asarray(rng.permutation(batch * max_pages + 2)[:batch * max_pages].reshape(batch, max_pages),
                        jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, 1, hq, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((batch * max_pages + 2, page, hkv, d)), jnp.float32) for _ in range(2))
    expected = ragged_attention_with_kvcache(q, k, v, lengths, page_table=table, implementation="xla")
    got = decode_pieces.pieces_call(q, k, v, lengths, table, pieces, implementation="xla")
    assert_close(got, np.asarray(expected, np.float64), jnp.float32, f"{pieces} pieces")
    with pytest.raises(ValueError, match="not a multiple of pieces"):
        decode_pieces.pieces_call(q, k, v, lengths, table, 4, implementation="xla")


@pytest.mark.slow
def test_quick_run_prints_a_row_per_variant(capsys):
    assert decode_pieces.main(["--quick"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "x" in line]
    rows = [line for line in lines if not line.startswith("| shape")]
    assert len(rows) == 2 * 3, lines  # two shapes x pieces 1, 2, 4 on the xla path
    assert all(float(row.split("|")[-2]) < 1e-4 for row in rows), rows  # each merge matches P = 1


@pytest.mark.parametrize("flags", [[], ["--in-step"], ["--launches"]], ids=["alone", "in_step", "launches"])
def test_decode_few_quick_run_times_every_row_against_ours(capsys, flags):
    """benchmarks/decode_few.py (issue 48's decode targets, every row in the same rounds) on the xla path: one
    row per layout for ours, the pieces row on the paged cache, each checked against ours; alone and inside a
    decode step (its q, lengths and output made in the step: the same values)."""
    from benchmarks import decode_few

    assert decode_few.main(["--quick", *flags]) == 0
    table = capsys.readouterr().out.split("\n\n")[-1].splitlines()
    rows = [line for line in table if line.startswith("| 2 x 256")]
    assert [row.split("|")[2].strip() for row in rows] == ["ours", "ours", "ours pieces=2"], table
    assert all(float(row.split("|")[-2]) < 1e-4 for row in rows), rows  # every row's output matches ours
    assert all(int(row.split("|")[-3]) >= 1 for row in rows), rows  # the kernels a call launches, counted
    named = [line for line in table if line.startswith("# 2 x 256") and " ours launches: " in line]
    assert len(named) == (2 if "--launches" in flags else 0), table  # each layout's launches, by name and shape
    for line, row in zip(named, rows):
        assert len(line.split(": ", 1)[1].split("; ")) == int(row.split("|")[-3]), (line, row)


def test_launch_cost_times_each_program_and_counts_its_launches(capsys):
    """benchmarks/launch_cost.py (what one launch costs a plain loop, the price of the KV-cache index clamp) on
    any machine: a row per program, each with the launches its compiled call makes: none for the program that
    returns nothing, one for the lengths' clamp, one or two for the jnp reference of both clamps (a GPU runs two
    fusions, XLA's CPU backend may fuse them); the clamp of both (the handler on a GPU, the jnp reference
    elsewhere) at most two."""
    from benchmarks import launch_cost

    assert launch_cost.main(["--calls", "3", "--rounds", "1"]) == 0
    rows = {line.split("|")[1].strip(): line.split("|") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith(("| row", "| ---"))}
    launches = {label: int(row[-2]) for label, row in rows.items()}
    assert list(launches) == ["no kernel", "XLA: 1 fusion", "XLA: 2 fusions", "FFI clamp"], rows
    assert launches["no kernel"] == 0 and launches["XLA: 1 fusion"] == 1, launches
    assert launches["XLA: 2 fusions"] >= 1 and 1 <= launches["FFI clamp"] <= 2, launches
    assert all(float(row[2]) > 0 for row in rows.values()), rows  # a time per call, in microseconds
