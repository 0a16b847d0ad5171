"""FlashAttention-3's wrapper, and its kernels as the flash-attn3-jax wheel provides them (providers.py).

The wheel (`pip install jax_ragged_attn[fa3]`, an optional extra) ships FlashAttention-3 compiled as XLA FFI
handlers. This module calls those handlers itself (the wheel's own Python wrapper hides the forward's
log-sum-exp and cannot pass seqused to the backward), registered under names of its own so that importing the
wheel as well registers nothing twice. It serves every semantic the op promises where FA3's kernels can:

- Lengths. Each sequence's used rows go to both kernels as FA3's seqused_q / seqused_k: min(slot length,
  max_seqlen, seqused), from sanitised (clamped) cu_seqlens. FA3's tiles do load rows past a sequence's end
  (masking only their scores), so the kernels get copies of q, k, v with every row outside the sequences set
  to 0 (_cleared): rows cut by max_seqlen, rows past seqused and capacity padding are never read, and a NaN
  there cannot leak. Rows FA3 does not own (and rows whose band is empty) are masked to out 0 / stats -inf /
  gradient 0 afterwards, as on cuDNN; the cotangents of those rows are never read.
- Masks. FA3's causal mask and windows are aligned bottom-right (diagonal i + skv - sq). diagonal_alignment=
  "bottom_right" maps straight onto FA3's window (left, right); "top_left" is the same mask where every
  sequence has as many keys as queries, which is proven at trace time (one array for both cu_seqlens, or
  concrete cu_seqlens whose used lengths agree); a top-left causal or windowed call that cannot be proven so
  is declined. Without causal mask and window the alignment does not matter.
- Stats. FA3's softmax_lse (natural log, head-major [Hq, Tq] rows of its buffer) is masked and returned in
  either layout; token-major is its transpose.
- Gradient of the stats. A stats cotangent g_i adds g_i * p_ij to dS_ij (see shared/stats_grad.py). FA3's
  head dim is fixed at 128, so the value columns cannot be widened as on cuDNN. Instead a second backward
  call carries the stats term alone, exactly: V := 0 (dP = dO.V^T = 0), and dO'', O'' built by
  stats_grad.stats_columns so that rowsum(dO'' * O'') = -g_i (two dtype terms, about float32 precision). FA3
  then computes dS = P * (0 - (-g)) = g * P, and its dQ, dK are the stats gradient (its dV, P^T.dO'', is
  discarded: V does not enter the stats). The two calls' dQ and dK add in float32. The second call runs only
  when the stats cotangent is not a symbolic zero (a loss that reads the stats).
- Packed QKV / KV: the parts are sliced out (copies) and autodiff assembles the gradients in the packed shape.
- deterministic=True: FA3's deterministic backward. strategy: FA3's backward has one intermediate layout,
  sized by the token capacity (strategy="lean_memory"'s), and serves both values. autotune: ignored.
- Check mode: cu_seqlens are validated by features.checks.apply_check before they reach the kernels (FA3 has no
  workspace to guard).

The flash-attn3-jax provider declines, with the reason (providers.py passes it on): head dims other than 128 or
Dv != Dqk, float32, a top-left causal / windowed mask whose q and kv lengths may differ, no Hopper GPU, the
wheel not installed.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from jax_ragged_attn.backends.shared import stats_grad
from jax_ragged_attn.backends.shared.forward_mode import forward_mode, portable
from jax_ragged_attn.backends.shared.remat_names import named_residuals
from jax_ragged_attn.backends.shared.row_zeroing import zero_unused_rows
from jax_ragged_attn.config import AttentionConfig
from jax_ragged_attn.index import (
    RaggedIndex,
    host_slots,
    query_rows_with_keys,
    sanitize_both,
    sanitize_cu_seqlens,
    sequence_lengths,
)

WHEEL = "flash-attn3-jax"
INSTALL = "pip install 'jax_ragged_attn[fa3]'"
FA3_DTYPES = ("bfloat16", "float16")
FA3_HEAD_DIM = 128  # the only head dim the wheel's kernels are compiled for (qk and v)
TARGET_PREFIX = "jax_ragged_attn_fa3_"  # our registrations of the wheel's handlers
# The backward's dQ accumulator rows: FA3 pads each sequence to its tile of 128 query rows (the wheel's own).
BLOCK_M = 128


# ---- availability ------------------------------------------------------------------------------------------


@functools.cache
def _registered() -> str | None:
    """Registers the wheel's FFI handlers under our names once; None, or why they cannot be registered."""
    try:
        from flash_attn3_jax_lib import flash_api  # the compiled module; the wheel's Python is not needed
    except Exception as error:  # noqa: BLE001 - any import failure is a reason to decline
        return f"the {WHEEL} wheel's FFI module does not import: {type(error).__name__}: {error}"
    try:
        for name, capsule in flash_api.get_ffi_registrations().items():
            jax.ffi.register_ffi_target(TARGET_PREFIX + name, capsule, platform="CUDA")
    except Exception as error:  # noqa: BLE001
        return f"registering the {WHEEL} wheel's FFI handlers failed: {type(error).__name__}: {error}"
    return None


