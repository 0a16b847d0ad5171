"""`python -m jax_ragged_attn.selfcheck --deep`: every feature each backend serves here, against the float64 reference.

Each row is one feature of an op (ragged_attention forward and backward; ragged_attention_with_kvcache forward),
each column one backend, run with implementation=<backend> on the loaded cuDNN and FA3 wheel: "passed" (out,
stats and every gradient within the dtype's tolerance of testing/reference.py or kvcache_reference.py),
"FAILED" (with the error) or "declined" (with the backend's reason: a feature it does not serve here, or one a
known upstream bug of the loaded version fences off, backends/shared/known_issues.py). Every row the op does
not own is NaN in the inputs and the cotangents (capacity padding, rows past seqused, unused cache rows and
pages), so reading one fails the row. The versions and the known issues in range come first; the exit status
is 1 when a row failed. Sizes are small (bfloat16, head dim 128 as FA3's wheel needs): about a minute on an
H200, the xla path alone on a CPU.

    from jax_ragged_attn.tools.selfcheck import deep_check
    assert not [row for row in deep_check() if row.status == "failed"]   # in a user's CI
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import sys
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from jax_ragged_attn import ragged_attention, ragged_attention_with_kvcache
from jax_ragged_attn.backends.shared import extension, known_issues
from jax_ragged_attn.inputs.packed import ragged_attention_kvpacked, ragged_attention_qkvpacked
from jax_ragged_attn.testing import assert_close, reference_attention
from jax_ragged_attn.testing.kvcache_reference import reference_kvcache_attention, reference_kvcache_attention_packed

BACKENDS = ("cudnn", "fa3", "xla")  # fa3: the provider it takes here (dew-flash-attn where it serves)
DTYPE = "bfloat16"


@dataclasses.dataclass(frozen=True)
class Row:
    op: str  # "ragged" or "kvcache"
    feature: str
    backend: str
    status: str  # "passed", "failed" or "declined"
    detail: str  # the error or the reason; "" when passed
    seconds: float


@dataclasses.dataclass(frozen=True)
class RaggedCase:
    """Sequence b owns slot b of slots_q / slots_kv and uses its first used_q[b] / used_kv[b] rows."""

    feature: str
    slots_q: tuple[int, ...] = (37, 0, 21, 9)
    slots_kv: tuple[int, ...] = (37, 0, 21, 9)
    used_q: tuple[int, ...] | None = None  # None: the whole slot, and no seqused passed
    used_kv: tuple[int, ...] | None = None
    heads: tuple[int, int] = (4, 2)
    dims: tuple[int, int] = (128, 128)
    options: tuple = (("is_causal", True),)
    packing: str = "none"
    sinks: bool = False
    return_stats: bool = True
    stats_gradient: bool = False
    twice: bool = False  # run twice: the results must be bit-identical


CROSS = dict(slots_q=(5, 0, 12, 3), slots_kv=(40, 7, 33, 19))  # fewer queries than keys
RAGGED_CASES = (
    RaggedCase("causal, head-major stats", heads=(4, 4)),
    RaggedCase("causal, token-major stats", options=(("is_causal", True), ("stats_layout", "token_major"))),
    RaggedCase("grouped-query heads (8 query heads on 2)", heads=(8, 2)),
    RaggedCase("window (8, 4), top-left", options=(("local_window_size", (8, 4)),)),
    RaggedCase(
        "window (8, 0), bottom-right",
        **CROSS,
        options=(("is_causal", True), ("diagonal_alignment", "bottom_right"), ("local_window_size", (8, 0))),
    ),
    RaggedCase(
        "causal bottom-right, fewer queries than keys",
        **CROSS,
        options=(("is_causal", True), ("diagonal_alignment", "bottom_right")),
    ),
    RaggedCase(
        "seqused (slots with unused rows)",
        slots_q=(9, 6, 12, 5),
        used_q=(4, 0, 12, 3),
        slots_kv=(9, 6, 12, 5),
        used_kv=(7, 2, 12, 0),
    ),
    RaggedCase("sinks", sinks=True, return_stats=False),
    RaggedCase("softcap 2.0", options=(("is_causal", True), ("softcap", 2.0), ("scale", 0.3))),
    RaggedCase("stats gradient", stats_gradient=True),
    RaggedCase("packed qkv", heads=(4, 4), packing="qkv"),
    RaggedCase("packed kv", packing="kv"),
    RaggedCase("deterministic backward", options=(("is_causal", True), ("deterministic", True)), twice=True),
    RaggedCase("unequal head dims (Dqk 160, Dv 128)", dims=(160, 128)),
    # Past one 128-row tile: cuDNN 9.14's Hopper backward of Dv 144 on Dqk 128 (a stats cotangent's widened
    # columns) is right in the first tile and wrong after it (known_issues.py, TransformerEngine#2185).
    RaggedCase(
        "stats gradient, sequences past one 128-row tile",
        slots_q=(300, 0, 200, 129),
        slots_kv=(300, 0, 200, 129),
        stats_gradient=True,
    ),
    RaggedCase(
        "one query row per sequence, grouped heads",
        slots_q=(1, 1, 0, 1),
        slots_kv=(40, 7, 3, 19),
        heads=(8, 2),
        options=(("is_causal", True), ("diagonal_alignment", "bottom_right")),
    ),
    RaggedCase(
        "left window over 1100 keys",
        slots_q=(48, 5),
        slots_kv=(1100, 9),
        options=(("is_causal", True), ("diagonal_alignment", "bottom_right"), ("local_window_size", (32, 0))),
    ),
)


@dataclasses.dataclass(frozen=True)
class CacheCase:
    feature: str
    seqlen_q: int = 1
    paged: bool = True
    heads: tuple[int, int] = (8, 2)
    lengths: tuple[int, ...] = (512, 300, 17, 0)  # past the kernels' tail of 256 rows, so their heads are read
    options: tuple = ()
    # Packed queries (cu_seqlens_q, a serving step): each sequence's query count; None: q [B, seqlen_q, ...].
    queries: tuple[int, ...] | None = None


CACHE_CASES = (
    CacheCase("decode, contiguous cache", paged=False),
    CacheCase("decode, paged cache"),
    CacheCase(
        "chunked prefill (4 queries), paged, window (20, 0)", seqlen_q=4, options=(("local_window_size", (20, 0)),)
    ),
    CacheCase("decode, paged, softcap 2.0", options=(("softcap", 2.0),)),
    # A prefill chunk longer than its cache (positions below 0), a decode row, a short chunk, an empty sequence.
    CacheCase("serving step: packed chunks and decode rows, paged", queries=(70, 1, 20, 0)),
)
PAGE_SIZE, MAX_PAGES = 16, 32  # capacity 512


def _rng(*parts) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32("/".join(map(str, parts)).encode()))


def _rounded(x) -> np.ndarray:
    """float64 of the values the op sees in DTYPE (NaN stays NaN)."""
    return np.asarray(jnp.asarray(x, DTYPE).astype(jnp.float32), np.float64)


def _rows(slots, used) -> np.ndarray:
    cu = np.concatenate([[0], np.cumsum(slots)])
    return np.concatenate([np.arange(cu[b], cu[b] + used[b]) for b in range(len(slots))] + [[]]).astype(np.int64)


def _poisoned(rng, rows, total, *shape) -> np.ndarray:
    x = np.full((total, *shape), np.nan)
    x[rows] = rng.standard_normal((len(rows), *shape))
    return x


# ---- ragged_attention ---------------------------------------------------------------------------------------


def _ragged_inputs(case: RaggedCase) -> dict:
    rng = _rng("ragged", case.feature)
    used_q, used_kv = case.used_q or case.slots_q, case.used_kv or case.slots_kv
    rows_q, rows_kv = _rows(case.slots_q, used_q), _rows(case.slots_kv, used_kv)
    tq, tkv = sum(case.slots_q) + 5, sum(case.slots_kv) + 5  # 5 rows of capacity padding
    (hq, hkv), (dqk, dv) = case.heads, case.dims
    x = dict(
        q=_rounded(_poisoned(rng, rows_q, tq, hq, dqk)),
        k=_rounded(_poisoned(rng, rows_kv, tkv, hkv, dqk)),
        v=_rounded(_poisoned(rng, rows_kv, tkv, hkv, dv)),
        d_out=_rounded(_poisoned(rng, rows_q, tq, hq, dv)),
        d_stats=_poisoned(rng, rows_q, tq, hq) if case.stats_gradient else np.zeros((tq, hq)),
        sinks=rng.standard_normal(hq).astype(np.float32).astype(np.float64) if case.sinks else None,
        rows_q=rows_q,
        rows_kv=rows_kv,
    )
    options = dict(case.options)
    options.pop("stats_layout", None), options.pop("deterministic", None)
    cu = lambda lengths: np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tight = reference_attention(
        x["q"][rows_q],
        x["k"][rows_kv],
        x["v"][rows_kv],
        cu(used_q),
        cu(used_kv),
        max_seqlen_q=max(max(used_q), 1),
        max_seqlen_kv=max(max(used_kv), 1),
        d_out=x["d_out"][rows_q],
        d_stats=x["d_stats"][rows_q],
        sinks=x["sinks"],
        **options,
    )
    expected = dict(
        out=np.zeros(x["d_out"].shape),
        stats=np.full((tq, hq), -np.inf),
        dq=np.zeros(x["q"].shape),
        dk=np.zeros(x["k"].shape),
        dv=np.zeros(x["v"].shape),
    )
    for name, rows in (("out", rows_q), ("stats", rows_q), ("dq", rows_q), ("dk", rows_kv), ("dv", rows_kv)):
        expected[name][rows] = tight[name]
    if case.sinks:
        expected["dsinks"] = tight["dsinks"]
    return dict(x, expected=expected)


def _ragged_run(case: RaggedCase, backend: str, x: dict) -> dict:
    used_q, used_kv = case.used_q or case.slots_q, case.used_kv or case.slots_kv
    cu_q = jnp.asarray(np.concatenate([[0], np.cumsum(case.slots_q)]), jnp.int32)
    cu_kv = jnp.asarray(np.concatenate([[0], np.cumsum(case.slots_kv)]), jnp.int32)
    seqused = (
        {}
        if case.used_q is None
        else dict(seqused_q=jnp.asarray(used_q, jnp.int32), seqused_kv=jnp.asarray(used_kv, jnp.int32))
    )
    options = dict(case.options)
    kwargs = dict(implementation=backend, return_stats=case.return_stats, **seqused, **options)
    head_major = options.get("stats_layout", "head_major") == "head_major"

    def attention(q, k, v, sinks):
        if case.packing == "qkv":
            return ragged_attention_qkvpacked(
                jnp.stack([q, k, v], axis=1), cu_q, max_seqlen=max(case.slots_q), sinks=sinks, **kwargs
            )
        if case.packing == "kv":
            return ragged_attention_kvpacked(
                q,
                jnp.stack([k, v], axis=1),
                cu_q,
                cu_kv,
                max_seqlen_q=max(case.slots_q),
                max_seqlen_kv=max(case.slots_kv),
                sinks=sinks,
                **kwargs,
            )
        return ragged_attention(
            q,
            k,
            v,
            cu_q,
            cu_kv,
            max_seqlen_q=max(case.slots_q),
            max_seqlen_kv=max(case.slots_kv),
            sinks=sinks,
            **kwargs,
        )

    d_out = jnp.asarray(x["d_out"], DTYPE)
    d_stats = jnp.asarray(x["d_stats"].T if head_major else x["d_stats"], jnp.float32)

    @jax.jit
    def forward_backward(q, k, v, sinks):
        if case.stats_gradient:  # the stats are differentiated too
            (out, stats), vjp = jax.vjp(attention, q, k, v, sinks)
            return out, stats, vjp((d_out, d_stats))

        def split(*primals):  # (out, stats as an aux): no stats cotangent reaches the backward
            result = attention(*primals)
            return (result[0], result[1]) if case.return_stats else (result, None)

        out, vjp, stats = jax.vjp(split, q, k, v, sinks, has_aux=True)
        return out, stats, vjp(d_out)

    sinks = None if x["sinks"] is None else jnp.asarray(x["sinks"], jnp.float32)
    args = [jnp.asarray(x[name], DTYPE) for name in ("q", "k", "v")] + [sinks]
    out, stats, grads = forward_backward(*args)
    if case.twice:
        again = forward_backward(*args)
        for a, b in zip(jax.tree.leaves((out, stats, grads)), jax.tree.leaves(again)):
            if not np.array_equal(np.asarray(a), np.asarray(b)):
                raise AssertionError("two runs of the same call differ (deterministic=True)")
    got = dict(out=out, dq=grads[0], dk=grads[1], dv=grads[2])
    if case.return_stats:
        got["stats"] = stats.T if head_major else stats
    if case.sinks:
        got["dsinks"] = grads[3]
    return got


def _ragged_check(case: RaggedCase, got: dict, expected: dict) -> None:
    for name, value in got.items():
        assert_close(value, expected[name], DTYPE, name)


# ---- ragged_attention_with_kvcache ----------------------------------------------------------------------------


def _cache_inputs(case: CacheCase) -> dict:
    rng = _rng("kvcache", case.feature)
    (hq, hkv), d, batch = case.heads, 128, len(case.lengths)
    lengths = np.asarray(case.lengths, np.int32)
    cu = None
    if case.queries is None:
        q = _rounded(rng.standard_normal((batch, case.seqlen_q, hq, d)))
    else:  # packed rows, 3 rows of NaN past the last sequence's (never read)
        cu = np.concatenate([[0], np.cumsum(case.queries)]).astype(np.int32)
        q = _rounded(_poisoned(rng, np.arange(cu[-1]), int(cu[-1]) + 3, hq, d))
    capacity = PAGE_SIZE * MAX_PAGES
    table = None
    if not case.paged:
        k, v = (np.full((batch, capacity, hkv, d), np.nan) for _ in range(2))
        for b, n in enumerate(lengths):
            k[b, :n], v[b, :n] = rng.standard_normal((2, n, hkv, d))
    else:  # pages shuffled through the cache, two unused all-NaN pages, -1 for a sequence's unused entries
        used = [-(-int(n) // PAGE_SIZE) for n in lengths]
        order = rng.permutation(sum(used) + 2)
        k, v = (np.full((len(order), PAGE_SIZE, hkv, d), np.nan) for _ in range(2))
        table = np.full((batch, MAX_PAGES), -1, np.int32)
        at = 0
        for b, n in enumerate(lengths):
            for p in range(used[b]):
                table[b, p], at = order[at], at + 1
                rows = min(PAGE_SIZE, int(n) - p * PAGE_SIZE)
                k[table[b, p], :rows], v[table[b, p], :rows] = rng.standard_normal((2, rows, hkv, d))
    k, v = _rounded(k), _rounded(v)
    if cu is None:
        expected = reference_kvcache_attention(q, k, v, lengths, page_table=table, **dict(case.options))
    else:
        expected = reference_kvcache_attention_packed(
            q, k, v, lengths, cu, max(case.queries), page_table=table, **dict(case.options)
        )
    return dict(q=q, k=k, v=v, lengths=lengths, table=table, cu=cu, expected=expected)


def _cache_run(case: CacheCase, backend: str, x: dict) -> dict:
    table = None if x["table"] is None else jnp.asarray(x["table"])
    cu = None if x["cu"] is None else jnp.asarray(x["cu"])
    packed = {} if cu is None else dict(max_seqlen_q=max(case.queries))
    call = jax.jit(
        lambda q, k, v, lengths, table, cu: ragged_attention_with_kvcache(
            q,
            k,
            v,
            lengths,
            cu_seqlens_q=cu,
            page_table=table,
            return_stats=True,
            implementation=backend,
            **packed,
            **dict(case.options),
        )
    )
    out, stats = call(*(jnp.asarray(x[name], DTYPE) for name in ("q", "k", "v")), jnp.asarray(x["lengths"]), table, cu)
    return dict(out=out, stats=stats)


def _cache_check(case: CacheCase, got: dict, expected: dict) -> None:
    for name, value in got.items():
        assert_close(value, expected[name], DTYPE, name)


# ---- the table ------------------------------------------------------------------------------------------------


def _row(op: str, feature: str, backend: str, run, check) -> Row:
    start = time.perf_counter()
    try:
        got = run()
    except NotImplementedError as error:
        return Row(op, feature, backend, "declined", str(error), time.perf_counter() - start)
    except Exception as error:  # noqa: BLE001 - a row reports any error and the check goes on
        return Row(op, feature, backend, "failed", f"{type(error).__name__}: {error}", time.perf_counter() - start)
    try:
        check(got)
    except AssertionError as error:
        return Row(op, feature, backend, "failed", str(error), time.perf_counter() - start)
    return Row(op, feature, backend, "passed", "", time.perf_counter() - start)


def _tasks(case, backend: str, x: dict):
    if isinstance(case, RaggedCase):
        return (
            "ragged",
            case.feature,
            backend,
            lambda: _ragged_run(case, backend, x),
            lambda got: _ragged_check(case, got, x["expected"]),
        )
    return (
        "kvcache",
        case.feature,
        backend,
        lambda: _cache_run(case, backend, x),
        lambda got: _cache_check(case, got, x["expected"]),
    )


def deep_check(backends=BACKENDS, *, features=None, lift=(), workers: int | None = None) -> list[Row]:
    """One Row per (feature, backend): every feature of both ops each backend runs here, in the order of
    RAGGED_CASES then CACHE_CASES. `features`: only those whose name contains one of these strings.
    `lift`: keys of known_issues.TABLE whose fences are lifted for the run (the reproducers' switch, never for
    a user's check). The rows run on `workers` threads (default: up to 8 by the CPU count), since most of a
    row's time is XLA compiling it."""
    cases = [
        case
        for case in RAGGED_CASES + CACHE_CASES
        if features is None or any(part in case.feature for part in features)
    ]
    workers = workers or max(1, min(8, os.cpu_count() or 1))
    with known_issues.lifted(*lift), concurrent.futures.ThreadPoolExecutor(workers) as pool:
        inputs = list(
            pool.map(lambda case: _ragged_inputs(case) if isinstance(case, RaggedCase) else _cache_inputs(case), cases)
        )
        tasks = [_tasks(case, backend, x) for case, x in zip(cases, inputs) for backend in backends]
        # The first case's rows alone first: each backend registers its targets and loads its library once.
        first = [_row(*task) for task in tasks[: len(backends)]]
        return first + list(pool.map(lambda task: _row(*task), tasks[len(backends) :]))


def _first_line(text: str, width: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[: width - 3] + "..."


def table_lines(rows: list[Row]) -> list[str]:
    """The feature x backend table, then each failure and each decline's reason (a backend's most common reason
    once, for all the rows it declined with it)."""
    backends = list(dict.fromkeys(row.backend for row in rows))
    features = list(dict.fromkeys((row.op, row.feature) for row in rows))
    cell = {(row.op, row.feature, row.backend): row for row in rows}
    width = max(len(f"{op}: {feature}") for op, feature in features) + 2
    lines = ["".join([f"{'feature':<{width}}"] + [f"{b:<10}" for b in backends])]
    for op, feature in features:
        status = [cell[op, feature, b].status if (op, feature, b) in cell else "-" for b in backends]
        lines.append(
            "".join([f"{op + ': ' + feature:<{width}}"] + [f"{s.upper() if s == 'failed' else s:<10}" for s in status])
        )
    failed = [row for row in rows if row.status == "failed"]
    if failed:
        lines.append("failures:")
        lines += [f"  {r.backend}, {r.op}: {r.feature}: {_first_line(r.detail)}" for r in failed]
    lines.append("declined:")
    for backend in backends:
        declined = [row for row in rows if row.backend == backend and row.status == "declined"]
        if not declined:
            continue
        details = [row.detail for row in declined]
        common = max(set(details), key=details.count) if len(details) > len(set(details)) else None
        lines += [f"  {backend}, {r.op}: {r.feature}: {_first_line(r.detail)}" for r in declined if r.detail != common]
        shared = details.count(common)
        if not shared:  # every reason its own: each row named above
            continue
        which = (
            "every row"
            if shared == sum(row.backend == backend for row in rows)
            else f"{'the other ' if shared < len(declined) else ''}{shared} declined row{'s' * (shared > 1)}"
        )
        lines.append(f"  {backend}, {which}: {_first_line(common)}")
    return lines


def _dew_version() -> str:
    from importlib import metadata

    from jax_ragged_attn.backends.fa3 import dew

    try:
        return metadata.version(dew.WHEEL)
    except metadata.PackageNotFoundError:
        return "not installed"


def version_lines() -> list[str]:
    """jax, the devices, the extension, cuDNN and its frontend, the FA3 wheel, the GPU, and the known issues of
    the loaded versions."""
    versions = known_issues.loaded_versions()
    lines = [f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}"]
    lines += [f"  {key}: {value}" for key, value in extension.versions().items()]
    lines.append(f"  flash-attn3-jax: {known_issues.format_version(versions.fa3) if versions.fa3 else 'not installed'}")
    lines.append(f"  dew-flash-attn: {_dew_version()}")
    lines.append(f"  GPU compute capability: {'none' if versions.arch is None else versions.arch / 10}")
    issues = known_issues.summary_lines(versions)
    lines.append(
        "known issues of the loaded versions (backends/shared/known_issues.py): "
        + ("none" if not issues else f"{len(issues)}")
    )
    lines += [f"  {line}" for line in issues]
    return lines


def run_deep(file=None, library_lines=()) -> int:
    """Prints the versions (then `library_lines`: the self-check's paths of the loaded libraries) and the table;
    1 when a row failed, else 0."""
    file = file or sys.stdout
    extension.cudnn_unavailable_reason()  # loads cuDNN (where there is one) before its version is read
    print("\n".join(version_lines() + list(library_lines)), file=file, flush=True)
    start = time.perf_counter()
    rows = deep_check()
    print("\n".join(table_lines(rows)), file=file)
    counts = {status: sum(row.status == status for row in rows) for status in ("passed", "failed", "declined")}
    verdict = "FAILED" if counts["failed"] else "OK"
    print(
        f"selfcheck --deep: {verdict} ({counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['declined']} declined in {time.perf_counter() - start:.1f} s)",
        file=file,
    )
    return int(bool(counts["failed"]))
