"""backends/fa3/dew.py: FlashAttention-3 as dew-flash-attn builds it, whose kernels take no seqused. On the CPU its
two kernel calls are the dense stand-ins of testing/fa3_emulator.py taking offsets alone (`patched_dew`), so what
is tested there is the wrapper; on a Hopper GPU with the wheel the same cases run on its kernels. The cases: the offsets
with gaps that hand each sequence's unused rows (past seqused, cut by max_seqlen) over as sequences of their own,
against the float64 reference with NaN in every row the op does not own. The semantic suite runs on it in
test_semantics.py (DewEmulatedTest here, DewTest on a Hopper GPU with the wheel installed); the declines are in
test_declines.py.
"""

from __future__ import annotations

import zlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiers import some_fast  # tests/ is on sys.path under pytest

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.backends.fa3 import dew
from jax_ragged_attn.ops import common
from jax_ragged_attn.testing import assert_close, fa3_emulator, reference_attention

_DEW_REASON = dew.unavailable_reason()


@pytest.fixture
def emulated():
    with fa3_emulator.patched_dew():
        yield


KERNELS = [
    "emulated",
    pytest.param(
        "gpu",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(_DEW_REASON is not None, reason=f"dew-flash-attn unavailable: {_DEW_REASON}"),
        ],
    ),
]


@pytest.fixture(params=KERNELS)
def kernels(request):
    """The jnp stand-ins (everywhere), then the wheel's kernels (a Hopper GPU with it installed)."""
    if request.param == "emulated":
        with fa3_emulator.patched_dew():
            yield
    else:
        yield


def test_with_gaps_puts_each_unused_remainder_in_a_sequence_of_its_own():
    """Three sequences a slot: the used rows, the query gap (no keys), the key gap (no queries)."""
    cu, used = jnp.asarray([0, 5, 9, 9], jnp.int32), jnp.asarray([3, 4, 0], jnp.int32)
    assert np.asarray(dew.with_gaps(cu, used, "q")).tolist() == [0, 3, 5, 5, 9, 9, 9, 9, 9, 9]
    assert np.asarray(dew.with_gaps(cu, used, "kv")).tolist() == [0, 3, 3, 5, 9, 9, 9, 9, 9, 9]
    for side in ("q", "kv"):  # one gap sequence a slot, both sides' rest
        assert np.asarray(dew.with_gaps(cu, used, side, paired=True)).tolist() == [0, 3, 5, 9, 9, 9, 9]


@pytest.mark.parametrize(
    "seqused, max_seqlen, traced, sequences",
    [
        (False, 5, False, 2 * 3),
        (True, 7, False, 3 * 3),
        (False, 7, False, 3),
        (False, 7, True, 2 * 3),
        (False, 20, True, 3),
    ],
)
def test_one_gap_sequence_a_slot_without_seqused(emulated, monkeypatch, seqused, max_seqlen, traced, sequences):
    """Without seqused only max_seqlen cuts leave rows unused: [2B + 1] offsets (fewer sequences for the
    kernels to schedule); with it [3B + 1], so a long unused rest of a slot is never gap queries x gap keys;
    where no slot can exceed max_seqlen (known cu_seqlens whose slots fit, or max_seqlen at least the buffer's
    rows) the slots alone ([B + 1], dew.no_cut_rows), but not for traced cu_seqlens with a smaller max_seqlen."""
    seen = []
    for name in ("_kernel_forward", "_kernel_backward"):
        real = getattr(dew, name)
        monkeypatch.setattr(dew, name, lambda *args, real=real: seen.append(args[-3].shape[0] - 1) or real(*args))
    x = jnp.ones((20, 2, 128), jnp.bfloat16)
    cu = jnp.asarray([0, 6, 13, 17], jnp.int32)
    used = dict(seqused_q=jnp.asarray([6, 7, 4]), seqused_kv=jnp.asarray([6, 7, 4])) if seqused else {}

    def loss(x, cu):
        return (
            ragged_attention(
                x,
                x,
                x,
                cu,
                cu,
                max_seqlen_q=max_seqlen,
                max_seqlen_kv=max_seqlen,
                implementation="fa3",
                fa3_provider="dew-flash-attn",
                is_causal=True,
                **used,
            )
            .astype(jnp.float32)
            .sum()
        )

    if traced:
        jax.jit(jax.grad(loss))(x, cu)
    else:
        jax.grad(lambda x: loss(x, cu))(x)
    assert seen == [sequences, sequences]


def _poisoned(rng, total, rows, heads, dim):
    x = np.full((total, heads, dim), np.nan)
    x[rows] = rng.standard_normal((len(rows), heads, dim))
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)  # the values the op sees


