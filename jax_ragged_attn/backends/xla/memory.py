"""How big the xla path's blocks are, what working set they need, and the bound it must stay under.

The xla path (ragged.py) never materialises a [B, H, S, S] score tensor: it walks blocks of the packed token
axis, so its working set is set by the block sizes and the capacities Tq, Tkv, never by max_seqlen or the
number of sequences. `estimate_bytes` says how much, before anything is compiled; `check_working_set`
raises `WorkingSetTooLargeError` when that passes the bound, instead of letting the process die.

Settings: the block rows are the static config's xla_block_size (ragged_attention's keyword; default 128
on a GPU, 64 on a CPU); the bound on the estimate is read when a call is traced from

  JAX_RAGGED_ATTN_XLA_MEMORY_LIMIT   "50%" (default: half the device's memory; on a CPU, of physical RAM),
                                     a size ("8GiB", "512MB", "3e9" bytes), or "off"

(it changes whether a call is refused, never what is lowered).

A step's scores are Tq * Hq * block_kv float32 (the backward keeps four such tensors, the forward two),
so block_kv is the knob that trades memory for fewer, larger steps; block_q sets how finely the key range
each query block walks is cut (rows of one block share one range). Decode-like calls (one query row per
sequence) gain from a small block_q: (8, 128) ran 64 queries over 64 x 512 keys in 52 ms against 83 ms
at 128 on the 2-core CPU, since a 128-row block walks every sequence's keys.
"""

from __future__ import annotations

import math
import os
import re
import warnings

import jax
import numpy as np

from jax_ragged_attn.backends.xla import options
from jax_ragged_attn.config import AttentionConfig
from jax_ragged_attn.features.stacklevel import users_stacklevel

MEMORY_LIMIT_ENV = "JAX_RAGGED_ATTN_XLA_MEMORY_LIMIT"
# The backward (fused_backward): "fused", one pass over the key blocks, computes P and dP once per tile and
# yields dK, dV and dQ (five matmuls a tile), adding each tile's dQ rows with a scatter-add; "two passes", a
# dQ pass and a dK/dV pass (seven matmuls a tile: P and dP twice), add nothing with a scatter. Fused where XLA
# runs a scatter-add in order (the CPU), so dQ stays deterministic; two passes elsewhere (a GPU's scatter-add
# of overlapping rows uses atomics, whose order varies run to run, and the xla path promises bit-identical
# gradients whatever `deterministic` says). What determinism costs: docs/PERFORMANCE.md#the-xla-path. Tests run
# either through xla/options.py.

# 128 x 128 blocks on a GPU: a step of W1 (32k tokens, 16 heads) holds 256 MiB of float32 scores, small
# beside an H200, and large enough that a step's matmuls keep the device busy. 64 x 64 on the CPU: fewer
# half-masked diagonal tiles and blocks straddling two sequences, a faster fused fwd+bwd than 128 x 128 on
# cpu-4k and cpu-8k (2 cores; the method: docs/PERFORMANCE.md#the-xla-path).
# Matmul operands (matmul_dtype): bfloat16 / float16 inputs enter the tiles' matmuls in their own dtype, as do
# the probabilities and dS (cast down), with float32 accumulation and a float32 softmax: what jax.nn's xla
# attention and the fused kernels (cuDNN, FlashAttention) do, at the tensor cores' rate. Every operand float32
# at precision HIGHEST runs as FMA, much slower (docs/PERFORMANCE.md#what-the-measurements-found, "The xla path's
# matmuls").
# float32 and float64 inputs always run float32 at HIGHEST (no TF32).
DEFAULT_BLOCK = 128
DEFAULT_CPU_BLOCK = 64
DEFAULT_MEMORY_FRACTION = 0.5
_F32 = 4


def fused_backward(config: AttentionConfig) -> bool:
    """Whether this call's backward runs the fused pass: OPTIONS.xla_fused_backward (tests), else on a CPU only."""
    if options.OPTIONS.xla_fused_backward is not None:
        return options.OPTIONS.xla_fused_backward
    return jax.default_backend() == "cpu"


def matmul_dtype(config: AttentionConfig) -> str:
    """The dtype of the xla path's matmul operands for this call (accumulation is float32)."""
    return config.dtype if config.dtype in ("bfloat16", "float16") else "float32"


class WorkingSetTooLargeError(MemoryError):
    """The xla path's estimated working set for a call exceeds the bound (see the module docstring)."""


