"""A float64 NumPy reference for attention over a KV cache, written from the semantics, for tests only.

It loops over sequences and queries and reads the cache one row at a time through the page table, sharing no
code with the backends (nor with index/kvcache.py):

- Sequence b uses rows 0 .. n - 1 of its cache, n = cache_seqlens[b] clamped into [0, capacity]; row r is
  k_cache[b, r] (contiguous) or k_cache[page_table[b, r // P], r % P] (paged, page size P). A row whose
  page-table entry lies outside [0, num_pages) is absent: no key.
- Query i sits at position n - Sq + i. is_causal keeps rows r <= position; local_window_size (left, right)
  keeps position - left <= r <= position + right (an int w means (w, w); a negative side has no limit).
- Query head h reads kv head h // (Hq // Hkv). stats: natural-log log-sum-exp of the kept scores.
- A query with no key: out 0, stats -inf; with sinks, p = exp(s) / (sum exp(s) + exp(sink_h)), and a query
  with no key has stats sink_h, out 0.
- Packed queries (reference_kvcache_attention_packed): q [T, Hq, D]; sequence b's queries are rows
  cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1, at most max_seqlen_q of them (cu_seqlens_q clamped monotone into
  [0, T] first), n_b in all; query i sits at position n - n_b + i. Every other row: out 0, stats -inf.
"""

from __future__ import annotations

import math

import numpy as np


def _window(local_window_size):
    if local_window_size is None:
        return None, None
    left, right = (
        local_window_size if isinstance(local_window_size, (tuple, list)) else (local_window_size, local_window_size)
    )
    return (None if left < 0 else int(left)), (None if right < 0 else int(right))


def reference_kvcache_attention(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    *,
    page_table=None,
    scale=None,
    is_causal=True,
    local_window_size=None,
    sinks=None,
    softcap=None,
) -> dict[str, np.ndarray]:
    """{"out": [B, Sq, Hq, Dv], "stats": [B, Hq, Sq] head-major} in float64."""
    q = np.asarray(q, np.float64)
    batch, seqlen_q, heads_q, _ = q.shape
    cache = _Cache(
        k_cache, v_cache, page_table, heads_q, scale, is_causal, local_window_size, sinks, softcap, q.shape[3]
    )
    out = np.zeros((batch, seqlen_q, heads_q, cache.v.shape[3]))
    stats = np.full((batch, heads_q, seqlen_q), -np.inf)
    for b in range(batch):
        n = cache.length(cache_seqlens[b])
        rows = cache.rows(b, n)
        for i in range(seqlen_q):
            out[b, i], stats[b, :, i] = cache.attend(q[b, i], rows, n - seqlen_q + i)
    return {"out": out, "stats": stats}


def reference_kvcache_attention_packed(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    cu_seqlens_q,
    max_seqlen_q,
    *,
    page_table=None,
    scale=None,
    is_causal=True,
    local_window_size=None,
    sinks=None,
    softcap=None,
) -> dict[str, np.ndarray]:
    """{"out": [T, Hq, Dv], "stats": [Hq, T] head-major} in float64, for packed queries q [T, Hq, D]."""
    q = np.asarray(q, np.float64)
    total, heads_q, _ = q.shape
    cache = _Cache(
        k_cache, v_cache, page_table, heads_q, scale, is_causal, local_window_size, sinks, softcap, q.shape[2]
    )
    cu = np.clip(np.maximum.accumulate(np.asarray(cu_seqlens_q, np.int64)), 0, total)
    out = np.zeros((total, heads_q, cache.v.shape[3]))
    stats = np.full((heads_q, total), -np.inf)
    for b in range(len(cu) - 1):
        n = cache.length(cache_seqlens[b])
        count = min(int(cu[b + 1] - cu[b]), max_seqlen_q)
        rows = cache.rows(b, n)
        for i in range(count):
            out[cu[b] + i], stats[:, cu[b] + i] = cache.attend(q[cu[b] + i], rows, n - count + i)
    return {"out": out, "stats": stats}


class _Cache:
    """One call's cache and options: a sequence's rows, and one query's attention over them."""

    def __init__(self, k_cache, v_cache, page_table, heads_q, scale, is_causal, local_window_size, sinks, softcap, dim):
        self.k, self.v = np.asarray(k_cache, np.float64), np.asarray(v_cache, np.float64)
        self.group = heads_q // self.k.shape[2]
        self.scale = 1.0 / math.sqrt(dim) if scale is None else scale
        self.is_causal, self.sinks, self.softcap = is_causal, sinks, softcap
        self.left, self.right = _window(local_window_size)
        self.table = None if page_table is None else np.asarray(page_table, np.int64)
        self.capacity = self.k.shape[1] * (1 if self.table is None else self.table.shape[1])

    def length(self, cache_seqlen) -> int:
        return min(max(int(cache_seqlen), 0), self.capacity)

    def rows(self, b: int, n: int):
        """(keys, values, row numbers) of sequence b's first n rows, rows on pages outside the cache left out."""
        keys, values, rows = [], [], []
        page_size, num_pages = self.k.shape[1], self.k.shape[0]
        for r in range(n):
            if self.table is None:
                keys.append(self.k[b, r]), values.append(self.v[b, r]), rows.append(r)
            else:
                page = self.table[b, r // page_size]
                if 0 <= page < num_pages:
                    keys.append(self.k[page, r % page_size]), values.append(self.v[page, r % page_size])
                    rows.append(r)
        return keys, values, np.asarray(rows, np.int64)

    def attend(self, query, sequence_rows, position: int):
        """(out [Hq, Dv], stats [Hq]) of one query [Hq, D] at `position` over a sequence's rows()."""
        keys, values, rows = sequence_rows
        keep = np.ones(len(rows), bool)
        if self.is_causal:
            keep &= rows <= position
        if self.left is not None:
            keep &= rows >= position - self.left
        if self.right is not None:
            keep &= rows <= position + self.right
        chosen = np.flatnonzero(keep)
        heads_q = query.shape[0]
        out, stats = np.zeros((heads_q, self.v.shape[3])), np.full(heads_q, -np.inf)
        for h in range(heads_q):
            sink = None if self.sinks is None else float(self.sinks[h])
            if not len(chosen):
                stats[h] = -np.inf if sink is None else sink
                continue
            kk = np.stack([keys[j][h // self.group] for j in chosen])
            vv = np.stack([values[j][h // self.group] for j in chosen])
            s = kk @ query[h] * self.scale
            if self.softcap:  # logit soft-capping, before the softmax (the mask chose `chosen` already)
                s = self.softcap * np.tanh(s / self.softcap)
            top = s.max() if sink is None else max(s.max(), sink)
            e = np.exp(s - top)
            total = e.sum() + (0.0 if sink is None else math.exp(sink - top))
            out[h] = e @ vv / total
            stats[h] = top + math.log(total)
        return out, stats