def _installed() -> bool:
    return importlib.util.find_spec("flash_attn3_jax_lib") is not None


def hopper_reason(wheel: str) -> str | None:
    """Why `wheel`'s FlashAttention-3 kernels (built for Hopper, sm_90, only) cannot run here, or None."""
    backend = jax.default_backend()
    if backend != "gpu":
        return f"FlashAttention-3 needs a CUDA GPU; JAX's backend is {backend!r}"
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if capability is None or str(capability).split(".")[0] != "9":
        return (
            f"FlashAttention-3's kernels in the {wheel} wheel are built for Hopper (sm_90) only; this GPU "
            f"({device.device_kind}) has compute capability {capability}"
        )
    return None


@functools.cache
def unavailable_reason() -> str | None:
    """None when FA3 can run on this machine (the wheel installed, a Hopper GPU), else a sentence why not."""
    if not _installed():
        return f"the optional {WHEEL} wheel is not installed ({INSTALL})"
    return hopper_reason(WHEEL) or _registered()


# ---- what FA3 serves --------------------------------------------------------------------------------------


def _host_lengths(cu, capacity: int, max_seqlen: int, seqused) -> np.ndarray | None:
    """The used lengths of each sequence as the op computes them (packing.sequence_lengths), on the host, or
    None when the values are not known at trace time."""
    slots = host_slots(cu, capacity)
    if slots is None or isinstance(seqused, jax.core.Tracer):
        return None
    lengths = np.minimum(slots, max_seqlen)
    if seqused is not None:
        lengths = np.clip(np.asarray(seqused, np.int64), 0, lengths)
    return lengths


def lengths_equal(config: AttentionConfig, cu_seqlens_q, cu_seqlens_kv, seqused=(None, None)) -> bool:
    """Whether every sequence provably has as many used keys as queries (so top-left = bottom-right)."""
    if cu_seqlens_q is None or cu_seqlens_kv is None:
        return False
    if (
        cu_seqlens_q is cu_seqlens_kv
        and seqused[0] is seqused[1]
        and config.capacity_q == config.capacity_kv
        and config.max_seqlen_q == config.max_seqlen_kv
    ):
        return True
    lengths_q = _host_lengths(cu_seqlens_q, config.capacity_q, config.max_seqlen_q, seqused[0])
    lengths_kv = _host_lengths(cu_seqlens_kv, config.capacity_kv, config.max_seqlen_kv, seqused[1])
    return lengths_q is not None and lengths_kv is not None and np.array_equal(lengths_q, lengths_kv)


