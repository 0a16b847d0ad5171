"""The cuDNN path's stats gradient (backends/shared/stats_grad.py) on a CPU, against the float64 reference.

The trick lives in what cuDNN's backward does with the buffers it is handed: it recomputes P from q, k and
the stats, and shifts dP by D = rowsum(dO * O) taken from the O and dO it receives. The stand-in kernel of
test_cudnn_wrapper.py differentiates the xla path and ignores O, so it could not tell a working trick from a
broken one. The stand-in here does cuDNN's arithmetic on the passed buffers, with the masks cuDNN derives
from the lengths and ragged offsets, and like cuDNN writes only the rows of sequences (every other row keeps
NaN). The real kernels are held to the same reference in tests/test_cudnn.py on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiers import some_fast  # tests/ is on sys.path under pytest

from jax_ragged_attn.backends.cudnn import launch
from jax_ragged_attn.backends.cudnn import options as cudnn_options
from jax_ragged_attn.backends.cudnn import ragged as cudnn
from jax_ragged_attn.backends.shared import extension, stats_grad
from jax_ragged_attn.config import PACKINGS, AttentionOptions, make_config
from jax_ragged_attn.inputs import packed
from jax_ragged_attn.testing import assert_close, packed_batch, stand_in_handler_args
from jax_ragged_attn.testing.reference import reference_attention

# GQA, causal bottom-right, an empty query sequence (1), a sequence with queries but no keys (3) and one with
# more queries than keys (2: its first rows attend nothing), capacity padding on both sides.
SEQLENS_Q = (9, 0, 14, 3, 6)
SEQLENS_KV = (11, 4, 6, 0, 6)
OPTIONS = dict(is_causal=True, diagonal_alignment="bottom_right", local_window_size=None)
LAYOUTS = ("head_major", "token_major")
# A causal bottom-right backward runs as two handler calls, rectangle + square (launch._backward).
CALLS = 2
DTYPES = ("bfloat16", "float16")


def _rows(offsets, per_row: int, lengths, capacity: int):
    """Per row: (sequence, position in it, owned), from the ragged offsets (in elements) and the lengths, the
    way the handler reads them."""
    starts = offsets[:-1] // per_row
    rows = jnp.arange(capacity)
    member = (rows[None, :] >= starts[:, None]) & (rows[None, :] < (starts + lengths)[:, None])  # [B, T]
    sequence = jnp.argmax(member, axis=0)
    return sequence, rows - starts[sequence], member.any(axis=0)


# Where the handlers find q, k and v in their three buffer arguments, per `packing` attribute (0 none, 1 kv,
# 2 qkv; ffi/layouts.h): the part of a packed [T, parts, H, D] row, or None for an unpacked [T, H, D] buffer.
# Written out here rather than read from index/packings.py, so that a wrong table entry shows up.
PARTS_OF = {0: (None, None, None), 1: (None, 0, 1), 2: (0, 1, 2)}
# The backward's results per packing: (dq, dk, dv), (dq, dkv) or (dqkv,), each in its input's shape.
PACK_GRADIENTS = {0: lambda g: g, 1: lambda g: (g[0], jnp.stack(g[1:], axis=1)), 2: lambda g: (jnp.stack(g, axis=1),)}


class CudnnArithmetic:
    """Replaces jax.ffi.ffi_call for both handlers; records the value head dim and the packing each backward
    received, and each call's (target, guarded)."""

    def __init__(self, config):
        self.config = config  # the options (scale, masks, stats layout); shapes come from the buffers
        self.backward_head_dims_v = []
        self.backward_packings = []
        self.targets = []

    def __call__(self, target, result_types, *, vmap_method=None, input_output_aliases=None):
        assert target in (extension.FORWARD_TARGET, extension.BACKWARD_TARGET), target
        guarded = bool(input_output_aliases)  # check mode: the canary buffers come in aliased to the results
        self.targets.append((target, guarded))
        forward = target == extension.FORWARD_TARGET

        def call(*args, **attributes):
            args, workspace, initial = stand_in_handler_args(args, result_types, input_output_aliases, attributes)
            self.attributes = attributes  # the mask comes from the call (a split backward changes it)
            packing = int(attributes["packing"])
            args = self._unpacked(args, packing, forward)
            if forward:
                results, owned = self._forward(*args)
            else:
                self.backward_packings.append(packing)
                results, owned = self._backward(*args)
                results, owned = PACK_GRADIENTS[packing](results), PACK_GRADIENTS[packing](owned)
            results = [jnp.where(mask, r.astype(init.dtype), init) for r, mask, init in zip(results, owned, initial)]
            return (*results, workspace)

        return call

    @staticmethod
    def _unpacked(args, packing: int, forward: bool):
        """The handler's view of a packed call: q, k and v read out of their buffers, and their ragged offsets
        (which step over whole packed rows) in units of one part's row."""
        args = list(args)
        first_offset = 5 if forward else 8  # after the inputs (q, k, v [, o, dO, stats]) and the two lengths
        for i, part in enumerate(PARTS_OF[packing]):
            if part is not None:
                args[first_offset + i] = args[first_offset + i] // args[i].shape[1]
                args[i] = args[i][:, part]
        return args

    def _mask(self, q, k, seq_len_q, seq_len_kv, off_q, off_k):
        """[Tq, Tkv]: which key each query row attends to; and which rows of each side are owned."""
        a = self.attributes
        left, right = int(a["left_bound"]), int(a["right_bound"])  # -1: no bound
        seq_q, pos_q, own_q = _rows(off_q, q.shape[1] * q.shape[2], seq_len_q, q.shape[0])
        seq_k, pos_k, own_k = _rows(off_k, k.shape[1] * k.shape[2], seq_len_kv, k.shape[0])
        diagonal = pos_q if not int(a["bottom_right"]) else pos_q + seq_len_kv[seq_q] - seq_len_q[seq_q]
        mask = own_q[:, None] & own_k[None, :] & (seq_q[:, None] == seq_k[None, :])
        if right >= 0:
            mask &= pos_k[None, :] <= diagonal[:, None] + right
        if left >= 0:
            mask &= pos_k[None, :] >= diagonal[:, None] - left
        return mask, own_q, own_k

    @staticmethod
    def _owned_only(own, *arrays):
        # cuDNN never reads a row it does not own: NaN there must not reach a matmul, even times a zero.
        return [jnp.where(own[:, None, None], x.astype(jnp.float32), 0.0) for x in arrays]

    def _heads(self, x, num_heads_q):
        return jnp.repeat(x, num_heads_q // x.shape[1], axis=1)  # query head h reads kv head h // group

    def _logits(self, q, k, mask):
        scores = self.config.scale * jnp.einsum("ihd,jhd->hij", q, self._heads(k, q.shape[1]))
        return jnp.where(mask[None], scores, -jnp.inf)  # [Hq, Tq, Tkv]

    def _per_kv_head(self, x, num_heads_kv):
        """[Tkv, Hq, D] per query head -> [Tkv, Hkv, D]: a group's query heads add up on their kv head."""
        return x.reshape(x.shape[0], num_heads_kv, -1, x.shape[2]).sum(axis=2)

    def _stats_owned(self, own):
        return own[None, :] if self.config.stats_layout == "head_major" else own[:, None]

    def _forward(self, q, k, v, seq_len_q, seq_len_kv, off_q, off_k, *_):
        mask, own_q, own_k = self._mask(q, k, seq_len_q, seq_len_kv, off_q, off_k)
        (q32,), (k32, v32) = self._owned_only(own_q, q), self._owned_only(own_k, k, v)
        scores = self._logits(q32, k32, mask)
        stats = jax.nn.logsumexp(scores, axis=-1)  # [Hq, Tq]; -inf where no key is attended
        p = jnp.where(mask[None], jnp.exp(scores - stats[..., None]), 0.0)
        out = jnp.einsum("hij,jhd->ihd", p, self._heads(v32, q.shape[1]))
        stats = stats if self.config.stats_layout == "head_major" else stats.T
        return (out, stats), (own_q[:, None, None], self._stats_owned(own_q))

    def _backward(self, q, k, v, o, d_o, stats, seq_len_q, seq_len_kv, off_q, off_k, *_):
        self.backward_head_dims_v.append(v.shape[2])
        mask, own_q, own_k = self._mask(q, k, seq_len_q, seq_len_kv, off_q, off_k)
        q32, o32, d_o32 = self._owned_only(own_q, q, o, d_o)
        k32, v32 = self._owned_only(own_k, k, v)
        hq, hkv, scale = q.shape[1], k.shape[1], self.config.scale
        stats = stats if self.config.stats_layout == "head_major" else stats.T  # [Hq, Tq]
        # P from the stats the forward wrote, dP from the passed dO and V, D from the passed dO and O.
        p = jnp.where(mask[None], jnp.exp(self._logits(q32, k32, mask) - stats[..., None]), 0.0)
        d_p = jnp.einsum("ihd,jhd->hij", d_o32, self._heads(v32, hq))
        delta = jnp.einsum("ihd,ihd->hi", d_o32, o32)
        d_s = p * (d_p - delta[..., None])
        d_q = scale * jnp.einsum("hij,jhd->ihd", d_s, self._heads(k32, hq))
        d_k = self._per_kv_head(scale * jnp.einsum("hij,ihd->jhd", d_s, q32), hkv)
        d_v = self._per_kv_head(jnp.einsum("hij,ihd->jhd", p, d_o32), hkv)
        owned_kv = own_k[:, None, None]
        return (d_q, d_k, d_v), (own_q[:, None, None], owned_kv, owned_kv)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """Seeded by the test's own id: fresh inputs per case, the same ones on every rerun."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def _batch(rng, dtype, head_dim_v=8):
    return packed_batch(
        rng,
        SEQLENS_Q,
        SEQLENS_KV,
        num_heads_q=4,
        num_heads_kv=2,
        head_dim_qk=16,
        head_dim_v=head_dim_v,
        dtype=dtype,
        slack_q=5,
        slack_kv=3,
    )


def _install(monkeypatch, batch, layout, **changes):
    config = make_config(
        *batch.args,
        AttentionOptions(stats_layout=layout, **OPTIONS),
        max_seqlen_q=batch.max_seqlen_q,
        max_seqlen_kv=batch.max_seqlen_kv,
    )
    config = dataclasses.replace(config, **changes)
    kernel = CudnnArithmetic(config)
    monkeypatch.setattr(jax.ffi, "ffi_call", kernel)
    monkeypatch.setattr(launch, "graph_info", lambda direction, config, layout=None: {"workspace_bytes": 64})
    return config, kernel


def _reference(batch, **cotangents):
    return reference_attention(
        *batch.reference_args,
        max_seqlen_q=batch.max_seqlen_q,
        max_seqlen_kv=batch.max_seqlen_kv,
        **OPTIONS,
        **cotangents,
    )


def _cotangents(rng, batch, dtype):
    """d_out (NaN on padding rows: never to be read) and d_stats, token-major, as the op receives them."""
    tq, hq = batch.q.shape[:2]
    d_out = rng.standard_normal((tq, hq, batch.v.shape[2])).astype(dtype)
    d_out[batch.padding_q] = np.nan
    d_stats = rng.standard_normal((tq, hq)).astype(np.float32)
    return d_out, d_stats


def _in_layout(stats_token_major, layout):
    return stats_token_major if layout == "token_major" else stats_token_major.T


def _check_gradients(grads, expected, batch, dtype, what="", rows_without_keys=True):
    for name, grad, like in zip(("dq", "dk", "dv"), grads, (batch.q, batch.k, batch.v)):
        assert grad.dtype == like.dtype, f"{what}{name} dtype {grad.dtype}, expected {like.dtype}"
        assert_close(np.asarray(grad, np.float64), expected[name], dtype, f"{what}{name}")
    dq, dk, dv = (np.asarray(g, np.float64) for g in grads)
    without_keys = np.isneginf(expected["stats"]).all(axis=1)  # padding rows and rows that attend nothing
    if rows_without_keys:
        assert without_keys.sum() > batch.padding_q.sum()  # the batch does have rows without keys
    np.testing.assert_array_equal(dq[without_keys], 0.0, err_msg=f"{what}dq of rows without keys")
    np.testing.assert_array_equal(dk[batch.padding_kv], 0.0, err_msg=f"{what}dk of padding rows")
    np.testing.assert_array_equal(dv[batch.padding_kv], 0.0, err_msg=f"{what}dv of padding rows")
    # The reference is not all zeros, so agreeing with it means the stand-in really ran.
    assert np.abs(expected["dq"]).max() > 0 and np.abs(expected["dk"]).max() > 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_grad_of_a_loss_of_out_and_stats_matches_the_reference(monkeypatch, rng, layout, dtype):
    batch = _batch(rng, dtype)
    config, kernel = _install(monkeypatch, batch, layout)
    d_out, d_stats = _cotangents(rng, batch, dtype)
    weights = jnp.asarray(_in_layout(d_stats, layout))

    def loss(q, k, v):
        out, stats = cudnn.attention_cudnn(q, k, v, *batch.args[3:], config)
        # -inf stats rows get a zero weight through `where`, so the loss stays finite there.
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(d_out, jnp.float32)) + jnp.sum(
            jnp.where(jnp.isfinite(stats), stats * weights, 0.0)
        )

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*batch.args[:3])
    expected = _reference(batch, d_out=d_out.astype(np.float64), d_stats=d_stats.astype(np.float64))
    _check_gradients(grads, expected, batch, dtype)
    assert kernel.backward_head_dims_v == [batch.v.shape[2] + stats_grad.EXTRA_COLUMNS] * CALLS


@pytest.mark.parametrize("guard", [False, True], ids=["plain", "check_mode"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_stats_cotangent_of_rows_without_a_softmax_is_never_read(monkeypatch, rng, layout, guard):
    """A raw vjp: d_stats is NaN on every row whose stats are -inf (padding, rows without keys), where
    stats are a constant; the result must equal the reference's with those cotangents zero."""
    dtype = "bfloat16"
    batch = _batch(rng, dtype)
    config, kernel = _install(monkeypatch, batch, layout, guard_workspace=guard)
    d_out, d_stats = _cotangents(rng, batch, dtype)
    expected_stats = _reference(batch)["stats"]
    poisoned = np.where(np.isneginf(expected_stats), np.nan, d_stats).astype(np.float32)

    @jax.jit
    def grads(q, k, v, d_out, d_stats):
        _, vjp = jax.vjp(lambda q, k, v: cudnn.attention_cudnn(q, k, v, *batch.args[3:], config), q, k, v)
        return vjp((d_out, d_stats))

    result = grads(*batch.args[:3], jnp.asarray(d_out), jnp.asarray(_in_layout(poisoned, layout)))
    expected = _reference(
        batch,
        d_out=d_out.astype(np.float64),
        d_stats=np.where(np.isneginf(expected_stats), 0.0, d_stats.astype(np.float64)),
    )
    _check_gradients(result, expected, batch, dtype)
    if guard:
        assert (extension.BACKWARD_TARGET, True) in kernel.targets


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grad_of_a_loss_of_stats_alone(monkeypatch, rng, layout):
    """out unused: its cotangent is a symbolic zero, and dO'' is [0, c]."""
    dtype = "float16"
    batch = _batch(rng, dtype)
    config, _ = _install(monkeypatch, batch, layout)
    _, d_stats = _cotangents(rng, batch, dtype)
    weights = jnp.asarray(_in_layout(d_stats, layout))

    def loss(q, k, v):
        _, stats = cudnn.attention_cudnn(q, k, v, *batch.args[3:], config)
        return jnp.sum(jnp.where(jnp.isfinite(stats), stats * weights, 0.0))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*batch.args[:3])
    zero_d_out = np.zeros(batch.q.shape[:2] + batch.v.shape[2:])
    expected = _reference(batch, d_out=zero_d_out, d_stats=d_stats.astype(np.float64))
    _check_gradients(grads, expected, batch, dtype)
    np.testing.assert_array_equal(np.asarray(grads[2], np.float64), 0.0, err_msg="dv of a loss of stats alone")


