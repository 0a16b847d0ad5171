"""The op's semantics, written once and run against every implementation (tokamax's test-base pattern).

`SemanticsTest` holds the named cases and the checks, through the public `ragged_attention` only; each
subclass runs all of them on one implementation: `XlaTest` on the portable path (any backend; float32,
bfloat16, float16), `CudnnTest` on cuDNN (bfloat16, float16; GPU only, skipped with the reason elsewhere) and
`CudnnLeanMemoryTest`, the same with strategy="lean_memory" (the backward's other intermediate layout), and
`CudnnPoisonedOutputsTest`, with NaN in every output row cuDNN is trusted to write; `Fa3Test` on
FlashAttention-3 (the optional flash-attn3-jax wheel, Hopper only, head dim 128: every case at that head dim)
and `Fa3EmulatedTest`, the FA3 wrapper (backends/fa3/ragged.py) around dense stand-ins of its two kernels, on
any backend.
Tests of one backend's machinery (graph cache, check mode's guard bands, stand-in kernels, workspace,
fallback rules) stay in test_xla_path.py, test_cudnn.py and test_cudnn_wrapper.py.

A case says what to compute (heads, masks, empty sequences, padding); the implementation's `Sizes` say how
big: a few rows per sequence on the xla path (run with small blocks, so sequences straddle them), sequences
of up to 192 rows and head dims up to 128 on cuDNN, so that its kernels run over several tiles. cuDNN's
sizes are the same for every case, so cases that differ only in their lengths share a cuDNN graph (a build
costs seconds, a cached call microseconds). A configuration a backend declines by design
(jax_ragged_attn/testing/declines.py lists them) is a skip, with its reason; any other decline fails.

Every test draws fresh inputs from a seed derived from its id, so a failure reproduces with
`pytest tests/test_semantics.py -k 'XlaTest and test_gradients_gqa_causal'`. Every row that belongs to no
sequence (capacity padding, rows past max_seqlen) is NaN in q, k, v and in both cotangents: a NaN in any
result proves padding leaked. Results are held to the float64 NumPy reference with dtype-derived tolerances,
and the rows that attend nothing to exact 0 / -inf.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jax_ragged_attn
from jax_ragged_attn import ragged_attention
from jax_ragged_attn.backends.fa3 import dew as _dew
from jax_ragged_attn.backends.fa3 import ragged as _fa3
from jax_ragged_attn.testing import PackedBatch, assert_close, declines, fa3_emulator, packed_batch, reference_attention
from jax_ragged_attn.testing.private_config import backend_options, config_overrides

LAYOUTS = ("head_major", "token_major")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How one implementation sizes every case."""

    num_seqs: int
    max_seqlen: tuple[int, int]  # (q, kv): lengths are drawn up to these, and they are the max_seqlen passed
    slack: tuple[int, int]  # capacity padding rows past num_seqs * max_seqlen, of q and of k/v
    head_dim_unit: int  # a case's head dims are multiples of this
    window_unit: int  # and so are its window sizes
    head_dim: int | None = None  # every case's Dqk and Dv instead (an implementation of one head dim: FA3)


@dataclasses.dataclass(frozen=True)
class Case:
    heads: tuple[int, int] = (4, 2)  # (Hq, Hkv)
    dims: tuple[int, int] = (2, 2)  # (Dqk, Dv), in head_dim_units
    is_causal: bool = False
    diagonal_alignment: str = "top_left"
    window: int | tuple[int, int] | None = None  # local_window_size, in window_units
    self_attention: bool = False  # kv lengths equal the q lengths; otherwise drawn on their own
    empty_q: tuple[int, ...] | str = ()  # sequences (negative: from the end) without queries; "all"
    empty_kv: tuple[int, ...] | str = ()  # sequences without keys
    padding: bool = True  # capacity padding rows after the last sequence
    scale: float | None = None
    softcap: float | None = None  # logit soft-capping: scores c * tanh(s / c)
    all_dtypes: bool = False  # run every dtype of the implementation (otherwise its first)

    def options(self, sizes: Sizes) -> dict:
        window = self.window
        if isinstance(window, tuple):
            window = tuple(w * sizes.window_unit for w in window)
        elif window is not None:
            window = window * sizes.window_unit
        options = dict(
            scale=self.scale,
            is_causal=self.is_causal,
            diagonal_alignment=self.diagonal_alignment,
            local_window_size=window,
        )
        return options if self.softcap is None else {**options, "softcap": self.softcap}