# (slots q, rows used of each, slots kv, rows used of each, max_seqlen q, kv): seqused gaps, slots longer than
# max_seqlen (their tails cut), and slots over twice max_seqlen (a gap sequence longer than the max_seqlen the
# kernels are told), each with 3 rows of capacity padding after the last slot.
CASES = {
    "seqused": ((9, 6, 12, 5), (4, 0, 12, 3), (9, 6, 12, 5), (7, 2, 12, 1), 12, 12),
    "truncated": ((12, 3, 8), (8, 3, 8), (14, 2, 9), (9, 2, 9), 8, 9),
    "long_slots": ((20, 3, 17), (8, 3, 8), (27, 2, 19), (9, 2, 9), 8, 9),
    # One array for both cu_seqlens (self-attention), slots cut by max_seqlen, one over twice it: gap sequences
    # (the stand-ins leave rows past max_seqlen unwritten in the forward and read them so in the backward, as
    # FA3's grids do; a version that handed these slots over whole failed here).
    "same_slots": ((12, 3, 20, 6), (8, 3, 8, 6), (12, 3, 20, 6), (8, 3, 8, 6), 8, 8),
    # The same with a slot whose cut rows run past several of FA3's 64- and 128-row tiles (on the GPU, the rows
    # its backward preprocessing never writes lie in whole tiles of their own).
    "same_long_slot": ((300, 3, 9), (8, 3, 8), (300, 3, 9), (8, 3, 8), 8, 8),
    # Every slot within max_seqlen: the slots themselves go over (dew.PLAIN), q and kv of different lengths.
    "slots_fit": ((9, 6, 12, 5), (9, 6, 12, 5), (7, 2, 12, 1), (7, 2, 12, 1), 12, 12),
}


@some_fast(
    {
        "kernels": KERNELS,
        "stats_layout": ["head_major", "token_major"],
        "mask": ["none", "causal_bottom_right", "window_bottom_right"],
        "case_name": sorted(CASES),
    },
    fast=[
        "emulated-head_major-none-long_slots",
        "emulated-token_major-causal_bottom_right-same_long_slot",
        "emulated-head_major-window_bottom_right-same_slots",
        "emulated-token_major-none-seqused",
        "emulated-head_major-causal_bottom_right-slots_fit",
        "emulated-token_major-window_bottom_right-truncated",
    ],
    indirect=["kernels"],
)
def test_unused_rows_go_over_as_gap_sequences(kernels, case_name, mask, stats_layout):
    _check_against_reference(case_name, mask, stats_layout, head_dim=128)


@some_fast(
    {"kernels": KERNELS, "stats_layout": ["head_major", "token_major"], "head_dim": [64, 192, 256]},
    fast=["emulated-head_major-64", "emulated-token_major-192", "emulated-head_major-256"],
    indirect=["kernels"],
)
def test_every_head_dim_it_advertises(kernels, head_dim, stats_layout):
    """dew.HEAD_DIMS besides 128 (the semantic suite's): each one its own kernel in the wheel."""
    _check_against_reference("seqused", "causal_bottom_right", stats_layout, head_dim=head_dim)


@pytest.mark.parametrize("case_name", sorted(CASES))
def test_a_forward_alone_reads_no_unused_row(kernels, case_name):
    """Inference: without a backward only V is cleared (fa3/ragged.py _cleared), so the gap sequences' NaN
    queries and keys reach the kernels; what they compute must stay out of every result."""
    _check_against_reference(case_name, "causal_bottom_right", "head_major", head_dim=128, forward_only=True)


def _check_against_reference(case_name, mask, stats_layout, head_dim, forward_only=False):
    slots_q, used_q, slots_kv, used_kv, max_q, max_kv = CASES[case_name]
    rng = np.random.default_rng(zlib.crc32(f"{case_name}/{mask}/{stats_layout}/{head_dim}".encode()))
    cu_q, cu_kv = (np.concatenate([[0], np.cumsum(s)]).astype(np.int32) for s in (slots_q, slots_kv))
    rows = lambda cu, used: np.concatenate([np.arange(cu[b], cu[b] + n) for b, n in enumerate(used)])
    rows_q, rows_kv = rows(cu_q, used_q), rows(cu_kv, used_kv)
    tq, tkv = int(cu_q[-1]) + 3, int(cu_kv[-1]) + 3
    q, d_out = (_poisoned(rng, tq, rows_q, 4, head_dim) for _ in range(2))
    k, v = (_poisoned(rng, tkv, rows_kv, 2, head_dim) for _ in range(2))
    d_stats = np.full((tq, 4), np.nan)
    d_stats[rows_q] = rng.standard_normal((len(rows_q), 4))
    options = {
        "none": {},
        "causal_bottom_right": dict(is_causal=True, diagonal_alignment="bottom_right"),
        "window_bottom_right": dict(local_window_size=(3, 1), diagonal_alignment="bottom_right"),
    }[mask]
    tight_cu = lambda used: np.concatenate([[0], np.cumsum(used)]).astype(np.int64)
    tight = reference_attention(
        q[rows_q],
        k[rows_kv],
        v[rows_kv],
        tight_cu(used_q),
        tight_cu(used_kv),
        max_seqlen_q=max(used_q),
        max_seqlen_kv=max(used_kv),
        d_out=d_out[rows_q],
        d_stats=d_stats[rows_q],
        **options,
    )
    expected = dict(
        out=np.zeros(q.shape),
        stats=np.full((tq, 4), -np.inf),
        dq=np.zeros(q.shape),
        dk=np.zeros(k.shape),
        dv=np.zeros(v.shape),
    )
    for name, at in (("out", rows_q), ("stats", rows_q), ("dq", rows_q), ("dk", rows_kv), ("dv", rows_kv)):
        expected[name][at] = tight[name]

    seqused = (
        {}
        if case_name != "seqused"
        else dict(seqused_q=jnp.asarray(used_q, jnp.int32), seqused_kv=jnp.asarray(used_kv, jnp.int32))
    )

    same = slots_q == slots_kv  # then one array for both, as self-attention passes it
    cu_q_array = jnp.asarray(cu_q)
    cu_kv_array = cu_q_array if same else jnp.asarray(cu_kv)

    def attention(q, k, v):
        return ragged_attention(
            q,
            k,
            v,
            cu_q_array,
            cu_kv_array,
            max_seqlen_q=max_q,
            max_seqlen_kv=max_kv,
            return_stats=True,
            stats_layout=stats_layout,
            implementation="fa3",
            fa3_provider="dew-flash-attn",
            **seqused,
            **options,
        )

    cast = lambda x: jnp.asarray(x, jnp.bfloat16)
    # A slot longer than max_seqlen makes its sequence invalid, whose rows the op reads NaN after the backend
    # (ops/common.loud, test_loud_rows.py). What is tested here is what the wrapper computes for the rows it is
    # given, cut slots included, so that select is left out.
    with mock.patch.object(common, "loud", lambda out, stats, rows, layout: (out, stats)):
        got = _run(attention, cast, q, k, v, d_out, d_stats, stats_layout, forward_only)
    for name, value in got.items():
        assert_close(value, expected[name], jnp.bfloat16, name)


