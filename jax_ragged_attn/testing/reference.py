"""A float64 NumPy reference for ragged attention, written for clarity rather than speed.

It loops over sequences and materialises each sequence's full score matrix, so it is only for tests and
benchmarks on small shapes. It shares no code with the backends: everything here is spelled out again
from the project's semantics, including the analytic backward pass, so agreement means something.

Semantics, over packed buffers q [Tq, Hq, Dqk], k [Tkv, Hkv, Dqk], v [Tkv, Hkv, Dv]:

- Sequence b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1] and key rows
  cu_seqlens_kv[b]:cu_seqlens_kv[b+1]. Zero-length sequences are allowed. Rows past cu[-1] are padding.
- A sequence longer than max_seqlen is clamped: its length is min(cu[b+1] - cu[b], max_seqlen) and its
  rows beyond that are treated like padding. max_seqlen fixes the size of the kernels' per-sequence tiles,
  so rows past it are never visited. For example cu_seqlens_q = [0, 5, 7] with max_seqlen_q = 3: sequence 0
  is query rows 0, 1, 2 (rows 3 and 4 are treated as padding) and sequence 1 is rows 5, 6.
- Query head h reads kv head h // (Hq // Hkv).
- Query i and key j of one sequence (0-based, lengths sq and skv) sit on diagonal d = i ("top_left") or
  d = i + skv - sq ("bottom_right"). is_causal keeps j <= d; local_window_size (left, right) keeps
  d - left <= j <= d + right (an int w means (w, w); a negative side, FlashAttention's -1, has no limit).
  Both may apply at once.
- softcap c > 0 caps the scores before the mask: s = c * tanh(scale * q.k / c) (Gemma 2); None or 0: s = scale * q.k.
- stats is the natural-log log-sum-exp of the scores s over the attended keys, token-major [Tq, Hq].
- A query row with no attended key, and every padding row: out 0, stats -inf, gradients 0. Padding rows
  are never read, so NaN there cannot reach any result.
"""

from __future__ import annotations

import math

import numpy as np

# Spelled out again rather than imported from config, which imports JAX: the reference is NumPy only.
DIAGONAL_ALIGNMENTS = ("top_left", "bottom_right")


def _window(local_window_size) -> tuple[int | None, int | None]:
    if local_window_size is None:
        return None, None
    if isinstance(local_window_size, (tuple, list)):
        left, right = local_window_size
    else:
        left = right = local_window_size
    return (None if int(left) < 0 else int(left)), (None if int(right) < 0 else int(right))


def _mask(sq: int, skv: int, *, is_causal, diagonal_alignment, window) -> np.ndarray:
    """[sq, skv] bool: which keys each query of one sequence attends to."""
    i = np.arange(sq)[:, None]
    j = np.arange(skv)[None, :]
    diagonal = i if diagonal_alignment == "top_left" else i + (skv - sq)
    keep = np.ones((sq, skv), dtype=bool)
    if is_causal:
        keep &= j <= diagonal
    left, right = window
    if left is not None:
        keep &= j >= diagonal - left
    if right is not None:
        keep &= j <= diagonal + right
    return keep


def _span(cu: np.ndarray, b: int, max_seqlen: int) -> slice:
    start = int(cu[b])
    length = min(max(int(cu[b + 1]) - start, 0), max_seqlen)
    return slice(start, start + length)