def unsupported_reason(
    config: AttentionConfig, cu_seqlens_q=None, cu_seqlens_kv=None, seqused=(None, None)
) -> str | None:
    """None when FA3 can serve this call here, else a sentence saying why not. The cu_seqlens (and seqused),
    or one index.RaggedIndex in their place, serve to prove a top-left mask equal to FA3's bottom-right one;
    without them such a mask is declined. (Its stats differentiate with a second backward call.) A machine
    without the wheel says so first."""
    if isinstance(cu_seqlens_q, RaggedIndex):
        cu_seqlens_q, cu_seqlens_kv, seqused = (
            cu_seqlens_q.cu_seqlens_q,
            cu_seqlens_q.cu_seqlens_kv,
            cu_seqlens_q.seqused,
        )
    unavailable = unavailable_reason()
    if unavailable is not None:
        return unavailable
    if config.softcap:
        return (
            f"the {WHEEL} wheel's kernels are called with softcap 0 (its binding hard-codes it), got "
            f"softcap={config.softcap}"
        )
    if config.dtype not in FA3_DTYPES:
        return f"FlashAttention-3 takes bfloat16 or float16 inputs, got {config.dtype}"
    if config.head_dim_qk != FA3_HEAD_DIM or config.head_dim_v != FA3_HEAD_DIM:
        return (
            f"the {WHEEL} wheel's kernels are built for head dim {FA3_HEAD_DIM} only (Dqk = Dv = "
            f"{FA3_HEAD_DIM}), got Dqk={config.head_dim_qk}, Dv={config.head_dim_v}"
        )
    return alignment_reason(config, cu_seqlens_q, cu_seqlens_kv, seqused)


def alignment_reason(config: AttentionConfig, cu_seqlens_q, cu_seqlens_kv, seqused) -> str | None:
    """Why FA3's bottom-right masks cannot serve this call's top-left one, or None (every binding's kernels)."""
    bounded = config.left_bound is not None or config.right_bound is not None
    if (
        bounded
        and config.diagonal_alignment == "top_left"
        and not lengths_equal(config, cu_seqlens_q, cu_seqlens_kv, seqused)
    ):
        return (
            "FlashAttention-3 aligns its causal mask and windows bottom-right; a top-left one is the same "
            "mask only where every sequence has as many keys as queries, which this call does not prove "
            "(pass one array as both cu_seqlens, or concrete cu_seqlens with equal lengths, or use "
            "diagonal_alignment='bottom_right')"
        )
    return None


# ---- the provider surface (providers.py) -------------------------------------------------------------------

NAME = "fa3"  # this module's binding of the kernels (_kernels); the provider is WHEEL


def attend(buffers, index, config: AttentionConfig, *, stats=True):
    """(out, stats) of the parts sliced out of packed buffers; autodiff assembles their gradients."""
    from jax_ragged_attn.index.packings import TABLE

    return attention(
        *TABLE[config.packing].split(buffers), index.cu_seqlens_q, index.cu_seqlens_kv, config, index.seqused
    )


# ---- the kernels ------------------------------------------------------------------------------------------


def _window(config: AttentionConfig) -> tuple[bool, int, int]:
    """(is_causal, window_left, window_right) in FA3's terms: bounds from the diagonal, -1 for none."""
    left = -1 if config.left_bound is None else config.left_bound
    right = -1 if config.right_bound is None else config.right_bound
    return left < 0 and right == 0, left, right


# The log-sum-exp buffer the forward is handed is [1, Hq, Tq], B times smaller than the wheel's own declaration
# [B, Hq, max_seqlen_q] with max_seqlen_q = Tq: FA3 writes the varlen log-sum-exp head-major, row
# cu_seqlens_q[b] + i of head h at h * Tq + cu_seqlens_q[b] + i, within either. Measured on the H200
# (benchmarks/fa3_compare.py's probe): FA3 writes the same values into either, also with max_seqlen grids
# below the capacity.
# FA3's grids are sized by the caller's max_seqlen bounds (clamped to the capacities), not by Tq, Tkv as the
# wheel's wrapper passes by default. Measured on the H200, W1 fwd+bwd: 3.19 ms against 3.57 ms with the
# capacities (results identical).


def _lse_shape(config: AttentionConfig) -> tuple[int, int, int]:
    return (1, config.num_heads_q, config.capacity_q)


