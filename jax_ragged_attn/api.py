"""The public entry point: validate, pick an implementation, call it.

Every entry point (this one, packed.py, segments.py, sharding.py) builds an `AttentionOptions` from its
keywords first thing and hands it to `attend`, which serves every packing of the inputs (packings.TABLE).
"""

from __future__ import annotations

import dataclasses

import jax

from jax_ragged_attn import _cudnn as cudnn, _fa3 as fa3, implementation_tuning
from jax_ragged_attn._cudnn import launch
from jax_ragged_attn._cudnn import sinks as cudnn_sinks
from jax_ragged_attn._cudnn.packings import TABLE
from jax_ragged_attn.checks import check_enabled, checked_cu_seqlens, checked_seqused, warn_cu_seqlens_on_host
from jax_ragged_attn.config import AttentionConfig, AttentionOptions, make_config
from jax_ragged_attn.indices import as_int32
from jax_ragged_attn.overflow import cu_seqlens_overflow
from jax_ragged_attn.packing import query_rows_with_keys, row_positions, sanitize_both
from jax_ragged_attn.sinks import apply_sinks
from jax_ragged_attn.xla import attention_xla, warn_cudnn_fallback


def ragged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_kv: jax.Array,
    *,
    max_seqlen_q: int,
    max_seqlen_kv: int,
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
      local_window_size: (left, right) keeps d - left <= j <= d + right; an int w means (w, w).
      stats_layout: "head_major" returns stats [Hq, Tq] (FlashAttention's softmax_lse); "token_major"
        returns [Tq, Hq] (cuDNN's and TransformerEngine's).
      return_stats: also return the float32 natural-log log-sum-exp of the attended logits. Its -inf rows
        (below) are the only inf the op computes, so jax.debug_infs reports them; jax.debug_nans never
        fires, and with return_stats=False neither does jax.debug_infs (unless the inputs hold inf/NaN).
      implementation: None picks cuDNN when it can serve the call here, else "xla"; "cudnn" raises
        NotImplementedError saying why when it cannot; "xla" is the portable jnp implementation; "fa3" is
        FlashAttention-3 through the optional flash-attn3-jax wheel (Hopper, head dim 128; see _fa3.py for
        what it serves), raising NotImplementedError with the reason where it cannot.
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
        jax_ragged_attn/_cudnn/autotune.py. The xla path ignores it. With strategy="fastest" it also times
        the backward's two intermediate layouts (where the padded one is within its workspace bound) and
        keeps the lean one unless the padded one is more than 3 % faster. With implementation=None, where
        FlashAttention-3 can serve the call too, it also times a forward + backward of each once per
        configuration and runs FA3 only if it is more than 3 % faster (implementation_tuning.py).
      strategy: on cuDNN, speed or memory first for the backward's fp32 intermediates. "fastest" (default):
        a layout padded to [B, max_seqlen_q] when its workspace is at most twice the lean one's (or at most
        256 MiB more), measured 0.6-18 % faster backward on the H200; else the lean one. "lean_memory":
        always the layout sized by the token capacity Tq. The forward is the same either way and gradients
        agree to rounding (see jax_ragged_attn/_cudnn/strategy.py). The xla path ignores it.
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
      return_overflow: also return an overflow.Overflow of int32 scalars counting what this call dropped
        (truncated_rows_q, truncated_rows_kv, invalid_cu_seqlens; dropped_segments is 0 here), computed on
        the device with no host round trip; all zero when nothing was lost. They carry no gradient.

    Returns:
      out [Tq, Hq, Dv] in q's dtype, or (out, stats) with return_stats=True, with the Overflow appended
      last when return_overflow=True: (out, overflow) or (out, stats, overflow). Rows with no attended key
      and padding rows read out = 0 and stats = -inf, and their gradients are 0.
    """
    options = AttentionOptions(scale=scale, is_causal=is_causal, diagonal_alignment=diagonal_alignment,
                               local_window_size=local_window_size, stats_layout=stats_layout,
                               return_stats=return_stats, implementation=implementation,
                               deterministic=deterministic, check=check, autotune=autotune,
                               strategy=strategy)
    return attend((q, k, v), cu_seqlens_q, cu_seqlens_kv, options, max_seqlen_q=max_seqlen_q,
                  max_seqlen_kv=max_seqlen_kv, sinks=sinks, return_overflow=return_overflow, seqused_q=seqused_q,
                  seqused_kv=seqused_kv)


def attend(buffers: tuple, cu_seqlens_q, cu_seqlens_kv, options: AttentionOptions, *, max_seqlen_q: int,
           max_seqlen_kv: int, packing: str = "none", sinks=None, return_overflow: bool = False,
           seqused_q=None, seqused_kv=None):
    """`ragged_attention` of the buffers laid out as TABLE[packing] says: (q, k, v), (q, kv) or (qkv,).

    The cuDNN path reads packed buffers in place and returns their gradients in their own layout; the xla
    path slices the parts out and lets autodiff assemble the gradients (correct everywhere, with copies).
    """
    layout = TABLE[packing]
    q, k, v = layout.views(buffers)
    same = cu_seqlens_q is cu_seqlens_kv  # one array for both (qkv-packed, segments): checked once
    cu_seqlens_q = as_int32(cu_seqlens_q, "cu_seqlens" if same and packing == "qkv" else "cu_seqlens_q")
    cu_seqlens_kv = cu_seqlens_q if same else as_int32(cu_seqlens_kv, "cu_seqlens_kv")
    config = make_config(q, k, v, cu_seqlens_q, cu_seqlens_kv, options, max_seqlen_q=max_seqlen_q,
                         max_seqlen_kv=max_seqlen_kv, sinks=sinks, packing=packing)
    config = dataclasses.replace(config, return_stats=options.return_stats)
    if not isinstance(return_overflow, bool):
        raise ValueError(f"return_overflow must be a Python bool, got {type(return_overflow).__name__}")
    seqused = (_seqused(seqused_q, "seqused_q", config), _seqused(seqused_kv, "seqused_kv", config))
    if (same and seqused[0] is seqused[1] and config.diagonal_alignment == "bottom_right"
            and (config.capacity_q, config.max_seqlen_q) == (config.capacity_kv, config.max_seqlen_kv)):
        # Every sequence has as many keys as queries, so the bottom-right mask is the top-left one, whose
        # backward is the cheaper (a bottom-right one runs as two calls: _cudnn/launch.py _backward).
        config = dataclasses.replace(config, diagonal_alignment="top_left")
    config, cu_seqlens_q, cu_seqlens_kv, seqused = apply_check(options.check, config, cu_seqlens_q, cu_seqlens_kv,
                                                               seqused)
    # Sinks are an epilogue of the sink-free op on every implementation (sinks.py): the op itself runs without,
    # and hands over its stats as computed (raw: never -inf made for the epilogue's sake, so debug_infs is quiet).
    inner = dataclasses.replace(config, has_sinks=False)
    chosen = choose_implementation(options.implementation, inner, sinks=sinks is not None,
                                   index=(cu_seqlens_q, cu_seqlens_kv, seqused))
    if chosen == "cudnn" and sinks is not None and not options.return_stats:
        # No stats leave the op, so no stats cotangent can come back: the sink folds into the plain backward.
        out = cudnn_sinks.attention_with_sinks(tuple(buffers), cu_seqlens_q, cu_seqlens_kv, sinks, inner, seqused)
        sinks, stats = None, None  # applied
    elif chosen == "cudnn":
        out, stats = launch.attention(tuple(buffers), cu_seqlens_q, cu_seqlens_kv, inner, seqused)
    elif chosen == "fa3":  # packed parts are sliced out; autodiff assembles their gradients in the packed shape
        out, stats = fa3.attention(*layout.split(buffers), cu_seqlens_q, cu_seqlens_kv, inner, seqused)
    else:
        wanted = "raw" if sinks is not None and not options.return_stats else options.return_stats
        out, stats = attention_xla(*layout.split(buffers), cu_seqlens_q, cu_seqlens_kv, inner,
                                   return_stats=wanted,  # False: no -inf computed (debug_infs)
                                   seqused_q=seqused[0], seqused_kv=seqused[1])
    if sinks is not None:
        cu_q, cu_kv = sanitize_both(cu_seqlens_q, cu_seqlens_kv, config)
        real_rows = row_positions(cu_q, config.capacity_q, config.max_seqlen_q, seqused[0])[2]
        rows_with_keys = query_rows_with_keys(cu_q, cu_kv, config, *seqused)
        out, stats = apply_sinks(out, stats, sinks, real_rows, rows_with_keys, config.stats_layout,
                                 options.return_stats)
    result = (out, stats) if options.return_stats else (out,)
    if return_overflow:  # from the cu_seqlens as the caller passed them (checked ones are the same values)
        result += (cu_seqlens_overflow(cu_seqlens_q, cu_seqlens_kv, config, same=cu_seqlens_q is cu_seqlens_kv,
                                       seqused=seqused),)
    return result if len(result) > 1 else out


def _seqused(seqused, name: str, config: AttentionConfig):
    """None, or seqused as int32 [B] (any integer dtype accepted)."""
    if seqused is None:
        return None
    seqused = as_int32(seqused, name)
    if tuple(seqused.shape) != (config.num_seqs,):
        raise ValueError(f"{name} must be [B={config.num_seqs}] (one entry per sequence of cu_seqlens), got shape "
                         f"{tuple(seqused.shape)}")
    return seqused


def apply_check(check: bool | None, config: AttentionConfig, cu_seqlens_q, cu_seqlens_kv, seqused=(None, None)):
    """With check on: guard mode in the config, and cu_seqlens (and seqused) that are validated on the host at
    run time (checks.py). Off: NumPy cu_seqlens, free to read, warn if they will be clamped or cut.
    Returns (config, cu_seqlens_q, cu_seqlens_kv, seqused)."""
    # One array for q and kv (qkv-packed, segments): checked once, under the name the caller passed.
    same = cu_seqlens_q is cu_seqlens_kv and (config.capacity_q, config.max_seqlen_q) == (config.capacity_kv,
                                                                                           config.max_seqlen_kv)
    name_q = "cu_seqlens" if same and config.packing == "qkv" else "cu_seqlens_q"
    sides = [(name_q, cu_seqlens_q, config.capacity_q, config.max_seqlen_q)]
    if not same:
        sides.append(("cu_seqlens_kv", cu_seqlens_kv, config.capacity_kv, config.max_seqlen_kv))
    if not check_enabled(check):
        for name, cu, capacity, max_seqlen in sides:
            # With seqused the slot may be longer than max_seqlen: only the used rows count.
            if seqused[0 if name != "cu_seqlens_kv" else 1] is None:
                warn_cu_seqlens_on_host(cu, name=name, capacity=capacity, max_seqlen=max_seqlen)
        return config, cu_seqlens_q, cu_seqlens_kv, seqused
    config = dataclasses.replace(config, guard_workspace=True)
    checked, used = [], list(seqused)
    for name, cu, capacity, max_seqlen in sides:
        side = 0 if name != "cu_seqlens_kv" else 1
        if seqused[side] is None:
            checked.append(checked_cu_seqlens(cu, name=name, capacity=capacity, max_seqlen=max_seqlen))
        else:
            seq_name = "seqused_q" if side == 0 else "seqused_kv"
            cu, used[side] = checked_seqused(cu, seqused[side], name=name, seqused_name=seq_name, capacity=capacity,
                                             max_seqlen=max_seqlen)
            checked.append(cu)
    if same and seqused[1] is not None and used[1] is seqused[1]:  # one cu for both sides: check kv's seqused too
        _, used[1] = checked_seqused(checked[0], seqused[1], name="cu_seqlens" if config.packing == "qkv" else
                                     "cu_seqlens_kv", seqused_name="seqused_kv",
                                     capacity=config.capacity_kv, max_seqlen=config.max_seqlen_kv)
    return config, checked[0], checked[-1], tuple(used)


def choose_implementation(implementation: str | None, config: AttentionConfig, *, sinks: bool = False,
                          index=(None, None, (None, None))) -> str:
    """"cudnn", "fa3" or "xla" for this call (implementation already checked); implementation="cudnn" or
    "fa3" that cannot be served raises saying why. sinks: the sink epilogue will differentiate through the
    stats. index: (cu_seqlens_q, cu_seqlens_kv, seqused), which FA3 reads to prove a top-left mask its own."""
    if implementation == "xla":
        return "xla"
    fa3_reason = "not considered"
    if implementation == "fa3" or (implementation is None and (fa3.preferred(config) or config.autotune)):
        # FA3 differentiates its stats with a second backward call (_fa3.py): sinks need nothing more.
        fa3_reason = fa3.unsupported_reason(config, *index)
        if implementation == "fa3" and fa3_reason is not None:
            raise NotImplementedError(f"implementation='fa3' cannot serve this call: {fa3_reason}")
        if implementation == "fa3" or (fa3_reason is None and fa3.preferred(config)):
            return "fa3"
    reason = cudnn.unsupported_reason(config)
    if reason is None and sinks:
        reason = launch.stats_gradient_unsupported(config)
    if implementation == "cudnn" and reason is not None:
        raise NotImplementedError(f"implementation='cudnn' cannot serve this call: {reason}")
    if reason is not None:
        warn_cudnn_fallback(reason, config)  # on a GPU only, once per reason
        return "xla"
    if fa3_reason is None:  # autotune=True and both kernels serve the call: the measured faster one
        return implementation_tuning.faster(config, index[0], index[1])
    return "cudnn"
