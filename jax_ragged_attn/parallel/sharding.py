"""`ragged_attention` split across the devices of a mesh: over heads, over the packed token axis, or both.

Heads (head_axis): heads never interact in attention, so cutting Hq and Hkv by the same factor keeps every
GQA group (query heads i*g .. i*g+g-1 and kv head i, g = Hq // Hkv) on one device, and no device needs
another's data: the compiled program holds no collective. cu_seqlens are tiny and replicated.

Tokens (token_axis, context parallelism, self-attention only): device r holds rows [r*T/n, (r+1)*T/n) of
the packed buffer (with load_balance=True, chunks r and 2n-1-r of 2n: see reorder_for_load_balance), and
sequences may straddle any number of devices. Each device all-gathers K and V over token_axis and attends
its own queries with one call of the op per contiguous chunk (context_parallel.py); the gradient of the
gather is a reduce-scatter that returns dK and dV to their owners. Masks: none, causal, causal with a
left window.

    mesh = jax.make_mesh((4,), ("model",))
    out = jax.jit(functools.partial(sharded_ragged_attention, mesh=mesh, head_axis="model",
                                    max_seqlen_q=512, max_seqlen_kv=512, is_causal=True))(q, k, v, cu, cu)

    mesh = jax.make_mesh((2, 4), ("heads", "cp"))
    q, k, v = (reorder_for_load_balance(x, 4) for x in (q, k, v))
    out = sharded_ragged_attention(q, k, v, cu, cu, mesh=mesh, token_axis="cp", head_axis="heads",
                                   max_seqlen_q=S, max_seqlen_kv=S, is_causal=True, load_balance=True)
    out = restore_order(out, 4)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_ragged_attn.config import AttentionOptions, make_config
from jax_ragged_attn.features.checks import check_enabled, checked_cu_seqlens
from jax_ragged_attn.features.overflow import cu_seqlens_overflow
from jax_ragged_attn.index import RaggedIndex, as_int32
from jax_ragged_attn.ops import common
from jax_ragged_attn.ops.ragged import attend
from jax_ragged_attn.parallel import context_parallel as cp
from jax_ragged_attn.parallel import ring
from jax_ragged_attn.parallel.context_parallel import reorder_for_load_balance, restore_order

__all__ = ["reorder_for_load_balance", "restore_order", "sharded_ragged_attention"]


def sharded_ragged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_kv: jax.Array,
    *,
    mesh: Mesh,
    head_axis: str | tuple[str, ...] | None = None,
    token_axis: str | tuple[str, ...] | None = None,
    load_balance: bool = False,
    context_strategy: str = "all_gather",
    **kwargs,
):
    """`ragged_attention(q, k, v, cu_seqlens_q, cu_seqlens_kv, **kwargs)` split over heads and/or tokens.

    Args:
      q, k, v, cu_seqlens_q, cu_seqlens_kv, kwargs: as for `ragged_attention`.
      mesh: the device mesh.
      head_axis: None, or the mesh axis name (or tuple of names) that q's and k/v's head dimension is split
        over. Hq and Hkv must both be multiples of its size.
      token_axis: None, or the mesh axis name (or tuple of names) that the packed token axis is split over
        (context parallelism). Self-attention only: q, k and v share the capacity T and cu_seqlens_q must be
        cu_seqlens_kv (and max_seqlen_q max_seqlen_kv). T must be a multiple of the axis size n (of 2n with
        load_balance). Masks: none, is_causal, is_causal with local_window_size (l, 0) (or (l, r): causal
        ignores r); other windows raise NotImplementedError. With token_axis None, a q, k or v whose type
        (explicit mesh axes) says its token axis is split raises NotImplementedError.
      load_balance: with token_axis: q, k, v are in the order reorder_for_load_balance(x, n) gives (device r
        holds chunks r and 2n-1-r of the natural order), and out, stats and the gradients come back in that
        order (restore_order undoes it). cu_seqlens always describe the natural order.
      context_strategy: with token_axis, "all_gather" (each device gathers all of K/V: O(T) memory) or "ring"
        (K/V blocks travel around the devices with ppermute, results merged by log-sum-exp: O(T/n); ring.py).

    Returns what `ragged_attention` returns: out [Tq, Hq, Dv] sharded on tokens over token_axis and on heads
    over head_axis; with return_stats=True also stats sharded the same way on their token and head axes
    ("head_major" [Hq, Tq] or "token_major" [Tq, Hq]). Inputs laid out otherwise are resharded first.
    """
    options, rest = AttentionOptions.split(kwargs)
    return_overflow = rest.pop("return_overflow", False)
    same = cu_seqlens_q is cu_seqlens_kv
    cu_seqlens_q = as_int32(cu_seqlens_q, "cu_seqlens_q")  # any integer dtype (index/__init__.py)
    cu_seqlens_kv = cu_seqlens_q if same else as_int32(cu_seqlens_kv, "cu_seqlens_kv")
    if not isinstance(return_overflow, bool):
        raise ValueError(f"return_overflow must be a Python bool, got {type(return_overflow).__name__}")
    # The per-head sink logits travel with their heads: split over head_axis like q's heads.
    sinks = rest.pop("sinks", None)
    if sinks is not None and context_strategy == "ring":
        raise NotImplementedError(
            "sinks with context_strategy='ring': the sink joins each row's softmax once, "
            "after the ring's partial results are merged, which the ring does not do yet; "
            "use context_strategy='all_gather'"
        )
    if head_axis is None and token_axis is None:
        raise ValueError("sharded_ragged_attention needs head_axis, token_axis or both, got neither")
    head_axes = _axes(mesh, head_axis, "head_axis")
    token_axes = _axes(mesh, token_axis, "token_axis")
    if set(head_axes) & set(token_axes):
        raise ValueError(f"head_axis {head_axis!r} and token_axis {token_axis!r} must name different mesh axes")
    if not isinstance(load_balance, (bool, np.bool_)):
        raise ValueError(f"load_balance must be a Python bool, got {load_balance!r}")
    if load_balance and token_axis is None:
        raise ValueError("load_balance=True balances the token axis: it needs token_axis")
    ring.check_strategy(context_strategy, token_axis)
    heads = math.prod(mesh.shape[a] for a in head_axes)
    for name, x, layout in (("q", q, "[Tq, Hq, Dqk]"), ("k", k, "[Tkv, Hkv, Dqk]"), ("v", v, "[Tkv, Hkv, Dv]")):
        if getattr(x, "ndim", None) != 3:
            raise ValueError(f"{name} must have rank 3 {layout}, got shape {getattr(x, 'shape', None)}")
        if x.shape[1] % heads:
            raise ValueError(
                f"{name}'s heads ({x.shape[1]}) must be a multiple of the {heads} devices on head_axis "
                f"{head_axis!r}, so that each device holds whole GQA groups"
            )
        split = jax.typeof(x).sharding.spec[0]  # known for explicit mesh axes; auto axes read None
        if token_axis is None and split is not None:
            raise NotImplementedError(
                f"{name} is split along its packed token axis over {split!r}, but token_axis is None: pass "
                f"token_axis={split!r} for context parallelism, or replicate the token axis and split heads"
            )

    # Counted outside shard_map, from the caller's cu_seqlens and the whole buffers.
    overflow = (
        functools.partial(_overflow, q, k, v, cu_seqlens_q, cu_seqlens_kv, options, rest) if return_overflow else None
    )
    tokens = P(token_axis, head_axis, None)
    axes = head_axes + token_axes
    if all(mesh.axis_types[mesh.axis_names.index(a)] == AxisType.Explicit for a in axes):
        # Explicit axes are part of an array's type, and shard_map refuses inputs typed otherwise than its
        # in_specs; with auto axes shard_map reshards by itself (and jax.reshard refuses them).
        q, k, v = jax.reshard((q, k, v), NamedSharding(mesh, tokens))
        cu_seqlens_q, cu_seqlens_kv = jax.reshard((cu_seqlens_q, cu_seqlens_kv), NamedSharding(mesh, P()))
        if sinks is not None:
            sinks = jax.reshard(sinks, NamedSharding(mesh, P(head_axis)))
    if options.stats_layout == "head_major":
        stats = P(head_axis, token_axis)
    else:
        stats = P(token_axis, head_axis)
    out_specs = (tokens, stats) if options.return_stats else tokens
    # The cuDNN path's ffi_call has JAX's standard rule for varying manual axes, which refuses to mix the
    # sharded q/k/v with the replicated cu_seqlens; every output here is sharded, so nothing relies on the
    # replication check.
    shard = lambda body, in_specs: jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )

    if token_axis is None:

        def attend_shard(q, k, v, cu_seqlens_q, cu_seqlens_kv, sinks):
            # rest: max_seqlen_q, max_seqlen_kv; attend raises TypeError for anything else.
            return attend((q, k, v), cu_seqlens_q, cu_seqlens_kv, options, sinks=sinks, **rest)

        result = shard(attend_shard, (tokens, tokens, tokens, P(), P(), P(head_axis)))(
            q, k, v, cu_seqlens_q, cu_seqlens_kv, sinks
        )
        return _with_overflow(result, options, overflow)

    plan, inner, cu_seqlens = _context_parallel_plan(
        q, k, v, cu_seqlens_q, cu_seqlens_kv, mesh, token_axis, load_balance, options, rest
    )

    def attend_tokens(q, k, v, cu_seqlens, sinks):
        # Each chunk's calls own disjoint rows, so each applies the sink epilogue (sinks.py) to its own rows.
        def attend_chunk(q, k, v, cu_q, cu_kv, max_seqlen_q, max_seqlen_kv, *, seqused, diagonal_alignment):
            options = dataclasses.replace(inner, diagonal_alignment=diagonal_alignment)
            result = attend(
                (q, k, v),
                cu_q,
                cu_kv,
                options,
                max_seqlen_q=max_seqlen_q,
                max_seqlen_kv=max_seqlen_kv,
                seqused_q=seqused[0],
                seqused_kv=seqused[1],
                sinks=sinks,
                loud=False,  # a chunk's gap sequences may exceed max_seqlen: _loud selects over the caller's rows
            )
            return result if inner.return_stats else (result, None)

        if context_strategy == "ring":
            out, stats = ring.device_attention(plan, inner, q, k, v, cu_seqlens)
        else:
            out, stats = cp.device_attention(plan, attend_chunk, q, k, v, cu_seqlens)
        return (out, stats) if inner.return_stats else out

    result = shard(attend_tokens, (tokens, tokens, tokens, P(), P(head_axis)))(q, k, v, cu_seqlens, sinks)
    result = _loud(result, q, k, v, cu_seqlens, options, rest, plan.devices if load_balance else None)
    return _with_overflow(result, options, overflow)


def _loud(result, q, k, v, cu_seqlens, options: AttentionOptions, rest, balanced_devices):
    """The context-parallel result with the rows of the caller's invalid sequences NaN, as ragged_attention
    makes them (ops/common.loud); balanced_devices: n where the rows are in reorder_for_load_balance's order."""
    config = make_config(
        q, k, v, cu_seqlens, cu_seqlens, options, max_seqlen_q=rest["max_seqlen_q"], max_seqlen_kv=rest["max_seqlen_kv"]
    )
    rows = RaggedIndex(cu_seqlens, cu_seqlens, same=True).invalid_rows_q(config)
    if balanced_devices is not None:
        rows = reorder_for_load_balance(rows, balanced_devices)
    out, stats = result if options.return_stats else (result, None)
    out, stats = common.loud(out, stats, rows, options.stats_layout)
    return (out, stats) if options.return_stats else out