def _grid_seqlens(config: AttentionConfig) -> tuple[int, int]:
    return config.max_seqlen_q, config.max_seqlen_kv


def _forward_call(q, k, v, cu_q, cu_kv, used_q, used_kv, config: AttentionConfig):
    """FA3's varlen forward: (out [Tq, Hq, D] with garbage in rows it does not own, lse buffer)."""
    is_causal, left, right = _window(config)
    dtype = q.dtype
    empty_i32, empty_f32, empty_like_q = (
        jnp.zeros((0,), jnp.int32),
        jnp.zeros((0,), jnp.float32),
        jnp.zeros((0,), dtype),
    )
    result_types = [
        jax.ShapeDtypeStruct(q.shape, dtype),
        jax.ShapeDtypeStruct(_lse_shape(config), jnp.float32),
        jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32),
        jax.ShapeDtypeStruct((1, 1, 1), jnp.float32),
    ]
    out, lse, _, _ = jax.ffi.ffi_call(
        TARGET_PREFIX + "flash_mha_fwd",
        result_types,
        has_side_effect=False,
        vmap_method="sequential",
        input_layouts=[None] * 21,
        output_layouts=[None] * 4,
    )(
        q,
        k,
        v,
        empty_like_q,
        empty_like_q,
        empty_like_q,  # k_new, v_new, q_v
        cu_q,
        cu_kv,
        empty_i32,  # cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new
        used_q,
        used_kv,  # seqused_q, seqused_k
        empty_i32,
        empty_i32,
        empty_i32,  # page_table, kv_batch_idx, leftpad_k
        empty_like_q,
        empty_like_q,
        empty_i32,  # rotary_cos, rotary_sin, seqlens_rotary
        empty_f32,
        empty_f32,
        empty_f32,  # q/k/v descale
        empty_i32,  # scheduler_metadata
        max_seqlen_q=_grid_seqlens(config)[0],
        max_seqlen_q_has_value=True,
        max_seqlen_k=_grid_seqlens(config)[1],
        max_seqlen_k_has_value=True,
        softmax_scale_val=float(config.scale),
        softmax_scale_has_value=True,
        pack_gqa_val=False,
        pack_gqa_has_value=False,
        is_causal=is_causal,
        window_size_left=left,
        window_size_right=right,
        attention_chunk=0,
        softcap=0.0,
        is_rotary_interleaved=False,
        num_splits=1,
        sm_margin=0,
    )
    return out, lse