def test_an_explicit_zero_stats_cotangent_changes_nothing(monkeypatch, rng):
    """Under jit a zeros array is not a symbolic zero: it takes the widened pass, which must agree with the
    plain one (stats as aux) and with the reference."""
    dtype = "bfloat16"
    batch = _batch(rng, dtype)
    config, kernel = _install(monkeypatch, batch, "head_major")
    d_out, _ = _cotangents(rng, batch, dtype)
    attend = lambda q, k, v: cudnn.attention_cudnn(q, k, v, *batch.args[3:], config)

    @jax.jit
    def widened(q, k, v, d_out):
        (_, stats), vjp = jax.vjp(attend, q, k, v)
        return vjp((d_out, jnp.zeros_like(stats)))

    @jax.jit
    def plain(q, k, v, d_out):
        _, vjp, _ = jax.vjp(attend, q, k, v, has_aux=True)
        return vjp(d_out)

    first = widened(*batch.args[:3], jnp.asarray(d_out))
    second = plain(*batch.args[:3], jnp.asarray(d_out))
    dv = batch.v.shape[2]
    assert kernel.backward_head_dims_v == [dv + stats_grad.EXTRA_COLUMNS] * CALLS + [dv] * CALLS
    expected = _reference(batch, d_out=d_out.astype(np.float64))
    _check_gradients(first, expected, batch, dtype, "explicit zero: ")
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert_close(np.asarray(a, np.float64), np.asarray(b, np.float64), dtype, f"{name}: widened vs plain")