def _run(attention, cast, q, k, v, d_out, d_stats, stats_layout, forward_only):
    """The op's out and token-major stats, and its gradients unless forward_only."""
    if forward_only:  # no vjp: the forward clears V alone, so NaN gap queries meet NaN gap keys in the kernels
        out, stats = jax.jit(attention)(cast(q), cast(k), cast(v))
        got = dict(out=out, stats=stats.T if stats_layout == "head_major" else stats)
    else:
        (out, stats), vjp = jax.vjp(jax.jit(attention), cast(q), cast(k), cast(v))
        g_stats = jnp.asarray(d_stats.T if stats_layout == "head_major" else d_stats, jnp.float32)
        dq, dk, dv = vjp((cast(d_out), g_stats))
        got = dict(out=out, stats=stats.T if stats_layout == "head_major" else stats, dq=dq, dk=dk, dv=dv)
    return got


def test_implementation_none_takes_it_where_the_policy_prefers_fa3(emulated, monkeypatch):
    """Ahead of the flash-attn3-jax wheel where both serve and the call is of FA3's class; cuDNN's class (short
    sequences) leaves it out unless autotune=True, which times it against cuDNN (test_implementation_tuning.py)."""
    from jax_ragged_attn import backends
    from jax_ragged_attn.backends import policy
    from jax_ragged_attn.backends.fa3 import ragged as fa3
    from jax_ragged_attn.config import AttentionOptions, make_config
    from jax_ragged_attn.index import RaggedIndex

    monkeypatch.setattr(policy, "_compute_capability", lambda: "9.0")
    monkeypatch.setattr(fa3, "unsupported_reason", lambda config, *index, **kwargs: None)
    monkeypatch.delenv(policy.ENV_VAR, raising=False)

    def config(tokens, num_seqs, **options):
        x = jax.ShapeDtypeStruct((tokens, 4, 128), jnp.bfloat16)
        cu = jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32)
        return make_config(
            x,
            x,
            x,
            cu,
            cu,
            AttentionOptions(is_causal=True, diagonal_alignment="bottom_right", **options),
            max_seqlen_q=tokens,
            max_seqlen_kv=tokens,
        )

    def chosen(tokens, num_seqs, **options):
        cu = jnp.zeros(num_seqs + 1, jnp.int32)
        call, index = config(tokens, num_seqs, **options), RaggedIndex(cu, cu)
        backend = backends.choose(None, call, index)
        return backend.provider(call, index) if backend.NAME == "fa3" else backend.NAME

    assert dew.unavailable_reason() is None  # the stand-ins declared available
    assert chosen(4096, 2) == "dew-flash-attn"  # 2,048 tokens a sequence: FA3's class
    assert chosen(4096, 2, softcap=2.0) == "flash-attn3-jax"  # one it declines: the other wheel's FA3
    # 551 tokens a sequence: cuDNN's class (the xla path on a CPU)
    assert chosen(65536, 119) not in ("dew-flash-attn", "flash-attn3-jax")
    assert backends.get("fa3").auto_candidate(config(65536, 119, autotune=True))


def test_the_kvcache_op_names_its_backends_when_asked_for_dew():
    from jax_ragged_attn import backends

    with pytest.raises(NotImplementedError, match="implementation='dew' does not serve kvcache calls"):
        backends.get("dew", "kvcache")
