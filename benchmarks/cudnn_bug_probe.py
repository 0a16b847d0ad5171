"""Probe the loaded cuDNN for the backward bugs of older releases: which rows of which output go wrong, and when.

    python -m benchmarks.cudnn_bug_probe          # on a GPU, with the cuDNN under test first on the path

Not a test: an experiment that decides a known-issue entry's range and trigger (backends/shared/known_issues.py)
before its reproducer is written. Each case is a RaggedCase of the deep self-check (NaN-poisoned padding, the
float64 reference) run on implementation="cudnn"; the table prints, for out / dq / dk / dv, the worst error and
the sequences whose rows exceed the dtype's tolerance ("-" where none does), so a bug confined to one kind of
sequence (no query rows, keys out of every window) shows as such. Every case runs with the fences and
workarounds of the bugs it probes lifted (LIFT).

What it found: docs/CUDNN_VERSIONS.md.
"""

from __future__ import annotations

import argparse

import numpy as np

from jax_ragged_attn.backends.shared import extension, known_issues
from jax_ragged_attn.testing.helpers import tolerance
from jax_ragged_attn.tools.selfcheck_deep import DTYPE, RaggedCase, _ragged_inputs, _ragged_run

CAUSAL_BR = (("is_causal", True), ("diagonal_alignment", "bottom_right"))
CASES = (
    # Sequences with keys but no query rows (cross attention, context-parallel chunks, seqused_q = 0).
    RaggedCase(
        "no-query sequence, causal bottom-right", slots_q=(5, 0, 12, 3), slots_kv=(40, 7, 33, 19), options=CAUSAL_BR
    ),
    RaggedCase(
        "same lengths, every sequence has queries", slots_q=(5, 2, 12, 3), slots_kv=(40, 7, 33, 19), options=CAUSAL_BR
    ),
    RaggedCase("no-query sequence, no mask", slots_q=(5, 0, 12, 3), slots_kv=(40, 7, 33, 19)),
    RaggedCase(
        "no-query sequence first, top-left causal",
        slots_q=(0, 5, 12),
        slots_kv=(20, 40, 33),
        options=(("is_causal", True),),
    ),
    RaggedCase("no-query sequence of 700 keys", slots_q=(5, 0, 12), slots_kv=(40, 700, 33)),
    RaggedCase("no-query sequence, MHA", slots_q=(5, 0, 12, 3), slots_kv=(40, 7, 33, 19), heads=(4, 4)),
    RaggedCase(
        "seqused_q 0 beside seqused_kv 2",
        slots_q=(9, 6, 12, 5),
        used_q=(4, 0, 12, 3),
        slots_kv=(9, 6, 12, 5),
        used_kv=(7, 2, 12, 1),
    ),
    # Keys no query reaches inside sequences that have queries.
    RaggedCase(
        "keys left of every window: 10 queries on 1000 keys, window (8, 0) bottom-right",
        slots_q=(10, 3),
        slots_kv=(1000, 9),
        options=CAUSAL_BR + (("local_window_size", (8, 0)),),
    ),
    # Unequal head dims past one 128-row tile (the stats cotangent's backward widens Dv by 16: 128 -> 144).
    RaggedCase(
        "Dqk 128, Dv 144, 300 + 200 + 129 rows, GQA, causal",
        slots_q=(300, 200, 129),
        slots_kv=(300, 200, 129),
        dims=(128, 144),
        options=(("is_causal", True),),
    ),
    RaggedCase(
        "Dqk 128, Dv 144, 300 + 200 + 129 rows, MHA, no mask",
        slots_q=(300, 200, 129),
        slots_kv=(300, 200, 129),
        heads=(4, 4),
        dims=(128, 144),
    ),
    RaggedCase(
        "Dqk 192, Dv 128, 300 + 200 + 129 rows, causal",
        slots_q=(300, 200, 129),
        slots_kv=(300, 200, 129),
        heads=(4, 4),
        dims=(192, 128),
        options=(("is_causal", True),),
    ),
    RaggedCase(
        "Dqk 128, Dv 64, 300 + 200 + 129 rows, causal",
        slots_q=(300, 200, 129),
        slots_kv=(300, 200, 129),
        heads=(4, 4),
        dims=(128, 64),
        options=(("is_causal", True),),
    ),
    RaggedCase(
        "stats gradient, 300 + 200 + 129 rows, GQA, causal",
        slots_q=(300, 200, 129),
        slots_kv=(300, 200, 129),
        stats_gradient=True,
    ),
    RaggedCase("equal dims 128, 300 + 200 + 129 rows, GQA, causal", slots_q=(300, 200, 129), slots_kv=(300, 200, 129)),
    # TransformerEngine#2344's trigger (cuDNN 9.14.0: a left window, max_seqlen_kv > 1024, a mask but causal).
    RaggedCase(
        "window (64, 64) over 1500 keys",
        slots_q=(1500, 37),
        slots_kv=(1500, 37),
        heads=(2, 2),
        options=(("local_window_size", (64, 64)),),
    ),
    RaggedCase(
        "window (128, 0), no causal, 2048 keys, 16 heads",
        slots_q=(2048,),
        slots_kv=(2048,),
        heads=(16, 16),
        options=(("local_window_size", (128, 0)),),
    ),
    RaggedCase(
        "window (256, 256), 2 sequences of 2048 and 1100, GQA",
        slots_q=(2048, 1100),
        slots_kv=(2048, 1100),
        heads=(8, 2),
        options=(("local_window_size", (256, 256)),),
    ),
    RaggedCase(
        "window (1000, 0) bottom-right, 300 queries on 3000 keys",
        slots_q=(300,),
        slots_kv=(3000,),
        heads=(4, 4),
        options=CAUSAL_BR + (("local_window_size", (1000, 0)),),
    ),
)
# Every fence and workaround the cases probe is lifted: the probe shows what cuDNN itself does.
LIFT = ("TransformerEngine#2344", "TransformerEngine#2185", known_issues.NO_QUERY_SEQUENCES)


