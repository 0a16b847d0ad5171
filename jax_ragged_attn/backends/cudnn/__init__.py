"""The cuDNN backend: the compiled extension, the graphs it builds, and the differentiable launch.

Imports run one way: the api imports this package through the registry (backends/__init__.py); this package
imports the extension and the lower layers (config, index, features), never the other way round.
"""

from jax_ragged_attn.backends.cudnn import launch, sinks as folded_sinks
from jax_ragged_attn.backends.cudnn.extension import cudnn_unavailable_reason
from jax_ragged_attn.backends.cudnn.graphs import (MAX_HEAD_DIM, device_ordinal, ffi_attributes, graph_info,
                                                   unsupported_reason)
from jax_ragged_attn.backends.cudnn.launch import attention_cudnn, stats_gradient_unsupported

NAME = "cudnn"

__all__ = ["MAX_HEAD_DIM", "NAME", "attend", "attend_with_sinks", "attention_cudnn", "cudnn_unavailable_reason",
           "device_ordinal", "ffi_attributes", "graph_info", "stats_gradient_unsupported", "unsupported_reason"]


def attend(buffers, index, config, *, stats=True):
    """(out, stats) of the buffers read in place (packings.TABLE[config.packing]); the gradient comes back in
    the buffers' own layout. The stats are computed either way (the kernel writes them)."""
    return launch.attention(tuple(buffers), index.cu_seqlens_q, index.cu_seqlens_kv, config, index.seqused)


def attend_with_sinks(buffers, index, sinks, config):
    """out with the sinks folded into the plain backward (sinks.py beside this file): no stats cotangent."""
    return folded_sinks.attention_with_sinks(tuple(buffers), index.cu_seqlens_q, index.cu_seqlens_kv, sinks, config,
                                       index.seqused)
