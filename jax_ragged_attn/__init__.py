"""Fused attention over packed variable-length sequences (THD / varlen) for JAX.

    out = jax_ragged_attn.ragged_attention(q, k, v, cu_seqlens_q, cu_seqlens_kv,
                                           max_seqlen_q=..., max_seqlen_kv=..., is_causal=True)

The layout, in layers that import only downwards (tests/test_layout.py holds it):

    tools/, testing/      the main job, the self-check, a bench of your own shapes; the float64 reference, test
                          helpers and the named workloads (the benchmarks live outside the package: benchmarks/)
    export.py             jax.export of steps that call the ops: the exporter's allowance for our custom calls,
                          their handlers registered where a deserialized step runs
    flax.py               the Flax block
    inputs/               other input layouts: packed projections, segment ids, FlashAttention's names, the
                          document packer
    parallel/             several devices: heads sharded, context parallelism (all-gather, ring; a chunk's
                          pieces and key windows), load balance
    ops/                  one module per op: ragged_attention (ragged.py), the KV-cache op (kvcache.py)
    backends/             the kernel families cudnn/, fa3/, xla/ (each serving both ops) and what they share
                          (shared/), behind one registry
    features/             checks, sinks, the bottom-right rewrite, overflow counts
    config.py, index/     both ops' options and static configs; the index arithmetic (ragged, KV cache, packings)
"""

import jax as _jax

# jax.shard_map(check_vma=) and jax.reshard arrived in jax 0.10, and 0.10.2 is the oldest release tested
# (docs/INSTALL.md's table): with an older jax (installed with --no-deps, or pinned by another package) say so
# here rather than fail later inside the op.
if tuple(int(part) for part in _jax.__version__.split(".")[:3] if part.isdigit()) < (0, 10, 2):
    raise ImportError(
        f"jax_ragged_attn needs jax 0.10.2 or newer, found {_jax.__version__}: pip install -U 'jax>=0.10.2'"
    )

from jax_ragged_attn import export
from jax_ragged_attn.backends.shared.extension import cudnn_unavailable_reason
from jax_ragged_attn.config import AttentionConfig
from jax_ragged_attn.inputs.flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
from jax_ragged_attn.ops.kvcache import kvcache_append, ragged_attention_with_kvcache
from jax_ragged_attn.ops.ragged import ragged_attention

__all__ = [
    "AttentionConfig",
    "cudnn_unavailable_reason",
    "export",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "kvcache_append",
    "ragged_attention",
    "ragged_attention_with_kvcache",
]
__version__ = "0.1.0"
