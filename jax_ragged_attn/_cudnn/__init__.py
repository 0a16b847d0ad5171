"""The cuDNN backend: the compiled extension, the graphs it builds, and the differentiable launch.

Imports run one way: the library (api, packed, segments, sharding) imports this package; this package
imports the extension and the library's leaf modules (config, packing, checks), never the other way round.
"""

from jax_ragged_attn._cudnn.extension import cudnn_unavailable_reason
from jax_ragged_attn._cudnn.graphs import MAX_HEAD_DIM, device_ordinal, ffi_attributes, graph_info, unsupported_reason
from jax_ragged_attn._cudnn.launch import attention_cudnn

__all__ = ["MAX_HEAD_DIM", "attention_cudnn", "cudnn_unavailable_reason", "device_ordinal", "ffi_attributes",
           "graph_info", "unsupported_reason"]
