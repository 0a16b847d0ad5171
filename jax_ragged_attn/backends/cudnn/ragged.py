"""The cuDNN backend: the compiled extension, the graphs it builds, and the differentiable launch.

Imports run one way: the ops import this package through the registry (backends/__init__.py); this package
imports the extension and the lower layers (config, index, features), never the other way round.
"""

import functools

from jax_ragged_attn.backends.cudnn import extents, launch
from jax_ragged_attn.backends.cudnn import sinks as folded_sinks
from jax_ragged_attn.backends.cudnn.graphs import (
    MAX_HEAD_DIM,
    device_ordinal,
    ffi_attributes,
    graph_info,
    unsupported_reason,
)
from jax_ragged_attn.backends.cudnn.launch import attention_cudnn
from jax_ragged_attn.backends.shared import head_groups
from jax_ragged_attn.backends.shared.extension import cudnn_unavailable_reason

NAME = "cudnn"

__all__ = [
    "MAX_HEAD_DIM",
    "NAME",
    "attend",
    "attend_with_sinks",
    "attention_cudnn",
    "cudnn_unavailable_reason",
    "device_ordinal",
    "ffi_attributes",
    "graph_info",
    "stats_gradient_unsupported",
    "unsupported_reason",
]


def _groups(config, *, backward: bool = True, stats_gradient: bool = False) -> int:
    """Head groups the call runs as (extents.py): 1 unless a tensor passes the int32 offsets' 2**31."""
    groups = extents.groups(config, backward=backward, stats_gradient=stats_gradient)
    if groups is None:
        raise NotImplementedError(extents.too_large_reason(config))
    return groups


def stats_gradient_unsupported(config) -> str | None:
    """Why the backward cannot take a stats cotangent here, for one head group of the call (see attend)."""
    groups = extents.groups(config, stats_gradient=True)
    if groups is None:
        return extents.too_large_reason(config)
    return launch.stats_gradient_unsupported(head_groups.group_config(config, groups))


def attend(buffers, index, config, *, stats=True, forward_only: bool = False):
    """(out, stats) of the buffers read in place (packings.TABLE[config.packing]); the gradient comes back in
    the buffers' own layout. The stats are computed either way (the kernel writes them).

    A call whose tensors pass the int32 ragged offsets runs over head groups (extents.py), sized for the
    backward's tensors too (and, where stats are wanted, a stats cotangent's widened value columns), since
    whether a gradient follows is not known here. forward_only=True: a caller that never differentiates (the
    KV-cache op, whose gradient raises) sizes them for the forward alone."""
    groups = _groups(config, backward=not forward_only, stats_gradient=bool(stats) and not forward_only)
    if groups > 1:
        inner = functools.partial(attend, forward_only=forward_only)
        return head_groups.attend_in_groups(inner, buffers, index, config, groups, stats=stats)
    return launch.attention(tuple(buffers), index.cu_seqlens_q, index.cu_seqlens_kv, config, index.seqused)


def attend_with_sinks(buffers, index, sinks, config):
    """out with the sinks folded into the plain backward (sinks.py beside this file): no stats cotangent."""
    groups = _groups(config, stats_gradient=False)
    if groups > 1:
        return head_groups.attend_with_sinks_in_groups(attend_with_sinks, buffers, index, sinks, config, groups)
    return folded_sinks.attention_with_sinks(
        tuple(buffers), index.cu_seqlens_q, index.cu_seqlens_kv, sinks, config, index.seqused
    )