def reference_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_kv,
    *,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    scale: float | None = None,
    is_causal: bool = False,
    diagonal_alignment: str = "top_left",
    local_window_size=None,
    d_out=None,
    d_stats=None,
    sinks=None,
    softcap: float | None = None,
) -> dict[str, np.ndarray]:
    """Attention over packed sequences in float64; see the module docstring for the semantics.

    Returns {"out": [Tq, Hq, Dv], "stats": [Tq, Hq]} and, when d_out ([Tq, Hq, Dv]) is given, also
    "dq", "dk", "dv": the vector-Jacobian product for cotangents d_out and d_stats ([Tq, Hq], token-major;
    None means zero).

    sinks ([Hq] or None): one learnable logit per query head that joins every row's softmax without a
    value (gpt-oss): p_ij = exp(s_ij) / (sum_j exp(s_ij) + exp(sink_h)). A real query row with no attended
    key has the sink as its whole softmax: out 0, stats sink_h (padding rows stay -inf). With d_out, the
    result also holds "dsinks" [Hq].

    softcap (None, 0 or c > 0): the scores are c * tanh(scale * q.k / c); the gradients carry the cap's
    derivative 1 - tanh^2.
    """
    if diagonal_alignment not in DIAGONAL_ALIGNMENTS:
        raise ValueError(f"diagonal_alignment must be one of {DIAGONAL_ALIGNMENTS}, got {diagonal_alignment!r}")
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    cu_q = np.asarray(cu_seqlens_q, dtype=np.int64)
    cu_kv = np.asarray(cu_seqlens_kv, dtype=np.int64)
    tq, hq, dqk = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    if scale is None:
        scale = 1.0 / math.sqrt(dqk)
    window = _window(local_window_size)
    sinks = None if sinks is None else np.asarray(sinks, dtype=np.float64)

    out = np.zeros((tq, hq, v.shape[2]))
    stats = np.full((tq, hq), -np.inf)
    grads = d_out is not None
    if grads:
        d_out = np.asarray(d_out, dtype=np.float64)
        d_stats = np.zeros((tq, hq)) if d_stats is None else np.asarray(d_stats, dtype=np.float64)
        dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
        dsinks = np.zeros(hq)

    for b in range(len(cu_q) - 1):
        rows_q = _span(cu_q, b, max_seqlen_q)
        rows_kv = _span(cu_kv, b, max_seqlen_kv)
        sq, skv = rows_q.stop - rows_q.start, rows_kv.stop - rows_kv.start
        if sq == 0:
            continue
        keep = _mask(sq, skv, is_causal=is_causal, diagonal_alignment=diagonal_alignment, window=window)
        attended = keep.any(axis=1)  # [sq]; rows without a key keep out 0 and stats -inf

        qb = q[rows_q]  # [sq, Hq, Dqk]
        kb = np.repeat(k[rows_kv], group, axis=1)  # [skv, Hq, Dqk]: query head h reads kv head h // group
        vb = np.repeat(v[rows_kv], group, axis=1)  # [skv, Hq, Dv]

        scores = scale * np.einsum("ihd,jhd->hij", qb, kb)
        if softcap:
            capped = np.tanh(scores / softcap)  # [Hq, sq, skv], kept for the backward's derivative
            scores = softcap * capped
        scores = np.where(keep, scores, -np.inf)
        row_max = np.where(attended, scores.max(axis=2, initial=-np.inf), 0.0)  # [Hq, sq]
        if sinks is not None:  # the sink joins the softmax: shift by the larger of the two
            row_max = np.where(attended, np.maximum(row_max, sinks[:, None]), sinks[:, None])
            # A real row without keys has the sink as its whole softmax: stats = sink, out 0.
            attended = np.ones_like(attended)
        unnormalised = np.where(keep, np.exp(scores - row_max[:, :, None]), 0.0)
        row_sum = unnormalised.sum(axis=2)
        if sinks is not None:
            sink_weight = np.where(attended, np.exp(sinks[:, None] - row_max), 0.0)  # [Hq, sq]
            row_sum = row_sum + sink_weight
        # Rows without a key divide 0 by 1 so that p stays 0 there instead of becoming NaN.
        p = unnormalised / np.where(attended, row_sum, 1.0)[:, :, None]  # [Hq, sq, skv]
        ob = np.einsum("hij,jhd->ihd", p, vb)
        out[rows_q] = ob
        stats[rows_q] = np.where(attended, row_max + np.log(np.where(attended, row_sum, 1.0)), -np.inf).T

        if not grads:
            continue
        dob = d_out[rows_q]  # [sq, Hq, Dv]
        dp = np.einsum("ihd,jhd->hij", dob, vb)
        delta = np.einsum("ihd,ihd->hi", dob, ob)  # D_i = rowsum(dO * O)
        # d stats_i / d s_ij = p_ij, so the stats cotangent adds p * d_stats to the softmax backward.
        ds = p * (dp - delta[:, :, None] + d_stats[rows_q].T[:, :, None])  # [Hq, sq, skv]
        if sinks is not None:
            # The sink's logit gets the same softmax gradient as a key's, with no value: p_sink * (g - D).
            p_sink = sink_weight / np.where(attended, row_sum, 1.0)
            dsinks += (p_sink * (d_stats[rows_q].T - delta)).sum(axis=1)
        if softcap:  # d (c * tanh(x / c)) / dx = 1 - tanh(x / c)^2: dS of the capped scores to the raw ones
            ds = ds * (1.0 - capped**2)
        dq[rows_q] = scale * np.einsum("hij,jhd->ihd", ds, kb)
        dk_heads = scale * np.einsum("hij,ihd->jhd", ds, qb)  # [skv, Hq, Dqk]
        dv_heads = np.einsum("hij,ihd->jhd", p, dob)  # [skv, Hq, Dv]
        # The query heads of one group all read the same kv head, so their gradients add up there.
        dk[rows_kv] = dk_heads.reshape(skv, hkv, group, dqk).sum(axis=2)
        dv[rows_kv] = dv_heads.reshape(skv, hkv, group, v.shape[2]).sum(axis=2)

    result = {"out": out, "stats": stats}
    if grads:
        result.update(dq=dq, dk=dk, dv=dv)
        if sinks is not None:
            result["dsinks"] = dsinks
    return result
