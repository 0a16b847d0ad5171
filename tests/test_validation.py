"""Malformed calls fail early with ValueError (or NotImplementedError) whose message names the argument."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ragged_attn import ragged_attention, ragged_attention_with_kvcache
from jax_ragged_attn.backends.shared import extension

_CUDNN_REASON = extension.cudnn_unavailable_reason()


def _zeros(*shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


# A valid call: two sequences, GQA with 4 query heads over 2 kv heads.
VALID = dict(
    q=_zeros(6, 4, 8),
    k=_zeros(5, 2, 8),
    v=_zeros(5, 2, 8),
    cu_seqlens_q=jnp.array([0, 2, 6], jnp.int32),
    cu_seqlens_kv=jnp.array([0, 3, 5], jnp.int32),
    max_seqlen_q=4,
    max_seqlen_kv=3,
    implementation="xla",
)


@dataclasses.dataclass(frozen=True)
class Bad:
    changes: dict  # replaces entries of VALID
    names: str  # the argument the message must name, as a whole word
    error: type = ValueError
    traced: tuple[str, ...] = ()  # arguments passed in as jit-traced values

    def call(self):
        kwargs = {**VALID, **self.changes}
        if not self.traced:
            return ragged_attention(**kwargs)
        traced = {name: kwargs.pop(name) for name in self.traced}
        return jax.jit(lambda traced: ragged_attention(**kwargs, **traced))(traced)


CASES = {
    # Ranks and kinds.
    "q_rank_2": Bad(dict(q=_zeros(6, 32)), "q"),
    "k_rank_4": Bad(dict(k=_zeros(5, 2, 8, 1)), "k"),
    "v_rank_2": Bad(dict(v=_zeros(5, 16)), "v"),
    "q_is_a_list": Bad(dict(q=[[[0.0] * 8] * 4] * 6), "q"),
    "cu_seqlens_q_rank_2": Bad(dict(cu_seqlens_q=jnp.array([[0, 2, 6]], jnp.int32)), "cu_seqlens_q"),
    # Dtypes.
    "k_dtype_differs": Bad(dict(k=_zeros(5, 2, 8, dtype=jnp.float16)), "k"),
    "v_dtype_differs": Bad(dict(v=_zeros(5, 2, 8, dtype=jnp.bfloat16)), "v"),
    "qkv_integer": Bad(
        dict(
            q=_zeros(6, 4, 8, dtype=jnp.int32), k=_zeros(5, 2, 8, dtype=jnp.int32), v=_zeros(5, 2, 8, dtype=jnp.int32)
        ),
        "q",
    ),
    # float64 NumPy converts as jnp.asarray would (float32 without x64); integers never.
    "qkv_int32": Bad(
        dict(q=np.zeros((6, 4, 8), np.int32), k=np.zeros((5, 2, 8), np.int32), v=np.zeros((5, 2, 8), np.int32)), "q"
    ),
    # Any integer dtype is accepted (tests/test_jax_configs.py); a float one is refused by name.
    "cu_seqlens_q_float": Bad(dict(cu_seqlens_q=np.array([0, 2, 6], np.float32)), "cu_seqlens_q"),
    "cu_seqlens_kv_float32": Bad(dict(cu_seqlens_kv=jnp.array([0, 3, 5], jnp.float32)), "cu_seqlens_kv"),
    # Shapes that disagree.
    "cu_seqlens_single_entry": Bad(
        dict(cu_seqlens_q=jnp.array([0], jnp.int32), cu_seqlens_kv=jnp.array([0], jnp.int32)), "cu_seqlens_q"
    ),
    "cu_seqlens_lengths_differ": Bad(dict(cu_seqlens_kv=jnp.array([0, 3, 4, 5], jnp.int32)), "cu_seqlens_kv"),
    "heads_not_a_multiple": Bad(dict(q=_zeros(6, 3, 8)), "q"),
    "k_head_dim_differs": Bad(dict(k=_zeros(5, 2, 4)), "k"),
    "v_rows_differ": Bad(dict(v=_zeros(4, 2, 8)), "v"),
    "v_heads_differ": Bad(dict(v=_zeros(5, 1, 8)), "v"),
    "zero_query_heads": Bad(dict(q=_zeros(6, 0, 8)), "Hq"),
    "zero_query_rows": Bad(dict(q=_zeros(0, 4, 8)), "Tq"),
    # max_seqlen fixes shapes, so it must be a static int >= 1.
    "max_seqlen_q_float": Bad(dict(max_seqlen_q=4.0), "max_seqlen_q"),
    "max_seqlen_q_negative": Bad(dict(max_seqlen_q=-3), "max_seqlen_q"),
    "max_seqlen_kv_zero": Bad(dict(max_seqlen_kv=0), "max_seqlen_kv"),
    "max_seqlen_kv_none": Bad(dict(max_seqlen_kv=None), "max_seqlen_kv"),
    "max_seqlen_q_traced": Bad(dict(max_seqlen_q=jnp.int32(4)), "max_seqlen_q", traced=("max_seqlen_q",)),
    # Option strings.
    "diagonal_alignment_unknown": Bad(dict(diagonal_alignment="bottom-right"), "diagonal_alignment"),
    "diagonal_alignment_none": Bad(dict(diagonal_alignment=None), "diagonal_alignment"),
    "stats_layout_unknown": Bad(dict(stats_layout="bhs"), "stats_layout"),
    "implementation_unknown": Bad(dict(implementation="triton"), "implementation"),
    "implementation_wrong_case": Bad(dict(implementation="XLA"), "implementation"),
    # scale must be a finite static float.
    "scale_nan": Bad(dict(scale=float("nan")), "scale"),
    "scale_inf": Bad(dict(scale=float("inf")), "scale"),
    "scale_not_a_number": Bad(dict(scale="abc"), "scale"),
    "scale_traced": Bad(dict(scale=jnp.float32(0.5)), "scale", traced=("scale",)),
    # local_window_size is an int or a (left, right) pair of ints (a negative side: no limit, test_window_conventions).
    "window_none_side": Bad(dict(local_window_size=(None, 2)), "local_window_size"),
    "window_three_entries": Bad(dict(local_window_size=(1, 2, 3)), "local_window_size"),
    "window_float": Bad(dict(local_window_size=(1.5, 2)), "local_window_size"),
    "window_string": Bad(dict(local_window_size="3"), "local_window_size"),
    # is_causal picks a graph, so it must be a Python bool.
    "is_causal_int": Bad(dict(is_causal=1), "is_causal"),
    "deterministic_string": Bad(dict(deterministic="no"), "deterministic"),
    "autotune_int": Bad(dict(autotune=1), "autotune"),
    "is_causal_string": Bad(dict(is_causal="yes"), "is_causal"),
    "is_causal_traced": Bad(dict(is_causal=jnp.bool_(True)), "is_causal", traced=("is_causal",)),
    # softcap: None, 0 or a positive finite static float.
    "softcap_negative": Bad(dict(softcap=-1.0), "softcap"),
    "softcap_nan": Bad(dict(softcap=float("nan")), "softcap"),
    "softcap_inf": Bad(dict(softcap=float("inf")), "softcap"),
    "softcap_string": Bad(dict(softcap="30"), "softcap"),
    "softcap_bool": Bad(dict(softcap=True), "softcap"),
    "softcap_traced": Bad(dict(softcap=jnp.float32(30.0)), "softcap", traced=("softcap",)),
}
if _CUDNN_REASON is None:
    # Valid requests the cuDNN path cannot serve on a GPU: NotImplementedError, saying why (without a GPU the
    # reason is the missing GPU: test_cudnn_without_a_gpu_names_the_gpu_not_the_dtype).
    CASES.update(
        {
            "cudnn_float32": Bad(dict(implementation="cudnn"), "float32", NotImplementedError),
            "cudnn_head_dim_not_multiple_of_8": Bad(
                dict(
                    implementation="cudnn",
                    q=_zeros(6, 4, 12, dtype=jnp.bfloat16),
                    k=_zeros(5, 2, 12, dtype=jnp.bfloat16),
                    v=_zeros(5, 2, 12, dtype=jnp.bfloat16),
                ),
                "Dqk",
                NotImplementedError,
            ),
        }
    )


@pytest.mark.parametrize("bad", list(CASES.values()), ids=list(CASES))
def test_bad_input_names_the_argument(bad):
    with pytest.raises(bad.error, match=rf"(?<![\w.]){re.escape(bad.names)}(?!\w)"):
        bad.call()


# ragged_attention_with_kvcache validates through the same code (AttentionOptions, config.check_heads): the same
# bad option is the same ValueError word for word, and the same bad heads, dtypes or sinks the same message with
# k_cache / v_cache for k / v. Each case: (ragged_attention's changes, the KV-cache call's).
KV_VALID = dict(
    q=_zeros(2, 1, 4, 8),
    k_cache=_zeros(2, 5, 2, 8),
    v_cache=_zeros(2, 5, 2, 8),
    cache_seqlens=jnp.array([3, 5], jnp.int32),
    implementation="xla",
)
SHARED_CASES = {
    **{
        name: (CASES[name].changes, CASES[name].changes)
        for name in CASES
        if not CASES[name].traced
        and set(CASES[name].changes)
        <= {"stats_layout", "implementation", "scale", "local_window_size", "is_causal", "softcap"}
    },
    "heads_not_a_multiple": (dict(q=_zeros(6, 3, 8)), dict(q=_zeros(2, 1, 3, 8))),
    "k_dtype_differs": (
        dict(k=_zeros(5, 2, 8, dtype=jnp.float16)),
        dict(k_cache=_zeros(2, 5, 2, 8, dtype=jnp.float16)),
    ),
    "qkv_integer": (
        {name: x.astype(jnp.int32) for name, x in VALID.items() if name in "qkv"},
        {name: KV_VALID[name].astype(jnp.int32) for name in ("q", "k_cache", "v_cache")},
    ),
    "sinks_shape": (dict(sinks=_zeros(3)), dict(sinks=_zeros(3))),
    "sinks_integer": (dict(sinks=_zeros(4, dtype=jnp.int32)), dict(sinks=_zeros(4, dtype=jnp.int32))),
}


@pytest.mark.parametrize("name", list(SHARED_CASES))
def test_both_ops_validate_with_the_same_code(name):
    ragged_changes, cache_changes = SHARED_CASES[name]
    with pytest.raises(ValueError) as ragged:
        ragged_attention(**{**VALID, **ragged_changes})
    with pytest.raises(ValueError) as cache:
        ragged_attention_with_kvcache(**{**KV_VALID, **cache_changes})
    assert re.sub(r"\b([kv])_cache\b", r"\1", str(cache.value)) == str(ragged.value)


def test_valid_call_passes():
    """The baseline the cases above modify must itself be accepted, or every case passes for nothing."""
    out = ragged_attention(**VALID)
    assert out.shape == (6, 4, 8)
    assert ragged_attention_with_kvcache(**KV_VALID).shape == (2, 1, 4, 8)


@pytest.mark.skipif(_CUDNN_REASON is None, reason="a GPU with cuDNN is present; this checks the answer without one")
def test_cudnn_without_a_gpu_names_the_gpu_not_the_dtype():
    """float32 and head dim 12 are both wrong for cuDNN too, but on a machine without it the reason to give is
    that one: changing the dtype would not help."""
    for changes in (dict(), dict(q=_zeros(6, 4, 12), k=_zeros(5, 2, 12), v=_zeros(5, 2, 12))):
        with pytest.raises(NotImplementedError) as caught:
            ragged_attention(**{**VALID, **changes, "implementation": "cudnn"})
        message = str(caught.value)
        assert _CUDNN_REASON in message, message
        assert "float32" not in message and "Dqk" not in message, message


def test_positional_max_seqlen_says_which_keywords_to_use():
    args = [VALID[name] for name in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_kv")]
    with pytest.raises(TypeError, match=r"max_seqlen_q=\.\.\. and max_seqlen_kv=\.\.\. \(keyword-only\)"):
        ragged_attention(*args, 4, 3, implementation="xla")
    with pytest.raises(ValueError, match="max_seqlen_kv is required"):
        ragged_attention(*args, max_seqlen_q=4, implementation="xla")


@pytest.mark.parametrize(
    "window,same_as",
    [
        ((-1, 0), dict(is_causal=True)),  # FlashAttention's causal spelling
        ((-1, -1), dict()),
        (-1, dict()),
        ((2, -1), dict(local_window_size=(2, 10**6))),
        ((-5, 1), dict(local_window_size=(10**6, 1))),
    ],
)
def test_window_conventions(window, same_as):
    """A negative window side has no limit (FlashAttention's -1); results equal the spelled-out mask."""
    rng = np.random.default_rng(0)
    arrays = {name: jnp.asarray(rng.standard_normal(VALID[name].shape).astype(np.float32)) for name in "qkv"}
    got = ragged_attention(**{**VALID, **arrays, "local_window_size": window})
    want = ragged_attention(**{**VALID, **arrays, **same_as})
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
