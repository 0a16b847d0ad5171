"""How tests and benchmarks reach what no keyword of the ops sets: the backends' own knobs and test hooks
(`backend_options`), and fields of the ops' configs (`config_overrides`).

    with backend_options(poison_outputs=True):          # cuDNN's NaN-filled outputs (cudnn/options.py)
        out = ragged_attention(...)
    with backend_options(route="ragged", block_rows=8):  # a kernel's route, the jnp path's cache rows a step
        out = ragged_attention_with_kvcache(...)
    with config_overrides(xla_block_size=(8, 5)):       # every call's config with the field replaced
        out = ragged_attention(...)

backend_options sets the named field of every backend's options dataclass that has it (OPTIONS below); the
backends read them when a call is traced, so they are no part of any cache key: a function jitted around the op
keeps what it was traced with (trace it inside the block). config_overrides has every call of ragged_attention
(and the entry points built on ops.ragged.attend) and of ragged_attention_with_kvcache build its config as usual
and then replaces the named fields its config class has. A name no class has is a TypeError.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

from jax_ragged_attn.backends.cudnn import options as cudnn_options
from jax_ragged_attn.backends.fa3 import options as fa3_options
from jax_ragged_attn.backends.shared import options as shared_options
from jax_ragged_attn.backends.xla import options as xla_options
from jax_ragged_attn.config import AttentionConfig, KVCacheConfig
from jax_ragged_attn.ops import kvcache, ragged

# The modules whose OPTIONS hold a backend's knobs.
OPTIONS = (cudnn_options, fa3_options, shared_options, xla_options)
# The routes a test may pin: cuDNN's two for a contiguous cache, FA3's head / tail split; each backend ignores
# the others'.
PINNED_ROUTES = ("paged", "ragged", "head_tail")


@contextlib.contextmanager
def backend_options(**fields):
    """The block's calls run with `fields` set in every backend's options that has them (the module docstring)."""
    known = {f.name for module in OPTIONS for f in dataclasses.fields(module.OPTIONS)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TypeError(f"no backend option is named {unknown}")
    if fields.get("route") not in (None, *PINNED_ROUTES):
        raise ValueError(f"route must be None or one of {PINNED_ROUTES}, got {fields['route']!r}")
    with contextlib.ExitStack() as stack:
        for module in OPTIONS:
            own = {
                name: value
                for name, value in fields.items()
                if name in {f.name for f in dataclasses.fields(module.OPTIONS)}
            }
            if own:
                stack.enter_context(mock.patch.object(module, "OPTIONS", dataclasses.replace(module.OPTIONS, **own)))
        yield


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
    with (
        mock.patch.object(ragged, "make_config", _replaced(ragged.make_config, AttentionConfig, fields)),
        mock.patch.object(kvcache, "kvcache_config", _replaced(kvcache.kvcache_config, KVCacheConfig, fields)),
    ):
        yield
