"""Attention over fused projections: qkv [T, 3, H, D] and kv [T, 2, Hkv, D], read in place.

A fused QKV (or KV) projection writes one buffer whose token rows hold the parts side by side. Splitting it
costs a full copy of the activations forward and a full-size concatenate of the gradients backward. On the
cuDNN path neither happens: the packed buffer goes to the kernels as it is, each part addressed through its
token stride (3*H*D or 2*Hkv*D elements) and its offset within a row (ffi/layouts.h), and the backward
writes dQ, dK and dV into one gradient buffer of the packed shape. How each packing lies is one entry of
index/packings.TABLE, and one custom_vjp (cudnn/launch.attention) serves them all.

The xla path slices the parts and lets autodiff assemble the gradient: correct everywhere, with the copies.

    out = ragged_attention_qkvpacked(qkv, cu_seqlens, max_seqlen=2048, is_causal=True)
    out = ragged_attention_kvpacked(q, kv, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q=1, max_seqlen_kv=2048)
"""

from __future__ import annotations

from jax_ragged_attn.config import AttentionOptions
from jax_ragged_attn.ops.ragged import attend


def ragged_attention_qkvpacked(
    qkv,
    cu_seqlens,
    *,
    max_seqlen: int,
    scale: float | None = None,
    is_causal: bool = False,
    diagonal_alignment: str = "top_left",
    local_window_size=None,
    stats_layout: str = "head_major",
    return_stats: bool = False,
    implementation: str | None = None,
    deterministic: bool = False,
    check: bool | None = None,
    autotune: bool = False,
    strategy: str = "fastest",
    return_overflow: bool = False,
    seqused_q=None,
    seqused_kv=None,
    sinks=None,
    softcap: float | None = None,
    fa3_provider: str | None = None,
):
    """Self-attention over a fused projection qkv [T, 3, H, D] (FlashAttention's qkvpacked layout).

    Sequence b owns rows cu_seqlens[b]:cu_seqlens[b+1] of q, k and v alike. Every option means what it
    means in `ragged_attention`. Returns out [T, H, D] (and stats, then the overflow.Overflow with
    return_overflow=True; cu_seqlens' invalid entries count once); the gradient has qkv's shape.
    """
    options = AttentionOptions.from_arguments(locals())
    return attend(
        (qkv,),
        cu_seqlens,
        cu_seqlens,
        options,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        packing="qkv",
        return_overflow=return_overflow,
        seqused_q=seqused_q,
        seqused_kv=seqused_kv,
        sinks=sinks,
    )


def ragged_attention_kvpacked(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_kv,
    *,
    max_seqlen_q: int,
    max_seqlen_kv: int,
    scale: float | None = None,
    is_causal: bool = False,
    diagonal_alignment: str = "top_left",
    local_window_size=None,
    stats_layout: str = "head_major",
    return_stats: bool = False,
    implementation: str | None = None,
    deterministic: bool = False,
    check: bool | None = None,
    autotune: bool = False,
    strategy: str = "fastest",
    return_overflow: bool = False,
    seqused_q=None,
    seqused_kv=None,
    sinks=None,
    softcap: float | None = None,
    fa3_provider: str | None = None,
):
    """Attention of q [Tq, Hq, D] over a fused projection kv [Tkv, 2, Hkv, D] (FlashAttention's kvpacked).

    Every option means what it means in `ragged_attention`. Returns out [Tq, Hq, D] (and stats, then the
    overflow.Overflow with return_overflow=True); the gradients have the shapes of q and kv.
    """
    options = AttentionOptions.from_arguments(locals())
    return attend(
        (q, kv),
        cu_seqlens_q,
        cu_seqlens_kv,
        options,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_kv=max_seqlen_kv,
        packing="kv",
        return_overflow=return_overflow,
        seqused_q=seqused_q,
        seqused_kv=seqused_kv,
        sinks=sinks,
    )
