"""Which GPU kernel implementation=None runs where more than one serves a call, decided without measuring.

The shipped policy is per GPU (compute capability) and shape class, the static tokens per sequence, so the first
call is right: FA3's cost over its kernels grows with tokens (its padding safety), cuDNN's backward is slower on
long sequences. "FA3" is whichever provider serves the call (fa3/providers.py). autotune=True refines the choice
by timing the configuration once (tuning.py); JAX_RAGGED_ATTN_IMPLEMENTATION pins a backend for every call it
can serve.
"""

from __future__ import annotations

import logging
import os

ENV_VAR = "JAX_RAGGED_ATTN_IMPLEMENTATION"

# compute capability -> the smallest tokens per sequence (capacity_q / B) at which FA3 is preferred: FA3 wins
# W1, W2, W6 and both head dims; below, cuDNN leads with jit-argument inputs by more than it trails in a step
# (docs/PERFORMANCE.md#what-the-measurements-found, "The FA3 / cuDNN policy"; #against-every-peer).
FA3_MIN_TOKENS_PER_SEQUENCE = {"9.0": 1024}

log = logging.getLogger("jax_ragged_attn")


def _compute_capability() -> str | None:
    import jax

    if jax.default_backend() != "gpu":
        return None
    return str(getattr(jax.devices()[0], "compute_capability", None))


def prefers_fa3(config) -> bool:
    """Whether the shipped policy prefers FlashAttention-3 over cuDNN for this configuration on this GPU."""
    capability = _compute_capability()
    threshold = None if capability is None else FA3_MIN_TOKENS_PER_SEQUENCE.get(capability)
    return threshold is not None and tokens_per_sequence(config) >= threshold


def tokens_per_sequence(config) -> float:
    """The shape class: capacity_q / num_seqs, or the whole batch's where a context-parallel device's call
    carries it (config.policy_tokens_per_sequence): a context-parallel device's share of long documents runs
    faster on FA3, the class of its documents, though its own capacity / B is that of short sequences
    (docs/PERFORMANCE.md#context-parallel, CP-c)."""
    hint = config.policy_tokens_per_sequence
    return hint if hint is not None else config.capacity_q / config.num_seqs


def pinned() -> str | None:
    """The backend JAX_RAGGED_ATTN_IMPLEMENTATION names ("cudnn", "fa3", "xla"), or None. implementation=None
    runs it wherever it can serve the call and chooses as usual elsewhere."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    return value or None


def report(name: str, config, why: str) -> None:
    """The debug log line of a choice made for implementation=None."""
    log.debug(
        "implementation=None runs %s (%s) for B=%d, Tq=%d, Tkv=%d, heads %d/%d, head dims %d/%d, %s",
        name,
        why,
        config.num_seqs,
        config.capacity_q,
        config.capacity_kv,
        config.num_heads_q,
        config.num_heads_kv,
        config.head_dim_qk,
        config.head_dim_v,
        config.dtype,
    )
