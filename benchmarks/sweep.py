"""A seeded sweep over random configurations, in the spirit of cudnn-frontend's test_mhas_v2.py.

    python -m benchmarks.sweep --tier cpu --seed 0 --num-tests 200
    python -m benchmarks.sweep --repro '{"seed": 17, ...}'   # what a failing case prints

`draw_case(seed, tier)` draws one configuration with weights towards the awkward corners (empty sequences,
one long sequence among short ones, capacity slack, windows, GQA/MQA); the case is a plain JSON dict that
spells out its lengths, so a repro does not depend on the drawing code staying the same. `run_case(case)`
runs forward and backward under jax.jit and holds every result to the float64 NumPy reference, and the
rows that belong to no sequence to exact 0 / -inf. Every row that belongs to no sequence (capacity padding,
and rows past max_seqlen in a repro that gives one) is NaN in q, k, v and in the output cotangent, so any read
of one shows.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import functools
import itertools
import json
import multiprocessing
import os
import shlex
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jax_ragged_attn.backends.cudnn import ragged as cudnn
from jax_ragged_attn.backends.shared import extension, stats_grad
from jax_ragged_attn.config import STRATEGIES
from jax_ragged_attn.ops import ragged as api
from jax_ragged_attn.testing import assert_close, packed_batch
from jax_ragged_attn.testing.reference import reference_attention

# Per tier. tokens: the most tokens on each side (q, kv); longest: the longest sequence; work: the most
# multiply-adds of the reference, which is a float64 NumPy loop (about 1e9 a second) and, on the CPU tier,
# also bounds the xla path's padded B * Sq * Skv work. Head dims of the CPU tier are the GPU set divided
# by 8 (9 is deliberately not a multiple of 8). compiler_options: the CPU tier compiles one program per case
# and spends most of its time compiling; LLVM's -O0 halves that and leaves XLA's own HLO passes, which
# decide the arithmetic, as they are.
TIERS = {
    "cpu": dict(
        implementation="xla",
        tokens=256,
        longest=64,
        work=2e6,
        slack=(4, 64),
        compiler_options={"xla_backend_optimization_level": 0},
        dtypes=(("float32", 2), ("bfloat16", 1), ("float16", 1)),
        heads=(((2, 2), 2), ((4, 4), 1), ((4, 2), 2), ((6, 2), 1), ((3, 1), 1), ((4, 1), 1)),
        dims=(((8, 8), 3), ((9, 9), 1), ((16, 16), 2), ((24, 16), 1), ((32, 32), 1)),
        window=16,
    ),
    "gpu": dict(
        implementation="cudnn",
        tokens=4096,
        longest=1024,
        work=2e9,
        slack=(64, 2048),
        compiler_options={},
        dtypes=(("bfloat16", 2), ("float16", 1)),
        heads=(((8, 8), 2), ((16, 16), 1), ((8, 2), 2), ((16, 4), 1), ((8, 1), 1), ((16, 1), 1)),
        dims=(((64, 64), 2), ((72, 72), 1), ((128, 128), 3), ((192, 128), 1), ((256, 256), 1)),
        window=256,
    ),
}
BATCH_SIZES = ((1, 3), (2, 3), (3, 2), (4, 2), (5, 1), (8, 2), (16, 1), (32, 1), (64, 1))
LENGTHS = (("uniform", 3), ("heavy_tailed", 2), ("many_zero", 2), ("all_equal", 1), ("one_long", 2))


def _pick(rng: np.random.Generator, weighted):
    """One value of a ((value, weight), ...) table."""
    values, weights = zip(*weighted)
    return values[rng.choice(len(values), p=np.array(weights) / sum(weights))]


def _lengths(rng, kind: str, num_seqs: int, longest: int) -> list[int]:
    if kind == "uniform":
        lengths = rng.integers(0, longest, size=num_seqs, endpoint=True)
    elif kind == "heavy_tailed":  # mostly short, now and then up to `longest`
        lengths = np.minimum(rng.pareto(1.2, size=num_seqs) * longest / 8, longest).astype(int)
    elif kind == "many_zero":
        lengths = np.where(rng.random(num_seqs) < 0.6, 0, rng.integers(1, longest, size=num_seqs, endpoint=True))
    elif kind == "all_equal":
        lengths = np.full(num_seqs, rng.integers(1, longest, endpoint=True))
    else:  # one_long: one sequence of `longest` among short ones
        lengths = rng.integers(0, max(longest // 16, 2), size=num_seqs, endpoint=True)
        lengths[rng.integers(num_seqs)] = longest
    return [int(n) for n in lengths]


def _fit(lengths: list[int], budget: int) -> list[int]:
    """Halves lengths (zeros stay zero, the shape of the distribution stays) until they sum to <= budget."""
    while sum(lengths) > budget:
        lengths = [n // 2 for n in lengths]
    return lengths


def _slack(rng, small: int, large: int) -> int:
    return int(
        _pick(
            rng,
            (
                (0, 2),
                (int(rng.integers(1, small, endpoint=True)), 2),
                (int(rng.integers(small, large, endpoint=True)), 1),
            ),
        )
    )


def _max_seqlen(rng, lengths: list[int]) -> int:
    """Usually the longest length; sometimes more (a graph built for longer sequences). Never less: a sequence
    longer than max_seqlen is invalid input and reads NaN (tests/test_loud_rows.py), so the reference's numbers
    are not what the op returns for it."""
    longest = max(max(lengths), 1)
    kind = _pick(rng, (("exact", 7), ("more", 2), ("exact", 1)))  # three weights: the same draws of rng as ever
    if kind == "more":
        return longest + int(rng.integers(1, longest, endpoint=True))
    return longest


def _work(case: dict) -> float:
    """Multiply-adds of the reference (per sequence) and of the padded xla path, whichever is larger."""
    heads, dims = case["num_heads_q"], case["head_dim_qk"] + case["head_dim_v"]
    per_sequence = sum(
        min(a, case["max_seqlen_q"]) * min(b, case["max_seqlen_kv"])
        for a, b in zip(case["seqlens_q"], case["seqlens_kv"])
    )
    padded = len(case["seqlens_q"]) * case["max_seqlen_q"] * case["max_seqlen_kv"]
    return max(per_sequence, padded if case["tier"] == "cpu" else 0) * heads * dims


def draw_case(seed: int, tier: str = "cpu") -> dict:
    """One configuration, a JSON-able dict; the same seed and tier always give the same dict."""
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {tuple(TIERS)}, got {tier!r}")
    spec = TIERS[tier]
    rng = np.random.default_rng(seed)
    num_seqs = int(_pick(rng, BATCH_SIZES))
    kind = _pick(rng, LENGTHS)
    longest = int(rng.integers(1, spec["longest"], endpoint=True))
    seqlens_q = _lengths(rng, kind, num_seqs, longest)
    # Self-attention (same lengths) or cross-attention (independent lengths of the same kind).
    seqlens_kv = list(seqlens_q) if rng.random() < 0.4 else _lengths(rng, kind, num_seqs, longest)
    seqlens_q, seqlens_kv = _fit(seqlens_q, spec["tokens"]), _fit(seqlens_kv, spec["tokens"])
    (hq, hkv), (dqk, dv) = _pick(rng, spec["heads"]), _pick(rng, spec["dims"])
    w = spec["window"]
    window = _pick(
        rng,
        (
            (None, 3),
            (int(rng.integers(0, w, endpoint=True)), 1),
            ([int(rng.integers(0, w, endpoint=True)), int(rng.integers(0, w // 4, endpoint=True))], 1),
        ),
    )
    case = dict(
        seed=int(seed),
        tier=tier,
        implementation=spec["implementation"],
        lengths=kind,
        seqlens_q=seqlens_q,
        seqlens_kv=seqlens_kv,
        slack_q=_slack(rng, *spec["slack"]),
        slack_kv=_slack(rng, *spec["slack"]),
        max_seqlen_q=_max_seqlen(rng, seqlens_q),
        max_seqlen_kv=_max_seqlen(rng, seqlens_kv),
        num_heads_q=hq,
        num_heads_kv=hkv,
        head_dim_qk=dqk,
        head_dim_v=dv,
        dtype=_pick(rng, spec["dtypes"]),
        scale=None if rng.random() < 0.8 else round(float(rng.uniform(0.05, 1.0)), 4),
        is_causal=bool(rng.random() < 0.5),
        diagonal_alignment=str(rng.choice(["top_left", "bottom_right"])),
        local_window_size=window,
        stats_layout=str(rng.choice(["head_major", "token_major"])),
        # A cotangent into stats: cuDNN carries it on Dv + 16 value columns (stats_grad.py), so its head dim
        # limit leaves Dv = 256 out. The draw comes first in the `and`: every case of both tiers makes it, so
        # the draws after it depend on neither Dv nor the implementation.
        stats_cotangent=bool(
            rng.random() < 0.5
            and (spec["implementation"] == "xla" or dv + stats_grad.EXTRA_COLUMNS <= cudnn.MAX_HEAD_DIM)
        ),
    )
    # Drawn last, so the axes above keep the values they had before this one existed. Check mode guards
    # every buffer the kernel writes with canary bands (cuDNN only; the xla path has no kernel to guard);
    # it also rejects sequences longer than max_seqlen, so cases that cut sequences run without it.
    check = spec["implementation"] == "cudnn" and rng.random() < 0.25
    # The cuDNN backward's intermediate layout (_cudnn/strategy.py): half the cases run the capacity-sized
    # one, the layout of cudnn-frontend <= 1.27's sizing bug (the mutation run needs them), half "fastest".
    case["strategy"] = str(rng.choice(STRATEGIES))
    while _work(case) > spec["work"]:  # shrink the lengths, not the variety of the other axes
        for side in ("q", "kv"):
            case[f"seqlens_{side}"] = [n // 2 for n in case[f"seqlens_{side}"]]
            case[f"max_seqlen_{side}"] = max(case[f"max_seqlen_{side}"] // 2, 1)
    cut = any(max(case[f"seqlens_{side}"], default=0) > case[f"max_seqlen_{side}"] for side in ("q", "kv"))
    case["check"] = bool(check and not cut)
    # A buffer needs at least one row, even when every sequence is empty.
    for side in ("q", "kv"):
        if sum(case[f"seqlens_{side}"]) + case[f"slack_{side}"] == 0:
            case[f"slack_{side}"] = 1
    return case


def describe(case: dict) -> str:
    """One short line: the axes a reader scans for."""
    window = case["local_window_size"]
    parts = [
        f"B={len(case['seqlens_q'])}",
        case["lengths"],
        f"T={sum(case['seqlens_q'])}+{case['slack_q']}/{sum(case['seqlens_kv'])}+{case['slack_kv']}",
        f"S={case['max_seqlen_q']}/{case['max_seqlen_kv']}",
        f"H={case['num_heads_q']}/{case['num_heads_kv']}",
        f"D={case['head_dim_qk']}/{case['head_dim_v']}",
        case["dtype"],
        "causal" if case["is_causal"] else "full",
        case["diagonal_alignment"],
        f"window={tuple(window) if isinstance(window, list) else window}",
        case["stats_layout"],
    ]
    if case["scale"] is not None:
        parts.append(f"scale={case['scale']}")
    if case["stats_cotangent"]:
        parts.append("d_stats")
    if case.get("check"):
        parts.append("check")
    if case["implementation"] == "cudnn" and case.get("strategy", "fastest") != "fastest":
        parts.append(case["strategy"])
    return " ".join(parts)


def repro_command(case: dict) -> str:
    return f"python -m benchmarks.sweep --repro {shlex.quote(json.dumps(case))}"


def _owned_rows(cu: np.ndarray, capacity: int, max_seqlen: int) -> np.ndarray:
    """[capacity] bool: the row belongs to a sequence (not padding, not cut by max_seqlen)."""
    owned = np.zeros(capacity, dtype=bool)
    for start, stop in itertools.pairwise(cu):
        owned[start : min(stop, start + max_seqlen)] = True
    return owned


def _poisoned(x: jax.Array, owned: np.ndarray):
    values = np.array(x)
    values[~owned] = np.nan
    return jnp.asarray(values), values.astype(np.float64)


def _inputs(case: dict):
    rng = np.random.default_rng([case["seed"], 1])  # the data's own stream, apart from the drawing's
    batch = packed_batch(
        rng,
        case["seqlens_q"],
        case["seqlens_kv"],
        num_heads_q=case["num_heads_q"],
        num_heads_kv=case["num_heads_kv"],
        head_dim_qk=case["head_dim_qk"],
        head_dim_v=case["head_dim_v"],
        dtype=case["dtype"],
        slack_q=case["slack_q"],
        slack_kv=case["slack_kv"],
    )
    # packed_batch poisons the capacity padding; poison the rows cut by max_seqlen as well.
    owned_q = _owned_rows(np.asarray(batch.cu_seqlens_q), batch.q.shape[0], case["max_seqlen_q"])
    owned_kv = _owned_rows(np.asarray(batch.cu_seqlens_kv), batch.k.shape[0], case["max_seqlen_kv"])
    q, q64 = _poisoned(batch.q, owned_q)
    k, k64 = _poisoned(batch.k, owned_kv)
    v, v64 = _poisoned(batch.v, owned_kv)
    tq, hq = q.shape[:2]
    d_out = rng.standard_normal((tq, hq, case["head_dim_v"])).astype(case["dtype"])
    d_out[~owned_q] = np.nan  # the cotangent of rows the op does not own must never be read
    d_stats = rng.standard_normal((tq, hq)).astype(np.float32) if case["stats_cotangent"] else None
    arrays = (q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_kv)
    reference_arrays = (q64, k64, v64, np.asarray(batch.cu_seqlens_q), np.asarray(batch.cu_seqlens_kv))
    return arrays, reference_arrays, d_out, d_stats, owned_kv


def _options(case: dict) -> dict:
    return dict(
        max_seqlen_q=case["max_seqlen_q"],
        max_seqlen_kv=case["max_seqlen_kv"],
        scale=case["scale"],
        is_causal=case["is_causal"],
        diagonal_alignment=case["diagonal_alignment"],
        local_window_size=case["local_window_size"],
    )


def _forward_backward(case: dict, arrays, d_out, d_stats):
    """(out, token-major stats, [dq, dk, dv]) from one jitted forward + backward, as jax arrays."""
    q, k, v, cu_q, cu_kv = arrays
    head_major = case["stats_layout"] == "head_major"

    def attend(q, k, v):
        return api.ragged_attention(
            q,
            k,
            v,
            cu_q,
            cu_kv,
            stats_layout=case["stats_layout"],
            return_stats=True,
            implementation=case["implementation"],
            check=case.get("check", False),
            strategy=case.get("strategy", "fastest"),
            **_options(case),
        )

    @functools.partial(jax.jit, compiler_options=TIERS[case["tier"]]["compiler_options"])
    def step(q, k, v, d_out, d_stats):
        if d_stats is None:  # stats as aux: no cotangent reaches them, and cuDNN runs its plain backward
            out, vjp, stats = jax.vjp(attend, q, k, v, has_aux=True)
            return out, stats, vjp(d_out)
        (out, stats), vjp = jax.vjp(attend, q, k, v)
        return out, stats, vjp((d_out, d_stats.T if head_major else d_stats))

    out, stats, grads = step(q, k, v, jnp.asarray(d_out), None if d_stats is None else jnp.asarray(d_stats))
    return out, stats.T if head_major else stats, list(grads)


def _compare(case: dict, arrays, reference_arrays, d_out, d_stats, owned_kv) -> None:
    """Raises AssertionError naming the first result that is off."""
    dtype = case["dtype"]
    out, stats, grads = _forward_backward(case, arrays, d_out, d_stats)
    names = ("out", "stats", "dq", "dk", "dv")
    wanted = (arrays[0].dtype, jnp.float32) + tuple(x.dtype for x in arrays[:3])
    for name, value, want in zip(names, [out, stats, *grads], wanted):
        assert value.dtype == want, f"{name} has dtype {value.dtype}, expected {np.dtype(want).name}"
    out, stats, dq, dk, dv = (np.asarray(x, np.float64) for x in (out, stats, *grads))

    expected = reference_attention(
        *reference_arrays,
        **_options(case),
        d_out=d_out.astype(np.float64),
        d_stats=None if d_stats is None else d_stats.astype(np.float64),
    )
    assert_close(out, expected["out"], dtype, "out")
    # stats are float32 whatever the input dtype (test_cudnn.py holds them to float32 as well).
    assert_close(stats, expected["stats"], "float32", "stats")
    for name, grad in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert_close(grad, expected[name], dtype, name)
    # assert_close only bounds these; rows that attend nothing and rows no sequence owns must be exact.
    empty = np.isneginf(expected["stats"])  # [Tq, Hq]
    for name, value in (("out", out), ("dq", dq)):
        bad = empty & (value != 0).any(axis=-1)
        assert not bad.any(), (
            f"{name}: {int(bad.sum())} (row, head) pairs that attend no key are not exactly 0, "
            f"e.g. {tuple(int(i) for i in np.argwhere(bad)[0])}"
        )
    for name, grad in (("dk", dk), ("dv", dv)):
        bad = ~owned_kv & (grad != 0).any(axis=(1, 2))
        assert not bad.any(), (
            f"{name}: {int(bad.sum())} key rows that belong to no sequence are not exactly 0, "
            f"e.g. row {int(np.argmax(bad))}"
        )


def run_case(case: dict) -> tuple[str, str]:
    """("passed" | "skipped" | "failed", message). Only cuDNN declining the configuration is a skip."""
    if case["implementation"] == "cudnn":
        reason = extension.cudnn_unavailable_reason()
        if reason is not None:
            return "skipped", f"cuDNN path unavailable: {reason}"
    try:
        _compare(case, *_inputs(case))
    except NotImplementedError as error:
        if "cuDNN cannot run this" in str(error):  # the graph is not supported: cudnn.graph_info's wording
            return "skipped", str(error)
        return "failed", _failure(case, error)
    except Exception as error:  # noqa: BLE001 - every other exception is a failure, reported with its repro
        return "failed", _failure(case, error)
    return "passed", ""


def _failure(case: dict, error: BaseException) -> str:
    what = "".join(traceback.format_exception_only(type(error), error)).strip()
    return f"{what}\n  repro: {repro_command(case)}"


def _run_all(cases: list[dict], jobs: int):
    """run_case over the cases, in order; with jobs > 1 in spawned worker processes (JAX is not fork-safe)."""
    if jobs == 1:
        yield from map(run_case, cases)
        return
    # Each worker is a JAX client of the same GPU: without this, the first one takes 75 % of its memory.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        yield from pool.map(run_case, cases)


def case_line(i: int, total: int, case: dict, status: str, message: str, description: str) -> str:
    """One case's line of a sweep's log: its seed, status and description, a skip's reason, a failure's repro."""
    line = f"[{i + 1}/{total}] seed={case['seed']} {status.upper():7} {description}"
    if status == "skipped":
        return line + f" ({message})"
    return line + f"\n  {message}" if status == "failed" else line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the first case's seed; case i uses seed + i")
    parser.add_argument("--num-tests", type=int, default=100)
    parser.add_argument("--tier", choices=tuple(TIERS), default="cpu")
    parser.add_argument("--repro", metavar="JSON", help="run exactly this case (as a failure prints it)")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="worker processes (each compiles its own cases; the float64 reference and XLA's "
        "compiler, not the GPU, bound a GPU sweep)",
    )
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.repro is not None:
        cases = [json.loads(args.repro)]
    else:
        cases = [draw_case(args.seed + i, args.tier) for i in range(args.num_tests)]

    counts, skips, failures = collections.Counter(), collections.Counter(), []
    for i, (case, (status, message)) in enumerate(zip(cases, _run_all(cases, args.jobs))):
        counts[status] += 1
        if status == "skipped":
            skips[message] += 1
        elif status == "failed":
            failures.append(case["seed"])
        print(case_line(i, len(cases), case, status, message, describe(case)), flush=True)

    print(f"\n{len(cases)} cases: {counts['passed']} passed, {counts['skipped']} skipped, {counts['failed']} failed")
    for reason, n in skips.most_common():
        print(f"  skipped {n}: {reason}")
    if failures:
        print(f"  failed seeds: {failures}")
    # The verdict last, so the one line a log tail shows answers "did it pass?".
    print(
        f"sweep: {counts['passed']} passed, {counts['skipped']} skipped, {counts['failed']} failed - "
        + ("FAILED" if failures else "OK")
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
