"""How tests and benchmarks reach the static configs' private fields, which no keyword of the ops sets.

    with config_overrides(poison_outputs=True):          # AttentionConfig: cuDNN's NaN-filled outputs
        out = ragged_attention(...)
    with config_overrides(route="ragged", block_rows=8):  # KVCacheConfig: a kernel's route, the xla rows a step
        out = ragged_attention_with_kvcache(...)

Inside the block, every call of ragged_attention (and the entry points built on api.attend) and of
ragged_attention_with_kvcache builds its config as usual and then replaces the named fields that its config
class has; a name neither class has is a TypeError. The values travel in the config, so they are part of
every cache key below the op (the custom_vjp's static arguments, the cuDNN graph-cache key where they reach
the extension's attributes). A function jitted around the op keeps the config it was traced with: trace it
inside the block.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

from jax_ragged_attn.ops import ragged as api
from jax_ragged_attn.config import KVCacheConfig
from jax_ragged_attn.config import AttentionConfig
from jax_ragged_attn.ops import kvcache


def _replaced(build, config_class, fields: dict):
    names = {f.name for f in dataclasses.fields(config_class)}
    own = {name: value for name, value in fields.items() if name in names}

    def built(*args, **kwargs):
        return dataclasses.replace(build(*args, **kwargs), **own)

    return built


@contextlib.contextmanager
def config_overrides(**fields):
    """The block's op calls build their configs with `fields` replaced (the module docstring)."""
    known = {f.name for f in dataclasses.fields(AttentionConfig)} | {f.name for f in dataclasses.fields(KVCacheConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TypeError(f"no config field is named {unknown}")
    with mock.patch.object(api, "make_config", _replaced(api.make_config, AttentionConfig, fields)), \
            mock.patch.object(kvcache, "kvcache_config", _replaced(kvcache.kvcache_config, KVCacheConfig, fields)):
        yield
