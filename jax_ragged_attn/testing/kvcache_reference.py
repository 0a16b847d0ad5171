"""A float64 NumPy reference for attention over a KV cache, written from the semantics, for tests only.

It loops over sequences and queries and reads the cache one row at a time through the page table, sharing no
code with the backends (nor with backends/shared/kvcache_config.py):

- Sequence b uses rows 0 .. n - 1 of its cache, n = cache_seqlens[b] clamped into [0, capacity]; row r is
  k_cache[b, r] (contiguous) or k_cache[page_table[b, r // P], r % P] (paged, page size P). A row whose
  page-table entry lies outside [0, num_pages) is absent: no key.
- Query i sits at position n - Sq + i. is_causal keeps rows r <= position; local_window_size (left, right)
  keeps position - left <= r <= position + right (an int w means (w, w); a negative side has no limit).
- Query head h reads kv head h // (Hq // Hkv). stats: natural-log log-sum-exp of the kept scores.
- A query with no key: out 0, stats -inf; with sinks, p = exp(s) / (sum exp(s) + exp(sink_h)), and a query
  with no key has stats sink_h, out 0.
"""

from __future__ import annotations

import math

import numpy as np


def _window(local_window_size):
    if local_window_size is None:
        return None, None
    left, right = (local_window_size if isinstance(local_window_size, (tuple, list))
                   else (local_window_size, local_window_size))
    return (None if left < 0 else int(left)), (None if right < 0 else int(right))


def reference_kvcache_attention(q, k_cache, v_cache, cache_seqlens, *, page_table=None, scale=None,
                                is_causal=True, local_window_size=None, sinks=None,
                                softcap=None) -> dict[str, np.ndarray]:
    """{"out": [B, Sq, Hq, Dv], "stats": [B, Hq, Sq] head-major} in float64."""
    q, k_cache, v_cache = (np.asarray(x, np.float64) for x in (q, k_cache, v_cache))
    batch, seqlen_q, heads_q, dim = q.shape
    group = heads_q // k_cache.shape[2]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    left, right = _window(local_window_size)
    if page_table is None:
        capacity = k_cache.shape[1]
    else:
        page_table = np.asarray(page_table, np.int64)
        page_size, num_pages = k_cache.shape[1], k_cache.shape[0]
        capacity = page_table.shape[1] * page_size
    out = np.zeros((batch, seqlen_q, heads_q, v_cache.shape[3]))
    stats = np.full((batch, heads_q, seqlen_q), -np.inf)
    for b in range(batch):
        n = min(max(int(cache_seqlens[b]), 0), capacity)
        keys, values, rows = [], [], []
        for r in range(n):
            if page_table is None:
                keys.append(k_cache[b, r]), values.append(v_cache[b, r]), rows.append(r)
            else:
                page = page_table[b, r // page_size]
                if 0 <= page < num_pages:
                    keys.append(k_cache[page, r % page_size]), values.append(v_cache[page, r % page_size])
                    rows.append(r)
        rows = np.asarray(rows, np.int64)
        for i in range(seqlen_q):
            position = n - seqlen_q + i
            keep = np.ones(len(rows), bool)
            if is_causal:
                keep &= rows <= position
            if left is not None:
                keep &= rows >= position - left
            if right is not None:
                keep &= rows <= position + right
            chosen = np.flatnonzero(keep)
            for h in range(heads_q):
                sink = None if sinks is None else float(sinks[h])
                if not len(chosen):
                    stats[b, h, i] = -np.inf if sink is None else sink
                    continue
                kk = np.stack([keys[j][h // group] for j in chosen])
                vv = np.stack([values[j][h // group] for j in chosen])
                s = kk @ q[b, i, h] * scale
                if softcap:  # logit soft-capping, before the softmax (the mask chose `chosen` already)
                    s = softcap * np.tanh(s / softcap)
                top = s.max() if sink is None else max(s.max(), sink)
                e = np.exp(s - top)
                total = e.sum() + (0.0 if sink is None else math.exp(sink - top))
                out[b, i, h] = e @ vv / total
                stats[b, h, i] = top + math.log(total)
    return {"out": out, "stats": stats}
