"""Keywords the entry points do not take, refused with a TypeError that says what to pass instead.

Code moving over from FlashAttention (or another attention API) brings its keywords along; Python's bare
"got an unexpected keyword argument 'window_size'" leaves the reader to find ours. `ragged_attention` and
`ragged_attention_with_kvcache` collect unknown keywords in `**unknown` and hand them here, so the name map
lives in one place. Every name keeps failing (nothing is silently translated: FlashAttention's causal mask is
aligned differently, so a quiet rename could change results); the message names the keyword to use.
"""

from __future__ import annotations

import inspect

# FlashAttention's keyword -> (ours or None, what to know when switching). A replacement is offered only where
# the function takes it (ragged_attention has no page_table); {alignment} is the note on the diagonal.
NAMES = {
    "window_size": (
        "local_window_size",
        "(left, right), a negative side unlimited as FlashAttention's -1; {alignment}",
    ),
    "softmax_scale": ("scale", None),
    "causal": ("is_causal", "{alignment}"),
    "return_softmax_lse": (
        "return_stats",
        "returns (out, lse), lse float32 and head-major as FlashAttention's ([H, T] packed, [B, H, Sq] over a cache)",
    ),
    "return_attn_probs": (
        "return_stats",
        "returns (out, lse), lse float32 and head-major ([H, T] packed, [B, H, Sq] over a cache); no probabilities",
    ),
    "cu_seqlens_k": ("cu_seqlens_kv", None),
    "max_seqlen_k": ("max_seqlen_kv", None),
    "seqused_k": ("seqused_kv", None),
    "block_table": ("page_table", None),
    "k": (
        None,
        "append new keys and values with kvcache_append(k_cache, v_cache, k, v, cache_seqlens) first, "
        "then attend with cache_seqlens + Sn",
    ),
    "v": (None, "append new keys and values with kvcache_append first (see k)"),
    "dropout_p": (None, "no implementation here has attention dropout"),
    "alibi_slopes": (None, "no implementation here adds ALiBi biases"),
}
COMPAT = (
    "jax_ragged_attn.flash_attn_varlen_func and flash_attn_with_kvcache take FlashAttention's names, "
    "semantics and bottom-right alignment as they are"
)


def _alignment(parameters) -> str:
    if "diagonal_alignment" in parameters:
        return (
            "FlashAttention aligns the diagonal bottom-right, this function top-left unless "
            'diagonal_alignment="bottom_right": the same when a sequence has as many queries as keys, '
            "different for cross-attention"
        )
    return "aligned bottom-right, as FlashAttention's; is_causal defaults to True here"


def hint(name: str, parameters) -> str:
    """What to say about keyword `name` to a function whose parameters are `parameters`."""
    ours, note = NAMES.get(name, (None, None))
    note = note and note.format(alignment=_alignment(parameters))
    if ours is not None and ours in parameters:
        return f"pass {ours}= instead" + (f" ({note})" if note else "")
    if ours is None and note is not None:
        return note
    import difflib  # only on the error path: not an import-time cost of the package

    close = difflib.get_close_matches(name, parameters, n=1)
    return f"did you mean {close[0]}=?" if close else "see the function's docstring for its keywords"


def reject_unknown_keywords(function, unknown: dict) -> None:
    """Raises TypeError naming every keyword in `unknown` (a `**unknown` catch-all of `function`) and, for each,
    the keyword `function` takes instead. Nothing when `unknown` is empty."""
    if not unknown:
        return
    parameters = [
        name
        for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    ]
    problems = [f"{name!r}: {hint(name, parameters)}" for name in unknown]
    noun = "an unexpected keyword argument" if len(problems) == 1 else "unexpected keyword arguments"
    flash_attention = any(name in NAMES for name in unknown)
    raise TypeError(
        f"{function.__name__}() got {noun} " + "; ".join(problems) + (f". {COMPAT}" if flash_attention else "")
    )
