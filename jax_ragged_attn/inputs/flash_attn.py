"""FlashAttention's varlen and KV-cache calls, with their names and their semantics, over this package's ops.

    from jax_ragged_attn import flash_attn_varlen_func      # was: from flash_attn import flash_attn_varlen_func
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True)

The call reads as FlashAttention 2's (`flash_attn.flash_attn_varlen_func`, `flash_attn_with_kvcache`), and means
what FlashAttention 2.1+ and 3 mean: the causal diagonal and the window are aligned bottom-right, per sequence
(query i of a sequence with sq queries and sk keys sees keys j <= i + sk - sq; `window_size=(left, right)` keeps
i + sk - sq - left <= j <= i + sk - sq + right, -1 unlimited). `ragged_attention` itself aligns them top-left
unless told `diagonal_alignment="bottom_right"`: the same for self-attention of equal lengths, different for
cross-attention (docs/COMING_FROM.md). Where the results differ from FlashAttention's, by design:

- softmax_lse is -inf for a query row that attends no key (FlashAttention 3 too; FlashAttention 2 writes +inf
  there), and every row past cu_seqlens_q[-1] reads out 0 and lse -inf (FlashAttention leaves them unspecified).
- return_attn_probs=True returns (out, softmax_lse, None): FlashAttention 2's three results, whose third, the
  probabilities, it returns only with dropout (an empty tensor otherwise); FlashAttention 3's varlen returns
  two, (out, softmax_lse), so code from it unpacks `out, lse, _ = ...`.
- gradients flow into softmax_lse too (FlashAttention drops its cotangent).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_ragged_attn.index import as_int32, sanitize_cu_seqlens
from jax_ragged_attn.ops.kvcache import kvcache_append, ragged_attention_with_kvcache
from jax_ragged_attn.ops.ragged import ragged_attention


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    seqused_q=None,
    seqused_k=None,
    implementation=None,
):
    """FlashAttention's `flash_attn_varlen_func` (2.1+ semantics, 2's argument order) on `ragged_attention`.

    Args:
      q: [total_q, Hq, Dqk]; k: [total_k, Hkv, Dqk]; v: [total_k, Hkv, Dv]; Hq a multiple of Hkv (query head h
        reads kv head h // (Hq // Hkv), as in FlashAttention). Rows past cu_seqlens[-1] are padding.
      cu_seqlens_q, cu_seqlens_k: integer [B + 1] offsets (any integer dtype).
      max_seqlen_q, max_seqlen_k: static Python ints bounding every sequence's length.
      dropout_p: must be 0.0: no implementation here has attention dropout (NotImplementedError otherwise).
      softmax_scale: multiplies q.k; None is 1/sqrt(Dqk).
      causal: query i of a sequence sees keys j <= i + sk - sq (bottom-right, per sequence).
      window_size: (left, right), -1 (any negative) unlimited; aligned bottom-right like causal.
      softcap: 0.0 off, c > 0 caps the scores to c * tanh(s / c).
      alibi_slopes: must be None (NotImplementedError otherwise: no implementation here adds ALiBi biases).
      deterministic: a bit-reproducible backward (cuDNN's deterministic kernels; the xla path always is).
      return_attn_probs: also return softmax_lse and None (below).
      block_table: must be None (FlashAttention 2's paged varlen call); decode against a paged cache with
        flash_attn_with_kvcache(block_table=...).
      seqused_q, seqused_k: keyword-only (FlashAttention 3's): None, or integer [B]; sequence b uses only the
        first seqused[b] rows of its slot cu_seqlens[b]:cu_seqlens[b+1].
      implementation: keyword-only, as `ragged_attention`'s: None chooses by the shipped policy (FA3 from
        1,024 tokens a sequence where one of its wheels is installed, cuDNN, else the xla path); "cudnn", "fa3"
        or "xla" asks for one.

    Returns:
      out [total_q, Hq, Dv] in q's dtype; with return_attn_probs=True, (out, softmax_lse, None) where
      softmax_lse is the float32 natural-log log-sum-exp of the scaled scores, [Hq, total_q] (FlashAttention's
      varlen layout), -inf on rows that attend no key and on padding rows.
    """
    _unsupported(
        dropout_p=(
            dropout_p != 0,
            "no implementation here has attention dropout: pass dropout_p=0.0 "
            "(apply dropout to the attention's output or inputs instead)",
        ),
        alibi_slopes=(alibi_slopes is not None, "no implementation here adds ALiBi biases"),
        block_table=(
            block_table is not None,
            "a paged cache is read by flash_attn_with_kvcache("
            "block_table=...) or ragged_attention_with_kvcache("
            "page_table=...)",
        ),
    )
    result = ragged_attention(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_k,
        scale=softmax_scale,
        is_causal=_flag(causal, "causal"),
        diagonal_alignment="bottom_right",
        local_window_size=_window(window_size),
        softcap=_softcap(softcap),
        deterministic=_flag(deterministic, "deterministic"),
        return_stats=_flag(return_attn_probs, "return_attn_probs"),
        stats_layout="head_major",
        seqused_q=seqused_q,
        seqused_kv=seqused_k,
        implementation=implementation,
    )
    if not return_attn_probs:
        return result
    out, lse = result
    return out, lse, None


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    page_table=None,
    cu_seqlens_q=None,
    cu_seqlens_k_new=None,
    max_seqlen_q=None,
    implementation=None,
):
    """FlashAttention's `flash_attn_with_kvcache` on `kvcache_append` and `ragged_attention_with_kvcache`.

    FlashAttention writes k and v into the caches in place. JAX arrays are immutable, so here the updated caches
    are returned: with k and v given, the result is (out, k_cache, v_cache), or (out, softmax_lse, k_cache,
    v_cache) with return_softmax_lse=True; without them, out or (out, softmax_lse) as FlashAttention returns.
    Under jax.jit with the caches donated (donate_argnums), XLA writes them in place, with no copy.

    Args:
      q: [B, Sq, Hq, Dqk], each sequence's newest Sq queries; with cu_seqlens_q, packed [T, Hq, Dqk].
      k_cache, v_cache: contiguous [B, L, Hkv, D], or paged [num_pages, page_size, Hkv, D] with block_table.
      k, v: None, or [B, Sn, Hkv, D]: new keys and values, written at rows cache_seqlens[b] .. + Sn - 1 of
        sequence b's cache before the attention (rows past the capacity are dropped); with cu_seqlens_k_new,
        packed [T_new, Hkv, D], sequence b's being rows cu_seqlens_k_new[b] .. cu_seqlens_k_new[b + 1] - 1.
      cache_seqlens: int or integer [B]: the rows of each cache in use BEFORE k and v are appended (FlashAttention's
        meaning); the queries attend cache_seqlens + Sn keys. None: the whole capacity (L, or max_pages *
        page_size), which needs k and v to be None.
      block_table (FlashAttention 2's name) or page_table (FlashAttention 3's, keyword-only): None, or integer
        [B, max_pages] naming each sequence's pages.
      softmax_scale: multiplies q.k; None is 1/sqrt(Dqk).
      causal: bottom-right, as FlashAttention's: query i sees keys j <= i + seqlen_k - Sq.
      window_size: (left, right), -1 unlimited, aligned bottom-right.
      softcap: 0.0 off, c > 0 caps the scores to c * tanh(s / c).
      rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad, alibi_slopes: must be None; num_splits must be 0
        (the default): NotImplementedError naming the argument otherwise. rotary_interleaved only matters
        with rotary_cos, and is ignored.
      return_softmax_lse: also return softmax_lse [B, Hq, Sq] float32, -inf for a query without keys.
      cu_seqlens_q, max_seqlen_q: keyword-only, FlashAttention 3's varlen queries (a serving step: prefill
        chunks and decode rows in one call): integer [B + 1] over q [T, Hq, Dqk], sequence b's queries being
        its newest positions; max_seqlen_q (a static int) is required with it. out is then [T, Hq, Dv] and
        softmax_lse [Hq, T] (FlashAttention 3's varlen layout).
      cu_seqlens_k_new: keyword-only, integer [B + 1]: k and v are packed (above). Sequence b attends
        cache_seqlens[b] + its new rows.
      implementation: keyword-only, as `ragged_attention_with_kvcache`'s.
    """
    _unsupported(
        rotary_cos=(rotary_cos is not None, "apply rotary embeddings to q and k before the call"),
        rotary_sin=(rotary_sin is not None, "apply rotary embeddings to q and k before the call"),
        cache_batch_idx=(
            cache_batch_idx is not None,
            "gather the batch's caches (k_cache[cache_batch_idx]) first, "
            "or give each sequence its pages through block_table",
        ),
        cache_leftpad=(cache_leftpad is not None, "a cache here starts at row 0 of its sequence"),
        alibi_slopes=(alibi_slopes is not None, "no implementation here adds ALiBi biases"),
        num_splits=(
            num_splits != 0,
            "each implementation splits the keys as it sees fit; only the default 0 "
            "(FlashAttention's heuristic) is taken",
        ),
    )
    if block_table is not None and page_table is not None:
        raise ValueError("pass block_table (FlashAttention 2's name) or page_table (FlashAttention 3's), not both")
    page_table = block_table if block_table is not None else page_table
    if (k is None) != (v is None):
        raise ValueError(
            f"k and v come together: got k {'None' if k is None else 'an array'} and v "
            f"{'None' if v is None else 'an array'}"
        )
    if cu_seqlens_k_new is not None and k is None:
        raise ValueError("cu_seqlens_k_new describes packed k and v: pass them, or leave it None")
    q = jnp.asarray(q) if isinstance(q, np.ndarray) else q
    # The sequences: q's first dim, or (packed queries) cu_seqlens_q's entries less one.
    batch = q.shape[0] if cu_seqlens_q is None else np.shape(cu_seqlens_q)[0] - 1
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens is required with k and v: it says where in each cache they are written")
        capacity = k_cache.shape[1] * (1 if page_table is None else np.shape(page_table)[1])
        cache_seqlens = jnp.full((batch,), capacity, jnp.int32)
    elif isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, (bool, np.bool_)):
        cache_seqlens = jnp.full((batch,), int(cache_seqlens), jnp.int32)  # one length for every sequence
    else:
        cache_seqlens = as_int32(cache_seqlens, "cache_seqlens")
    lengths = cache_seqlens
    if k is not None:
        k_cache, v_cache = kvcache_append(
            k_cache, v_cache, k, v, cache_seqlens, cu_seqlens_k_new=cu_seqlens_k_new, page_table=page_table
        )
        if cu_seqlens_k_new is None:
            lengths = jnp.asarray(cache_seqlens) + k.shape[1]
        else:  # each sequence's new rows: its slot of cu_seqlens_k_new, clamped as kvcache_append clamps it
            cu = sanitize_cu_seqlens(jnp.asarray(as_int32(cu_seqlens_k_new, "cu_seqlens_k_new")), k.shape[0])
            lengths = jnp.asarray(cache_seqlens) + (cu[1:] - cu[:-1])
    result = ragged_attention_with_kvcache(
        q,
        k_cache,
        v_cache,
        lengths,
        cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q,
        page_table=page_table,
        scale=softmax_scale,
        is_causal=_flag(causal, "causal"),
        local_window_size=_window(window_size),
        softcap=_softcap(softcap),
        return_stats=_flag(return_softmax_lse, "return_softmax_lse"),
        stats_layout="head_major",
        implementation=implementation,
    )
    if k is None:
        return result
    return (*result, k_cache, v_cache) if return_softmax_lse else (result, k_cache, v_cache)


def _unsupported(**arguments) -> None:
    """NotImplementedError naming the first argument whose (given, why) pair says it was given."""
    for name, (given, why) in arguments.items():
        if given:
            raise NotImplementedError(f"{name} is not supported: {why}")


def _flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a Python bool, got {type(value).__name__} {value!r}")
    return bool(value)


def _window(window_size):
    """FlashAttention's (left, right), -1 unlimited, as local_window_size: None when both sides are unlimited."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise ValueError(f"window_size must be a (left, right) pair of ints, -1 for unlimited, got {window_size!r}")
    left, right = window_size
    if (
        isinstance(left, (bool, np.bool_))
        or isinstance(right, (bool, np.bool_))
        or not all(isinstance(side, (int, np.integer)) for side in (left, right))
    ):
        raise ValueError(f"window_size must be a (left, right) pair of ints, -1 for unlimited, got {window_size!r}")
    return None if left < 0 and right < 0 else (int(left), int(right))


def _softcap(softcap):
    """FlashAttention's 0.0 (off) as None; a positive cap as it is (a negative one: the op's ValueError)."""
    return None if softcap is None or (not isinstance(softcap, (bool, np.bool_)) and softcap == 0) else softcap
