"""A seeded sweep of ragged_attention_with_kvcache over random configurations, as benchmarks/sweep.py sweeps
ragged_attention: the fixed form q [B, Sq, Hq, D] and packed queries (cu_seqlens_q, a serving step), paged and
contiguous caches, GQA/MQA, windows, causal or not, softcap, sinks, both stats layouts.

    python -m benchmarks.sweep_kvcache --tier cpu --num-tests 200            # the xla path
    python -m benchmarks.sweep_kvcache --tier gpu --implementation cudnn    # the kernels, on a GPU
    python -m benchmarks.sweep_kvcache --repro '{"seed": 17, ...}'          # what a failing case prints

Every cache row no sequence uses (past its length, on its unused pages, two spare pages) is NaN, and so are q's
rows past cu_seqlens_q[-1]; cache_seqlens are drawn past the capacity and below 0 at times (such a
sequence must read NaN). An unused page's table entry is -1 at times (never read). Each other result is held to
the float64 reference (testing/kvcache_reference.py) within the dtype's tolerance. A decline the implementation lists
(testing/declines.py) is a skip with its reason; any other decline, error or mismatch fails, with the case's
JSON to repeat it.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.sweep import case_line
from jax_ragged_attn import ragged_attention_with_kvcache
from jax_ragged_attn.testing import assert_close, declines
from jax_ragged_attn.testing.kvcache_reference import reference_kvcache_attention, reference_kvcache_attention_packed

# Per tier: dtypes, (Hq, Hkv), head dims (Dqk, Dv), page sizes, the most pages a sequence, the most queries a
# sequence. The gpu tier's page sizes include multiples of FA3's and cuDNN's key tiles (128), where a kernel
# loading whole tiles would read unused rows.
TIERS = {
    "cpu": dict(
        implementation="xla",
        dtypes=("float32", "bfloat16"),
        heads=((2, 2), (4, 2), (6, 2), (3, 1)),
        dims=((8, 8), (16, 16), (16, 8)),
        pages=(1, 2, 4, 5, 8),
        max_pages=6,
        max_queries=9,
    ),
    "gpu": dict(
        implementation="cudnn",
        dtypes=("bfloat16", "float16"),
        heads=((8, 8), (8, 2), (32, 8), (16, 1)),
        dims=((128, 128), (64, 64)),
        pages=(16, 64, 128, 256),
        max_pages=12,
        max_queries=150,
    ),
}


def draw_case(seed: int, tier: str = "cpu", implementation: str | None = None) -> dict:
    """One configuration, a JSON-able dict (its lengths spelled out); the same arguments give the same dict."""
    spec = TIERS[tier]
    rng = np.random.default_rng(seed)
    pick = lambda options: options[int(rng.integers(len(options)))]
    batch = int(pick((1, 2, 3, 5, 8)))
    paged = bool(rng.integers(2))
    page = int(pick(spec["pages"]))
    max_pages = int(rng.integers(1, spec["max_pages"] + 1))
    capacity = page * max_pages
    packed = bool(rng.integers(2))
    max_queries = int(rng.integers(1, spec["max_queries"] + 1))
    window = None
    if rng.random() < 0.3:
        window = [int(rng.integers(-1, 3 * page)), int(rng.integers(-1, 4))]
    lengths = [int(x) for x in rng.integers(0, capacity + 1, batch)]
    if rng.random() < 0.3:  # invalid, read NaN by the op: past the capacity, below 0
        lengths[0] = capacity + int(rng.integers(1, 5))
        lengths[-1] = -int(rng.integers(1, 3))
    counts = [int(x) for x in rng.integers(0, max_queries + 1, batch)] if packed else None
    return dict(
        seed=seed,
        tier=tier,
        implementation=implementation or spec["implementation"],
        dtype=pick(spec["dtypes"]),
        heads=list(pick(spec["heads"])),
        dims=list(pick(spec["dims"])),
        paged=paged,
        page_size=page,
        max_pages=max_pages,
        lengths=lengths,
        packed=packed,
        max_seqlen_q=max_queries,
        counts=counts,
        spare_rows=int(rng.integers(0, 4)),
        is_causal=bool(rng.random() < 0.7),
        local_window_size=window,
        softcap=float(pick((0.0, 0.0, 0.0, 5.0))),
        sinks=bool(rng.random() < 0.25),
        stats_layout=pick(("head_major", "token_major")),
        unused_entry=bool(rng.random() < 0.3),
    )


def _rounded(x, dtype) -> np.ndarray:
    """float64 of the values the op sees in `dtype` (NaN stays NaN)."""
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)


def _inputs(case: dict):
    rng = np.random.default_rng(case["seed"] + 7919)
    (hq, hkv), (dqk, dv), dtype = case["heads"], case["dims"], case["dtype"]
    batch, page, max_pages = len(case["lengths"]), case["page_size"], case["max_pages"]
    capacity = page * max_pages
    used = [min(max(n, 0), capacity) for n in case["lengths"]]
    table = None
    if case["paged"]:
        num_pages = batch * max_pages + 2
        k = np.full((num_pages, page, hkv, dqk), np.nan)
        v = np.full((num_pages, page, hkv, dv), np.nan)
        table = rng.permutation(num_pages)[: batch * max_pages].reshape(batch, max_pages).astype(np.int32)
        for b, n in enumerate(used):
            for p in range(math.ceil(n / page)):
                rows = min(page, n - p * page)
                k[table[b, p], :rows] = rng.standard_normal((rows, hkv, dqk))
                v[table[b, p], :rows] = rng.standard_normal((rows, hkv, dv))
            if case["unused_entry"] and math.ceil(n / page) < max_pages:
                table[b, -1] = -1  # an unused page's entry: never read
    else:
        k = np.full((batch, capacity, hkv, dqk), np.nan)
        v = np.full((batch, capacity, hkv, dv), np.nan)
        for b, n in enumerate(used):
            k[b, :n], v[b, :n] = rng.standard_normal((n, hkv, dqk)), rng.standard_normal((n, hkv, dv))
    if case["packed"]:
        cu = np.concatenate([[0], np.cumsum(case["counts"])]).astype(np.int32)
        q = np.full((int(cu[-1]) + case["spare_rows"] or 1, hq, dqk), np.nan)
        q[: cu[-1]] = rng.standard_normal((int(cu[-1]), hq, dqk))
    else:
        cu = None
        q = rng.standard_normal((batch, case["max_seqlen_q"], hq, dqk))
    sinks = rng.standard_normal(hq).astype(np.float32) if case["sinks"] else None
    return _rounded(q, dtype), _rounded(k, dtype), _rounded(v, dtype), table, cu, sinks


def _options(case: dict) -> dict:
    window = case["local_window_size"]
    return dict(
        is_causal=case["is_causal"],
        local_window_size=None if window is None else tuple(window),
        softcap=case["softcap"] or None,
    )


def compare(case: dict) -> None:
    """Raises AssertionError naming the first result that is off (NotImplementedError where declined)."""
    q, k, v, table, cu, sinks = _inputs(case)
    dtype, lengths = case["dtype"], np.asarray(case["lengths"], np.int32)
    packed = {} if cu is None else dict(cu_seqlens_q=jnp.asarray(cu), max_seqlen_q=case["max_seqlen_q"])
    call = jax.jit(
        lambda q, k, v, n, t, s: ragged_attention_with_kvcache(
            q,
            k,
            v,
            n,
            page_table=t,
            sinks=s,
            return_stats=True,
            stats_layout=case["stats_layout"],
            implementation=case["implementation"],
            **packed,
            **_options(case),
        )
    )
    out, stats = call(
        *(jnp.asarray(x, dtype) for x in (q, k, v)),
        jnp.asarray(lengths),
        None if table is None else jnp.asarray(table),
        None if sinks is None else jnp.asarray(sinks),
    )
    stats = np.asarray(stats, np.float64)
    if case["stats_layout"] == "token_major":
        stats = np.swapaxes(stats, -1, -2)
    if cu is None:
        expected = reference_kvcache_attention(q, k, v, lengths, page_table=table, sinks=sinks, **_options(case))
    else:
        expected = reference_kvcache_attention_packed(
            q, k, v, lengths, cu, case["max_seqlen_q"], page_table=table, sinks=sinks, **_options(case)
        )
    # A sequence whose cache_seqlens is outside [0, capacity] reads NaN on every one of its query rows (the op's
    # signal for invalid input); the reference's clamped numbers are not what it returns there.
    out = np.asarray(out, np.float64)
    expected_out, expected_stats = np.array(expected["out"], np.float64), np.array(expected["stats"], np.float64)
    invalid = (lengths < 0) | (lengths > case["page_size"] * case["max_pages"])
    rows = np.zeros(out.shape[:-2], bool)  # [B, Sq] or [T]
    for b in np.flatnonzero(invalid):
        if cu is None:
            rows[b] = True
        else:
            rows[cu[b] : cu[b + 1]] = True
    stats_rows = np.swapaxes(rows[..., None], -1, -2)  # stats are [..., Hq, rows]
    assert np.isnan(out[rows]).all(), "out: a sequence with cache_seqlens outside the cache does not read NaN"
    assert np.isnan(np.where(stats_rows, stats, np.nan)).all(), "stats: an invalid sequence's rows are not NaN"
    out[rows], expected_out[rows] = 0.0, 0.0
    stats, expected_stats = np.where(stats_rows, 0.0, stats), np.where(stats_rows, 0.0, expected_stats)
    assert_close(out, expected_out, dtype, "out")
    # The stats are float32 whatever the inputs' dtype, and the inputs are the values the op sees (as sweep.py).
    assert_close(stats, expected_stats, "float32", "stats")
    # A query without keys (and without sinks): out exactly 0. Rows [B * Sq] or [T], heads last.
    out = out.reshape(-1, q.shape[-2], v.shape[-1])
    empty = np.swapaxes(np.isneginf(expected_stats), -1, -2).reshape(-1, q.shape[-2])
    bad = empty & (out != 0).any(axis=-1)
    assert not bad.any(), f"out: {int(bad.sum())} (row, head) pairs that attend no key are not exactly 0"


def run_case(case: dict) -> tuple[str, str]:
    """("passed" | "skipped" | "failed", message). A skip is a decline testing/declines.py lists."""
    unavailable = declines.unavailable_reason(case["implementation"])
    if unavailable is not None:
        return "skipped", f"{case['implementation']} unavailable: {unavailable}"
    skipped = []

    def skip(reason):
        skipped.append(reason)
        raise _Skip

    try:
        declines.call(case["implementation"], compare, case, skip=skip)
    except _Skip:
        return "skipped", skipped[0]
    except Exception as error:  # noqa: BLE001 - every error is a failure, reported with its repro
        what = "".join(traceback.format_exception_only(type(error), error)).strip()
        return "failed", f"{what}\n  repro: python -m benchmarks.sweep_kvcache --repro '{json.dumps(case)}'"
    return "passed", ""


class _Skip(Exception):
    pass


def describe(case: dict) -> str:
    form = (
        f"packed {sum(case['counts'])} rows, max {case['max_seqlen_q']}"
        if case["packed"]
        else f"Sq {case['max_seqlen_q']}"
    )
    cache = (
        f"pages of {case['page_size']} x {case['max_pages']}"
        if case["paged"]
        else f"contiguous {case['page_size'] * case['max_pages']}"
    )
    extras = (
        [name for name in ("sinks",) if case[name]]
        + (["softcap"] if case["softcap"] else [])
        + ([f"window {case['local_window_size']}"] if case["local_window_size"] else [])
        + ([] if case["is_causal"] else ["not causal"])
    )
    return (
        f"{case['implementation']} {case['dtype']} B={len(case['lengths'])} H={case['heads']} D={case['dims']} "
        f"{form}, {cache} {' '.join(extras)}"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sweep_kvcache", description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the first case's seed; case i uses seed + i")
    parser.add_argument("--num-tests", type=int, default=100)
    parser.add_argument("--tier", choices=tuple(TIERS), default="cpu")
    parser.add_argument(
        "--implementation",
        choices=("xla", "cudnn", "fa3"),
        default=None,
        help="default: the tier's (cpu: xla, gpu: cudnn)",
    )
    parser.add_argument("--repro", metavar="JSON", help="run exactly this case (as a failure prints it)")
    args = parser.parse_args(argv)
    if args.repro is not None:
        cases = [json.loads(args.repro)]
    else:
        cases = [draw_case(args.seed + i, args.tier, args.implementation) for i in range(args.num_tests)]
    counts, failures = collections.Counter(), []
    for i, case in enumerate(cases):
        status, message = run_case(case)
        counts[status] += 1
        if status == "failed":
            failures.append(case["seed"])
        print(case_line(i, len(cases), case, status, message, describe(case)), flush=True)
    print(f"\n{len(cases)} cases: {counts['passed']} passed, {counts['skipped']} skipped, {counts['failed']} failed")
    if failures:
        print(f"failed seeds: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