def _packed_batch(rng, packing: str):
    """q, k, v with one head dim (packed k and v share a row), GQA for kv; self-attention (one capacity,
    one set of lengths, Hq == Hkv) for qkv. Padding rows are NaN, in the packed buffers too."""
    if packing == "kv":
        return packed_batch(
            rng,
            SEQLENS_Q,
            SEQLENS_KV,
            num_heads_q=4,
            num_heads_kv=2,
            head_dim_qk=16,
            head_dim_v=16,
            dtype="bfloat16",
            slack_q=5,
            slack_kv=3,
        )
    return packed_batch(
        rng,
        SEQLENS_Q,
        SEQLENS_Q,
        num_heads_q=4,
        num_heads_kv=4,
        head_dim_qk=16,
        head_dim_v=16,
        dtype="bfloat16",
        slack_q=4,
        slack_kv=4,
    )


def _packed_buffers(batch, packing: str) -> tuple:
    if packing == "kv":
        return batch.q, jnp.stack([batch.k, batch.v], axis=1)
    return (jnp.stack([batch.q, batch.k, batch.v], axis=1),)


def _unpacked_gradients(grads, packing: str) -> tuple:
    if packing == "kv":
        d_q, d_kv = grads
        return d_q, d_kv[:, 0], d_kv[:, 1]
    (d_qkv,) = grads
    return d_qkv[:, 0], d_qkv[:, 1], d_qkv[:, 2]


