"""The dew-flash-attn provider of implementation="fa3" (providers.py): FlashAttention-3's Hopper kernels as the
dew-flash-attn-cu13 wheel builds them (head dims 64 to 256, a varlen backward launched over the batch's blocks),
called through their FFI targets by fa3/ragged.py's wrapper, which adds padding safety, masks, both stats layouts
and row masking. The wheel's Python API hides the log-sum-exp and takes no seqused, hence the direct calls.

Declined, with the reason: softcap (not in the build), deterministic=True (no deterministic backward), head dims
other than Dqk = Dv in 64, 128, 192, 256, float32, a top-left causal / windowed mask FA3's bottom-right one cannot
be proven equal to, no Hopper GPU, the wheel not installed. implementation="fa3" takes it first where it serves the
call: it is the fastest FA3 build on the rows it serves (docs/PERFORMANCE.md#against-every-peer).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_ragged_attn.backends.fa3 import ragged as fa3
from jax_ragged_attn.config import AttentionConfig
from jax_ragged_attn.index import RaggedIndex, host_slots

NAME = "dew"  # this module's binding of the kernels (fa3/ragged.py _kernels); the provider is "dew-flash-attn"
WHEEL = "dew-flash-attn-cu13"
INSTALL = "pip install 'jax_ragged_attn[dew]'"
HEAD_DIMS = (64, 128, 192, 256)  # the FA3 kernels its library holds (Dqk = Dv)
LIBRARY = "libdew_flash_attn3.so"  # FlashAttention-3 for sm90, beside the package's __init__.py
# The wheel's targets (dew_flash_attn/__init__.py of dew_flash_attn_cu13-0.3.6, `_forward3` / `_backward3`):
# - `dew_flash3_mha_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k)` -> (out, lse f32 [Hq, Tq] head-major, two
#   one-element scratch), attributes max_seqlen, max_seqlen_k (int64), softmax_scale (float64), is_causal,
#   window_size_left, window_size_right (int64; FA3's bottom-right band, -1 unbounded);
# - `dew_flash3_mha_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)` -> (dq, dk, dv per key head,
#   two float32 scratch of Hq * (Tq + 128 * (sequences + 1))), the same attributes.
TARGETS = ("dew_flash3_mha_varlen_fwd", "dew_flash3_mha_varlen_bwd")
TARGET_PREFIX = "jax_ragged_attn_"  # our registrations of its handlers
SCRATCH_ROWS = 128  # the backward's scratch: 128 rows per sequence and 128 more, per head (its own sizing)


# ---- availability ------------------------------------------------------------------------------------------


def _installed() -> bool:
    return importlib.util.find_spec("dew_flash_attn") is not None


@functools.cache
def _registered() -> str | None:
    """Registers the library's two varlen FFI handlers under our names once; None, or why they cannot be."""
    try:
        import dew_flash_attn  # loads its libraries (it needs libcudart.so.13, which JAX's CUDA plugin maps)

        library = ctypes.CDLL(os.path.join(os.path.dirname(dew_flash_attn.__file__), LIBRARY))
        for name in TARGETS:
            jax.ffi.register_ffi_target(
                TARGET_PREFIX + name, jax.ffi.pycapsule(getattr(library, name)), platform="CUDA"
            )
    except Exception as error:  # noqa: BLE001 - any failure is a reason to decline
        return f"the {WHEEL} wheel's FlashAttention-3 handlers do not register: {type(error).__name__}: {error}"
    return None


@functools.cache
def unavailable_reason() -> str | None:
    """None when dew-flash-attn's FA3 kernels can run here (the wheel installed, a Hopper GPU), else why not."""
    if not _installed():
        return f"the optional {WHEEL} wheel is not installed ({INSTALL})"
    # Its FlashAttention-2 kernels (sm80, sm120) are not called here.
    return fa3.hopper_reason(WHEEL) or _registered()


# ---- what it serves ---------------------------------------------------------------------------------------


def unsupported_reason(
    config: AttentionConfig, cu_seqlens_q=None, cu_seqlens_kv=None, seqused=(None, None)
) -> str | None:
    """None when dew-flash-attn's kernels can serve this call here, else a sentence saying why not (the index
    proves a top-left mask, as for the flash-attn3-jax provider)."""
    if isinstance(cu_seqlens_q, RaggedIndex):
        cu_seqlens_q, cu_seqlens_kv, seqused = (
            cu_seqlens_q.cu_seqlens_q,
            cu_seqlens_q.cu_seqlens_kv,
            cu_seqlens_q.seqused,
        )
    if config.softcap:
        return f"the {WHEEL} wheel's kernels are built without softcap, got softcap={config.softcap}"
    if config.dtype not in fa3.FA3_DTYPES:
        return f"FlashAttention-3 takes bfloat16 or float16 inputs, got {config.dtype}"
    if config.head_dim_qk != config.head_dim_v or config.head_dim_qk not in HEAD_DIMS:
        return (
            f"the {WHEEL} wheel's kernels take equal head dims of {', '.join(map(str, HEAD_DIMS))} (Dqk = Dv), "
            f"got Dqk={config.head_dim_qk}, Dv={config.head_dim_v}"
        )
    if config.deterministic:
        return f"the {WHEEL} wheel's backward has no deterministic mode (deterministic=True)"
    return fa3.alignment_reason(config, cu_seqlens_q, cu_seqlens_kv, seqused) or unavailable_reason()


