"""No input data is dropped without a signal: every row of the README's table "What can be dropped", in both
modes, on the xla path and on the cuDNN path's Python layer (a CPU stand-in kernel; the real kernels on a GPU).

Default mode: the call runs, and return_overflow=True counts what was dropped (checked against counts
written out by hand and, for cut query rows, against the rows that read exactly 0). NumPy inputs, free to
read, warn. Check mode: RaggedAttentionInputError naming the argument, index and values, eagerly and under
jit. The segment-id rows are in test_segments.py; the packer's (nothing dropped) in test_data.py.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiers import some_fast  # tests/ is on sys.path under pytest

import jax_ragged_attn
from jax_ragged_attn import ragged_attention
from jax_ragged_attn.backends.cudnn import launch
from jax_ragged_attn.backends.cudnn import ragged as cudnn
from jax_ragged_attn.config import AttentionOptions, make_config
from jax_ragged_attn.features.checks import RaggedAttentionInputError, RaggedAttentionInputWarning, input_errors
from jax_ragged_attn.features.overflow import Overflow
from jax_ragged_attn.index import sanitize_cu_seqlens
from jax_ragged_attn.inputs.data import pack_documents
from jax_ragged_attn.inputs.packed import ragged_attention_kvpacked, ragged_attention_qkvpacked

CAPACITY_Q, CAPACITY_KV = 12, 10
MAX_SEQLEN_Q, MAX_SEQLEN_KV = 4, 5
HEADS, DIM = 2, 8
VALID_Q, VALID_KV = [0, 3, 3, 7], [0, 5, 5, 9]


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the table: cu_seqlens, the counts return_overflow must report, check mode's message."""

    cu_q: tuple[int, ...]
    cu_kv: tuple[int, ...]
    counts: tuple[int, int, int]  # truncated_rows_q, truncated_rows_kv, invalid_cu_seqlens
    fragments: tuple[str, ...] = ()  # check mode's message holds these (empty: valid input)
    nan_rows: tuple[int, int] = (0, 0)  # default mode: query rows start..stop - 1 read NaN, the rest are finite


ROWS = {
    "valid": Row(VALID_Q, VALID_KV, (0, 0, 0)),
    "q_longer_than_max_seqlen_q": Row(
        [0, 6, 6, 7],
        VALID_KV,
        (2, 0, 0),
        (
            "cu_seqlens_q is invalid",
            "sequence 0 has 6 tokens (cu_seqlens_q[1] - cu_seqlens_q[0] = 6 - 0)",
            "more than max_seqlen_q = 4",
            "Got [0 6 6 7]",
        ),
        (0, 6),
    ),
    "kv_longer_than_max_seqlen_kv": Row(
        VALID_Q,
        [0, 2, 9, 10],
        (0, 2, 0),
        ("cu_seqlens_kv is invalid", "sequence 1 has 7 tokens", "more than max_seqlen_kv = 5"),
        (3, 3),  # sequence 1 is invalid, and it has no query rows
    ),
    # Malformed cu_seqlens (not from 0, decreasing): every row, padding included.
    "q_not_starting_at_0": Row([1, 3, 3, 7], VALID_KV, (0, 0, 1), ("cu_seqlens_q[0] = 1, must be 0",), (0, CAPACITY_Q)),
    "kv_decreasing": Row(
        VALID_Q,
        [0, 5, 4, 9],
        (0, 0, 1),
        ("cu_seqlens_kv is invalid: it decreases at index 2", "cu_seqlens_kv[1] = 5 > cu_seqlens_kv[2] = 4"),
        (0, CAPACITY_Q),
    ),
    # Clamped to [0, 3, 3, 12]: its last sequence becomes 9 rows long, 5 of them past max_seqlen_q.
    "q_past_capacity": Row(
        [0, 3, 3, 15],
        VALID_KV,
        (5, 0, 1),
        ("cu_seqlens_q[3] = 15 is past the capacity 12 (rows of the packed buffer)", "sequence 2 has 12 tokens"),
        (3, CAPACITY_Q),
    ),
    "kv_negative": Row(VALID_Q, [-2, 5, 5, 9], (0, 0, 1), ("cu_seqlens_kv[0] = -2, must be 0",), (0, CAPACITY_Q)),
}
INVALID = {name: row for name, row in ROWS.items() if row.fragments}
RAISED = (ValueError, jax.errors.JaxRuntimeError)  # what XLA delivers under jit (checks module docstring)