@some_fast(
    {
        "packing": ["kv", "qkv"],
        "stats_in_loss": {"stats_as_aux": False, "stats_in_the_loss": True},
        "mode": ["unowned", "poisoned", "check_mode"],
    },
    fast=[
        "kv-stats_as_aux-check_mode",
        "kv-stats_in_the_loss-poisoned",
        "qkv-stats_as_aux-unowned",
        "qkv-stats_in_the_loss-check_mode",
    ],
)
def test_packed_buffers_get_gradients_in_their_own_layout(monkeypatch, rng, packing, stats_in_loss, mode):
    """The one custom_vjp (launch.attention) with packed buffers: the handlers receive the packed buffers and
    the backward writes one gradient per buffer, (dq, dkv) or (dqkv,), each part's rows masked by its side;
    a stats cotangent takes the unpacked pass on widened value columns, its gradients stacked back."""
    dtype = "bfloat16"
    guard = mode == "check_mode"
    batch = _packed_batch(rng, packing)
    monkeypatch.setattr(cudnn_options, "OPTIONS", cudnn_options.CudnnOptions(poison_outputs=mode == "poisoned"))
    config, kernel = _install(monkeypatch, batch, "head_major", guard_workspace=guard, packing=packing)
    buffers = _packed_buffers(batch, packing)
    d_out, d_stats = _cotangents(rng, batch, dtype)
    weights = jnp.asarray(d_stats.T)

    def terms(*buffers):
        out, stats = launch.attention(buffers, *batch.args[3:], config)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(d_out, jnp.float32)), stats

    def loss(*buffers):
        value, stats = terms(*buffers)
        return value + jnp.sum(jnp.where(jnp.isfinite(stats), stats * weights, 0.0))

    argnums = tuple(range(len(buffers)))
    if stats_in_loss:
        grads = jax.jit(jax.grad(loss, argnums=argnums))(*buffers)
    else:
        grads, _ = jax.jit(jax.grad(terms, argnums=argnums, has_aux=True))(*buffers)
    for grad, buffer in zip(grads, buffers):
        assert grad.shape == buffer.shape and grad.dtype == buffer.dtype, (grad.shape, buffer.shape)
    expected = _reference(
        batch, d_out=d_out.astype(np.float64), **(dict(d_stats=d_stats.astype(np.float64)) if stats_in_loss else {})
    )
    _check_gradients(
        _unpacked_gradients(grads, packing), expected, batch, dtype, f"{packing}: ", rows_without_keys=packing == "kv"
    )
    dv = batch.v.shape[2]
    if stats_in_loss:  # the unpacked (packing 0) backward on widened value columns
        assert (kernel.backward_packings, kernel.backward_head_dims_v) == (
            [0] * CALLS,
            [dv + stats_grad.EXTRA_COLUMNS] * CALLS,
        )
    else:  # the packed buffers themselves, in place
        assert (kernel.backward_packings, kernel.backward_head_dims_v) == (
            [PACKINGS.index(packing)] * CALLS,
            [dv] * CALLS,
        )
    # Initial buffers come in aliased to the results: check mode's canaries; and the split's square call takes
    # the rectangle's dK/dV where a gradient buffer holds key rows only (not dqkv) and the rectangle's call left
    # its unowned rows 0 (launch._writes_key_rows_in_place).
    given = mode == "check_mode"
    in_place = mode == "unowned" and (stats_in_loss or packing == "kv")
    assert [aliased for _, aliased in kernel.targets] == [given] * CALLS + [given or in_place]