def attend(buffers, index, config: AttentionConfig, *, stats=True):
    """(out, stats) of the parts sliced out of packed buffers; autodiff assembles their gradients."""
    from jax_ragged_attn.index.packings import TABLE

    # Without seqused a slot's unused rows are only those max_seqlen cuts: one gap sequence a slot (PAIRED), or
    # none where no slot can be cut (PLAIN: the offsets dew-flash-attn's own call passes).
    variant = None
    if all(used is None for used in index.seqused):
        variant = PLAIN if no_cut_rows(config, index) else PAIRED
    return fa3.attention(
        *TABLE[config.packing].split(buffers),
        index.cu_seqlens_q,
        index.cu_seqlens_kv,
        config,
        index.seqused,
        binding=f"{NAME}/{variant}" if variant else NAME,
    )


def no_cut_rows(config: AttentionConfig, index: RaggedIndex) -> bool:
    """Whether provably no slot is longer than its side's max_seqlen, so that without seqused every slot's rows
    are its used ones and the caller's offsets are the kernels' (PLAIN): max_seqlen at least the side's buffer
    rows, or cu_seqlens known at trace time whose slots fit. Not for traced cu_seqlens with a smaller max_seqlen
    (a training step's): handing a longer slot over whole is not safe. FA3's backward preprocessing runs over
    max_seqlen rows of each sequence, so the rows of a longer one past it would be read with log-sum-exps and
    row sums never written, inside the band of the sequence's used keys (a test needs a slot longer than one
    64-row tile to see it)."""
    return all(
        _slots_fit(cu, capacity, max_seqlen)
        for cu, capacity, max_seqlen in (
            (index.cu_seqlens_q, config.capacity_q, config.max_seqlen_q),
            (index.cu_seqlens_kv, config.capacity_kv, config.max_seqlen_kv),
        )
    )


def _slots_fit(cu, capacity: int, max_seqlen: int) -> bool:
    if max_seqlen >= capacity:
        return True
    slots = host_slots(cu, capacity)
    return slots is not None and bool(np.all(slots <= max_seqlen))


# ---- the kernels (fa3/ragged.py _kernels calls them with its own signature) ----------------------------------
#
# Lengths without seqused. The kernels take each sequence as the rows between two offsets. Sequence b's used rows
# (min(slot length, max_seqlen, seqused), fa3/ragged.py `_index`) are the first of its slot, so the offsets handed
# over are [3B + 1] (`with_gaps`): sequence 3b is b's used queries and keys, 3b + 1 the rest of its query slot
# with no keys, 3b + 2 the rest of its key slot with no queries (rows cut by max_seqlen or seqused). A gap so costs
# its own tiles, not gap queries x gap keys (this build's varlen schedulers count tiles from the offsets, so a gap
# is computed whole, whatever max_seqlen). Without seqused the gaps are only max_seqlen's cuts, empty in the common
# case, and one gap sequence a slot holds both sides ([2B + 1], PAIRED: fewer sequences to schedule); where no
# slot can be longer than its max_seqlen (max_seqlen at least the buffer's rows, or concrete cu_seqlens that
# show it) there is no gap at all and the kernels get the caller's slots ([B + 1], PLAIN, `no_cut_rows`).
# fa3/ragged.py clears every row outside the used ones before the kernels read them and masks every result row
# outside them after, so what the gap sequences compute is never read.


def with_gaps(cu: jax.Array, used: jax.Array, side: str, paired: bool = False) -> jax.Array:
    """[3B + 1] offsets from sanitised cu [B + 1] and used lengths [B]: sequence 3b is sequence b's used rows,
    3b + 1 the rest of its slot on the query side ("q": empty on the key side), 3b + 2 on the key side ("kv").
    cu [0, 5, 9], used [3, 4]: "q" -> [0, 3, 5, 5, 9, 9, 9], "kv" -> [0, 3, 3, 5, 9, 9, 9].
    paired: [2B + 1], sequence 2b + 1 the rest of both slots: "q" and "kv" -> [0, 3, 5, 9, 9]."""
    starts, ends = cu[:-1].astype(jnp.int32), cu[1:].astype(jnp.int32)
    used_end = starts + used.astype(jnp.int32)
    if paired:
        return jnp.concatenate([jnp.stack([starts, used_end], axis=1).reshape(-1), cu[-1:].astype(jnp.int32)])
    if side == "q":
        triples = jnp.stack([starts, used_end, ends], axis=1)  # used | query gap | (empty)
    else:
        triples = jnp.stack([starts, used_end, used_end], axis=1)  # used | (empty) | key gap
    return jnp.concatenate([triples.reshape(-1), cu[-1:].astype(jnp.int32)])


