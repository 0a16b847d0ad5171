"""What the cuDNN path asks the extension at trace time: the FFI attributes of a configuration, its graphs'
workspace sizes, and whether cuDNN can run it at all."""

from __future__ import annotations

import warnings

import jax
import numpy as np

from jax_ragged_attn.backends.cudnn import autotune, extents, strategy
from jax_ragged_attn.backends.shared import extension, head_groups, known_issues
from jax_ragged_attn.backends.shared.extension import device_ordinal
from jax_ragged_attn.config import PACKINGS, AttentionConfig
from jax_ragged_attn.features.stacklevel import users_stacklevel

CUDNN_DTYPES = ("bfloat16", "float16")
MAX_HEAD_DIM = 256
# Query and key rows a graph is built for at least (see _plain_attributes); a reproducer lowers it to 1.
MIN_GRAPH_SEQLEN = 2
INT32_LIMIT = extents.INT32_LIMIT


def ffi_attributes(config: AttentionConfig, direction: str | None = None, layout: str | None = None) -> dict:
    """The configuration as the C++ side names it (ffi/attention_config.h), in plain Python values, in the
    order of the extension's field list (ffi_kwargs holds the two to each other).

    `direction` ("forward" / "backward") picks the autotuned plan for that graph when config.autotune, and
    for the backward the intermediates' layout: `layout` ("bounded" / "padded") where given, else the one
    config.strategy asks for (strategy.py).
    """
    attributes = _plain_attributes(config)
    if direction == "backward":
        attributes = strategy.with_layout(attributes, layout or backward_layout(config))
    if config.autotune and direction is not None:
        attributes["plan_index"] = autotune.plan_index(direction, attributes, device_ordinal())
    return attributes


def backward_layout(config: AttentionConfig) -> str:
    """The backward intermediates' layout config.strategy picks for these buffers (strategy.py). Check mode
    asks it for the caller's buffers and passes it on for its enlarged ones, so it checks the graph the
    unguarded call runs."""
    return strategy.backward_layout(config, _plain_attributes(config), device_ordinal())


def _plain_attributes(config: AttentionConfig) -> dict:
    """Every field, the backward's layout at its lean default and the heuristic's plan."""
    return dict(
        num_seqs=config.num_seqs,
        capacity_q=config.capacity_q,
        capacity_kv=config.capacity_kv,
        num_heads_q=config.num_heads_q,
        num_heads_kv=config.num_heads_kv,
        head_dim_qk=config.head_dim_qk,
        head_dim_v=config.head_dim_v,
        # At least 2: on the H200 (cuDNN 9.19), graphs built for s_q = 1 write wrong or NaN stats
        # (sweep seeds 78 and 182; cudnn-frontend#1083 reports the same on 9.26-9.27, known_issues.py) and the
        # backward refuses s_q = s_kv = 1. The lengths are still capped at
        # the caller's max_seqlen (packing.sequence_lengths), so a larger bound changes no result.
        max_seqlen_q=max(config.max_seqlen_q, MIN_GRAPH_SEQLEN),
        max_seqlen_kv=max(config.max_seqlen_kv, MIN_GRAPH_SEQLEN),
        dtype=CUDNN_DTYPES.index(config.dtype),
        scale=config.scale,
        softcap=config.softcap,  # 0: no cap (graph_build.cc adds the score modifier only above 0)
        bottom_right=int(config.diagonal_alignment == "bottom_right"),
        left_bound=-1 if config.left_bound is None else config.left_bound,
        right_bound=-1 if config.right_bound is None else config.right_bound,
        stats_token_major=int(config.stats_layout == "token_major"),
        use_max_total_seq_len=1,  # the backward's layout: ffi_attributes sets it
        deterministic=int(config.deterministic),
        plan_index=-1,  # cuDNN's heuristic choice
        packing=PACKINGS.index(config.packing),
        zero_outputs=0,  # a launch choice, not the graph's (ffi_kwargs)
    )


# FFI attributes are typed: each field's type as the extension declares it (extension.config_fields()).
_ATTRIBUTE_TYPES = {"int64": np.int64, "float32": np.float32}


# What the handler does before the graph runs so that rows the graph does not own read 0 (the zero_outputs
# attribute, ffi/attention_config.h's ZeroOutputs): nothing, cudaMemsetAsync over each whole output, the
# row-zeroing kernel over the unowned rows only, or (testing) NaN everywhere first and then that kernel.
ZERO_OUTPUTS = ("no", "all", "unowned", "poisoned")


