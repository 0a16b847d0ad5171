"""ragged_attention: the features composed around one backend call.

Every entry point (this one, inputs/packed.py, inputs/segments.py, parallel/sharding.py, ...) builds an
`AttentionOptions` from its keywords first thing and hands the buffers to `attend`, which runs, in order:

    index arrays made int32, one RaggedIndex     (index/)
    the static config, validated                  (config.py)
    the bottom-right mask run as top-left         (features/bottom_right.py)
    check mode, or host-side warnings             (features/checks.py)
    the backend the registry picks                (backends/__init__.py: cuDNN, FlashAttention-3, xla)
    sinks: folded into the backend or an epilogue (features/sinks.py, through ops/common.py)
    overflow counts                               (features/overflow.py)
"""

from __future__ import annotations

import dataclasses

import jax

from jax_ragged_attn.config import AttentionConfig, AttentionOptions, make_config
from jax_ragged_attn.features.bottom_right import as_top_left
from jax_ragged_attn.features.checks import apply_check
from jax_ragged_attn.features.keyword_hints import hints_keywords, reject_unknown_keywords
from jax_ragged_attn.features.overflow import Overflow, cu_seqlens_overflow
from jax_ragged_attn.index import RaggedIndex, as_int32
from jax_ragged_attn.index.packings import TABLE
from jax_ragged_attn.ops import common


@hints_keywords
def ragged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_kv: jax.Array,
    *positional,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    diagonal_alignment: str = "top_left",
    local_window_size: int | tuple[int, int] | None = None,
    stats_layout: str = "head_major",
    return_stats: bool = False,
    implementation: str | None = None,
    deterministic: bool = False,
    check: bool | None = None,
    autotune: bool = False,
    strategy: str = "fastest",
    sinks: jax.Array | None = None,
    return_overflow: bool = False,
    seqused_q: jax.Array | None = None,
    seqused_kv: jax.Array | None = None,
    softcap: float | None = None,
    xla_block_size: int | tuple[int, int] | None = None,
    fa3_provider: str | None = None,
    **unknown,
):
    """Scaled dot-product attention over sequences packed into one token buffer (the THD / varlen layout).

    Args:
      q: [Tq, Hq, Dqk]; k: [Tkv, Hkv, Dqk]; v: [Tkv, Hkv, Dv]. Query head h reads key/value head h // (Hq // Hkv).
      cu_seqlens_q, cu_seqlens_kv: integer [B + 1]; sequence b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
        and key rows cu_seqlens_kv[b]:cu_seqlens_kv[b+1]. Tq, Tkv are static capacities; rows past
        cu_seqlens[-1] are padding. Values are clamped monotone into [0, T] before any kernel reads them; the
        query rows of a sequence ending past T read NaN, and every row when cu_seqlens does not start at 0
        or decreases (docs/API.md, "What can be dropped").
      max_seqlen_q, max_seqlen_kv: keyword-only static bounds; a longer sequence's query rows read NaN.
      scale: multiplies q.k; default 1/sqrt(Dqk). softcap: None, 0 or c > 0 caps scores to c * tanh(s / c).
      is_causal, diagonal_alignment ("top_left" | "bottom_right"), local_window_size ((left, right) or an int;
        a negative side has no limit): the mask, per sequence.
      return_stats, stats_layout: also return the float32 log-sum-exp, [Hq, Tq] ("head_major") or [Tq, Hq].
      sinks: None or [Hq] float, one learnable logit per query head joining every row's softmax.
      seqused_q, seqused_kv: None or integer [B]: sequence b uses the first seqused[b] rows of its slot.
      implementation: None (chosen per call), "cudnn", "fa3" (fa3_provider: "dew-flash-attn",
        "flash-attn3-jax" or None for the first that serves the call) or "xla" (portable, serves every call).
      check: validate the index arrays at run time and raise RaggedAttentionInputError (None reads
        JAX_RAGGED_ATTN_CHECK). return_overflow: also return an Overflow counting what the call dropped.
      deterministic, autotune, strategy (cuDNN), xla_block_size (xla): speed, memory and reproducibility.

    Returns:
      out [Tq, Hq, Dv] in q's dtype; (out, stats) with return_stats; the Overflow appended last with
      return_overflow. Rows with no attended key and padding rows read out = 0 and stats = -inf, and their
      gradients are 0. Rows of a sequence with invalid index data read NaN (out and stats), gradients 0.

    Raises:
      ValueError for malformed input (rank, dtype, shape, a negative softcap), NotImplementedError where the
      named implementation cannot serve the call (saying why), TypeError for FlashAttention's keyword names
      (naming ours) or positional bounds.

    Every keyword in full, the input layouts and what happens to input that does not fit: docs/API.md.
    """
    reject_unknown_keywords(ragged_attention, unknown)  # FlashAttention's names: the TypeError says ours
    max_seqlen_q, max_seqlen_kv = _check_keywords_only(positional, max_seqlen_q, max_seqlen_kv)
    options = AttentionOptions.from_arguments(locals())
    return attend(
        (q, k, v),
        cu_seqlens_q,
        cu_seqlens_kv,
        options,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_kv,
        sinks=sinks,
        return_overflow=return_overflow,
        seqused_q=seqused_q,
        seqused_kv=seqused_kv,
    )