CASES = {
    "mha": Case(heads=(2, 2), self_attention=True, all_dtypes=True),
    "causal": Case(heads=(4, 4), is_causal=True, self_attention=True),
    "causal_bottom_right": Case(heads=(4, 4), is_causal=True, diagonal_alignment="bottom_right", all_dtypes=True),
    "gqa_causal": Case(heads=(6, 2), is_causal=True),
    "mqa": Case(heads=(4, 1)),
    "mqa_causal_bottom_right": Case(heads=(4, 1), is_causal=True, diagonal_alignment="bottom_right", all_dtypes=True),
    "dv_larger_gqa_causal": Case(heads=(6, 3), dims=(2, 4), is_causal=True, all_dtypes=True),
    "dqk_larger": Case(dims=(4, 2)),
    "wide_heads_causal": Case(dims=(4, 4), is_causal=True, all_dtypes=True),
    "custom_scale_mqa": Case(heads=(3, 1), scale=0.3),
    "window_int": Case(window=1),
    "window_bottom_right": Case(window=2, diagonal_alignment="bottom_right"),
    "window_tuple": Case(window=(4, 1)),
    "window_tuple_causal": Case(window=(3, 1), is_causal=True, all_dtypes=True),
    "window_causal_bottom_right": Case(window=2, is_causal=True, diagonal_alignment="bottom_right"),
    # Left 0 and causal: each query attends its diagonal key only (a softmax of one term).
    "window_left_zero_causal_bottom_right": Case(window=(0, 2), is_causal=True, diagonal_alignment="bottom_right"),
    "window_right_zero": Case(window=(9, 0)),
    "window_right_zero_gqa_bottom_right": Case(heads=(6, 2), window=(8, 0), diagonal_alignment="bottom_right"),
    "empty_first_middle_last": Case(empty_q=(0, 2, -1), empty_kv=(0, 2, -1), is_causal=True, all_dtypes=True),
    "empty_gqa_causal_bottom_right": Case(
        heads=(6, 2), empty_q=(0, 2, -1), empty_kv=(0, 2, -1), is_causal=True, diagonal_alignment="bottom_right"
    ),
    "empty_kv_only": Case(empty_kv=(0, 2)),  # query rows with no key at all
    "empty_q_only": Case(empty_q=(1, -1), is_causal=True),
    "all_empty": Case(empty_q="all", empty_kv="all"),
    "no_capacity_padding": Case(padding=False, is_causal=True),
    # Soft-capped scores (Gemma 2): a cap near the scores' spread, so tanh bends them (1.0 at the default scale)
    # and one they mostly saturate against (scale 0.5: scores of a few units against a cap of 2).
    "softcap_gqa_causal": Case(heads=(6, 2), is_causal=True, softcap=1.0, all_dtypes=True),
    "softcap_saturated_mqa": Case(heads=(4, 1), scale=0.5, softcap=2.0),
    "softcap_window_causal_bottom_right": Case(
        window=(3, 1), is_causal=True, diagonal_alignment="bottom_right", softcap=5.0
    ),
    "softcap_empty_gqa": Case(heads=(6, 3), dims=(2, 4), empty_q=(0, -1), empty_kv=(2,), softcap=1.5),
}


def _random_case(seed: int) -> Case:
    """A configuration drawn with weights towards the awkward corners (the sweep draws many more)."""
    rng = np.random.default_rng(seed)
    pick = lambda options: options[int(rng.integers(len(options)))]
    return Case(
        heads=pick([(2, 2), (4, 2), (6, 2), (3, 1), (4, 1), (6, 3)]),
        dims=pick([(1, 1), (2, 2), (1, 3), (3, 2), (4, 4)]),
        is_causal=bool(rng.random() < 0.5),
        diagonal_alignment=pick(["top_left", "bottom_right"]),
        window=pick([None, None, int(rng.integers(0, 4)), (int(rng.integers(0, 4)), int(rng.integers(0, 4)))]),
        self_attention=bool(rng.random() < 0.3),
        empty_q=pick([(), (), (0,), (1, -1)]),
        empty_kv=pick([(), (), (-1,), (0, 2)]),
        padding=bool(rng.random() < 0.8),
    )


CASES.update({f"random_{i}": _random_case(2024 + i) for i in range(6)})
NAMED_CASES = [dict(testcase_name=name, case_name=name) for name in CASES]


def _lengths(rng, num_seqs: int, longest: int, empty) -> np.ndarray:
    """Lengths in [1, longest], 0 at `empty` (indices, or "all"), and one of the others exactly `longest`:
    the boundary, where a sequence fills its max_seqlen."""
    lengths = rng.integers(1, longest, size=num_seqs, endpoint=True)
    lengths[slice(None) if empty == "all" else list(empty)] = 0
    nonempty = np.flatnonzero(lengths)
    if nonempty.size:
        lengths[rng.choice(nonempty)] = longest
    return lengths


