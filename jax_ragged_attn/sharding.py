"""`ragged_attention` split over heads across the devices of a mesh: each device attends with its own heads.

Heads never interact in attention, so cutting Hq and Hkv by the same factor keeps every GQA group (query
heads i*g .. i*g+g-1 and kv head i, g = Hq // Hkv) on one device, and no device needs another's data: the
compiled program holds no collective. cu_seqlens are tiny and replicated.

The packed token axis cannot be split: a sequence may straddle a shard boundary, and its queries on one side
would need the keys on the other (a ring or all-gather scheme, not implemented).

    mesh = jax.make_mesh((4,), ("model",))
    out = jax.jit(functools.partial(sharded_ragged_attention, mesh=mesh, head_axis="model",
                                    max_seqlen_q=512, max_seqlen_kv=512, is_causal=True))(q, k, v, cu, cu)
"""

from __future__ import annotations

import math

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jax_ragged_attn.api import attend
from jax_ragged_attn.config import AttentionOptions


def sharded_ragged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cu_seqlens_q: jax.Array,
    cu_seqlens_kv: jax.Array,
    *,
    mesh: Mesh,
    head_axis: str | tuple[str, ...],
    token_axis: str | tuple[str, ...] | None = None,
    **kwargs,
):
    """`ragged_attention(q, k, v, cu_seqlens_q, cu_seqlens_kv, **kwargs)` with heads split over `head_axis`.

    Args:
      q, k, v, cu_seqlens_q, cu_seqlens_kv, kwargs: as for `ragged_attention`.
      mesh: the device mesh.
      head_axis: the mesh axis name (or tuple of names) that q's and k/v's head dimension is split over.
        Hq and Hkv must both be multiples of its size.
      token_axis: must be None: splitting the packed token axis raises NotImplementedError, and so does a
        q, k or v whose type (explicit mesh axes) says its token axis is split.

    Returns what `ragged_attention` returns: out [Tq, Hq, Dv] sharded on axis 1; with return_stats=True also
    stats sharded on its head axis (axis 0 for "head_major" [Hq, Tq], axis 1 for "token_major" [Tq, Hq]).
    Inputs laid out otherwise (replicated, heads split another way) are resharded to this layout first.
    """
    options, rest = AttentionOptions.split(kwargs)
    if rest.get("sinks") is not None:
        raise NotImplementedError("sinks with sharded_ragged_attention: the per-head sink logits are not split over "
                                  "head_axis yet; call ragged_attention under jit with sharded inputs instead")
    if token_axis is not None:
        raise NotImplementedError(
            f"token_axis={token_axis!r}: splitting the packed token axis over devices is not supported (a "
            "sequence may straddle two shards); pass token_axis=None and split heads with head_axis"
        )
    axes = (head_axis,) if isinstance(head_axis, str) else tuple(head_axis)
    unknown = [a for a in axes if a not in mesh.axis_names]
    if not axes or unknown:
        raise ValueError(f"head_axis must name axes of the mesh {mesh.axis_names}, got {head_axis!r}")
    shards = math.prod(mesh.shape[a] for a in axes)
    for name, x, layout in (("q", q, "[Tq, Hq, Dqk]"), ("k", k, "[Tkv, Hkv, Dqk]"), ("v", v, "[Tkv, Hkv, Dv]")):
        if getattr(x, "ndim", None) != 3:
            raise ValueError(f"{name} must have rank 3 {layout}, got shape {getattr(x, 'shape', None)}")
        if x.shape[1] % shards:
            raise ValueError(
                f"{name}'s heads ({x.shape[1]}) must be a multiple of the {shards} devices on head_axis "
                f"{head_axis!r}, so that each device holds whole GQA groups"
            )
        split = jax.typeof(x).sharding.spec[0]  # known for explicit mesh axes; auto axes read None
        if split is not None:
            raise NotImplementedError(
                f"{name} is split along its packed token axis over {split!r}: splitting tokens over devices is "
                "not supported (a sequence may straddle two shards); replicate the token axis, split heads"
            )

    heads = P(None, head_axis, None)
    if all(mesh.axis_types[mesh.axis_names.index(a)] == AxisType.Explicit for a in axes):
        # Explicit axes are part of an array's type, and shard_map refuses inputs typed otherwise than its
        # in_specs; with auto axes shard_map reshards by itself (and jax.reshard refuses them).
        q, k, v = jax.reshard((q, k, v), NamedSharding(mesh, heads))
        cu_seqlens_q, cu_seqlens_kv = jax.reshard((cu_seqlens_q, cu_seqlens_kv), NamedSharding(mesh, P()))
    stats = P(head_axis, None) if options.stats_layout == "head_major" else P(None, head_axis)

    def attend_shard(q, k, v, cu_seqlens_q, cu_seqlens_kv):
        # rest: max_seqlen_q, max_seqlen_kv (and sinks=None); attend raises TypeError for anything else.
        return attend((q, k, v), cu_seqlens_q, cu_seqlens_kv, options, **rest)

    sharded = jax.shard_map(
        attend_shard,
        mesh=mesh,
        in_specs=(heads, heads, heads, P(), P()),
        out_specs=(heads, stats) if options.return_stats else heads,
        # The cuDNN path's ffi_call has JAX's standard rule for varying manual axes, which refuses to mix the
        # head-sharded q/k/v with the replicated cu_seqlens; every output here is sharded, so nothing relies
        # on the replication check.
        check_vma=False,
    )
    return sharded(q, k, v, cu_seqlens_q, cu_seqlens_kv)
