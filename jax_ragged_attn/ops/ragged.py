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
from jax_ragged_attn.features.keyword_hints import reject_unknown_keywords
from jax_ragged_attn.features.overflow import cu_seqlens_overflow
from jax_ragged_attn.index import RaggedIndex, as_int32
from jax_ragged_attn.index.packings import TABLE
from jax_ragged_attn.ops import common


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
      q: [Tq, Hq, Dqk]; k: [Tkv, Hkv, Dqk]; v: [Tkv, Hkv, Dv]. Hq must be a multiple of Hkv (MHA, GQA, MQA):
        query head h reads key/value head h // (Hq // Hkv).
      cu_seqlens_q, cu_seqlens_kv: integer [B + 1] (any integer dtype, NumPy or jax; used as int32). Sequence
        b owns query rows cu_seqlens_q[b]:cu_seqlens_q[b+1] and key rows cu_seqlens_kv[b]:cu_seqlens_kv[b+1].
        Zero-length sequences are fine. Tq and Tkv are static capacities; rows past cu_seqlens[-1] are padding. Values are clamped monotone into [0, T]
        before use, so no value can make a kernel address outside the buffers (return_overflow counts the
        entries clamped; check=True raises instead).
      max_seqlen_q, max_seqlen_kv: static upper bounds of the sequence lengths (rows of a longer sequence
        past the bound are treated as padding; return_overflow counts them, check=True raises). Bounds
        above the capacities are clamped to Tq / Tkv: a generous bound costs nothing.
      scale: multiplies q.k; default 1/sqrt(Dqk).
      is_causal: query i sees key j only if j <= diagonal.
      diagonal_alignment: "top_left" (diagonal d = i) or "bottom_right" (d = i + skv - sq), per sequence.
      local_window_size: (left, right) keeps d - left <= j <= d + right; an int w means (w, w). A negative
        side has no limit (FlashAttention's -1): (-1, 0) is causal with any reach back, -1 is no window.
      stats_layout: "head_major" returns stats [Hq, Tq] (FlashAttention's softmax_lse); "token_major"
        returns [Tq, Hq] (cuDNN's and TransformerEngine's).
      return_stats: also return the float32 natural-log log-sum-exp of the attended logits. Its -inf rows
        (below) are the only inf the op computes, so jax.debug_infs reports them; jax.debug_nans never
        fires, and with return_stats=False neither does jax.debug_infs (unless the inputs hold inf/NaN).
      implementation: None chooses per call by the policy shipped in backends/policy.py: FlashAttention-3
        where an optional FA3 wheel is installed and serves the call, the GPU is a Hopper and the call has at
        least 1,024 tokens a sequence (capacity Tq / B), cuDNN below that or where FA3 cannot serve the call,
        and "xla" where no GPU kernel can (with a warning on a GPU). autotune=True times cuDNN against FA3
        instead of applying the threshold; the environment variable JAX_RAGGED_ATTN_IMPLEMENTATION ("cudnn",
        "fa3" or "xla") pins one for every call it can serve. "cudnn" and "fa3" raise NotImplementedError
        saying why where they cannot serve the call; "xla" is the portable jnp implementation and serves every
        call. "fa3" runs FlashAttention-3's kernels from fa3_provider's wheel (backends/fa3/providers.py).
      fa3_provider: whose FlashAttention-3 kernels "fa3" runs: "dew-flash-attn" (head dims 64, 128, 192, 256;
        no softcap, no deterministic backward; backends/fa3/dew.py), "flash-attn3-jax" (head dim 128, no
        softcap; backends/fa3/ragged.py), or None: the first of the two that is installed and serves the call
        (dew-flash-attn's measured faster). Both need a Hopper GPU and bfloat16 / float16. A sequence longer
        than max_seqlen (which check=True rejects; cut otherwise) costs dew-flash-attn, without seqused, up to
        that sequence's uncut attention.
      deterministic: run cuDNN's deterministic backward, so dQ/dK/dV are bit-identical run to run (it keeps
        dP in a dense workspace: slower and much more memory). The xla path is deterministic anyway.
      check: validate cu_seqlens at run time (start at 0, never decrease, stay within the capacity, no
        sequence longer than max_seqlen) and, on cuDNN, surround the workspace with a verified canary band;
        a violation stops the computation with checks.RaggedAttentionInputError naming the argument, index
        and values (under jit XLA delivers it wrapped: see checks.input_errors). None reads
        JAX_RAGGED_ATTN_CHECK. Off, cu_seqlens are clamped into the buffers instead (see above), and NumPy
        cu_seqlens that will be clamped or cut raise a RaggedAttentionInputWarning when traced. Costs a
        device-to-host round trip per call (none when the values are concrete: an eager call).
      autotune: on cuDNN, time every candidate plan cuDNN offers for this configuration once (at trace
        time, on scratch buffers) and run the fastest; the heuristic's choice is kept unless another plan
        is measurably faster. Choices persist on disk per (GPU, cuDNN version, configuration); see
        jax_ragged_attn/backends/cudnn/autotune.py. The xla path ignores it. With strategy="fastest" it also times
        the backward's two intermediate layouts (where the padded one is within its workspace bound) and
        keeps the lean one unless the padded one is more than 3 % faster. With implementation=None, where
        FlashAttention-3 can serve the call too, it also times a forward + backward of each once per
        configuration and runs FA3 only if it is more than 3 % faster (backends/tuning.py).
      strategy: on cuDNN, speed or memory first for the backward's fp32 intermediates. "fastest" (default):
        a layout padded to [B, max_seqlen_q] when its workspace is at most twice the lean one's (or at most
        256 MiB more), measured 0.6-18 % faster backward on the H200; else the lean one. "lean_memory":
        always the layout sized by the token capacity Tq. The forward is the same either way and gradients
        agree to rounding (see jax_ragged_attn/backends/cudnn/strategy.py). The xla path ignores it.
      sinks: None or [Hq] float, one learnable logit per query head (gpt-oss style) that joins every row's
        softmax without a value, so a row can put weight on "nothing"; differentiable. stats then include
        the sink term, and a real query row without keys has the sink as its whole softmax: out 0, stats
        sinks[h], and the sink gets that row's stats gradient. Every implementation: an elementwise epilogue
        of the sink-free op through its log-sum-exp (sinks.py), so cuDNN serves sinks where it can
        differentiate its stats (Dv <= 240).
      seqused_q, seqused_kv: None, or integer [B] (FlashAttention's seqused_q / seqused_k): sequence b uses
        only the first seqused[b] rows of its slot cu_seqlens[b]:cu_seqlens[b+1]; the rest of the slot is
        treated like capacity padding (never read, out 0 / stats -inf / gradients 0). Offsets then need not
        be a tight prefix sum: fixed-size slots of a KV cache, or pieces with gaps. Values are clamped into
        [0, slot length] (and max_seqlen); check=True raises for a value outside [0, slot length]. Bottom-right
        alignment counts the used lengths.
      softcap: None, 0 (no cap) or c > 0: the scores are capped to c * tanh(scale * q.k / c) before the mask,
        sinks and softmax (Gemma 2, Grok); stats are the log-sum-exp of the capped scores and every gradient
        carries the cap's derivative. A negative or non-finite value is a ValueError. cuDNN serves it through
        its graph's score modifier where the loaded cuDNN builds one (else implementation=None falls back to
        xla); FlashAttention-3's wheel has no softcap and declines.
      xla_block_size: the xla path's query and key block rows, (block_q, block_kv) or an int for both; None:
        128 on a GPU, 64 on a CPU. Its working set grows with block_kv (a step holds Tq * Hq * block_kv float32
        scores): smaller blocks are the way out of its WorkingSetTooLargeError; one-query-per-sequence calls
        run faster with a small block_q ((8, 128): 52 against 83 ms on 64 queries over 64 x 512 keys, 2-core
        CPU). Part of the static config (a jit cache key); the GPU kernels ignore it.
      return_overflow: also return an overflow.Overflow of int32 scalars counting what this call dropped
        (truncated_rows_q, truncated_rows_kv, invalid_cu_seqlens; dropped_segments is 0 here), computed on
        the device with no host round trip; all zero when nothing was lost. They carry no gradient.

    Returns:
      out [Tq, Hq, Dv] in q's dtype, or (out, stats) with return_stats=True, with the Overflow appended
      last when return_overflow=True: (out, overflow) or (out, stats, overflow). Rows with no attended key
      and padding rows read out = 0 and stats = -inf, and their gradients are 0.
    """
    reject_unknown_keywords(ragged_attention, unknown)  # FlashAttention's names: the TypeError says ours
    _check_keywords_only(positional, max_seqlen_q, max_seqlen_kv)
    options = AttentionOptions(scale=scale, is_causal=is_causal, diagonal_alignment=diagonal_alignment,
                               local_window_size=local_window_size, stats_layout=stats_layout,
                               return_stats=return_stats, implementation=implementation,
                               deterministic=deterministic, check=check, autotune=autotune,
                               strategy=strategy, softcap=softcap, xla_block_size=xla_block_size,
                               fa3_provider=fa3_provider)
    return attend((q, k, v), cu_seqlens_q, cu_seqlens_kv, options, max_seqlen_q=max_seqlen_q,
                  max_seqlen_kv=max_seqlen_kv, sinks=sinks, return_overflow=return_overflow, seqused_q=seqused_q,
                  seqused_kv=seqused_kv)


def attend(buffers: tuple, cu_seqlens_q, cu_seqlens_kv, options: AttentionOptions, *, max_seqlen_q: int,
           max_seqlen_kv: int, packing: str = "none", sinks=None, return_overflow: bool = False,
           seqused_q=None, seqused_kv=None):
    """`ragged_attention` of the buffers laid out as TABLE[packing] says: (q, k, v), (q, kv) or (qkv,).

    A backend that reads packed buffers in place (cuDNN) returns their gradients in their own layout; the
    others slice the parts out and let autodiff assemble the gradients (correct everywhere, with copies).
    """
    buffers = tuple(common.as_array(x) for x, _ in zip(buffers, TABLE[packing].buffers))
    q, k, v = TABLE[packing].views(buffers)
    same = cu_seqlens_q is cu_seqlens_kv  # one array for both (qkv-packed, segments): checked once
    cu_seqlens_q = as_int32(cu_seqlens_q, "cu_seqlens" if same and packing == "qkv" else "cu_seqlens_q")
    cu_seqlens_kv = cu_seqlens_q if same else as_int32(cu_seqlens_kv, "cu_seqlens_kv")
    config = make_config(q, k, v, cu_seqlens_q, cu_seqlens_kv, options, max_seqlen_q=max_seqlen_q,
                         max_seqlen_kv=max_seqlen_kv, sinks=sinks, packing=packing)
    config = dataclasses.replace(config, return_stats=options.return_stats)
    if not isinstance(return_overflow, bool):
        raise ValueError(f"return_overflow must be a Python bool, got {type(return_overflow).__name__}")
    index = RaggedIndex(cu_seqlens_q, cu_seqlens_kv, _seqused(seqused_q, "seqused_q", config),
                        _seqused(seqused_kv, "seqused_kv", config), same=same)
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
    overflow = ()
    if return_overflow:  # from the cu_seqlens as the caller passed them (checked ones are the same values)
        overflow = (cu_seqlens_overflow(index.cu_seqlens_q, index.cu_seqlens_kv, config, same=index.same,
                                        seqused=index.seqused),)
    epilogue = sinks is not None and not folds_sinks
    return common.result(out, stats, sinks if epilogue else None,
                         index.real_rows_q(config) if epilogue else None,
                         index.rows_with_keys(config) if epilogue else None,
                         config.stats_layout, options.return_stats, overflow)


def _check_keywords_only(positional: tuple, max_seqlen_q, max_seqlen_kv) -> None:
    """The max_seqlen bounds are keyword-only (two ints in a row are easy to swap unseen); a positional call
    says which keywords to use instead of Python's bare "takes 5 positional arguments"."""
    if positional:
        raise TypeError(f"ragged_attention takes 5 positional arguments (q, k, v, cu_seqlens_q, cu_seqlens_kv), "
                        f"got {5 + len(positional)}: pass the bounds as max_seqlen_q=... and max_seqlen_kv=... "
                        "(keyword-only), and every option by its keyword")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_kv", max_seqlen_kv)):
        if value is None:  # None is the default only so that a positional call reaches the TypeError above
            raise ValueError(f"{name} is required (keyword-only): a static Python int >= 1, got None")


def _seqused(seqused, name: str, config: AttentionConfig):
    """None, or seqused as int32 [B] (any integer dtype accepted)."""
    if seqused is None:
        return None
    seqused = as_int32(seqused, name)
    if tuple(seqused.shape) != (config.num_seqs,):
        raise ValueError(f"{name} must be [B={config.num_seqs}] (one entry per sequence of cu_seqlens), got shape "
                         f"{tuple(seqused.shape)}")
    return seqused