@pytest.mark.parametrize("packing", ["kv", "qkv"])
def test_the_public_packed_wrappers_reach_the_packed_cudnn_launch(monkeypatch, rng, packing):
    """ragged_attention_kvpacked / _qkvpacked with implementation="cudnn" (cuDNN declared able here) and
    "xla": their options reach both paths (each held to the reference), and the cuDNN launch hands the
    packed buffers to the handlers."""
    batch = _packed_batch(rng, packing)
    config, kernel = _install(monkeypatch, batch, "token_major")
    monkeypatch.setattr(cudnn, "unsupported_reason", lambda config: None)
    buffers = _packed_buffers(batch, packing)
    d_out, _ = _cotangents(rng, batch, "bfloat16")
    options = dict(stats_layout="token_major", return_stats=True, **OPTIONS)

    def attend(*buffers, implementation):
        if packing == "qkv":
            return packed.ragged_attention_qkvpacked(
                *buffers, batch.cu_seqlens_q, max_seqlen=batch.max_seqlen_q, implementation=implementation, **options
            )
        return packed.ragged_attention_kvpacked(
            *buffers,
            batch.cu_seqlens_q,
            batch.cu_seqlens_kv,
            max_seqlen_q=batch.max_seqlen_q,
            max_seqlen_kv=batch.max_seqlen_kv,
            implementation=implementation,
            **options,
        )

    def run(implementation):  # stats as aux: the plain backward, on the packed buffers in place
        out, vjp, stats = jax.vjp(functools.partial(attend, implementation=implementation), *buffers, has_aux=True)
        return out, stats, vjp(jnp.asarray(d_out))

    expected = _reference(batch, d_out=d_out.astype(np.float64))
    for implementation in ("cudnn", "xla"):
        out, stats, grads = jax.jit(functools.partial(run, implementation))()
        assert_close(np.asarray(out, np.float64), expected["out"], "bfloat16", f"{implementation}: out")
        assert_close(np.asarray(stats, np.float64), expected["stats"], "float32", f"{implementation}: stats")
        for grad, buffer in zip(grads, buffers):
            assert grad.shape == buffer.shape and grad.dtype == buffer.dtype, (grad.shape, buffer.shape)
        _check_gradients(
            _unpacked_gradients(grads, packing),
            expected,
            batch,
            "bfloat16",
            f"{implementation}: ",
            rows_without_keys=packing == "kv",
        )
    # The cuDNN run (first) took the plain backward on the packed buffers in place; the xla run no handler.
    # qkv passes one cu_seqlens for both sides: bottom-right is then top-left (api.attend), one backward call.
    calls = CALLS if packing == "kv" else 1
    assert kernel.backward_packings == [PACKINGS.index(packing)] * calls, kernel.backward_packings


