"""One call run as several over groups of heads, for a kernel that cannot address the whole call at once.

Heads never interact in attention: query head h reads only key/value head h // (Hq / Hkv). So a call splits
exactly into G calls, group g taking query heads [g Hq/G, (g+1) Hq/G) and the key/value heads they read,
and its out and stats are the groups' side by side along the head axis. Two shapes of split keep every
query head with its key/value head:

    G divides Hkv          group g: Hkv/G kv heads, Hq/G query heads       Hq 32, Hkv 8, G 4: 2 kv + 8 q each
    G a multiple of Hkv    group g: kv head g // (G/Hkv), Hq/G q heads     Hq 32, Hkv 8, G 16: 1 kv + 2 q each
    (and G divides Hq)

The cuDNN path uses it where a tensor passes the int32 ragged offsets' 2**31 elements (cudnn/extents.py):
each group's tensors are G times smaller. The price is one copy of q, k, v into the groups (slices of a head
axis are strided) and one of the outputs back; autodiff routes every gradient through the same slices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp

from jax_ragged_attn.config import AttentionConfig
from jax_ragged_attn.index.packings import TABLE


def group_counts(num_heads_q: int, num_heads_kv: int) -> list[int]:
    """Every G that splits these heads (module docstring), smallest first; 1 (no split) included."""
    return [
        g
        for g in range(1, num_heads_q + 1)
        if num_heads_q % g == 0 and (num_heads_kv % g == 0 or g % num_heads_kv == 0)
    ]


def group_config(config: AttentionConfig, groups: int) -> AttentionConfig:
    """The configuration of one of `groups` calls: its heads, separate q/k/v (a group is a slice, not a view
    of a packed row)."""
    if groups == 1:
        return config
    return dataclasses.replace(
        config,
        num_heads_q=config.num_heads_q // groups,
        num_heads_kv=max(config.num_heads_kv // groups, 1),
        packing="none",
    )


def fewest_groups(config: AttentionConfig, fits: Callable[[AttentionConfig], bool]) -> int | None:
    """The smallest G whose group configuration fits, or None when not even one query head per call does."""
    return next(
        (g for g in group_counts(config.num_heads_q, config.num_heads_kv) if fits(group_config(config, g))), None
    )


def _kv_heads(group: int, groups: int, num_heads_kv: int) -> slice:
    if num_heads_kv % groups == 0:
        width = num_heads_kv // groups
        return slice(group * width, (group + 1) * width)
    head = group // (groups // num_heads_kv)
    return slice(head, head + 1)


def _split(buffers, config: AttentionConfig, groups: int):
    """Per group: (q, k, v) sliced along their head axis."""
    q, k, v = TABLE[config.packing].split(buffers)
    width_q = config.num_heads_q // groups
    return [
        (
            q[:, g * width_q : (g + 1) * width_q],
            k[:, _kv_heads(g, groups, config.num_heads_kv)],
            v[:, _kv_heads(g, groups, config.num_heads_kv)],
        )
        for g in range(groups)
    ]


def _join_stats(parts, config: AttentionConfig):
    if any(s is None for s in parts):
        return None
    return jnp.concatenate(parts, axis=0 if config.stats_layout == "head_major" else 1)


def attend_in_groups(attend: Callable, buffers, index, config: AttentionConfig, groups: int, *, stats):
    """attend(buffers, index, config, stats=...) -> (out, stats) run once per head group and joined."""
    inner = group_config(config, groups)
    results = [attend(part, index, inner, stats=stats) for part in _split(buffers, config, groups)]
    return (jnp.concatenate([out for out, _ in results], axis=1), _join_stats([s for _, s in results], config))


def attend_with_sinks_in_groups(
    attend_with_sinks: Callable, buffers, index, sinks, config: AttentionConfig, groups: int
):
    """attend_with_sinks(buffers, index, sinks, config) -> out, once per head group (sinks [Hq] sliced too)."""
    inner = group_config(config, groups)
    width = config.num_heads_q // groups
    outs = [
        attend_with_sinks(part, index, sinks[g * width : (g + 1) * width], inner)
        for g, part in enumerate(_split(buffers, config, groups))
    ]
    return jnp.concatenate(outs, axis=1)