def _backward_call(d_out, q, k, v, out, lse, cu_q, cu_kv, used_q, used_kv, config: AttentionConfig):
    """FA3's varlen backward: (dq, dk, dv), garbage in rows it does not own."""
    is_causal, left, right = _window(config)
    total_q, heads_q = q.shape[0], q.shape[1]
    rounded = ((total_q + config.num_seqs * BLOCK_M + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    result_types = [
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        jax.ShapeDtypeStruct((heads_q, rounded), jnp.float32),  # softmax_d
        jax.ShapeDtypeStruct((heads_q, rounded), jnp.float32),
    ]  # softmax_lse_log2
    dq, dk, dv, _, _ = jax.ffi.ffi_call(
        TARGET_PREFIX + "flash_mha_bwd",
        result_types,
        has_side_effect=False,
        vmap_method="sequential",
        input_layouts=[None] * 10,
        output_layouts=[None] * 5,
    )(
        d_out,
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_kv,
        used_q,
        used_kv,
        max_seqlen_q_val=_grid_seqlens(config)[0],
        max_seqlen_q_has_value=True,
        max_seqlen_k_val=_grid_seqlens(config)[1],
        max_seqlen_k_has_value=True,
        softmax_scale_val=float(config.scale),
        softmax_scale_has_value=True,
        is_causal=is_causal,
        window_size_left=left,
        window_size_right=right,
        softcap=0.0,
        deterministic=bool(config.deterministic),
        sm_margin=0,
    )
    return dq, dk, dv


def _kernels(binding: str):
    """(forward, backward) kernel calls of a binding of FlashAttention-3's kernels: this module's (the
    flash-attn3-jax wheel's, binding NAME) or a sibling module's (dew.py: dew-flash-attn's), each with this
    module's _forward_call / _backward_call signature; "module/variant" names the module's
    _forward_call_<variant> / _backward_call_<variant>. Looked up at call time, so a test can swap them
    (testing/fa3_emulator.py)."""
    name, _, variant = binding.partition("/")
    module = sys.modules[__name__] if name == NAME else importlib.import_module(f"{__package__}.{name}")
    suffix = f"_{variant}" if variant else ""
    return getattr(module, "_forward_call" + suffix), getattr(module, "_backward_call" + suffix)


def lse_head_major(lse: jax.Array, config: AttentionConfig) -> jax.Array:
    """FA3's log-sum-exp buffer as [Hq, Tq] (unmasked)."""
    heads, rows = config.num_heads_q, config.capacity_q
    return lse.reshape(-1)[: heads * rows].reshape(heads, rows)


def shares_rows(config: AttentionConfig, cu_seqlens_q, cu_seqlens_kv, seqused) -> bool:
    """Whether queries and keys have the same used rows: one array for both cu_seqlens (and for both seqused),
    equal capacities and max_seqlen (self-attention, as a language model calls it). Then the index is
    sanitised once and Q, K, V (and dQ, dK, dV) are cleared in one call of the zero-rows kernel, not three
    (what the wrapper's small kernels add: docs/PERFORMANCE.md#what-the-measurements-found)."""
    return (
        cu_seqlens_q is cu_seqlens_kv
        and seqused[0] is seqused[1]
        and (config.capacity_q, config.max_seqlen_q) == (config.capacity_kv, config.max_seqlen_kv)
    )


def _index(cu_seqlens_q, cu_seqlens_kv, config: AttentionConfig, seqused, shared: bool = False):
    """(sanitised cu_q, cu_kv, used rows per sequence q, kv): what both kernels read; computed once when the
    two sides share their rows (shares_rows), the same arrays then serving as both."""
    if shared:
        cu = sanitize_cu_seqlens(cu_seqlens_q, config.capacity_q)
        used = sequence_lengths(cu, config.max_seqlen_q, seqused[0])
        return cu, cu, used, used
    cu_q, cu_kv = sanitize_both(cu_seqlens_q, cu_seqlens_kv, config)
    return (
        cu_q,
        cu_kv,
        sequence_lengths(cu_q, config.max_seqlen_q, seqused[0]),
        sequence_lengths(cu_kv, config.max_seqlen_kv, seqused[1]),
    )


def _cleared(buffers, cu, used):
    """`buffers` (rows along the leading axis) with every row no sequence uses set to 0. FA3's tiles load rows
    past a sequence's used end (the next sequence's, rows cut by max_seqlen or seqused, capacity padding) and
    mask only their scores: P = 0 there, but 0 * NaN is NaN, so a non-finite value outside every sequence
    would reach the results (measured on the H200: NaN padding gave NaN outputs). Cleared buffers make those
    reads harmless, and the caller's rows outside the sequences are never read by a kernel. Zeroed in place
    where XLA can (row_zeroing.py: the cost follows the padding).

    The forward needs only V cleared: a key row past the end gets its score overwritten with -inf by FA3's
    length mask (a NaN there is replaced, not multiplied), and a query row past the end only makes its own
    output row, which FA3 never stores. The backward multiplies every one of Q, K, V and dO by probabilities
    that are 0 on those rows, so a differentiated call clears Q and K in its forward too (and the caller's dO
    is masked): a forward-only call (inference) pays for V alone."""
    return zero_unused_rows(tuple(buffers), cu, used)


def _keyless_rows_only_without_keys(config: AttentionConfig) -> bool:
    """Whether a real query row can lack keys only when its whole sequence has none (skv = 0): no left window
    bound, and a top-left diagonal or no right bound. Then FA3's unowned rows plus the rows of sequences
    without keys (a gate in zero_unused_rows) are all the rows that must read 0; otherwise rows inside a
    sequence can fall outside its band (bottom-right causal with sq > skv, a left window) and a `where` on
    query_rows_with_keys does it."""
    return config.left_bound is None and (config.diagonal_alignment == "top_left" or config.right_bound is None)


def _owned_query_rows(x, cu_q, used_q, used_kv, rows, config: AttentionConfig):
    """x [Tq, ...] with the rows outside query_rows_with_keys (`rows`) set to 0, at the padding's cost where
    the configuration allows (see _keyless_rows_only_without_keys)."""
    if _keyless_rows_only_without_keys(config):
        return zero_unused_rows((x,), cu_q, used_q, gate=used_kv)[0]
    return jnp.where(rows.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


def _forward(q, k, v, index, config: AttentionConfig, seqused, binding: str, v_cleared: bool = False):
    """(out, stats, lse buffer, the v the kernel read: cleared, see _cleared). index: _index's tuple."""
    cu_q, cu_kv, used_q, used_kv = index
    if not v_cleared:
        (v,) = _cleared((v,), cu_kv, used_kv)
    out, lse = _kernels(binding)[0](q, k, v, cu_q, cu_kv, used_q, used_kv, config)
    rows = query_rows_with_keys(cu_q, cu_kv, config, *seqused)
    # FA3 writes 0 to a real row without keys (its row sum is 0) and nothing to rows it does not own.
    out = _owned_query_rows(out, cu_q, used_q, used_kv, rows, config)
    raw = lse_head_major(lse, config)
    # Without return_stats the caller reads none (or, the sink epilogue, only rows with keys): no -inf is made.
    stats = jnp.where(rows[None, :], raw, -jnp.inf if config.return_stats else 0.0)
    if config.stats_layout == "token_major":
        stats = stats.T
    return out, stats, lse, v


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 7, 8))
def _attention(q, k, v, cu_seqlens_q, cu_seqlens_kv, config: AttentionConfig, seqused, binding: str, shared: bool):
    index = _index(cu_seqlens_q, cu_seqlens_kv, config, seqused, shared)
    return _forward(q, k, v, index, config, seqused, binding)[:2]


def _attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_kv, config, seqused, binding, shared):
    q, k, v, cu_seqlens_q, cu_seqlens_kv, seqused = jax.tree.map(
        lambda x: x.value, (q, k, v, cu_seqlens_q, cu_seqlens_kv, seqused)
    )
    # The backward needs Q and K cleared too (see _cleared). Clearing them here, where q and k are first used,
    # and keeping the cleared ones as residuals lets XLA zero a projection's output in place; cleared in the
    # backward, after the forward kernel has read them, XLA would copy both first
    # (docs/PERFORMANCE.md#what-the-measurements-found, "Padding safety"). A forward-only call (no vjp) goes
    # through _attention and clears V alone.
    index = cu_q, cu_kv, used_q, used_kv = _index(cu_seqlens_q, cu_seqlens_kv, config, seqused, shared)
    if shared:  # one call of the zero-rows kernel for all three
        q, k, v = _cleared((q, k, v), cu_q, used_q)
    else:
        (q,), (k,) = _cleared((q,), cu_q, used_q), _cleared((k,), cu_kv, used_kv)
    out, stats, lse, v = _forward(q, k, v, index, config, seqused, binding, v_cleared=shared)
    saved_out, lse = named_residuals(out, lse)
    return (out, stats), (q, k, v, index, seqused, saved_out, lse)