@pytest.mark.slow
def test_dv_past_the_head_dim_limit_raises_naming_it(monkeypatch, rng):
    limit = cudnn.MAX_HEAD_DIM - stats_grad.EXTRA_COLUMNS  # 240: the widest Dv that still fits
    batch = _batch(rng, "bfloat16", head_dim_v=limit + 8)
    config, _ = _install(monkeypatch, batch, "token_major")

    def loss(q):
        out, stats = cudnn.attention_cudnn(q, *batch.args[1:], config)
        return jnp.sum(jnp.where(jnp.isfinite(stats), stats, 0.0))

    with pytest.raises(NotImplementedError, match=rf"Dv={limit + 8}.*{cudnn.MAX_HEAD_DIM}.*Dv <= {limit}"):
        jax.grad(loss)(batch.q)

    # Stats as aux need no widening: the same call differentiates through out.
    def loss_with_stats_aux(q):
        out, stats = cudnn.attention_cudnn(q, *batch.args[1:], config)
        return jnp.sum(out.astype(jnp.float32)), stats

    grad, _ = jax.grad(loss_with_stats_aux, has_aux=True)(batch.q)
    assert np.isfinite(np.asarray(grad, np.float32)).all()


def test_dv_at_the_limit_fills_the_widest_head_dim(monkeypatch, rng):
    limit = cudnn.MAX_HEAD_DIM - stats_grad.EXTRA_COLUMNS
    batch = _batch(rng, "bfloat16", head_dim_v=limit)
    config, kernel = _install(monkeypatch, batch, "token_major")

    def loss(q, k, v):
        _, stats = cudnn.attention_cudnn(q, k, v, *batch.args[3:], config)
        return jnp.sum(jnp.where(jnp.isfinite(stats), stats, 0.0))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*batch.args[:3])
    assert kernel.backward_head_dims_v == [cudnn.MAX_HEAD_DIM] * CALLS
    ones = np.ones(batch.q.shape[:2])
    expected = _reference(batch, d_out=np.zeros(batch.q.shape[:2] + (limit,)), d_stats=ones)
    _check_gradients(grads, expected, batch, "bfloat16")


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_two_columns_carry_g_to_near_float32(rng, dtype):
    """sum(c * e) = -g to about eps(dtype)^2 relative, from 1e-3 to 1e9: no float16 overflow or flush."""
    magnitudes = 10.0 ** rng.uniform(-3, 9, size=4000)
    g = np.concatenate([magnitudes * rng.choice([-1.0, 1.0], size=magnitudes.size), [0.0, 1.0, -65504.0, 7e5]])
    g = g.astype(np.float32)
    c, e = stats_grad.stats_columns(jnp.asarray(g), jnp.dtype(dtype))
    assert all(x.dtype == jnp.dtype(dtype) and x.shape == (g.size, stats_grad.EXTRA_COLUMNS) for x in (c, e))
    c, e = np.asarray(c, np.float32), np.asarray(e, np.float32)
    assert np.isfinite(c).all() and np.isfinite(e).all()
    np.testing.assert_array_equal(c[:, 2:], 0.0)
    np.testing.assert_array_equal(e[:, 2:], 0.0)
    # What the kernel does: products of dtype values and a float32 sum (each product is exact in float32).
    carried = (c * e).sum(axis=1, dtype=np.float32).astype(np.float64)
    eps = float(jnp.finfo(jnp.dtype(dtype)).eps)
    relative = np.abs(carried + g) / np.maximum(np.abs(g), np.finfo(np.float32).tiny)
    assert carried[g == 0].tolist() == [0.0]
    assert relative.max() <= eps**2, f"worst relative error {relative.max():.3g} at g={g[np.argmax(relative)]}"