@pytest.fixture
def inputs():
    rng = np.random.default_rng(15)
    q = jnp.asarray(rng.standard_normal((CAPACITY_Q, HEADS, DIM)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((CAPACITY_KV, HEADS, DIM)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((CAPACITY_KV, HEADS, DIM)), jnp.float32)
    return q, k, v


@pytest.fixture(params=["xla", "cudnn_stand_in"])
def implementation(request, monkeypatch):
    """ "xla", or "cudnn" served on this CPU by test_cudnn_wrapper's stand-in kernel (check mode guarded)."""
    if request.param == "xla":
        return "xla"
    from test_cudnn_wrapper import StandInKernel  # tests/ is on sys.path under pytest

    kernel = StandInKernel()
    shapes = [jax.ShapeDtypeStruct((c, HEADS, DIM), jnp.bfloat16) for c in (CAPACITY_Q, CAPACITY_KV, CAPACITY_KV)]
    cu = jax.ShapeDtypeStruct((4,), jnp.int32)
    kernel.config = make_config(
        *shapes, cu, cu, AttentionOptions(), max_seqlen_q=MAX_SEQLEN_Q, max_seqlen_kv=MAX_SEQLEN_KV
    )
    monkeypatch.setattr(jax.ffi, "ffi_call", kernel)
    monkeypatch.setattr(launch, "graph_info", lambda direction, config, layout=None: {"workspace_bytes": 64})
    monkeypatch.setattr(cudnn, "unsupported_reason", lambda config: None)
    return "cudnn"


def _for(implementation, inputs):
    """The inputs in a dtype the implementation serves (cuDNN: bfloat16)."""
    return [x.astype(jnp.bfloat16) for x in inputs] if implementation == "cudnn" else inputs


def _attend(inputs, implementation, **options):
    q, k, v = _for(implementation, inputs)

    def f(cu_q, cu_kv):
        return ragged_attention(
            q,
            k,
            v,
            cu_q,
            cu_kv,
            max_seqlen_q=MAX_SEQLEN_Q,
            max_seqlen_kv=MAX_SEQLEN_KV,
            implementation=implementation,
            **options,
        )

    return f


def _cu(values):
    return jnp.asarray(values, jnp.int32)


def _assert_counts(overflow, expected, what=""):
    assert isinstance(overflow, Overflow), type(overflow)
    for name, value in zip(Overflow._fields, (*expected, 0)):
        field = getattr(overflow, name)
        assert field.dtype == jnp.int32 and field.shape == (), f"{what}{name}: {field.dtype} {field.shape}"
        assert int(field) == value, f"{what}{name} = {int(field)}, expected {value}"


def _assert_message(message: str, fragments):
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from: {message}"


@some_fast(
    {"implementation": ["xla", "cudnn_stand_in"], "row_name": list(ROWS)},
    fast=[
        "xla-valid",
        "xla-q_past_capacity",
        "xla-kv_negative",
        "xla-q_not_starting_at_0",
        "cudnn_stand_in-kv_decreasing",
        "cudnn_stand_in-kv_longer_than_max_seqlen_kv",
        "cudnn_stand_in-q_longer_than_max_seqlen_q",
    ],
    indirect=["implementation"],
)
def test_default_mode_runs_and_counts_what_was_dropped(inputs, implementation, row_name):
    row = ROWS[row_name]
    f = _attend(inputs, implementation, return_overflow=True)
    for how, call in (("eager", f), ("jit", jax.jit(f))):
        out, overflow = call(_cu(row.cu_q), _cu(row.cu_kv))
        what = f"{row_name} {implementation} {how}: "
        nan = np.isnan(np.asarray(out, np.float32)).all(axis=(1, 2))
        expected = np.zeros(CAPACITY_Q, bool)
        expected[slice(*row.nan_rows)] = True
        np.testing.assert_array_equal(nan, expected, err_msg=what + "NaN rows")
        assert np.isfinite(np.asarray(out, np.float32)[~expected]).all(), what + "out"
        _assert_counts(overflow, row.counts, what)
    # Independent of the counting code: with every sequence owning keys, no finite query row inside the
    # (clamped) sequences reads exactly 0 (a cut row reads NaN with the rest of its sequence), and the padding
    # rows past them read exactly 0 unless they are NaN.
    cu = np.asarray(sanitize_cu_seqlens(_cu(row.cu_q), CAPACITY_Q))
    finite = np.asarray(out)[~expected]
    rows = np.arange(CAPACITY_Q)[~expected]
    inside = (rows >= cu[0]) & (rows < cu[-1])
    assert not np.all(finite[inside] == 0, axis=(1, 2)).any(), row_name
    assert np.all(finite[~inside] == 0), row_name


@some_fast(
    {"implementation": ["xla", "cudnn_stand_in"], "row_name": list(INVALID)},
    fast=[
        "xla-q_past_capacity",
        "xla-kv_negative",
        "xla-q_longer_than_max_seqlen_q",
        "cudnn_stand_in-kv_decreasing",
        "cudnn_stand_in-kv_longer_than_max_seqlen_kv",
        "cudnn_stand_in-q_not_starting_at_0",
    ],
    indirect=["implementation"],
)
def test_check_mode_raises_naming_argument_index_and_values(inputs, implementation, row_name):
    row = INVALID[row_name]
    f = _attend(inputs, implementation, check=True)
    # Eagerly the values are concrete: checked on the host, raised as the dedicated type, no callback.
    with pytest.raises(RaggedAttentionInputError) as raised:
        f(_cu(row.cu_q), _cu(row.cu_kv))
    _assert_message(str(raised.value), row.fragments)
    # Under jit XLA delivers the callback's error wrapped; input_errors() unwraps it to the same type.
    jitted = jax.jit(f)
    with pytest.raises(RaggedAttentionInputError) as raised, input_errors():
        jax.block_until_ready(jitted(_cu(row.cu_q), _cu(row.cu_kv)))
    assert str(raised.value).splitlines()[0].endswith(str(raised.value)), "one clean message"
    _assert_message(str(raised.value), row.fragments)
    # Without it: jaxlib's exception, whose text still carries the whole message (a compiled call, again).
    jax.block_until_ready(jitted(_cu(VALID_Q), _cu(VALID_KV)))
    with pytest.raises(RAISED) as raised:
        jax.block_until_ready(jitted(_cu(row.cu_q), _cu(row.cu_kv)))
    _assert_message(str(raised.value), ("RaggedAttentionInputError: ", *row.fragments))


def test_check_mode_passes_valid_input_unchanged(inputs, implementation):
    cu = (_cu(VALID_Q), _cu(VALID_KV))
    plain = jax.jit(_attend(inputs, implementation, return_overflow=True))(*cu)
    checked = jax.jit(_attend(inputs, implementation, check=True, return_overflow=True))(*cu)
    np.testing.assert_array_equal(np.asarray(checked[0]), np.asarray(plain[0]))
    _assert_counts(checked[1], (0, 0, 0))


@pytest.mark.parametrize("row_name", ROWS)
def test_numpy_input_warns_when_traced_outside_check_mode(inputs, row_name):
    """Host-resident cu_seqlens cost nothing to read: checked at trace time whatever the mode."""
    row = ROWS[row_name]
    f = _attend(inputs, "xla")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f(np.asarray(row.cu_q, np.int32), np.asarray(row.cu_kv, np.int32))
    ours = [w for w in caught if issubclass(w.category, RaggedAttentionInputWarning)]
    if not row.fragments:
        assert not ours, [str(w.message) for w in ours]
        return
    assert len(ours) == 1, [str(w.message) for w in caught]
    _assert_message(str(ours[0].message), (*row.fragments, "check=True raises instead"))
    assert ours[0].filename == __file__, "the warning points at the caller"
    # Device arrays are not read outside check mode (no round trip): no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error", RaggedAttentionInputWarning)
        f(_cu(row.cu_q), _cu(row.cu_kv))


def test_failed_callback_is_logged_as_one_line(inputs, caplog):
    """JAX logs a failed callback's traceback before raising; ours becomes one line naming the problem."""
    row = INVALID["q_past_capacity"]
    jitted = jax.jit(_attend(inputs, "xla", check=True))
    with caplog.at_level(logging.ERROR, logger="jax._src.callback"), pytest.raises(RAISED):
        jax.block_until_ready(jitted(_cu(row.cu_q), _cu(row.cu_kv)))
    records = [r for r in caplog.records if r.name == "jax._src.callback"]
    assert records, "jax no longer logs failed callbacks: the filter in checks.py can go"
    for record in records:
        assert record.exc_info is None and "\n" not in record.getMessage(), record.getMessage()
        assert record.getMessage().startswith("RaggedAttentionInputError: cu_seqlens_q is invalid")


def test_input_errors_lets_other_exceptions_through():
    with pytest.raises(ZeroDivisionError), input_errors():
        1 / 0
    with pytest.raises(ValueError, match="^unrelated$"), input_errors():
        raise ValueError("unrelated")


@pytest.mark.slow
def test_gradient_with_overflow_as_aux(inputs, implementation):
    """The counts are integers with no gradient: jax.grad with has_aux sees the same gradients."""
    q, k, v = _for(implementation, inputs)
    cu_q, cu_kv = _cu([0, 6, 6, 7]), _cu(VALID_KV)  # one query row cut

    def loss(q, k, v, return_overflow):
        result = ragged_attention(
            q,
            k,
            v,
            cu_q,
            cu_kv,
            max_seqlen_q=MAX_SEQLEN_Q,
            max_seqlen_kv=MAX_SEQLEN_KV,
            implementation=implementation,
            return_overflow=return_overflow,
        )
        out, overflow = result if return_overflow else (result, None)
        return jnp.sum(jnp.square(out.astype(jnp.float32))), overflow

    grads, overflow = jax.jit(jax.grad(lambda *a: loss(*a, True), argnums=(0, 1, 2), has_aux=True))(q, k, v)
    plain, _ = jax.jit(jax.grad(lambda *a: loss(*a, False), argnums=(0, 1, 2), has_aux=True))(q, k, v)
    _assert_counts(overflow, (2, 0, 0))
    for name, g, p in zip("qkv", grads, plain):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(p), err_msg=f"d{name}")
        assert np.abs(np.asarray(g)).sum() > 0, f"d{name} is all zero"
    # value_and_grad over a function that returns the overflow itself: integer outputs stay out of the way.
    (_, overflow), _ = jax.value_and_grad(lambda q: loss(q, k, v, True), has_aux=True)(q)
    assert int(overflow.truncated_rows_q) == 2


def test_vmap_gives_one_count_per_element(inputs):
    f = _attend(inputs, "xla", return_overflow=True)
    rows = (ROWS["valid"], ROWS["q_longer_than_max_seqlen_q"], ROWS["q_past_capacity"])
    cu_q = jnp.stack([_cu(r.cu_q) for r in rows])
    _, overflow = jax.jit(jax.vmap(f, in_axes=(0, None)))(cu_q, _cu(VALID_KV))
    np.testing.assert_array_equal(np.asarray(overflow.truncated_rows_q), [r.counts[0] for r in rows])
    np.testing.assert_array_equal(np.asarray(overflow.invalid_cu_seqlens), [r.counts[2] for r in rows])


def test_return_stats_and_overflow_come_in_order(inputs):
    out, stats, overflow = _attend(inputs, "xla", return_stats=True, return_overflow=True)(_cu(VALID_Q), _cu(VALID_KV))
    assert out.shape == (CAPACITY_Q, HEADS, DIM) and stats.shape == (HEADS, CAPACITY_Q)
    _assert_counts(overflow, (0, 0, 0))
    with pytest.raises(ValueError, match="return_overflow"):
        _attend(inputs, "xla", return_overflow=1)(_cu(VALID_Q), _cu(VALID_KV))


def test_max_seqlen_above_the_capacity_loses_nothing(inputs):
    """Knowable at trace time: make_config clamps the bound to the capacity, so no row can be cut by it."""
    q, k, v = inputs
    cu_q, cu_kv = _cu([0, 12, 12, 12]), _cu([0, 10, 10, 10])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, overflow = ragged_attention(
            q,
            k,
            v,
            cu_q,
            cu_kv,
            max_seqlen_q=10**9,
            max_seqlen_kv=10**9,
            implementation="xla",
            check=True,
            return_overflow=True,
        )
    exact = ragged_attention(
        q, k, v, cu_q, cu_kv, max_seqlen_q=CAPACITY_Q, max_seqlen_kv=CAPACITY_KV, implementation="xla"
    )
    np.testing.assert_array_equal(np.asarray(out), np.asarray(exact))
    _assert_counts(overflow, (0, 0, 0))


def test_packed_wrappers_count_and_check(inputs):
    q, k, v = inputs
    kv = jnp.stack([k, v], axis=1)
    cu_q, cu_kv = _cu([0, 6, 6, 7]), _cu([0, 2, 9, 9])
    out, overflow = jax.jit(
        lambda a, b: ragged_attention_kvpacked(
            q,
            kv,
            a,
            b,
            max_seqlen_q=MAX_SEQLEN_Q,
            max_seqlen_kv=MAX_SEQLEN_KV,
            implementation="xla",
            return_overflow=True,
        )
    )(cu_q, cu_kv)
    _assert_counts(overflow, (2, 2, 0))
    with pytest.raises(RaggedAttentionInputError, match=r"cu_seqlens_q is invalid: sequence 0 has 6 tokens"):
        ragged_attention_kvpacked(
            q,
            kv,
            cu_q,
            _cu(VALID_KV),
            max_seqlen_q=MAX_SEQLEN_Q,
            max_seqlen_kv=MAX_SEQLEN_KV,
            implementation="xla",
            check=True,
        )

    qkv = jnp.stack([q[:CAPACITY_KV], k, v], axis=1)
    cu = _cu([3, 9, 2, 12])  # invalid entries 0, 2 and 3, counted once although the op reads it for q and kv
    out, stats, overflow = jax.jit(
        lambda c: ragged_attention_qkvpacked(
            qkv, c, max_seqlen=MAX_SEQLEN_KV, implementation="xla", return_stats=True, return_overflow=True
        )
    )(cu)
    # Clamped to [3, 9, 9, 10]: sequence 0 has 6 rows, 1 past max_seqlen, for q and kv alike.
    _assert_counts(overflow, (1, 1, 3))
    with pytest.raises(RaggedAttentionInputError, match=r"^cu_seqlens is invalid: cu_seqlens\[0\] = 3, must be 0"):
        ragged_attention_qkvpacked(qkv, cu, max_seqlen=MAX_SEQLEN_KV, implementation="xla", check=True)


def test_batches_of_the_packer_lose_nothing(inputs):
    """pack_documents splits long documents at max_seqlen (by design) and drops no token: its batches
    report no overflow when the attention gets the same max_seqlen. Token conservation: test_data.py."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 100, size=n) for n in (1, 13, 4, 0, 7, 2, 30)]
    q, k, v = inputs
    seen = 0
    for batch in pack_documents(docs, CAPACITY_KV, max_seqs=3, max_seqlen=MAX_SEQLEN_KV):
        cu = jnp.asarray(batch.cu_seqlens)
        _, overflow = ragged_attention(
            q[:CAPACITY_KV],
            k,
            v,
            cu,
            cu,
            max_seqlen_q=MAX_SEQLEN_KV,
            max_seqlen_kv=MAX_SEQLEN_KV,
            implementation="xla",
            check=True,
            return_overflow=True,
        )
        _assert_counts(overflow, (0, 0, 0))
        seen += batch.num_tokens
    assert seen == sum(len(d) for d in docs)


_CUDNN_REASON = jax_ragged_attn.cudnn_unavailable_reason()


@pytest.mark.gpu
@pytest.mark.skipif(_CUDNN_REASON is not None, reason=f"cuDNN path unavailable: {_CUDNN_REASON}")
@pytest.mark.parametrize("row_name", ROWS)
def test_cudnn_path_on_gpu_counts_and_raises_the_same(row_name):
    row = ROWS[row_name]
    rng = np.random.default_rng(15)
    inputs = [
        jnp.asarray(rng.standard_normal((c, HEADS, 64)), jnp.bfloat16) for c in (CAPACITY_Q, CAPACITY_KV, CAPACITY_KV)
    ]
    _, overflow = jax.jit(_attend(inputs, "cudnn", return_overflow=True))(_cu(row.cu_q), _cu(row.cu_kv))
    _assert_counts(overflow, row.counts, f"{row_name} cudnn: ")
    if not row.fragments:
        return
    f = _attend(inputs, "cudnn", check=True)
    with pytest.raises(RaggedAttentionInputError) as raised:
        f(_cu(row.cu_q), _cu(row.cu_kv))
    _assert_message(str(raised.value), row.fragments)
    with pytest.raises(RaggedAttentionInputError) as raised, input_errors():
        jax.block_until_ready(jax.jit(f)(_cu(row.cu_q), _cu(row.cu_kv)))
    _assert_message(str(raised.value), row.fragments)
