"""checks.checked_cu_seqlens stops a computation on malformed cu_seqlens, naming the argument, index, values.

The error crosses XLA, so its type depends on jax's dispatch path (see the checks module docstring): these
tests accept ValueError or JaxRuntimeError and hold the message to what the user must be told.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.features import checks
from jax_ragged_attn.features.checks import ENV_VAR, check_enabled, checked_cu_seqlens

RAISED = (ValueError, jax.errors.JaxRuntimeError)
CAPACITY, MAX_SEQLEN = 10, 4


def _check(cu, name="cu_seqlens_q"):
    return checked_cu_seqlens(cu, name=name, capacity=CAPACITY, max_seqlen=MAX_SEQLEN)


def _cu(values):
    return jnp.asarray(values, jnp.int32)


VALID = {
    "plain": [0, 3, 7],
    "empty_sequences": [0, 0, 4, 4, 4],
    "lengths_at_max_seqlen": [0, 4, 8],
    "ends_at_capacity": [0, 4, 6, 10],
    "single_empty": [0, 0],
}

# (values, name, the message must contain these, in this order)
INVALID = {
    "does_not_start_at_0": ([2, 3, 7], "cu_seqlens_q", ["cu_seqlens_q[0] = 2, must be 0"]),
    "negative_start": ([-1, 3, 7], "cu_seqlens_kv", ["cu_seqlens_kv[0] = -1, must be 0"]),
    "decreases": ([0, 3, 2, 5], "cu_seqlens_q", ["decreases at index 2", "cu_seqlens_q[1] = 3 > cu_seqlens_q[2] = 2"]),
    "past_capacity": ([0, 4, 8, 11], "cu_seqlens_kv", ["cu_seqlens_kv[3] = 11 is past the capacity 10"]),
    "longer_than_max_seqlen": (
        [0, 2, 7],
        "cu_seqlens_kv",
        ["sequence 1 has 5 tokens", "7 - 2", "more than max_seqlen_kv = 4"],
    ),
}


@pytest.mark.parametrize("values", VALID.values(), ids=VALID.keys())
def test_valid_input_returns_identical_values(values):
    cu = _cu(values)
    for result in (_check(cu), jax.jit(_check)(cu)):
        assert result.dtype == jnp.int32 and result.shape == cu.shape
        np.testing.assert_array_equal(np.asarray(result), values)


def _expect_error(call, name, fragments):
    with pytest.raises(RAISED) as raised:
        jax.block_until_ready(call())
    message = str(raised.value)
    assert f"{name} is invalid" in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from: {message}"
    assert "Got [" in message, message  # the values themselves


@pytest.mark.parametrize("values, name, fragments", INVALID.values(), ids=INVALID.keys())
def test_invalid_input_raises_naming_argument_index_and_values(values, name, fragments):
    check = functools.partial(_check, name=name)
    # Eagerly, on a jitted function's first call, and through jit's fast path (a compiled function called
    # again): jax turns the error into a different exception type on each path, never into silence.
    _expect_error(lambda: check(_cu(values)), name, fragments)
    jitted = jax.jit(lambda cu: check(cu) + 1)
    _expect_error(lambda: jitted(_cu(values)), name, fragments)
    np.testing.assert_array_equal(np.asarray(jitted(_cu([0, 1, 2]))), [1, 2, 3])
    _expect_error(lambda: jitted(_cu(values)), name, fragments)


def test_failed_check_stops_what_depends_on_it():
    ran = []

    def consumer(cu):
        ran.append(np.asarray(cu))
        return cu

    @jax.jit
    def f(cu):
        cu = _check(cu)
        return jax.pure_callback(consumer, jax.ShapeDtypeStruct(cu.shape, cu.dtype), cu)

    f(_cu([0, 1, 3])).block_until_ready()
    assert len(ran) == 1
    _expect_error(lambda: f(_cu([0, 5, 3])), "cu_seqlens_q", ["decreases at index 2"])
    assert len(ran) == 1, "a computation that consumes the checked cu_seqlens ran on invalid values"


def test_vmap_names_the_bad_element():
    good, bad = [0, 1, 3], [0, 3, 1]
    batched = jax.jit(jax.vmap(_check))
    np.testing.assert_array_equal(np.asarray(batched(_cu([good, good]))), [good, good])
    _expect_error(lambda: batched(_cu([good, bad])), "cu_seqlens_q", ["(vmapped element (1,))", "index 2"])


def test_composes_with_grad_and_checkpoint():
    def loss(x, cu):
        cu = _check(cu)
        return jnp.sum(x * cu.astype(x.dtype))

    x = jnp.arange(3.0)
    grad = jax.jit(jax.grad(jax.checkpoint(loss)))(x, _cu([0, 2, 5]))
    np.testing.assert_array_equal(np.asarray(grad), [0.0, 2.0, 5.0])
    _expect_error(
        lambda: jax.jit(jax.grad(jax.checkpoint(loss)))(x, _cu([0, 2, 9])), "cu_seqlens_q", ["sequence 1 has 7 tokens"]
    )


def test_wired_in_front_of_ragged_attention():
    """How api.ragged_attention uses it: the checked values feed the op, results identical to unchecked."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((CAPACITY, 2, 8)), jnp.float32)
    options = dict(max_seqlen_q=MAX_SEQLEN, max_seqlen_kv=MAX_SEQLEN, is_causal=True, implementation="xla")

    def attend(cu, checked):
        if checked:
            cu = _check(cu)
        return ragged_attention(q, q, q, cu, cu, **options)

    cu = _cu([0, 4, 4, 7])
    np.testing.assert_array_equal(
        np.asarray(jax.jit(attend, static_argnums=1)(cu, True)),
        np.asarray(jax.jit(attend, static_argnums=1)(cu, False)),
    )
    _expect_error(
        lambda: jax.jit(attend, static_argnums=1)(_cu([0, 4, 9, 7]), True),
        "cu_seqlens_q",
        ["more than max_seqlen_q = 4"],
    )


