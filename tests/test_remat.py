"""The op under `jax.checkpoint` policies: its forward's saved output and log-sum-exp carry the names
`ragged_attention_out` and `ragged_attention_lse` (backends/shared/remat_names.py), so a policy can save or
offload them; gradients are the same under every policy, and saving the names keeps the backward from running
the attention forward again (counted in the differentiated program: the xla path's loops, cuDNN's launches)."""

from __future__ import annotations

import re

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest
from implementations import xla_and_cudnn

import jax_ragged_attn as jra
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.backends.shared.remat_names import LSE, OUT
from jax_ragged_attn.index import cu_seqlens_from_lengths

POLICIES = {
    "none": None,  # no jax.checkpoint at all: the reference
    "save_nothing": jax.checkpoint_policies.nothing_saveable,
    "save_out_and_lse": jax.checkpoint_policies.save_only_these_names(OUT, LSE),
    "offload_out_and_lse": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=[OUT, LSE],
        offload_src="device",
        offload_dst="pinned_host",
    ),
}


def _loss(implementation):
    cu = jnp.asarray(cu_seqlens_from_lengths(np.array([7, 12, 5])))

    def block(q, k, v):
        out = jra.ragged_attention(
            q, k, v, cu, cu, max_seqlen_q=16, max_seqlen_kv=16, is_causal=True, implementation=implementation
        )
        return jnp.sum(jnp.sin(out.astype(jnp.float32)))  # a nonlinear loss: the backward needs out itself

    return block


def _inputs(implementation):
    rng = np.random.default_rng(3)
    dtype = jnp.float32 if implementation == "xla" else jnp.bfloat16
    return [jnp.asarray(rng.standard_normal((32, 4, 64)), dtype) for _ in range(3)]


def _grad(implementation, policy):
    f = _loss(implementation)
    if policy is not None:
        f = jax.checkpoint(f, policy=policy)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))


def _forward_passes(implementation, policy, args) -> int:
    """How many times the differentiated program runs the attention forward."""
    if implementation == "xla":  # a forward is two loops (its walk and its fold); the backward has its own
        jaxpr = str(jax.make_jaxpr(jax.grad(jax.checkpoint(_loss("xla"), policy=policy), argnums=(0, 1, 2)))(*args))
        return jaxpr.count("while[")
    text = _grad(implementation, policy).lower(*args).as_text()
    return len(re.findall(rf'custom_call_target\s*=\s*"{extension.FORWARD_TARGET}"', text)) + text.count(
        f"@{extension.FORWARD_TARGET}"
    )


@pytest.mark.parametrize("implementation", xla_and_cudnn())
@pytest.mark.parametrize("policy", ["save_nothing", "save_out_and_lse", "offload_out_and_lse"])
def test_gradients_are_the_same_under_every_policy(implementation, policy):
    args = _inputs(implementation)
    want = _grad(implementation, None)(*args)
    got = _grad(implementation, POLICIES[policy])(*args)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize("implementation", xla_and_cudnn())
@pytest.mark.parametrize("policy", ["save_out_and_lse", "offload_out_and_lse"])
def test_saving_the_named_values_skips_the_recomputed_forward(implementation, policy):
    args = _inputs(implementation)
    recomputed = _forward_passes(implementation, POLICIES["save_nothing"], args)
    saved = _forward_passes(implementation, POLICIES[policy], args)
    everything = _forward_passes(implementation, jax.checkpoint_policies.everything_saveable, args)
    assert saved == everything < recomputed, (saved, everything, recomputed)


def test_the_named_values_are_what_the_policy_saves(capsys):
    args = _inputs("xla")
    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(_loss("xla"), policy=POLICIES["save_out_and_lse"]), *args)
    saved = capsys.readouterr().out
    assert f"named '{OUT}'" in saved and f"named '{LSE}'" in saved, saved