def _owned(cu, capacity: int, max_seqlen: int) -> np.ndarray:
    """[capacity] bool: the row belongs to a sequence (not capacity padding, not cut by max_seqlen)."""
    owned = np.zeros(capacity, dtype=bool)
    for start, stop in zip(np.asarray(cu)[:-1], np.asarray(cu)[1:]):
        owned[start : min(stop, start + max_seqlen)] = True
    return owned


@dataclasses.dataclass(frozen=True)
class Inputs:
    """A packed batch whose rows outside every sequence are NaN, and cotangents poisoned the same way."""

    batch: PackedBatch
    owned_q: np.ndarray  # [Tq] bool
    owned_kv: np.ndarray  # [Tkv] bool
    d_out: np.ndarray  # [Tq, Hq, Dv] in the dtype, NaN on rows not owned
    d_stats: np.ndarray  # [Tq, Hq] float32, token-major, NaN on rows not owned

    @property
    def max_seqlen(self) -> dict:
        return dict(max_seqlen_q=self.batch.max_seqlen_q, max_seqlen_kv=self.batch.max_seqlen_kv)

    def reference(self, case: Case, sizes: Sizes, *, d_out=False, d_stats=False) -> dict:
        """The float64 reference; with d_out / d_stats, gradients for those cotangents (the rest zero)."""
        cotangents = {}
        if d_out or d_stats:  # the reference reads every row it is given: poisoned rows become zeros
            cotangents["d_out"] = np.nan_to_num(self.d_out.astype(np.float64)) if d_out else np.zeros(self.d_out.shape)
        if d_stats:
            cotangents["d_stats"] = np.nan_to_num(self.d_stats.astype(np.float64))
        return reference_attention(*self.batch.reference_args, **self.max_seqlen, **case.options(sizes), **cotangents)


def check_forward(out, stats, expected, inputs: Inputs, dtype, what=""):
    """out and token-major stats against the reference, and exact zeros / -inf where nothing is attended."""
    assert out.dtype == inputs.batch.q.dtype, f"{what}out dtype {out.dtype}, expected {inputs.batch.q.dtype}"
    assert stats.dtype == jnp.float32, f"{what}stats dtype {stats.dtype}, expected float32"
    assert out.shape == expected["out"].shape and stats.shape == expected["stats"].shape, (out.shape, stats.shape)
    out, stats = np.asarray(out, dtype=np.float64), np.asarray(stats, dtype=np.float64)
    assert_close(out, expected["out"], dtype, f"{what}out")
    # stats are float32 whatever the input dtype: held to float32's tolerance.
    assert_close(stats, expected["stats"], "float32", f"{what}stats")
    # assert_close only bounds these; rows no sequence owns and rows without keys must be exact.
    empty = np.isneginf(expected["stats"])  # [Tq, Hq]
    assert empty[~inputs.owned_q].all()
    np.testing.assert_array_equal(out[empty], 0.0, err_msg=f"{what}out of rows that attend no key")
    np.testing.assert_array_equal(stats[empty], -np.inf, err_msg=f"{what}stats of rows that attend no key")


def check_gradients(grads, expected, inputs: Inputs, dtype, what=""):
    batch = inputs.batch
    for name, grad, like in zip(("dq", "dk", "dv"), grads, (batch.q, batch.k, batch.v)):
        assert grad.dtype == like.dtype, f"{what}{name} dtype {grad.dtype}, expected {like.dtype}"
        assert_close(grad, expected[name], dtype, f"{what}{name}")
    dq, dk, dv = (np.asarray(g, dtype=np.float64) for g in grads)
    empty_rows = np.isneginf(expected["stats"]).all(axis=1)
    np.testing.assert_array_equal(dq[empty_rows], 0.0, err_msg=f"{what}dq of rows no sequence owns / without keys")
    np.testing.assert_array_equal(dk[~inputs.owned_kv], 0.0, err_msg=f"{what}dk of rows no sequence owns")
    np.testing.assert_array_equal(dv[~inputs.owned_kv], 0.0, err_msg=f"{what}dv of rows no sequence owns")
    if not empty_rows.all():  # agreeing with the reference means something only if it is not all zeros
        assert max(np.abs(expected[name]).max() for name in ("dq", "dk", "dv")) > 0, (
            f"{what}the reference gradients are all zero: the case tests nothing"
        )


def _stats_in(layout: str, token_major):
    """Token-major [Tq, Hq] stats (or their cotangent) in `layout`, and back: the transpose is its own inverse."""
    return token_major if layout == "token_major" else token_major.T