def _attention_bwd(config, binding, shared, residuals, cotangents):
    q, k, v, (cu_q, cu_kv, used_q, used_kv), seqused, out, lse = residuals
    d_out, d_stats = cotangents
    rows = query_rows_with_keys(cu_q, cu_kv, config, *seqused)
    # q, k and v are the forward's cleared ones.
    dtype = q.dtype
    backward_call = _kernels(binding)[1]
    parts = []  # (dq, dk, dv or None) of each backward call
    if not isinstance(d_out, SymbolicZero):
        # The cotangent of rows the op does not own is not ours to read (it may be NaN): zeroed, not multiplied.
        d_out = _owned_query_rows(d_out.astype(dtype), cu_q, used_q, used_kv, rows, config)
        parts.append(backward_call(d_out, q, k, v, out, lse, cu_q, cu_kv, used_q, used_kv, config))
    if not isinstance(d_stats, SymbolicZero):
        g = d_stats.T if config.stats_layout == "head_major" else d_stats  # [Tq, Hq]
        g = jnp.where(rows[:, None], g.astype(jnp.float32), 0.0)
        c, e = stats_grad.stats_columns(g, dtype)  # [Tq, Hq, EXTRA_COLUMNS], sum(c * e) = -g
        pad = [(0, 0), (0, 0), (0, config.head_dim_v - c.shape[-1])]
        d_out_stats, out_stats = jnp.pad(c, pad), jnp.pad(e, pad)
        dq, dk, _ = backward_call(
            d_out_stats, q, k, jnp.zeros_like(v), out_stats, lse, cu_q, cu_kv, used_q, used_kv, config
        )
        parts.append((dq, dk, None))
    if not parts:
        grads = (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v))
    else:
        grads = []
        for i, like in enumerate((q, k, v)):
            terms = [p[i] for p in parts if p[i] is not None]
            if not terms:
                grads.append(jnp.zeros_like(like))
            elif len(terms) == 1:
                grads.append(terms[0])
            else:
                grads.append(sum(t.astype(jnp.float32) for t in terms).astype(like.dtype))
    # FA3 leaves the rows it does not own unwritten; a row it owns but no key (or query) reaches gets 0.
    if shared:  # the same rows and gate for all three: one call
        dq, dk, dv = zero_unused_rows(tuple(grads), cu_q, used_q, gate=used_kv)
    else:
        (dq,) = zero_unused_rows(grads[:1], cu_q, used_q, gate=used_kv)
        dk, dv = zero_unused_rows(grads[1:], cu_kv, used_kv, gate=used_q)
    return dq, dk, dv, None, None, jax.tree.map(lambda _: None, seqused)


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def _portable(q, k, v, cu_seqlens_q, cu_seqlens_kv, config: AttentionConfig, seqused, binding: str, shared: bool):
    """_attention on the portable path (same inputs and config), the derivatives forward mode takes: no FA3
    kernel computes a tangent. Stats 0, not -inf, on rows without keys (constant either way)."""
    return portable().attend((q, k, v), RaggedIndex(cu_seqlens_q, cu_seqlens_kv, *seqused), config, stats="raw")


def _saved_arguments(config, binding, shared, saved):
    """_attention's arguments as its residuals hold them: q, k, v cleared and the cu_seqlens sanitised, which
    the portable path reads alike (it never reads a row outside the sequences, and sanitises again)."""
    q, k, v, (cu_q, cu_kv, _, _), seqused = saved[:5]
    return q, k, v, cu_q, cu_kv, seqused


_attention = forward_mode(_attention, _portable, primals_from=_saved_arguments)


def attention(
    q, k, v, cu_seqlens_q, cu_seqlens_kv, config: AttentionConfig, seqused=(None, None), *, binding: str = NAME
):
    """(out [Tq, Hq, Dv], stats float32 in the configured layout) through FA3; differentiable in q, k, v and
    (through the second backward call above) in the stats. The caller has checked unsupported_reason.
    binding: whose build of FA3's kernels runs them (_kernels): NAME, the flash-attn3-jax wheel's, or "dew"."""
    shared = shares_rows(config, cu_seqlens_q, cu_seqlens_kv, seqused)
    config = dataclasses.replace(config, packing="none", guard_workspace=False, autotune=False)
    return _attention(q, k, v, cu_seqlens_q, cu_seqlens_kv, config, tuple(seqused), binding, shared)
