"""Which GPU kernel implementation=None runs where more than one serves a call, decided without measuring.

A policy shipped with the package, from measurements, per GPU (compute capability) and shape class, so the
first call is right; autotune=True refines it by measuring the configuration once (tuning.py), and
JAX_RAGGED_ATTN_IMPLEMENTATION pins a backend for every call it can serve.

Measured on the H200 (bf16, causal, d 128, plain dispatch of jitted fwd+bwd, benchmarks/fa3_compare.py;
the figures: docs/PERFORMANCE.md, "The fastest kernel by default"): FA3 is faster on W1, W2 and W6 (2,048 to
about 12,000 tokens a sequence), cuDNN on W5 (119 sequences of 64..1022, 551 tokens a sequence). FA3's cost
over its own kernels is per token (its padding safety: row_zeroing.py), cuDNN's backward is slower on long
sequences, so the split is by the static tokens per sequence, capacity_q / num_seqs.

Those figures pass q, k, v as jit arguments, which XLA copies before FA3's padding clearing. Inside a model's
step (inputs made in the jit, fa3_compare --inputs computed) the clearing is in place and FA3 led on W5 too,
by less than it trails there with jit-argument inputs. The split stays at 1,024 tokens a sequence, the
smaller of the two losses; autotune=True times the two as a step meets them (tuning.py).

"FA3" is either provider of its kernels (fa3/providers.py): where the dew-flash-attn wheel is installed and
serves the call, its build goes first: on the H100 (2026-12-06, benchmarks/peers.py) it ran W1, W2, W6 and the
head dim 64 and 256 rows 1-3 % faster than the flash-attn3-jax wheel's and 11-16 % faster than cuDNN (fwd+bwd,
inputs made in the jit), and on W5 (the short class) level with cuDNN in a step but 1.25x behind it with
jit-argument inputs (its padding clearing copies them), so the threshold stands for it too.
"""

from __future__ import annotations

import logging
import os

ENV_VAR = "JAX_RAGGED_ATTN_IMPLEMENTATION"

# compute capability -> the smallest tokens per sequence (capacity_q / B) at which FA3 is preferred.
FA3_MIN_TOKENS_PER_SEQUENCE = {"9.0": 1024}

log = logging.getLogger("jax_ragged_attn")


def _compute_capability() -> str | None:
    import jax

    if jax.default_backend() != "gpu":
        return None
    return str(getattr(jax.devices()[0], "compute_capability", None))


def prefers_fa3(config) -> bool:
    """Whether the shipped policy prefers FlashAttention-3 over cuDNN for this configuration on this GPU."""
    threshold = FA3_MIN_TOKENS_PER_SEQUENCE.get(_compute_capability())
    return threshold is not None and tokens_per_sequence(config) >= threshold


def tokens_per_sequence(config) -> float:
    """The shape class: capacity_q / num_seqs, or the whole batch's where a context-parallel device's call
    carries it (config.policy_tokens_per_sequence). Measured on CP-c (16 documents of 254..7,768, GQA 32/8) on
    the H200, 2026-12-04: every device's call ran faster on FA3 than on cuDNN (n = 2 / 4 / 8: 10.7 / 6.0 / 3.6
    against 12.0 / 6.5 / 3.8 ms), the class of its documents (4,096 tokens each), though its own capacity / B
    (256 at n = 8) is that of short sequences."""
    hint = config.policy_tokens_per_sequence
    return hint if hint is not None else config.capacity_q / config.num_seqs


def pinned() -> str | None:
    """The backend JAX_RAGGED_ATTN_IMPLEMENTATION names ("cudnn", "fa3", "xla"), or None. implementation=None
    runs it wherever it can serve the call and chooses as usual elsewhere."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    return value or None


def report(name: str, config, why: str) -> None:
    """The debug log line of a choice made for implementation=None."""
    log.debug("implementation=None runs %s (%s) for B=%d, Tq=%d, Tkv=%d, heads %d/%d, head dims %d/%d, %s",
              name, why, config.num_seqs, config.capacity_q, config.capacity_kv, config.num_heads_q,
              config.num_heads_kv, config.head_dim_qk, config.head_dim_v, config.dtype)
