"""implementation=None's shipped policy (backends/policy.py): FA3 or cuDNN by GPU and shape class, the
environment pin, and the debug line that says what was chosen. The kernels' availability is replaced (both
serve every call here); the choice itself is real."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest

from jax_ragged_attn import backends
from jax_ragged_attn.backends import policy
from jax_ragged_attn.backends.cudnn import ragged as cudnn
from jax_ragged_attn.backends.fa3 import dew
from jax_ragged_attn.backends.fa3 import ragged as _fa3
from jax_ragged_attn.config import AttentionOptions, make_config
from jax_ragged_attn.index import RaggedIndex


def _config(tokens: int, num_seqs: int, **options):
    q = jax.ShapeDtypeStruct((tokens, 4, 128), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32)
    return make_config(
        q, q, q, cu, cu, AttentionOptions(is_causal=True, **options), max_seqlen_q=tokens, max_seqlen_kv=tokens
    )


def _index(num_seqs: int):
    cu = jnp.zeros(num_seqs + 1, jnp.int32)
    return RaggedIndex(cu, cu, same=True)


@pytest.fixture
def hopper_with_both(monkeypatch):
    monkeypatch.setattr(policy, "_compute_capability", lambda: "9.0")
    monkeypatch.setattr(_fa3, "unsupported_reason", lambda config, *index, **kwargs: None)
    monkeypatch.setattr(cudnn, "unsupported_reason", lambda config, *index, **kwargs: None)
    # dew-flash-attn's FA3 goes before this wheel's where installed (tests/test_dew.py): not here.
    monkeypatch.setattr(dew, "unsupported_reason", lambda config, *index, **kwargs: "not installed (this test)")
    monkeypatch.delenv(policy.ENV_VAR, raising=False)


@pytest.mark.parametrize(
    "tokens, num_seqs, chosen",
    [
        (32768, 16, "fa3"),  # W1: 2,048 tokens a sequence
        (65536, 119, "cudnn"),  # W5: 551
        (1024 * 8, 8, "fa3"),  # exactly the threshold
        (1023 * 8, 8, "cudnn"),  # just below it
    ],
)
def test_the_policy_splits_by_tokens_per_sequence(hopper_with_both, tokens, num_seqs, chosen):
    assert backends.choose(None, _config(tokens, num_seqs), _index(num_seqs)).NAME == chosen


@pytest.mark.parametrize("hint, chosen", [(4096, "fa3"), (551, "cudnn")])
def test_a_context_parallel_call_is_classed_by_its_whole_batch(hopper_with_both, hint, chosen):
    """A device's call of CP-c at n = 8 holds 8,192 query rows in 32 slots (256 a slot, the short class);
    the sharded op passes its whole batch's T / B, which decides instead."""
    config = _config(8192, 32, policy_tokens_per_sequence=hint)
    assert backends.choose(None, config, _index(32)).NAME == chosen


@pytest.mark.parametrize("bad", [0, -3, 2.5, "4096", True])
def test_a_bad_shape_class_names_itself(bad):
    with pytest.raises(ValueError, match="policy_tokens_per_sequence must be a positive int"):
        AttentionOptions(policy_tokens_per_sequence=bad)


@pytest.mark.slow  # a second sharded-batch shape class
def test_the_sharded_op_passes_its_whole_batchs_shape_class(monkeypatch):
    """sharded_ragged_attention(token_axis=...) gives every device's call T / B of the caller's batch."""
    from jax_ragged_attn.parallel import sharding

    seen = []
    real = sharding.attend
    monkeypatch.setattr(
        sharding, "attend", lambda *a, **kw: seen.append(a[3].policy_tokens_per_sequence) or real(*a, **kw)
    )
    q = jnp.zeros((64, 2, 8), jnp.float32)
    cu = jnp.array([0, 30, 50, 64], jnp.int32)
    mesh = jax.make_mesh((1,), ("cp",))
    sharding.sharded_ragged_attention(
        q,
        q,
        q,
        cu,
        cu,
        mesh=mesh,
        token_axis="cp",
        load_balance=True,
        max_seqlen_q=30,
        max_seqlen_kv=30,
        is_causal=True,
        implementation="xla",
    )
    assert seen and set(seen) == {64 // 3}


def test_no_policy_for_other_gpus_keeps_cudnn(hopper_with_both, monkeypatch):
    monkeypatch.setattr(policy, "_compute_capability", lambda: "8.0")
    assert backends.choose(None, _config(32768, 16), _index(16)).NAME == "cudnn"


def test_the_environment_pins_a_backend_where_it_serves(hopper_with_both, monkeypatch):
    monkeypatch.setenv(policy.ENV_VAR, "cudnn")
    assert backends.choose(None, _config(32768, 16), _index(16)).NAME == "cudnn"
    monkeypatch.setenv(policy.ENV_VAR, "fa3")
    assert backends.choose(None, _config(65536, 119), _index(119)).NAME == "fa3"
    # Where the pinned backend cannot serve, the usual choice.
    monkeypatch.setattr(_fa3, "unsupported_reason", lambda config, *index, **kwargs: "head dim 64")
    assert backends.choose(None, _config(65536, 119), _index(119)).NAME == "cudnn"
    # An explicit implementation= is never overridden.
    monkeypatch.setattr(_fa3, "unsupported_reason", lambda config, *index, **kwargs: None)
    assert backends.choose("cudnn", _config(32768, 16), _index(16)).NAME == "cudnn"


def test_a_bad_pin_names_the_variable(hopper_with_both, monkeypatch):
    monkeypatch.setenv(policy.ENV_VAR, "fast")
    with pytest.raises(ValueError, match=policy.ENV_VAR):
        backends.choose(None, _config(32768, 16), _index(16))


def test_the_choice_is_logged_at_debug_level(hopper_with_both, caplog):
    with caplog.at_level(logging.DEBUG, logger="jax_ragged_attn"):
        backends.choose(None, _config(32768, 16), _index(16))
    assert any("implementation=None runs fa3" in r.getMessage() and "B=16" in r.getMessage() for r in caplog.records)


def test_on_the_cpu_the_portable_path_is_chosen_and_said(monkeypatch, caplog):
    monkeypatch.delenv(policy.ENV_VAR, raising=False)
    if jax.default_backend() != "cpu":
        pytest.skip("checks the CPU's choice")
    with caplog.at_level(logging.DEBUG, logger="jax_ragged_attn"):
        assert backends.choose(None, _config(256, 2), _index(2)).NAME == "xla"
    assert any("implementation=None runs xla" in r.getMessage() for r in caplog.records)