def _attributes(config: AttentionConfig) -> dict:
    is_causal, left, right = fa3._window(config)
    return dict(
        max_seqlen=np.int64(config.max_seqlen_q),
        max_seqlen_k=np.int64(config.max_seqlen_kv),
        softmax_scale=np.float64(config.scale),
        is_causal=is_causal,
        window_size_left=np.int64(left),
        window_size_right=np.int64(right),
    )


def _forward_call(q, k, v, cu_q, cu_kv, used_q, used_kv, config: AttentionConfig, paired: bool = False):
    """(out [Tq, Hq, D] with garbage in rows no used sequence owns, lse [Hq, Tq])."""
    return _kernel_forward(
        q, k, v, with_gaps(cu_q, used_q, "q", paired), with_gaps(cu_kv, used_kv, "kv", paired), config
    )


def _backward_call(
    d_out, q, k, v, out, lse, cu_q, cu_kv, used_q, used_kv, config: AttentionConfig, paired: bool = False
):
    """(dq, dk, dv), garbage in rows no used sequence owns."""
    return _kernel_backward(
        d_out, q, k, v, out, lse, with_gaps(cu_q, used_q, "q", paired), with_gaps(cu_kv, used_kv, "kv", paired), config
    )


# Calls without seqused: the rows a slot does not use are those max_seqlen cuts (none where max_seqlen bounds
# every sequence, as FlashAttention's callers pass it), so one gap sequence a slot holds both sides' rest:
# 2B + 1 offsets instead of 3B + 1. Each sequence, even an empty one, costs the kernels scheduling work, and
# the fewer sequences keep the wrapper's cost over the kernel small (docs/PERFORMANCE.md#what-the-measurements-found,
# "What ours adds to a kernel"). A slot cut by max_seqlen on both sides (a sequence that
# check=True rejects as longer than max_seqlen) then computes its gap queries against its gap keys: up to its
# uncut attention (a 32k slot cut to 1k: about 1,000 times the cut call's work, where the three-a-slot layout and
# the flash-attn3-jax provider stay linear), its results masked like every other unowned row. docs/API.md says so.
PAIRED = "paired"


_forward_call_paired = functools.partial(_forward_call, paired=True)
_backward_call_paired = functools.partial(_backward_call, paired=True)

# Calls no_cut_rows proves: no gap sequence at all, the caller's [B + 1] slots, every row of which is used
# (B sequences fewer to schedule than PAIRED).
PLAIN = "plain"


def _forward_call_plain(q, k, v, cu_q, cu_kv, used_q, used_kv, config: AttentionConfig):
    return _kernel_forward(q, k, v, cu_q.astype(jnp.int32), cu_kv.astype(jnp.int32), config)


def _backward_call_plain(d_out, q, k, v, out, lse, cu_q, cu_kv, used_q, used_kv, config: AttentionConfig):
    return _kernel_backward(d_out, q, k, v, out, lse, cu_q.astype(jnp.int32), cu_kv.astype(jnp.int32), config)


def _kernel_forward(q, k, v, offsets_q, offsets_kv, config: AttentionConfig):
    """The library's varlen forward over the sequences between consecutive offsets."""
    heads, rows = q.shape[1], q.shape[0]
    results = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((heads, rows), jnp.float32),
        jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32),
        jax.ShapeDtypeStruct((1, 1, 1), jnp.float32),
    )
    call = jax.ffi.ffi_call(TARGET_PREFIX + TARGETS[0], results, vmap_method="sequential")
    out, lse, _, _ = call(q, k, v, offsets_q, offsets_kv, **_attributes(config))
    return out, lse


def _kernel_backward(d_out, q, k, v, out, lse, offsets_q, offsets_kv, config: AttentionConfig):
    """The library's varlen backward over the same sequences: (dq, dk, dv), dk and dv per key head."""
    sequences = offsets_q.shape[0] - 1
    scratch = jax.ShapeDtypeStruct((q.shape[1] * (q.shape[0] + SCRATCH_ROWS * (sequences + 1)),), jnp.float32)
    results = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        scratch,
        scratch,
    )
    call = jax.ffi.ffi_call(TARGET_PREFIX + TARGETS[1], results, vmap_method="sequential")
    dq, dk, dv, _, _ = call(
        d_out, q, k, v, out, fa3.lse_head_major(lse, config), offsets_q, offsets_kv, **_attributes(config)
    )
    return dq, dk, dv