def _overflow(q, k, v, cu_seqlens_q, cu_seqlens_kv, options, rest):
    config = make_config(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_kv,
        options,
        max_seqlen_q=rest.get("max_seqlen_q"),
        max_seqlen_kv=rest.get("max_seqlen_kv"),
    )
    return cu_seqlens_overflow(cu_seqlens_q, cu_seqlens_kv, config, same=cu_seqlens_q is cu_seqlens_kv)


def _with_overflow(result, options: AttentionOptions, overflow):
    """ragged_attention's return_overflow=True shape: the Overflow last."""
    if overflow is None:
        return result
    return (*result, overflow()) if options.return_stats else (result, overflow())


def _axes(mesh, axis, name: str) -> tuple[str, ...]:
    if axis is None:
        return ()
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    unknown = [a for a in axes if a not in mesh.axis_names]
    if not axes or unknown:
        raise ValueError(f"{name} must name axes of the mesh {mesh.axis_names}, got {axis!r}")
    return axes


def _context_parallel_plan(
    q, k, v, cu_seqlens_q, cu_seqlens_kv, mesh, token_axis, load_balance: bool, options: AttentionOptions, rest: dict
):
    """Validates a context-parallel call; returns (cp.Plan, the options of each chunk's call, cu_seqlens)."""
    if rest.get("seqused_q") is not None or rest.get("seqused_kv") is not None:
        raise NotImplementedError(
            "seqused_q / seqused_kv with token_axis: context parallelism splits the packed "
            "rows of tight cu_seqlens; pass the used rows packed back to back instead"
        )
    rest = {key: value for key, value in rest.items() if key not in ("seqused_q", "seqused_kv")}
    extra = sorted(set(rest) - {"max_seqlen_q", "max_seqlen_kv"})
    if extra:
        raise TypeError(f"sharded_ragged_attention got unexpected keyword arguments {extra}")
    for name in ("max_seqlen_q", "max_seqlen_kv"):
        if name not in rest:
            raise TypeError(f"sharded_ragged_attention missing the keyword argument {name!r}")
    n = cp.token_axis_size(mesh, token_axis)
    per_device = 2 if load_balance else 1
    total = q.shape[0]
    if k.shape[0] != total or v.shape[0] != total:
        raise ValueError(
            f"token_axis (context parallelism) is self-attention: q, k and v must share the capacity "
            f"T, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if total % (n * per_device):
        need = f"2n = {2 * n} (load_balance=True: 2 chunks per device)" if load_balance else f"n = {n}"
        raise ValueError(
            f"the packed token axis T = {total} must be a multiple of {need} for the {n} devices on "
            f"token_axis {token_axis!r}"
        )
    _check_same_cu_seqlens(cu_seqlens_q, cu_seqlens_kv)
    if rest["max_seqlen_q"] != rest["max_seqlen_kv"]:
        raise NotImplementedError(
            f"token_axis with max_seqlen_q={rest['max_seqlen_q']!r} != max_seqlen_kv={rest['max_seqlen_kv']!r}: "
            "context parallelism is self-attention, where both bound the same sequences; pass one value for both"
        )
    max_seqlen = min(_positive_int(rest["max_seqlen_q"], "max_seqlen_q"), total)
    causal, left = cp.effective_mask(options.is_causal, options.local_window_size)

    cu_seqlens = cu_seqlens_q
    if check_enabled(options.check):
        # The chunks' calls see gap sequences that may be longer than max_seqlen: check the caller's instead.
        cu_seqlens = checked_cu_seqlens(cu_seqlens, name="cu_seqlens_q", capacity=total, max_seqlen=max_seqlen)
    # Each chunk's call: the pieces, bottom-right aligned (the diagonal of a piece's query is its position).
    # The automatic kernel choice by the whole batch's shape class (its T / B), not by a device call's slots.
    inner = dataclasses.replace(
        options,
        is_causal=causal,
        diagonal_alignment="bottom_right",
        local_window_size=None if left is None else (left, 0),
        check=False,
        policy_tokens_per_sequence=options.policy_tokens_per_sequence
        or cp.batch_tokens_per_sequence(total, cu_seqlens_q.shape[0] - 1),
    )
    plan = cp.Plan(
        token_axis=token_axis,
        devices=n,
        load_balance=bool(load_balance),
        max_seqlen=max_seqlen,
        is_causal=causal,
        window_left=left,
        stats_axis=1 if options.stats_layout == "head_major" else 0,
    )
    return plan, inner, cu_seqlens


def _check_same_cu_seqlens(cu_q, cu_kv) -> None:
    shape_q, shape_kv = getattr(cu_q, "shape", None), getattr(cu_kv, "shape", None)
    if shape_q != shape_kv or shape_q is None or len(shape_q) != 1:
        raise ValueError(
            f"token_axis (context parallelism) is self-attention: cu_seqlens_q and cu_seqlens_kv must "
            f"be the same [B + 1] array, got shapes {shape_q} and {shape_kv}"
        )
    try:  # concrete values are compared; traced ones cannot be, and cu_seqlens_q is used
        same = np.array_equal(np.asarray(cu_q), np.asarray(cu_kv))
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    if not same:
        raise ValueError(
            "token_axis (context parallelism) is self-attention: cu_seqlens_q and cu_seqlens_kv must be "
            f"equal, got {np.asarray(cu_q).tolist()} and {np.asarray(cu_kv).tolist()}"
        )


def _positive_int(value, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a static Python int >= 1, got {value!r}")
    return int(value)
