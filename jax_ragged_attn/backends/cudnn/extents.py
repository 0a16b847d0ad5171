"""How far into each tensor a cuDNN call addresses, in elements, against the int32 ragged offsets' 2**31.

cuDNN's ragged offsets (launch._index_arrays) are int32 element offsets, one array per tensor: a tensor whose
rows reach 2**31 elements cannot be addressed. Each tensor is bounded by its own extent (rows x its token
stride), not by one product for all:

    q, dq (and cuDNN's float32 dQ accumulator, same strides)   Tq  x parts(q) x Hq  x Dqk
    k, dk                                                      Tkv x parts(k) x Hkv x Dqk
    v, dv                                                      Tkv x parts(v) x Hkv x Dv
    o, do                                                      Tq  x Hq x Dv
    stats                                                      Tq  x Hq
    dK / dV per query head (backward, Hq != Hkv)               Tkv x Hq x max(Dqk, Dv)

The last: with GQA the bounded backward keeps float32 dK/dV for every query head in the workspace, addressed
through the dK/dV offsets times Hq / Hkv (cudnn-frontend's "implicit multiplier"). Check mode adds its guard
rows at both ends of every row axis. A stats gradient widens Dv by stats_grad.EXTRA_COLUMNS and reads every
value-side tensor at Hq heads (launch.stats_gradient_unsupported's bound).

A call that passes the bound runs as several over groups of heads (head_groups.py); `groups` says how many.
"""

from __future__ import annotations

from jax_ragged_attn.backends.shared import head_groups, stats_grad
from jax_ragged_attn.config import AttentionConfig
from jax_ragged_attn.features import checks
from jax_ragged_attn.index import packings

INT32_LIMIT = 2**31 - 1


def tensor_extents(config: AttentionConfig, *, backward: bool = True, stats_gradient: bool = False) -> dict[str, int]:
    """Elements each tensor's ragged offsets and strides span, by name (module docstring); backward=False: the
    forward's tensors only (a call that is never differentiated)."""
    packing = packings.TABLE[config.packing]
    guard = 2 * checks.GUARD_ROWS if config.guard_workspace else 0
    rows_q, rows_kv = config.capacity_q + guard, config.capacity_kv + guard
    hq, hkv, dqk, dv = config.num_heads_q, config.num_heads_kv, config.head_dim_qk, config.head_dim_v
    extents = {
        "q": rows_q * packing.parts("q") * hq * dqk,
        "k": rows_kv * packing.parts("k") * hkv * dqk,
        "v": rows_kv * packing.parts("v") * hkv * dv,
        "out": rows_q * hq * dv,
        "stats": rows_q * hq,
    }
    if backward and hq != hkv:
        extents["dk/dv per query head"] = rows_kv * hq * max(dqk, dv)
    if backward and stats_gradient:
        extents["widened value columns"] = max(rows_q, rows_kv) * hq * (dv + stats_grad.EXTRA_COLUMNS)
    return extents


def fits(config: AttentionConfig, *, backward: bool = True, stats_gradient: bool = False) -> bool:
    return max(tensor_extents(config, backward=backward, stats_gradient=stats_gradient).values()) <= INT32_LIMIT


def groups(config: AttentionConfig, *, backward: bool = True, stats_gradient: bool = False) -> int | None:
    """Head groups the call runs as: 1 where every tensor fits, else the fewest that make each group's fit;
    None where even one query head per call passes 2**31 elements (a sequence split would be needed)."""
    return head_groups.fewest_groups(config, lambda c: fits(c, backward=backward, stats_gradient=stats_gradient))


def too_large_reason(config: AttentionConfig) -> str:
    largest, extent = max(tensor_extents(config).items(), key=lambda item: item[1])
    return (
        f"cuDNN's ragged offsets are int32 and the tensor {largest} spans {extent:,} elements (>= 2**31) even "
        "with one query head per call; splitting a call by sequences is not implemented"
    )
