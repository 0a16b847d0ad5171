"""Fused attention over packed variable-length sequences (THD / varlen) for JAX.

    out = jax_ragged_attn.ragged_attention(q, k, v, cu_seqlens_q, cu_seqlens_kv,
                                           max_seqlen_q=..., max_seqlen_kv=..., is_causal=True)

The layout, in layers that import only downwards (tests/test_layout.py holds it):

    tools/, testing/      the main job, benchmarks, demo, self-check; the float64 reference and test helpers
    flax.py               the Flax block
    inputs/               other input layouts: packed projections, segment ids, a KV cache, the document packer
    parallel/             several devices: heads sharded, context parallelism (all-gather, ring; a chunk's
                          pieces and key windows), load balance
    api.py                ragged_attention: the features composed around one backend call
    backends/             cuDNN, FlashAttention-3, xla (and their KV-cache forms) behind one registry
    features/             checks, sinks, the bottom-right rewrite, overflow counts
    index.py, config.py   the index arithmetic and the static configuration every layer shares
"""

import importlib as _importlib
import importlib.abc as _abc
import importlib.util as _util
import sys as _sys

import jax as _jax

# jax.shard_map(check_vma=) and jax.reshard arrived in jax 0.10: with an older jax (installed with --no-deps, or
# pinned by another package) say so here rather than fail later inside the op.
if tuple(int(part) for part in _jax.__version__.split(".")[:2]) < (0, 10):
    raise ImportError(f"jax_ragged_attn needs jax 0.10 or newer, found {_jax.__version__}: pip install -U 'jax>=0.10'")

# Modules that moved when the package took its current layout: the old import paths keep working (the same
# module object under both names), so code written against them needs no change.
MOVED = {
    "_cudnn": "backends.cudnn", "_cudnn.packings": "backends.packings", "_fa3": "backends.fa3", "xla": "backends.xla",
    "xla_memory": "backends.xla_memory",
    "implementation_tuning": "backends.tuning", "packing": "index", "indices": "index",
    "checks": "features.checks", "sinks": "features.sinks", "overflow": "features.overflow",
    "packed": "inputs.packed", "segments": "inputs.segments", "data": "inputs.data",
    "sharding": "parallel.sharding", "context_parallel": "parallel.context_parallel", "ring": "parallel.ring",
    "load_balance": "parallel.load_balance",
}


def _new_name(fullname: str) -> str | None:
    parts = fullname.split(".")
    if parts[0] != __name__:
        return None
    for cut in range(len(parts), 1, -1):  # the longest moved prefix: _cudnn.packings before _cudnn
        old = ".".join(parts[1:cut])
        if old in MOVED:
            return ".".join([__name__, MOVED[old], *parts[cut:]])
    return None


class _MovedModules(_abc.MetaPathFinder, _abc.Loader):
    """Resolves an old path (jax_ragged_attn.packed, jax_ragged_attn._cudnn.launch) to the module's new one."""

    def find_spec(self, fullname, path=None, target=None):
        new = _new_name(fullname)
        return None if new is None else _util.spec_from_loader(fullname, self)

    own_specs = {}  # alias -> the module's own spec, which importlib overwrites with the alias's

    def create_module(self, spec):
        module = _importlib.import_module(_new_name(spec.name))
        self.own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self.own_specs.pop(module.__spec__.name)


if not any(isinstance(finder, _MovedModules) for finder in _sys.meta_path):
    _sys.meta_path.insert(0, _MovedModules())


def __getattr__(name):  # jax_ragged_attn.checks.input_errors without importing the submodule first
    if name in MOVED:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


from jax_ragged_attn.api import ragged_attention  # noqa: E402
from jax_ragged_attn.backends.cudnn.extension import cudnn_unavailable_reason  # noqa: E402
from jax_ragged_attn.config import AttentionConfig  # noqa: E402
from jax_ragged_attn.inputs.kvcache import kvcache_append, ragged_attention_with_kvcache  # noqa: E402

__all__ = ["AttentionConfig", "cudnn_unavailable_reason", "kvcache_append", "ragged_attention",
           "ragged_attention_with_kvcache"]
__version__ = "0.1.0"
