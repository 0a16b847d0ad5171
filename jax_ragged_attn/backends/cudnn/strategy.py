"""Which layout the cuDNN backward gives its fp32 intermediates: a speed / memory choice. The forward is the
same graph either way; gradients agree to rounding (the order of cuDNN's atomic accumulation).

The ragged backward keeps fp32 intermediates per query row and head (the dQ accumulator and the softmax
sums). cudnn-frontend offers two layouts for them:

- "bounded" (`max_total_seq_len` set to the buffers' capacities): packed like the tokens, Tq rows. The
  smallest workspace, proportional to the token buffer (W1: 270.5 MB).
- "padded" (`max_total_seq_len` unset): one dense [B, Hq, max_seqlen_q, ...] block, B * max_seqlen_q rows.
  Faster (docs/PERFORMANCE.md#what-the-measurements-found, "The backward layout"), but B * max_seqlen_q >= Tq,
  far more when the lengths are skewed (W1: 525.7 MB).

Both are sized over their full extent: the bounded one is checked against the region the frontend reserved
(ffi/graph_build.cc: frontends before 1.28 sized head-major stats Hq times too small), the padded one is
indexed by (sequence, head, position < max_seqlen) inside a block the frontend sizes from those bounds, and
the sequence lengths the kernel sees are capped at max_seqlen (packing.sequence_lengths).

strategy="lean_memory" always runs the bounded layout. strategy="fastest" (the default) runs the padded one
when its workspace is at most FASTEST_WORKSPACE_RATIO times the bounded one's, or at most
FASTEST_EXTRA_BYTES more (so a small workspace may grow by more than 2x, never by more than 256 MiB): never
an unbounded amount on a skewed batch. With autotune=True both layouts that fit are timed once and the
bounded one is kept unless the padded one is faster by more than autotune.MARGIN. The bound compares the
heuristic plans' workspaces; a plan autotune picks for its speed may need a little more. The forward has no
such choice.

Check mode (config.guard_workspace) enlarges every buffer by its canary rows; it takes the layout the rule
picks for the caller's buffers (graphs.backward_layout), so it checks the graph the unguarded call runs.
"""

from __future__ import annotations

from jax_ragged_attn.backends.cudnn import autotune
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.config import AttentionConfig

# The padded layout's workspace bound, from the six workloads where it ran faster at up to 1.94x the bounded
# one's (docs/PERFORMANCE.md#what-the-measurements-found, "The backward layout").
FASTEST_WORKSPACE_RATIO = 2.0
FASTEST_EXTRA_BYTES = 256 << 20

LAYOUTS = ("bounded", "padded")


def backward_layout(config: AttentionConfig, attributes: dict, device: int) -> str:
    """ "bounded" or "padded" for the backward graph of `config`; `attributes` are its FFI attributes with the
    heuristic's plan, built on `device`."""
    if config.strategy == "lean_memory":
        return "bounded"
    return _fastest_layout(config.autotune, attributes, device)


def with_layout(attributes: dict, layout: str) -> dict:
    return {**attributes, "use_max_total_seq_len": int(layout == "bounded")}


def _fastest_layout(tune: bool, attributes: dict, device: int) -> str:
    # Both graphs are built (or found in the extension's cache) to read their workspace sizes.
    workspace = {}
    for layout in LAYOUTS:
        info = extension.module().graph_info("backward", device, with_layout(attributes, layout))
        if info["status"] != "ok":
            return "bounded"  # graph_info on the bounded layout reports the problem to the caller
        workspace[layout] = int(info["workspace_bytes"])
    if not padded_fits(workspace["bounded"], workspace["padded"]):
        return "bounded"
    if not tune:
        return "padded"
    bounded_ms, padded_ms = (
        autotune.chosen_ms("backward", with_layout(attributes, layout), device) for layout in LAYOUTS
    )
    return "padded" if padded_ms < bounded_ms * (1 - autotune.MARGIN) else "bounded"


def padded_fits(bounded_bytes: int, padded_bytes: int) -> bool:
    """strategy="fastest"'s memory bound: the padded layout's workspace against the bounded one's."""
    return padded_bytes <= max(FASTEST_WORKSPACE_RATIO * bounded_bytes, bounded_bytes + FASTEST_EXTRA_BYTES)
