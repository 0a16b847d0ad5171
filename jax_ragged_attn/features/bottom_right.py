"""A bottom-right mask that is the top-left one, run as top-left.

The two alignments differ only where a sequence has a different number of keys than queries. When one array
serves as both cu_seqlens (qkv-packed, segments) with the same seqused and the same capacities and bounds,
every sequence has as many keys as queries, so the masks are equal, and the top-left one has the cheaper
backward on cuDNN (a bottom-right one runs as two calls there: backends/cudnn/launch.py _backward).
"""

from __future__ import annotations

import dataclasses

from jax_ragged_attn.config import AttentionConfig
from jax_ragged_attn.index import RaggedIndex


def as_top_left(config: AttentionConfig, index: RaggedIndex) -> AttentionConfig:
    """`config` with diagonal_alignment="top_left" where that is provably the same mask, else unchanged."""
    if (
        index.same
        and index.seqused_q is index.seqused_kv
        and config.diagonal_alignment == "bottom_right"
        and (config.capacity_q, config.max_seqlen_q) == (config.capacity_kv, config.max_seqlen_kv)
    ):
        return dataclasses.replace(config, diagonal_alignment="top_left")
    return config