class CudnnFallbackWarning(UserWarning):
    """implementation=None runs the xla path on a GPU because cuDNN declined the call."""


def block_sizes(config: AttentionConfig, block_q: int | None = None, block_kv: int | None = None) -> tuple[int, int]:
    """(block_q, block_kv) for this call: the arguments, else config.xla_block_size, else 128 each (64 on a
    CPU), each capped at its capacity (a block never needs more rows than the buffer has)."""
    if block_q is None or block_kv is None:
        default = DEFAULT_CPU_BLOCK if jax.default_backend() == "cpu" else DEFAULT_BLOCK
        config_q, config_kv = config.xla_block_size or (default, default)
        block_q = config_q if block_q is None else block_q
        block_kv = config_kv if block_kv is None else block_kv
    for name, value in (("block_q", block_q), ("block_kv", block_kv)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return min(int(block_q), config.capacity_q), min(int(block_kv), config.capacity_kv)


def estimate_bytes(config: AttentionConfig, block_q: int, block_kv: int, direction: str) -> int:
    """Peak bytes the xla path allocates for one call besides its inputs, counted generously from the
    buffers ragged.py creates ("forward": the forward; "backward": the backward, with the forward's residuals).

    Compared with XLA's own accounting (compiled memory_analysis() temp + output bytes) in
    tests/test_xla_memory.py: an upper bound within a small factor.
    """
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    hq, hkv, dqk, dv = config.num_heads_q, config.num_heads_kv, config.head_dim_qk, config.head_dim_v
    item = np.dtype(config.dtype).itemsize
    tq, tkv = config.capacity_q, config.capacity_kv
    tq_pad = -(-tq // block_q) * block_q
    tkv_pad = -(-tkv // block_kv) * block_kv
    n_q, n_kv = tq_pad // block_q, tkv_pad // block_kv
    rows = 16 * (tq_pad + tkv_pad)  # band bookkeeping: a few int32 per row

    scores = n_q * block_q * block_kv * hq * _F32  # one float32 [block_q, block_kv] tile per head and query block
    key_tiles = n_q * block_kv * hkv * (dqk + dv) * (_F32 + item)  # the key/value rows a step gathers
    inputs_clean = tq * hq * dqk * (_F32 + item) + tkv * hkv * (dqk + dv) * item  # q in float32, masked k, v
    residuals = tq * hq * (dv * (_F32 + item) + 2 * _F32)  # out (float32 and q's dtype), lse, row sums
    carry = tq_pad * hq * (dv + 2) * _F32  # one online-softmax state (acc, max, sum) per query row
    # The forward's lanes (xla._walk_fold): their states, a step's copy, the slots (lanes + blocks of them),
    # the merged states; the query rows a step gathers and k, v padded for the tiles' slices.
    forward = (
        rows
        + inputs_clean
        + key_tiles
        + 3 * scores
        + 5 * carry
        + tq_pad * hq * dqk * _F32
        + (tkv + block_kv) * hkv * (dqk + dv) * _F32
        + residuals
    )
    if direction == "forward":
        return int(forward)

    live = rows + inputs_clean + residuals + tq * hq * (dv + 2) * _F32  # + d_out in float32, delta
    # The passes walk their blocks' tiles with one lane per block (xla._walk_loop): a lane's running sum, the
    # slots its finished segments go to (lanes + blocks of them), the per-block sum gathered from the slots,
    # and the rows a step gathers (the lane's own block's rows besides the tile it walks).
    q_rows = tq_pad * hq * (dqk + dv + 2) * _F32  # the lanes' q, dO, lse, delta rows for one step
    dq_pass = (
        key_tiles + 5 * scores + 4 * tq_pad * hq * dqk * _F32 + q_rows + (tkv + block_kv) * hkv * (dqk + dv) * _F32
    )  # k, v padded for the tiles' slices
    query_tiles = n_kv * block_q * hq * (dqk + dv + 2) * (_F32 + item)  # the query rows a step of pass 2 slices
    dkv_pass = (
        query_tiles
        + 5 * n_kv * block_q * block_kv * hq * _F32
        + (tq + block_q) * hq * (dqk + dv + 2) * _F32  # q, dO, lse, delta padded for the slices
        + 6 * tkv_pad * hkv * (dqk + dv) * _F32
    )  # k, v tiles, a step's copy, running sums, slots, sums
    grads = (tq * hq * dqk + tkv * hkv * (dqk + dv)) * (_F32 + item)
    if fused_backward(config):  # one pass over the key blocks, adding dQ into a float32 buffer it carries
        return int(live + dkv_pass + 2 * (tq + block_q) * hq * dqk * _F32 + grads)
    return int(live + max(dq_pass, dkv_pass) + grads)


def device_memory_bytes() -> int:
    """The default device's memory: the allocator's limit on a GPU, physical RAM on a CPU."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001  a backend without memory_stats, however it says so
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def memory_limit_bytes(limit=None) -> int | None:
    """The bound for `check_working_set`: `limit` (bytes, or a string as for the environment variable),
    else JAX_RAGGED_ATTN_XLA_MEMORY_LIMIT, else half the device's memory; None means no bound."""
    if limit is None:
        limit = os.environ.get(MEMORY_LIMIT_ENV, "").strip() or f"{DEFAULT_MEMORY_FRACTION * 100:g}%"
    if isinstance(limit, (int, float)) and not isinstance(limit, bool):
        if limit <= 0:
            raise ValueError(f"memory_limit must be positive, got {limit}")
        return int(limit)
    text = str(limit).strip().lower()
    if text in ("off", "none", "inf"):
        return None
    match = re.fullmatch(r"([0-9.]+(?:e[0-9]+)?)\s*(%|[kmgt]i?b|b|)", text)
    if match is None or (value := float(match.group(1))) <= 0 or not math.isfinite(value):
        raise ValueError(
            f"{MEMORY_LIMIT_ENV} must be a percentage of the device's memory ('50%'), a size "
            f"('8GiB', '512MB', '3e9') or 'off', got {limit!r}"
        )
    if match.group(2) == "%":
        return int(device_memory_bytes() * value / 100)
    return int(value * _UNITS[match.group(2)])


def _size(n: int) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**30 else f"{n / 2**20:.3g} MiB"


def check_working_set(config: AttentionConfig, block_q: int, block_kv: int, direction: str, limit=None) -> int:
    """The estimate for `direction`; raises WorkingSetTooLargeError naming the sizes and the ways out when it
    exceeds the bound. Called while tracing, so nothing has been compiled or allocated yet."""
    need = estimate_bytes(config, block_q, block_kv, direction)
    bound = memory_limit_bytes(limit)
    if bound is None or need <= bound:
        return need
    smallest = estimate_bytes(config, min(16, block_q), min(16, block_kv), direction)
    smaller = (
        f"smaller blocks (xla_block_size=16 brings it to {_size(smallest)})"
        if smallest < need
        else "smaller blocks cannot help: the float32 accumulators alone are that large"
    )
    raise WorkingSetTooLargeError(
        f"the xla attention {direction} would need about {_size(need)} of working memory (Tq={config.capacity_q}, "
        f"Tkv={config.capacity_kv}, Hq={config.num_heads_q}, Hkv={config.num_heads_kv}, Dqk={config.head_dim_qk}, "
        f"Dv={config.head_dim_v}, {config.dtype}, blocks {block_q}x{block_kv}), more than its bound of "
        f"{_size(bound)} ({MEMORY_LIMIT_ENV}, default {DEFAULT_MEMORY_FRACTION:.0%} of the device's memory). "
        f"Ways out: {smaller}; implementation='cudnn' where it can serve the call (bfloat16/float16 on a GPU); "
        f"fewer tokens per call (split the batch); or raise the bound ({MEMORY_LIMIT_ENV}=80% or a size, "
        f"'off' to disable)."
    )


_warned: set[str] = set()


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def warn_cudnn_fallback(reason: str, config: AttentionConfig) -> None:
    """implementation=None is about to run the xla path although a GPU is here: warn once per reason, naming
    why cuDNN declined and the xla path's estimated working set. Silent on other backends, where the xla
    path is the expected one."""
    if not _on_gpu() or reason in _warned:
        return
    _warned.add(reason)
    block_q, block_kv = block_sizes(config)
    forward = estimate_bytes(config, block_q, block_kv, "forward")
    backward = estimate_bytes(config, block_q, block_kv, "backward")
    warnings.warn(
        f"ragged_attention(implementation=None) runs the portable xla path on this GPU, not cuDNN: {reason}. "
        f"It is several times slower; its working set here is about {_size(forward)} forward and {_size(backward)} "
        f"backward (blocks {block_q}x{block_kv}, xla_block_size). Pass implementation='xla' to choose it "
        f"explicitly (and silence this), or remove the reason to run cuDNN. Shown once per reason.",
        CudnnFallbackWarning,
        stacklevel=users_stacklevel(),
    )
