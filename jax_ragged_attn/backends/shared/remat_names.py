"""The names `jax.checkpoint` policies see on what the op's forward saves for its backward: the attention
output and its log-sum-exp, named inside every backend's forward rule (docs/API.md, "Rematerialization")."""

from __future__ import annotations

from jax.ad_checkpoint import checkpoint_name

OUT = "ragged_attention_out"
LSE = "ragged_attention_lse"


def named_residuals(out, lse):
    """(out, lse) tagged with OUT and LSE, so a policy can save or offload them and keep the backward from
    running the attention forward again."""
    return checkpoint_name(out, OUT), checkpoint_name(lse, LSE)