def attend(
    buffers: tuple,
    cu_seqlens_q,
    cu_seqlens_kv,
    options: AttentionOptions,
    *,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    packing: str = "none",
    sinks=None,
    return_overflow: bool = False,
    seqused_q=None,
    seqused_kv=None,
    loud: bool = True,
):
    """`ragged_attention` of the buffers laid out as TABLE[packing] says: (q, k, v), (q, kv) or (qkv,).

    A backend that reads packed buffers in place (cuDNN) returns their gradients in their own layout; the
    others slice the parts out and let autodiff assemble the gradients (correct everywhere, with copies).
    `loud`: the rows of invalid sequences read NaN (ops/common.loud); False for a caller that builds the
    cu_seqlens itself from the user's and applies the select over the user's rows (parallel/).
    """
    buffers = tuple(common.as_array(x) for x, _ in zip(buffers, TABLE[packing].buffers))
    q, k, v = TABLE[packing].views(buffers)
    same = cu_seqlens_q is cu_seqlens_kv  # one array for both (qkv-packed, segments): checked once
    cu_seqlens_q = as_int32(cu_seqlens_q, "cu_seqlens" if same and packing == "qkv" else "cu_seqlens_q")
    cu_seqlens_kv = cu_seqlens_q if same else as_int32(cu_seqlens_kv, "cu_seqlens_kv")
    config = make_config(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_kv,
        options,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_kv,
        sinks=sinks,
        packing=packing,
    )
    config = dataclasses.replace(config, return_stats=options.return_stats)
    if not isinstance(return_overflow, bool):
        raise ValueError(f"return_overflow must be a Python bool, got {type(return_overflow).__name__}")
    index = RaggedIndex(
        cu_seqlens_q,
        cu_seqlens_kv,
        _seqused(seqused_q, "seqused_q", config),
        _seqused(seqused_kv, "seqused_kv", config),
        same=same,
    )
    config = as_top_left(config, index)
    config, index = apply_check(options.check, config, index)
    # The backend runs without sinks (inner); they fold into its backward where it can (no stats returned,
    # so no stats cotangent), else they are an epilogue on its stats, handed over raw (never -inf made for
    # the epilogue's sake, so debug_infs stays quiet).
    inner = dataclasses.replace(config, has_sinks=False)
    # Sinks need the stats' gradient where they are an epilogue; without returned stats a backend with
    # attend_with_sinks folds them into its plain backward instead. Every backend that can decline a stats
    # gradient (stats_gradient_unsupported: cuDNN) folds, so only returned stats make them ask it.
    backend = common.choose("ragged", options, inner, index, stats_gradient=sinks is not None and options.return_stats)
    folds_sinks = sinks is not None and not options.return_stats and hasattr(backend, "attend_with_sinks")
    if folds_sinks:
        out, stats = backend.attend_with_sinks(buffers, index, sinks, inner), None
    else:
        wanted = "raw" if sinks is not None and not options.return_stats else options.return_stats
        out, stats = backend.attend(buffers, index, inner, stats=wanted)  # False: no -inf computed (debug_infs)
    overflow: tuple[Overflow, ...] = ()
    if return_overflow:  # from the cu_seqlens as the caller passed them (checked ones are the same values)
        overflow = (
            cu_seqlens_overflow(
                index.cu_seqlens_q, index.cu_seqlens_kv, config, same=index.same, seqused=index.seqused
            ),
        )
    epilogue = sinks is not None and not folds_sinks
    return common.result(
        out,
        stats,
        sinks if epilogue else None,
        index.real_rows_q(config) if epilogue else None,
        index.rows_with_keys(config) if epilogue else None,
        config.stats_layout,
        options.return_stats,
        overflow,
        invalid_rows=index.invalid_rows_q(config) if loud else None,
    )


def _check_keywords_only(positional: tuple, max_seqlen_q, max_seqlen_kv) -> tuple[int, int]:
    """The max_seqlen bounds are keyword-only (two ints in a row are easy to swap unseen); a positional call
    says which keywords to use instead of Python's bare "takes 5 positional arguments". Returns the bounds,
    both given."""
    if positional:
        raise TypeError(
            f"ragged_attention takes 5 positional arguments (q, k, v, cu_seqlens_q, cu_seqlens_kv), "
            f"got {5 + len(positional)}: pass the bounds as max_seqlen_q=... and max_seqlen_kv=... "
            "(keyword-only), and every option by its keyword"
        )
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_kv", max_seqlen_kv)):
        if value is None:  # None is the default only so that a positional call reaches the TypeError above
            raise ValueError(f"{name} is required (keyword-only): a static Python int >= 1, got None")
    return max_seqlen_q, max_seqlen_kv


def _seqused(seqused, name: str, config: AttentionConfig):
    """None, or seqused as int32 [B] (any integer dtype accepted)."""
    if seqused is None:
        return None
    seqused = as_int32(seqused, name)
    if tuple(seqused.shape) != (config.num_seqs,):
        raise ValueError(
            f"{name} must be [B={config.num_seqs}] (one entry per sequence of cu_seqlens), got shape "
            f"{tuple(seqused.shape)}"
        )
    return seqused