@pytest.mark.parametrize(
    "env, expected",
    [(None, False), ("", False), ("0", False), ("off", False), ("1", True), ("true", True), (" YES ", True)],
)
def test_check_enabled_reads_the_environment(monkeypatch, env, expected):
    if env is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, env)
    assert check_enabled(None) is expected
    # An explicit argument wins over the environment, either way.
    assert check_enabled(True) is True and check_enabled(False) is False


def test_check_enabled_rejects_an_unknown_value(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "ture")
    with pytest.raises(ValueError, match=f"{ENV_VAR}.*'ture'"):
        check_enabled(None)


def test_guard_band_intact_passes_and_clobbered_band_stops_the_computation():
    intact = jnp.full((checks.GUARD_BYTES,), checks.CANARY, jnp.uint8)
    verify = jax.jit(lambda band: checks.verified_guard_band(band, description="unit test"))
    assert int(verify(intact)) == 0
    clobbered = intact.at[10:13].set(0)
    with pytest.raises((RuntimeError, ValueError), match="3 of the 4096 guard bytes"):
        jax.block_until_ready(verify(clobbered))


def test_concrete_values_are_checked_on_the_host_without_a_callback(monkeypatch):
    """Eagerly there is nothing to trace: the error is a plain RaggedAttentionInputError raised right here."""

    def no_callback(*args, **kwargs):
        raise AssertionError("concrete cu_seqlens went through a callback")

    monkeypatch.setattr(jax, "pure_callback", no_callback)
    np.testing.assert_array_equal(np.asarray(_check(_cu([0, 3, 7]))), [0, 3, 7])
    with pytest.raises(checks.RaggedAttentionInputError, match=r"^cu_seqlens_q is invalid: cu_seqlens_q\[0\] = 2"):
        _check(_cu([2, 3, 7]))


def test_input_errors_unwraps_what_jit_delivers():
    jitted = jax.jit(lambda cu: _check(cu) + 1)
    with pytest.raises(checks.RaggedAttentionInputError) as raised, checks.input_errors():
        jax.block_until_ready(jitted(_cu([0, 3, 2])))
    assert str(raised.value).startswith("cu_seqlens_q is invalid: it decreases at index 2"), str(raised.value)
    assert "\n" not in str(raised.value) and "Traceback" not in str(raised.value)