def ffi_kwargs(config: AttentionConfig, direction: str, zero_outputs: str = "no", layout: str | None = None) -> dict:
    """The FFI call's attributes: ffi_attributes, each typed as the extension declares its field.
    `zero_outputs`: one of ZERO_OUTPUTS (launch.py: "unowned", "poisoned" with OPTIONS.poison_outputs, "no"
    where the results are passed in)."""
    attributes = {**ffi_attributes(config, direction, layout), "zero_outputs": ZERO_OUTPUTS.index(zero_outputs)}
    fields = extension.config_fields()
    if list(attributes) != [name for name, _ in fields]:
        raise RuntimeError(
            f"ffi_attributes builds the fields {list(attributes)}, but the extension declares "
            f"{[name for name, _ in fields]} (ffi/attention_config.h): the two lists must match"
        )
    return {name: _ATTRIBUTE_TYPES[kind](attributes[name]) for name, kind in fields}


def _other_local_ordinals() -> list[int]:
    """The other GPUs of this process: their graphs are built at trace time too, so no handler ever builds
    one while it runs (where XLA may be capturing it into a CUDA graph, which a build would break)."""
    ordinals = [d.local_hardware_id or 0 for d in jax.local_devices(backend="gpu")]
    return [o for o in ordinals if o != device_ordinal()]


def graph_info(direction: str, config: AttentionConfig, layout: str | None = None) -> dict:
    """Builds or finds the graph (the backward in `layout`, else config.strategy's); raises
    NotImplementedError if cuDNN cannot run it."""
    attributes = ffi_attributes(config, direction, layout)
    info = extension.module().graph_info(direction, device_ordinal(), attributes)
    if info["status"] == "unsupported":
        raise NotImplementedError(f"cuDNN cannot run this {direction} configuration: {info['message']}")
    if info["status"] != "ok":
        raise RuntimeError(f"building the cuDNN {direction} graph failed: {info['message']}")
    for ordinal in _other_local_ordinals():
        other = extension.module().graph_info(direction, ordinal, attributes)
        if other["status"] != "ok":
            raise RuntimeError(f"building the cuDNN {direction} graph on GPU {ordinal} failed: {other['message']}")
    if info.get("fell_back"):
        warnings.warn(
            "cudnn-frontend reserved "
            f"{info['frontend_region_bytes']} bytes for the ragged backward intermediates, less than their full "
            f"extent ({info['expected_intermediate_bytes']} bytes); using the dense layout without "
            "max_total_seq_len instead (correct, larger workspace). Upgrade nvidia-cudnn-frontend to 1.28+.",
            RuntimeWarning,
            stacklevel=users_stacklevel(),
        )
    return info


def unsupported_reason(config: AttentionConfig) -> str | None:
    """None when the cuDNN path can serve `config` here, else a sentence saying why not.

    Whether cuDNN can run here at all is asked first: on a machine without a GPU (or without the extension)
    that is the reason, not the dtype or head dim the call would also need changed."""
    reason = extension.cudnn_unavailable_reason()
    if reason is not None:
        return reason
    if config.dtype not in CUDNN_DTYPES:
        return f"the cuDNN path takes bfloat16 or float16 inputs, got {config.dtype}"
    for name, dim in (("Dqk", config.head_dim_qk), ("Dv", config.head_dim_v)):
        if dim % 8 or dim > MAX_HEAD_DIM:
            return f"cuDNN needs head dims that are multiples of 8 up to {MAX_HEAD_DIM}, got {name}={dim}"
    # Upstream bugs of the loaded cuDNN that reach this call (known_issues.py names each report).
    reason = known_issues.fence("cudnn", "ragged", config)
    if reason is not None:
        return reason
    # The int32 ragged offsets bound each tensor by its own extent; a call past it runs as several over head
    # groups (extents.py), so the graphs asked about are one group's.
    groups = extents.groups(config)
    if groups is None:
        return extents.too_large_reason(config)
    config = head_groups.group_config(config, groups)
    # softcap builds its graphs with a score modifier (graph_build.cc); a cuDNN that cannot build them says so
    # below, and that is the reason given ("cuDNN cannot run this forward configuration: ...").
    for direction in ("forward", "backward"):
        try:
            graph_info(direction, config)
        except NotImplementedError as error:
            return str(error)
    return None