@pytest.mark.slow
@pytest.mark.parametrize("packing", PACKINGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_split_bottom_right_backward_matches_the_reference(monkeypatch, rng, layout, packing):
    """Rectangle + square against the reference, for every packing and a stats cotangent: sequences with more
    keys than queries, fewer, none, and empty ones."""
    batch = _batch(rng, "bfloat16", head_dim_v=16) if packing == "none" else _packed_batch(rng, packing)
    config, kernel = _install(monkeypatch, batch, layout, packing=packing)
    buffers = (batch.q, batch.k, batch.v) if packing == "none" else _packed_buffers(batch, packing)
    d_out, d_stats = _cotangents(rng, batch, "bfloat16")
    expected_stats = _reference(batch)["stats"]
    d_stats = np.where(np.isneginf(expected_stats), 0.0, d_stats).astype(np.float32)

    def grads(buffers, d_out, d_stats):
        _, vjp = jax.vjp(lambda b: launch.attention(b, *batch.args[3:], config), buffers)
        return vjp((d_out, d_stats))[0]

    args = (buffers, jnp.asarray(d_out), jnp.asarray(_in_layout(d_stats, layout)))
    split = jax.jit(grads)(*args)
    assert len(kernel.backward_packings) == CALLS
    if packing != "none":
        split = _unpacked_gradients(split, packing)
    expected = _reference(batch, d_out=d_out.astype(np.float64), d_stats=d_stats.astype(np.float64))
    _check_gradients(split, expected, batch, "bfloat16", f"split {packing}: ", rows_without_keys=packing != "qkv")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sinks_fold_into_the_plain_backward(monkeypatch, rng, layout, dtype):
    """Sinks without returned stats (cudnn/sinks.py): the backward gets O' = out and dO' = sigma * dOut and no
    stats cotangent, so it runs at Dv (no widened columns); gradients of q, k, v and the sinks against the
    float64 reference, on rows with keys, without keys (a keyless real row: out 0) and padding (NaN dOut)."""
    from jax_ragged_attn.backends.cudnn import sinks as cudnn_sinks

    batch = _batch(rng, dtype)
    config, kernel = _install(monkeypatch, batch, layout)
    d_out, _ = _cotangents(rng, batch, dtype)
    sinks = rng.standard_normal(4).astype(np.float32)

    @jax.jit
    def forward_and_grads(q, k, v, s, d_out):
        attend = lambda q, k, v, s: cudnn_sinks.attention_with_sinks(
            (q, k, v), *batch.args[3:], s, config, (None, None)
        )
        out, vjp = jax.vjp(attend, q, k, v, s)
        return out, vjp(d_out)

    out, (dq, dk, dv, dsinks) = forward_and_grads(*batch.args[:3], jnp.asarray(sinks), jnp.asarray(d_out))
    expected = _reference(batch, d_out=np.nan_to_num(d_out.astype(np.float64)), sinks=sinks.astype(np.float64))
    assert_close(np.asarray(out, np.float64), expected["out"], dtype, "out")
    _check_gradients((dq, dk, dv), expected, batch, dtype, "sinks: ", rows_without_keys=False)  # stats = s there
    assert_close(np.asarray(dsinks, np.float64), expected["dsinks"], dtype, "dsinks")
    assert np.abs(expected["dsinks"]).max() > 0
    assert kernel.backward_head_dims_v == [batch.v.shape[2]] * CALLS  # the plain backward, not widened
