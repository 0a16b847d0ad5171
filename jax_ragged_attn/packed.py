"""Attention over fused projections: qkv [T, 3, H, D] and kv [T, 2, Hkv, D], read in place.

A fused QKV (or KV) projection writes one buffer whose token rows hold the parts side by side. Splitting it
costs a full copy of the activations forward and a full-size concatenate of the gradients backward. On the
cuDNN path neither happens: the packed buffer goes to the kernels as it is, each part addressed through its
token stride (3*H*D or 2*Hkv*D elements) and its offset within a row (ffi/layouts.h), and the backward
writes dQ, dK and dV into one gradient buffer of the packed shape (the *_packed backward handlers).

The xla path slices the parts and lets autodiff assemble the gradient: correct everywhere, with the copies.

    out = ragged_attention_qkvpacked(qkv, cu_seqlens, max_seqlen=2048, is_causal=True)
    out = ragged_attention_kvpacked(q, kv, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q=1, max_seqlen_kv=2048)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jax_ragged_attn import _cudnn as cudnn
from jax_ragged_attn._cudnn import launch
from jax_ragged_attn.api import apply_check, choose_implementation
from jax_ragged_attn.config import check_implementation, make_config
from jax_ragged_attn.xla import attention_xla


def _part_view(x, parts: int, name: str, layout: str) -> jax.ShapeDtypeStruct:
    """The shape of one part of a packed buffer, for the shared validation in make_config."""
    shape = getattr(x, "shape", None)
    if shape is None or getattr(x, "dtype", None) is None:
        raise ValueError(f"{name} must be an array {layout}, got {type(x).__name__}")
    if len(shape) != 4 or shape[1] != parts:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(shape)}")
    return jax.ShapeDtypeStruct((shape[0], shape[2], shape[3]), x.dtype)


def ragged_attention_qkvpacked(qkv, cu_seqlens, *, max_seqlen: int, scale: float | None = None,
                               is_causal: bool = False, diagonal_alignment: str = "top_left",
                               local_window_size=None, stats_layout: str = "head_major", return_stats: bool = False,
                               implementation: str | None = None, deterministic: bool = False,
                               check: bool | None = None, autotune: bool = False):
    """Self-attention over a fused projection qkv [T, 3, H, D] (FlashAttention's qkvpacked layout).

    Sequence b owns rows cu_seqlens[b]:cu_seqlens[b+1] of q, k and v alike. Every option means what it
    means in `ragged_attention`. Returns out [T, H, D] (and stats); the gradient has qkv's shape.
    """
    check_implementation(implementation)
    view = _part_view(qkv, 3, "qkv", "[T, 3, H, D]")
    config = make_config(view, view, view, cu_seqlens, cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen,
                         scale=scale, is_causal=is_causal, diagonal_alignment=diagonal_alignment,
                         local_window_size=local_window_size, stats_layout=stats_layout,
                         deterministic=deterministic, autotune=autotune)
    config, cu_q, cu_kv = apply_check(check, config, cu_seqlens, cu_seqlens)
    packed = dataclasses.replace(config, packing="qkv")
    if choose_implementation(implementation, packed) == "cudnn":
        out, stats = _cudnn_qkvpacked(qkv, cu_q, cu_kv, packed)
    else:
        out, stats = attention_xla(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_q, cu_kv, config)
    return (out, stats) if return_stats else out


def ragged_attention_kvpacked(q, kv, cu_seqlens_q, cu_seqlens_kv, *, max_seqlen_q: int, max_seqlen_kv: int,
                              scale: float | None = None, is_causal: bool = False,
                              diagonal_alignment: str = "top_left", local_window_size=None,
                              stats_layout: str = "head_major", return_stats: bool = False,
                              implementation: str | None = None, deterministic: bool = False,
                              check: bool | None = None, autotune: bool = False):
    """Attention of q [Tq, Hq, D] over a fused projection kv [Tkv, 2, Hkv, D] (FlashAttention's kvpacked).

    Every option means what it means in `ragged_attention`. Returns out [Tq, Hq, D] (and stats); the
    gradients have the shapes of q and kv.
    """
    check_implementation(implementation)
    view = _part_view(kv, 2, "kv", "[Tkv, 2, Hkv, D]")
    config = make_config(q, view, view, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q=max_seqlen_q,
                         max_seqlen_kv=max_seqlen_kv, scale=scale, is_causal=is_causal,
                         diagonal_alignment=diagonal_alignment, local_window_size=local_window_size,
                         stats_layout=stats_layout, deterministic=deterministic, autotune=autotune)
    config, cu_q, cu_kv = apply_check(check, config, cu_seqlens_q, cu_seqlens_kv)
    packed = dataclasses.replace(config, packing="kv")
    if choose_implementation(implementation, packed) == "cudnn":
        out, stats = _cudnn_kvpacked(q, kv, cu_q, cu_kv, packed)
    else:
        out, stats = attention_xla(q, kv[:, 0], kv[:, 1], cu_q, cu_kv, config)
    return (out, stats) if return_stats else out


def _stats_cotangent_backward(q, k, v, cu_q, cu_kv, out, raw_stats, d_out, d_stats, config):
    """A stats cotangent goes through the unpacked backward (stats_grad.py widens v, which a packed buffer
    cannot hold): the parts are copied out here, the one place the packed path copies."""
    if isinstance(d_out, SymbolicZero):
        d_out = jnp.zeros(out.shape, out.dtype)
    separate = dataclasses.replace(config, packing="none")
    return launch._attention_bwd(separate, (q, k, v, cu_q, cu_kv, out, raw_stats), (d_out, d_stats))[:3]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _cudnn_qkvpacked(qkv, cu_q, cu_kv, config):
    return launch._forward(qkv, qkv, qkv, cu_q, cu_kv, config)[:2]


def _qkvpacked_fwd(qkv, cu_q, cu_kv, config):
    qkv, cu_q, cu_kv = (x.value for x in (qkv, cu_q, cu_kv))
    out, stats, raw_stats = launch._forward(qkv, qkv, qkv, cu_q, cu_kv, config)
    return (out, stats), (qkv, cu_q, cu_kv, out, raw_stats)


def _qkvpacked_bwd(config, residuals, cotangents):
    qkv, cu_q, cu_kv, out, raw_stats = residuals
    d_out, d_stats = cotangents
    if not isinstance(d_stats, SymbolicZero):
        grads = _stats_cotangent_backward(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_q, cu_kv, out, raw_stats, d_out,
                                          d_stats, config)
        return jnp.stack(grads, axis=1), None, None
    if isinstance(d_out, SymbolicZero):
        return jnp.zeros_like(qkv), None, None
    (d_qkv,) = launch._backward(qkv, qkv, qkv, cu_q, cu_kv, out, raw_stats, d_out, config)
    return d_qkv, None, None


_cudnn_qkvpacked.defvjp(_qkvpacked_fwd, _qkvpacked_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _cudnn_kvpacked(q, kv, cu_q, cu_kv, config):
    return launch._forward(q, kv, kv, cu_q, cu_kv, config)[:2]


def _kvpacked_fwd(q, kv, cu_q, cu_kv, config):
    q, kv, cu_q, cu_kv = (x.value for x in (q, kv, cu_q, cu_kv))
    out, stats, raw_stats = launch._forward(q, kv, kv, cu_q, cu_kv, config)
    return (out, stats), (q, kv, cu_q, cu_kv, out, raw_stats)


def _kvpacked_bwd(config, residuals, cotangents):
    q, kv, cu_q, cu_kv, out, raw_stats = residuals
    d_out, d_stats = cotangents
    if not isinstance(d_stats, SymbolicZero):
        d_q, d_k, d_v = _stats_cotangent_backward(q, kv[:, 0], kv[:, 1], cu_q, cu_kv, out, raw_stats, d_out,
                                                  d_stats, config)
        return d_q, jnp.stack([d_k, d_v], axis=1), None, None
    if isinstance(d_out, SymbolicZero):
        return jnp.zeros_like(q), jnp.zeros_like(kv), None, None
    d_q, d_kv = launch._backward(q, kv, kv, cu_q, cu_kv, out, raw_stats, d_out, config)
    return d_q, d_kv, None, None


_cudnn_kvpacked.defvjp(_kvpacked_fwd, _kvpacked_bwd, symbolic_zeros=True)