def _bad_sequences(name, got, expected, slots) -> str:
    """The worst error of `name` and the sequences (by `slots`) with a row off by more than assert_close allows."""
    atol, rtol = tolerance(DTYPE)
    got = np.asarray(got, np.float64)
    error = np.abs(got - expected)
    bad = ~(error <= atol * max(1.0, float(np.abs(expected).max(initial=0.0))) + rtol * np.abs(expected))
    rows = np.flatnonzero(bad.reshape(bad.shape[0], -1).any(axis=1))
    cu = np.concatenate([[0], np.cumsum(slots)])
    seqs = sorted({int(np.searchsorted(cu, r, side="right") - 1) for r in rows})
    worst = np.nanmax(np.where(np.isfinite(error), error, np.inf)) if error.size else 0.0
    return f"{worst:.3g} " + (f"seqs {seqs} ({len(rows)} rows)" if len(rows) else "-")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cudnn_bug_probe", description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="run the cases whose name contains this")
    args = parser.parse_args(argv)
    print(extension.versions(), flush=True)
    for case in CASES:
        if args.k not in case.feature:
            continue
        x = _ragged_inputs(case)
        try:
            with known_issues.lifted(*LIFT):
                got = _ragged_run(case, "cudnn", x)
        except Exception as error:  # noqa: BLE001 - the probe reports every failure and goes on
            print(f"{case.feature}: {type(error).__name__}: {str(error)[:200]}", flush=True)
            continue
        parts = []
        for name in ("out", "dq", "dk", "dv"):
            slots = case.slots_q if name in ("out", "dq") else case.slots_kv
            parts.append(f"{name} {_bad_sequences(name, got[name], x['expected'][name], slots)}")
        print(f"{case.feature}: " + " | ".join(parts), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