class SemanticsTest(parameterized.TestCase):
    """The semantic cases; a subclass names the implementation, its dtypes and its sizes."""

    __test__ = False  # the subclasses run these, each against its implementation
    implementation: str
    dtypes: tuple[str, ...]
    sizes: Sizes
    deterministic_by_default: bool  # reruns give bit-identical gradients without deterministic=True
    strategy: str = "fastest"  # the cuDNN backward's intermediate layout (cudnn/strategy.py); xla ignores it
    # FA3 serves a top-left mask only where the lengths are provably equal (the named cases show which): the
    # tests of other properties (eager, reruns, stats alone, vmap) run bottom-right masks on it instead.
    bottom_right_only: bool = False

    def adapted(self, case: Case) -> Case:
        if self.bottom_right_only and (case.is_causal or case.window is not None):
            return dataclasses.replace(case, diagonal_alignment="bottom_right")
        return case

    def rng(self) -> np.random.Generator:
        """A generator seeded by the test's own id: fresh inputs per test, the same ones on every rerun."""
        return np.random.default_rng(zlib.crc32(f"{type(self).__name__}.{self._testMethodName}".encode()))

    def dtypes_for(self, case: Case) -> tuple[str, ...]:
        return self.dtypes if case.all_dtypes else self.dtypes[:1]

    def inputs(self, rng, case: Case, dtype: str, *, max_seqlen: tuple[int, int] | None = None) -> Inputs:
        """Lengths drawn up to the implementation's max_seqlen, one sequence of each side exactly that long
        (self-attention: the kv lengths are the q lengths); `max_seqlen` passes smaller bounds instead,
        cutting the rows past them."""
        sizes = self.sizes
        n, (max_q, max_kv) = sizes.num_seqs, sizes.max_seqlen
        lengths_q = _lengths(rng, n, max_q, case.empty_q)
        if case.self_attention:  # the same lengths, but for the sequences without keys
            lengths_kv = np.where(_lengths(rng, n, max_kv, case.empty_kv) == 0, 0, lengths_q)
        else:
            lengths_kv = _lengths(rng, n, max_kv, case.empty_kv)
        slack_q, slack_kv = (
            (n * max_q + sizes.slack[0] - lengths_q.sum(), n * max_kv + sizes.slack[1] - lengths_kv.sum())
            if case.padding
            else (0, 0)
        )
        (hq, hkv), (dqk, dv) = case.heads, (sizes.head_dim or d * sizes.head_dim_unit for d in case.dims)
        batch = packed_batch(
            rng,
            lengths_q,
            lengths_kv,
            num_heads_q=hq,
            num_heads_kv=hkv,
            head_dim_qk=dqk,
            head_dim_v=dv,
            dtype=dtype,
            slack_q=int(slack_q),
            slack_kv=int(slack_kv),
        )
        max_q, max_kv = max_seqlen or (max_q, max_kv)
        owned_q = _owned(batch.cu_seqlens_q, batch.q.shape[0], max_q)
        owned_kv = _owned(batch.cu_seqlens_kv, batch.k.shape[0], max_kv)
        # packed_batch poisons the capacity padding; poison the rows cut by max_seqlen as well.
        arrays = {}
        for name, owned in (("q", owned_q), ("k", owned_kv), ("v", owned_kv)):
            values = np.array(getattr(batch, name))
            values[~owned] = np.nan
            arrays[name], arrays[f"{name}64"] = jnp.asarray(values), values.astype(np.float64)
        batch = dataclasses.replace(batch, max_seqlen_q=max_q, max_seqlen_kv=max_kv, **arrays)
        d_out = rng.standard_normal((batch.q.shape[0], hq, dv)).astype(dtype)
        d_out[~owned_q] = np.nan  # the cotangent of rows the op does not own must never be read
        d_stats = rng.standard_normal(batch.q.shape[:2]).astype(np.float32)
        d_stats[~owned_q] = np.nan
        return Inputs(batch, owned_q, owned_kv, d_out, d_stats)

    def attention(self, inputs: Inputs, case: Case, *, stats_layout="token_major", return_stats=True, **extra):
        """The op under test as a function of (q, k, v) alone."""
        batch = inputs.batch

        def attend(q, k, v):
            return ragged_attention(
                q,
                k,
                v,
                batch.cu_seqlens_q,
                batch.cu_seqlens_kv,
                **inputs.max_seqlen,
                stats_layout=stats_layout,
                return_stats=return_stats,
                implementation=self.implementation,
                strategy=self.strategy,
                **case.options(self.sizes),
                **extra,
            )

        return attend

    def run_op(self, f, *args):
        """f(*args), ready; a decline testing/declines.py lists for this implementation is a skip, any other
        decline or error fails."""
        return declines.call(self.implementation, lambda: jax.block_until_ready(f(*args)), skip=self.skipTest)

    def jit(self, f):
        return jax.jit(f, compiler_options=self.compiler_options())

    def compiler_options(self) -> dict:
        return {}

    def forward_and_vjps(self, inputs: Inputs, case: Case, layout: str, *, jit=True, out_only=True, **extra):
        """(out, token-major stats, gradients for both cotangents[, gradients for d_out alone]).

        The second backward takes return_stats=False: no cotangent reaches stats (cuDNN's plain backward);
        the first carries the stats cotangent too (cuDNN's widened one, stats_grad.py)."""
        with_stats = self.attention(inputs, case, stats_layout=layout, **extra)
        without_stats = self.attention(inputs, case, stats_layout=layout, return_stats=False, **extra)

        def step(q, k, v, d_out, d_stats):
            (out, stats), vjp = jax.vjp(with_stats, q, k, v)
            results = out, stats, vjp((d_out, d_stats))
            if out_only:
                results += (jax.vjp(without_stats, q, k, v)[1](d_out),)
            return results

        out, stats, *grads = self.run_op(
            self.jit(step) if jit else step,
            *inputs.batch.args[:3],
            jnp.asarray(inputs.d_out),
            jnp.asarray(_stats_in(layout, inputs.d_stats)),
        )
        return (out, _stats_in(layout, stats), *grads)

    def check_forward_and_vjps(self, results, inputs: Inputs, case: Case, dtype, what=""):
        out, stats, grads, *grads_out_only = results
        expected = inputs.reference(case, self.sizes, d_out=True, d_stats=True)
        check_forward(out, stats, expected, inputs, dtype, what)
        check_gradients(grads, expected, inputs, dtype, f"{what}out and stats cotangents: ")
        if grads_out_only:
            check_gradients(
                grads_out_only[0],
                inputs.reference(case, self.sizes, d_out=True),
                inputs,
                dtype,
                f"{what}out cotangent alone: ",
            )

    @parameterized.named_parameters(*NAMED_CASES)
    def test_forward(self, case_name):
        """Both stats layouts, under jit."""
        case, rng = CASES[case_name], self.rng()
        for dtype in self.dtypes_for(case):
            inputs = self.inputs(rng, case, dtype)
            expected = inputs.reference(case, self.sizes)
            attend = {layout: self.attention(inputs, case, stats_layout=layout) for layout in LAYOUTS}
            # One jit for both layouts: one compilation instead of two.
            results = self.run_op(
                self.jit(lambda q, k, v: {layout: f(q, k, v) for layout, f in attend.items()}), *inputs.batch.args[:3]
            )
            for layout, (out, stats) in results.items():
                want = inputs.batch.q.shape[:2]
                assert stats.shape == (want if layout == "token_major" else want[::-1]), (layout, stats.shape)
                check_forward(out, _stats_in(layout, stats), expected, inputs, dtype, f"{dtype} {layout}: ")

    @parameterized.named_parameters(*NAMED_CASES)
    def test_gradients(self, case_name):
        """dq, dk, dv for an out cotangent alone and with a stats cotangent, under jit; the stats layout
        alternates between cases (a head-major cotangent must be transposed on its way back)."""
        case, rng = CASES[case_name], self.rng()
        layout = LAYOUTS[list(CASES).index(case_name) % 2]
        for dtype in self.dtypes_for(case):
            inputs = self.inputs(rng, case, dtype)
            self.check_forward_and_vjps(
                self.forward_and_vjps(inputs, case, layout), inputs, case, dtype, f"{dtype} {layout}: "
            )

    def test_eager(self):
        """The other tests run under jit; this one dispatches the op and its vjp eagerly."""
        case = self.adapted(CASES["window_tuple_causal"])
        inputs = self.inputs(self.rng(), case, "bfloat16")
        results = self.forward_and_vjps(inputs, case, "head_major", jit=False, out_only=False)
        self.check_forward_and_vjps(results, inputs, case, "bfloat16", "eager: ")

    @parameterized.named_parameters(
        dict(testcase_name="deterministic", deterministic=True), dict(testcase_name="default", deterministic=False)
    )
    def test_reruns_are_bit_identical(self, deterministic):
        """The same jitted step twice: forward bit for bit; gradients bit for bit with deterministic=True (and
        by default where the implementation promises it; else equal up to summation order)."""
        case, dtype = self.adapted(CASES["gqa_causal"]), self.dtypes[0]
        inputs = self.inputs(self.rng(), case, dtype)
        first = self.forward_and_vjps(inputs, case, "head_major", deterministic=deterministic)
        second = self.forward_and_vjps(inputs, case, "head_major", deterministic=deterministic)
        self.check_forward_and_vjps(first, inputs, case, dtype)
        for name, a, b in zip(("out", "stats"), first, second):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name}: two runs differ")
        names = [f"{n} ({c})" for c in ("out and stats cotangents", "out cotangent alone") for n in ("dq", "dk", "dv")]
        for name, a, b in zip(names, jax.tree.leaves(first[2:]), jax.tree.leaves(second[2:])):
            if deterministic or self.deterministic_by_default:
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name}: two runs differ")
            else:  # accumulated with atomics: equal up to summation order
                assert_close(np.asarray(a, np.float64), np.asarray(b, np.float64), dtype, f"{name}: rerun")

    def test_sequences_longer_than_max_seqlen_read_nan(self):
        """A sequence longer than max_seqlen (queries or keys) is invalid: its query rows read NaN, out and
        stats, and take no cotangent (NaN here: never read), so its gradients are 0; its rows past max_seqlen
        are never read (NaN here); every other sequence is the reference's."""
        case = Case(heads=(4, 2), is_causal=True, diagonal_alignment="bottom_right")
        max_q, max_kv = self.sizes.max_seqlen
        cut = (2 * max_q // 3, 2 * max_kv // 3)
        dtype = self.dtypes[0]
        inputs = self.inputs(self.rng(), case, dtype, max_seqlen=cut)
        cu_q = np.asarray(inputs.batch.cu_seqlens_q)
        lengths_q = np.diff(cu_q)
        lengths_kv = np.diff(np.asarray(inputs.batch.cu_seqlens_kv))
        assert lengths_q.max() > cut[0] and lengths_kv.max() > cut[1]  # the case does cut rows away
        loud = np.zeros(inputs.batch.q.shape[0], bool)
        for b in np.flatnonzero((lengths_q > cut[0]) | (lengths_kv > cut[1])):
            loud[cu_q[b] : cu_q[b + 1]] = True
        d_out, d_stats = inputs.d_out.copy(), inputs.d_stats.copy()
        d_out[loud], d_stats[loud] = np.nan, np.nan
        inputs = dataclasses.replace(inputs, d_out=d_out, d_stats=d_stats)  # the reference reads them as 0
        out, stats, grads, grads_out_only = self.forward_and_vjps(inputs, case, "token_major")
        what = f"max_seqlen {cut}: "
        out, stats = np.asarray(out, np.float64), np.asarray(stats, np.float64)
        assert np.isnan(out[loud]).all() and np.isnan(stats[loud]).all(), f"{what}a row of an invalid sequence"
        expected = inputs.reference(case, self.sizes, d_out=True, d_stats=True)
        assert_close(out[~loud], expected["out"][~loud], dtype, f"{what}out")
        assert_close(stats[~loud], expected["stats"][~loud], "float32", f"{what}stats")
        empty = np.isneginf(expected["stats"]) & ~loud[:, None]
        np.testing.assert_array_equal(out[empty], 0.0, err_msg=f"{what}out of rows that attend no key")
        check_gradients(grads, expected, inputs, dtype, f"{what}out and stats cotangents: ")
        check_gradients(
            grads_out_only, inputs.reference(case, self.sizes, d_out=True), inputs, dtype, f"{what}out cotangent: "
        )

    def test_grad_of_stats_alone(self):
        """A loss of stats alone (out's cotangent a symbolic zero), in float16, whose narrow range cuDNN's
        carrying of the stats cotangent must respect; large cotangents."""
        case = self.adapted(CASES["wide_heads_causal"])
        inputs = self.inputs(self.rng(), case, "float16")
        inputs = dataclasses.replace(inputs, d_stats=100 * inputs.d_stats)
        f = self.attention(inputs, case, stats_layout="token_major")
        weights = jnp.asarray(np.nan_to_num(inputs.d_stats))  # the loss's weights: finite everywhere

        def loss(q, k, v):
            stats = f(q, k, v)[1]
            # -inf stats rows get a zero weight through `where`, so the loss stays finite there.
            return jnp.sum(jnp.where(jnp.isfinite(stats), stats * weights, 0.0))

        grads = self.run_op(self.jit(jax.grad(loss, argnums=(0, 1, 2))), *inputs.batch.args[:3])
        expected = inputs.reference(case, self.sizes, d_stats=True)
        check_gradients(grads, expected, inputs, "float16", "stats alone: ")

    def test_checkpoint(self):
        """jax.checkpoint around a loss of out and stats: the rematerialised forward gives the same gradients."""
        case, dtype = CASES["mqa_causal_bottom_right"], self.dtypes[0]
        inputs = self.inputs(self.rng(), case, dtype)
        f = self.attention(inputs, case)
        d_out = jnp.asarray(np.nan_to_num(inputs.d_out), jnp.float32)
        d_stats = jnp.asarray(np.nan_to_num(inputs.d_stats))

        @jax.checkpoint
        def loss(q, k, v):
            out, stats = f(q, k, v)
            return jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(
                jnp.where(jnp.isfinite(stats), stats * d_stats, 0.0)
            )

        grads = self.run_op(self.jit(jax.grad(loss, argnums=(0, 1, 2))), *inputs.batch.args[:3])
        # The loss reads d_out in float32, the reference in the dtype: the same values (d_out is dtype-rounded).
        check_gradients(grads, inputs.reference(case, self.sizes, d_out=True, d_stats=True), inputs, dtype)

    def test_vmap_over_two_batches(self):
        """Two batches of the same capacities but different lengths, stacked on a leading axis."""
        case, dtype = self.adapted(Case(heads=(4, 2), is_causal=True, window=(2, 3))), self.dtypes[0]
        rng = self.rng()
        both = [self.inputs(rng, case, dtype) for _ in range(2)]
        assert both[0].batch.q.shape == both[1].batch.q.shape and both[0].batch.k.shape == both[1].batch.k.shape

        def f(q, k, v, cu_q, cu_kv):
            return ragged_attention(
                q,
                k,
                v,
                cu_q,
                cu_kv,
                **both[0].max_seqlen,
                stats_layout="token_major",
                return_stats=True,
                implementation=self.implementation,
                strategy=self.strategy,
                **case.options(self.sizes),
            )

        def step(args, d_out, d_stats):
            outputs, vjp = jax.vjp(jax.vmap(f), *args)
            return outputs, vjp((d_out, d_stats))[:3]  # the cu_seqlens are integers: their cotangents are float0

        stacked = [jnp.stack(parts) for parts in zip(*(i.batch.args for i in both))]
        (out, stats), grads = self.run_op(
            self.jit(step),
            stacked,
            jnp.asarray(np.stack([i.d_out for i in both])),
            jnp.asarray(np.stack([i.d_stats for i in both])),
        )
        for n, inputs in enumerate(both):
            expected = inputs.reference(case, self.sizes, d_out=True, d_stats=True)
            check_forward(out[n], stats[n], expected, inputs, dtype, f"batch {n}: ")
            check_gradients([g[n] for g in grads], expected, inputs, dtype, f"batch {n}: ")


_CUDNN_REASON = jax_ragged_attn.cudnn_unavailable_reason()


class XlaTest(SemanticsTest):
    """The portable path, on whatever backend runs the tests (the CPU in CI)."""

    __test__ = True
    implementation = "xla"
    dtypes = ("float32", "bfloat16", "float16")
    sizes = Sizes(num_seqs=5, max_seqlen=(7, 9), slack=(3, 2), head_dim_unit=8, window_unit=1)
    deterministic_by_default = True  # plain XLA ops: no atomics
    # Query / key block rows of its online softmax. At the default (128) every buffer here would be one
    # block; small blocks that divide no capacity make sequences straddle blocks, blocks hold pieces of
    # several sequences, the last block is partial and some tiles are masked whole.
    blocks = (8, 5)

    def setUp(self):
        super().setUp()
        # Every call builds its config with these blocks (ragged_attention's xla_block_size); every test traces
        # its own functions.
        self.enter_context(config_overrides(xla_block_size=self.blocks))

    def compiler_options(self) -> dict:
        # These tests spend most of their time compiling; on the CPU, LLVM's -O0 about halves that and leaves
        # XLA's own HLO passes, which decide the arithmetic, as they are (as the sweep's CPU tier does).
        return {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else {}


@pytest.mark.gpu
@pytest.mark.skipif(_CUDNN_REASON is not None, reason=f"cuDNN path unavailable: {_CUDNN_REASON}")
class CudnnTest(SemanticsTest):
    """cuDNN's kernels: sequences over several of their tiles, head dims 32 to 128."""

    __test__ = True
    implementation = "cudnn"
    dtypes = ("bfloat16", "float16")
    sizes = Sizes(num_seqs=6, max_seqlen=(160, 192), slack=(37, 21), head_dim_unit=32, window_unit=4)
    deterministic_by_default = False  # dQ is accumulated with atomics unless deterministic=True


class CudnnPoisonedOutputsTest(CudnnTest):
    """cuDNN with every output filled with NaN before the graph runs and then only the rows no sequence owns
    zeroed (the private config field poison_outputs): the shipped launch leaves the owned rows to cuDNN, so a row
    cuDNN should write but skips would hold stale memory there; here it reads NaN and every check fails on it."""

    def setUp(self):
        super().setUp()
        self.enter_context(backend_options(poison_outputs=True))


class CudnnLeanMemoryTest(CudnnTest):
    """cuDNN with strategy="lean_memory": the backward's intermediates sized by the token capacity
    (max_total_seq_len set). CudnnTest's default "fastest" runs the layout padded to [B, max_seqlen] here
    (B * max_seqlen <= Tq at these sizes): the two subclasses cover both layouts with every case."""

    strategy = "lean_memory"


_FA3_REASON = _fa3.unavailable_reason()


@pytest.mark.gpu
@pytest.mark.skipif(_FA3_REASON is not None, reason=f"FlashAttention-3 unavailable: {_FA3_REASON}")
class Fa3Test(SemanticsTest):
    """FlashAttention-3's kernels through implementation="fa3": cuDNN's sizes, every case at head dim 128 (the
    only one the wheel serves). Cases FA3 declines (a top-left mask it cannot prove equal to its
    bottom-right one) are skips with the reason."""

    __test__ = True
    implementation = "fa3"
    dtypes = ("bfloat16", "float16")
    sizes = Sizes(
        num_seqs=6, max_seqlen=(160, 192), slack=(37, 21), head_dim_unit=32, window_unit=4, head_dim=_fa3.FA3_HEAD_DIM
    )
    deterministic_by_default = False  # dQ is accumulated with atomics unless deterministic=True
    bottom_right_only = True

    def setUp(self):
        super().setUp()
        self.enter_context(config_overrides(fa3_provider="flash-attn3-jax"))


EMULATED_CASES = (
    "mha",
    "causal",
    "causal_bottom_right",
    "mqa_causal_bottom_right",
    "window_causal_bottom_right",
    "window_right_zero_gqa_bottom_right",
    "empty_gqa_causal_bottom_right",
    "all_empty",
)


class Fa3EmulatedTest(SemanticsTest):
    """The FA3 wrapper (fa3/ragged.py: lengths, masks and their alignment, stats layouts, the stats gradient's second
    backward call, row masking) around dense jnp stand-ins of FA3's two kernels (testing/fa3_emulator.py),
    which leave NaN wherever FA3 writes nothing: on the CPU in CI, where the wheel cannot run."""

    __test__ = True
    implementation = "fa3"
    dtypes = ("bfloat16",)  # float16 in test_grad_of_stats_alone; Fa3Test runs both everywhere
    sizes = Sizes(
        num_seqs=5, max_seqlen=(7, 9), slack=(3, 2), head_dim_unit=8, window_unit=1, head_dim=_fa3.FA3_HEAD_DIM
    )
    deterministic_by_default = True  # dense jnp stand-ins
    bottom_right_only = True

    def setUp(self):
        super().setUp()
        self.enter_context(fa3_emulator.patched())

    def compiler_options(self) -> dict:
        return {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else {}


_DEW_REASON = _dew.unavailable_reason()


@pytest.mark.gpu
@pytest.mark.skipif(_DEW_REASON is not None, reason=f"dew-flash-attn unavailable: {_DEW_REASON}")
class DewTest(SemanticsTest):
    """FlashAttention-3's kernels as dew-flash-attn builds them, through implementation="fa3" (the FA3 wrapper
    with the sequences' unused rows handed over as sequences of their own): cuDNN's sizes at head dim 128.
    Declines (a top-left mask it cannot prove, deterministic=True) are skips with the reason."""

    __test__ = True
    implementation = "fa3"
    dtypes = ("bfloat16", "float16")
    sizes = Sizes(num_seqs=6, max_seqlen=(160, 192), slack=(37, 21), head_dim_unit=32, window_unit=4, head_dim=128)
    deterministic_by_default = False
    bottom_right_only = True

    def setUp(self):
        super().setUp()
        self.enter_context(config_overrides(fa3_provider="dew-flash-attn"))


class DewEmulatedTest(Fa3EmulatedTest):
    """fa3/dew.py (the offsets with gaps for the rows past each sequence's used ones) around the same stand-ins,
    taking offsets alone as dew-flash-attn's kernels do: on the CPU in CI."""

    implementation = "fa3"

    def setUp(self):
        SemanticsTest.setUp(self)
        self.enter_context(fa3_emulator.patched_dew())
        self.enter_context(config_overrides(fa3_provider="dew-flash-attn"))


# Only a few of the named cases here (ones FA3 serves, across its masks, GQA and empty sequences), so that CI
# stays quick; Fa3Test runs them all on the real kernels. None is not a test: neither runner collects it.
for _name in [n for n in vars(SemanticsTest) if n.startswith(("test_forward_", "test_gradients_"))]:
    if _name.split("_", 2)[2] not in EMULATED_CASES:
        setattr(Fa3EmulatedTest, _name, None)
# Eager dispatch and rerun determinism are properties of the real kernels (Fa3Test), not of the stand-ins.
for _name in [n for n in vars(SemanticsTest) if n.startswith(("test_eager", "test_reruns_are_bit_identical"))]:
    setattr(Fa3EmulatedTest, _name, None)