def _wrapped_lines(call) -> list[str]:
    """The lines of the error `call` raises, as jaxlib delivers it (no input_errors())."""
    with pytest.raises(RAISED) as raised:
        jax.block_until_ready(call())
    assert not isinstance(raised.value, checks.RaggedAttentionInputError), "expected jaxlib's wrapped error"
    return str(raised.value).splitlines()


def _assert_names_it_first(lines: list[str], message: str) -> None:
    """jaxlib's first line is fixed (the module docstring says why); the error's own text is one frame and then
    the message: the message by the third line, and none of jax's machinery before it."""
    text = "\n".join(lines)
    at = [i for i, line in enumerate(lines) if line.startswith(f"RaggedAttentionInputError: {message}")]
    assert at and at[0] <= 2, text
    assert "jax/_src" not in text and sum(line.lstrip().startswith("File ") for line in lines) <= 1, text


def test_under_jit_the_error_reads_as_the_check_without_input_errors():
    """On a jitted function's first call (JaxRuntimeError) and on its C++ fast path (ValueError): the check's
    message, naming the argument, the index and the values, three lines in, with no traceback before it."""
    jitted = jax.jit(lambda cu: _check(cu) + 1)
    bad = _cu([0, 3, 2])
    message = "cu_seqlens_q is invalid: it decreases at index 2: cu_seqlens_q[1] = 3 > cu_seqlens_q[2] = 2. Got [0 3 2]"
    _assert_names_it_first(_wrapped_lines(lambda: jitted(bad)), message)
    jax.block_until_ready(jitted(_cu([0, 1, 2])))  # compiled: later calls take the fast path
    _assert_names_it_first(_wrapped_lines(lambda: jitted(bad)), message)


def test_under_jit_through_ragged_attention_and_seqused():
    q = jnp.zeros((CAPACITY, 2, 8), jnp.float32)
    options = dict(max_seqlen_q=MAX_SEQLEN, max_seqlen_kv=MAX_SEQLEN, implementation="xla", check=True)
    attend = jax.jit(lambda cu: ragged_attention(q, q, q, cu, cu, **options))
    _assert_names_it_first(
        _wrapped_lines(lambda: attend(_cu([0, 4, 9, 7]))),
        "cu_seqlens_q is invalid: it decreases at index 3: cu_seqlens_q[2] = 9 > cu_seqlens_q[3] = 7",
    )
    used = jax.jit(lambda cu, n: ragged_attention(q, q, q, cu, cu, seqused_q=n, seqused_kv=n, **options))
    _assert_names_it_first(
        _wrapped_lines(lambda: used(_cu([0, 4, 8]), _cu([2, 5]))),
        "cu_seqlens_q / seqused_q are invalid: seqused_q[1] = 5 is more than the slot's 4 rows",
    )


def test_a_callback_run_inside_the_call_raises_the_named_error():
    """A transformation outside jit (vmap here) runs the callback within the op's own call: the error arrives
    as RaggedAttentionInputError, message only."""
    with pytest.raises(checks.RaggedAttentionInputError) as raised:
        jax.vmap(_check)(_cu([[0, 1, 3], [0, 3, 1]]))
    assert str(raised.value).startswith("cu_seqlens_q is invalid (vmapped element (1,)): it decreases at index 2")
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    "ids, max_segments, max_seqlen, expected",
    [
        ([[1, 1, 0, 2], [2, 0, 0, 2]], 4, 4, []),
        (
            [[1, 1, 0, 2], [2, 0, 0, 2]],
            2,
            4,
            [
                "segment_ids hold 4 segments, more than max_segments = 2: segments 2 to 3 "
                "(row-major) would be dropped, the first of them at segment_ids[1, 0] = 2"
            ],
        ),
        (
            [[3, 3, 3, 0], [4, 4, 0, 0]],
            2,
            2,
            ["segment 0 (segment_ids[0, 0:3] = 3) has 3 tokens, more than max_seqlen = 2"],
        ),
        ([[0, 0], [0, 0]], 1, 1, []),
    ],
)
def test_segment_problems_name_row_token_count_and_bound(ids, max_segments, max_seqlen, expected):
    assert checks.segment_problems(np.asarray(ids), max_segments, max_seqlen) == expected
