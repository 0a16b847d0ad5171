"""The KV-cache op's conformance tests, written once for its two query layouts (tokamax's test-base pattern).

`KVCacheConformance` checks what every implementation of ragged_attention_with_kvcache must do, whatever the
queries' layout: each named case against the float64 reference (`attention_tests`), jit and vmap, page-table
entries outside the cache never read, check mode naming the bad cache_seqlens / page_table entry eagerly and
under jit, and the gradient with respect to q raising. `XlaKVCacheConformance` adds what the portable path
alone is held to: half precision, the sinks' gradient, the automatic choice, argument validation.

A suite (test_kvcache.py: [B, Sq] decode queries; test_kvcache_varlen.py: packed queries with cu_seqlens_q)
derives from these and provides the hooks below: how inputs are drawn (`draw`, `case_inputs`,
`page_table_case`, `invalid_page_entries`, `vmap_parts`), how the op is called (`attend_inputs` eagerly,
`traced` as a function of arrays), the reference (`reference`, `check`) and what is particular to its
layout (`queries`, `invalid_calls`). Inputs are tuples (q, k_cache, v_cache, cache_seqlens, ..., page_table):
cache_seqlens fourth, the page table last. Tests import this module by name (tests/ is on sys.path under pytest).
"""

from __future__ import annotations

from collections.abc import Callable
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized

from jax_ragged_attn.features.checks import RaggedAttentionInputError, input_errors
from jax_ragged_attn.testing import assert_close
from jax_ragged_attn.testing.helpers import SeededCacheCase


class KVCacheConformance(SeededCacheCase, parameterized.TestCase):
    """The checks every implementation passes in both query layouts; a suite provides the hooks."""

    __test__ = False  # the suites' subclasses run these, each against its implementation
    implementation: str
    dtype = jnp.float32
    head_dim = 16
    page_size = 4
    max_pages = 6  # capacity max_pages * page_size, contiguous too
    contiguous_only = False
    # Two calls give the same bits; False where a kernel's reduction order varies run to run.
    bit_reproducible = True

    # ---- hooks ---------------------------------------------------------------------------------------------

    def draw(self, paged: bool) -> tuple:
        """The suite's default inputs in one cache layout (a suite gives `paged` its default)."""
        raise NotImplementedError

    def case_inputs(self, paged: bool, **case) -> tuple[tuple, dict]:
        """(inputs, the op's options) for one entry of the suite's case table."""
        raise NotImplementedError

    def page_table_case(self) -> tuple[tuple, tuple[int, int]]:
        """Paged inputs, and an entry (sequence, page) of a page that sequence uses."""
        raise NotImplementedError

    def invalid_page_entries(self) -> tuple[tuple, object, object]:
        """Paged inputs whose table points outside the cache on pages some sequences use, and the index of out's
        rows of those sequences (they read NaN) and of the others (exact)."""
        raise NotImplementedError

    def vmap_parts(self, paged: bool) -> list[tuple]:
        """Inputs of equal shapes, to stack and vmap over."""
        raise NotImplementedError

    def attend_inputs(self, inputs: tuple, **kwargs):
        """The op on `inputs` through self.implementation; a listed decline is a skip naming its reason."""
        raise NotImplementedError

    def traced(self, inputs: tuple, **kwargs) -> tuple[Callable, tuple]:
        """(f, arrays): the public op through self.implementation (or kwargs' implementation) as a function of
        the inputs' arrays, q first, cache_seqlens fourth, the page table last; static sizes closed over."""
        raise NotImplementedError

    def reference(self, inputs: tuple, **options) -> dict:
        """The float64 reference's out and stats."""
        raise NotImplementedError

    def check(self, inputs: tuple, *, sinks=None, compare=slice(None), **options):
        """Runs the op twice (bit-identical), both stats layouts, against the reference; returns out."""
        raise NotImplementedError

    def queries(self, inputs: tuple, out):
        """out's rows that hold queries."""
        return out

    def invalid_calls(self, inputs: tuple) -> list[tuple[Callable, str]]:
        """(call, message): calls with a malformed argument, and what their ValueError says."""
        raise NotImplementedError

    # ---- attention -----------------------------------------------------------------------------------------

    def need(self, paged: bool) -> None:
        if paged and self.contiguous_only:
            self.skipTest(f"{self.implementation} serves contiguous caches only")

    def attention(self, paged, **case):
        """One named case against the reference (`attention_tests` makes the tests)."""
        self.need(paged)
        inputs, options = self.case_inputs(paged, **case)
        self.check(inputs, **options)

    @parameterized.parameters(False, True)
    def test_jit(self, paged):
        self.need(paged)
        inputs = self.draw(paged)
        run, arrays = self.traced(inputs)
        self.attend_inputs(inputs)  # skips where declined
        assert_close(jax.jit(run)(*arrays), self.reference(inputs)["out"], self.dtype, "out under jit")

    @parameterized.parameters(False, True)
    def test_vmap(self, paged):
        self.need(paged)
        parts = self.vmap_parts(paged)
        self.attend_inputs(parts[0])  # skips where declined
        run, first = self.traced(parts[0])
        arrays = [self.traced(part)[1] for part in parts]
        stacked = [None if a is None else jnp.stack([p[i] for p in arrays]) for i, a in enumerate(first)]
        out = jax.vmap(run, in_axes=tuple(None if a is None else 0 for a in first))(*stacked)
        for i, part in enumerate(parts):
            assert_close(out[i], self.reference(part)["out"], self.dtype, f"vmapped element {i}")

    def test_invalid_page_entries_are_never_read(self):
        # Pages some sequences use are outside the cache: those sequences read NaN on every path, the other
        # sequences must be exact, and nothing may fault.
        self.need(True)
        inputs, unread, exact = self.invalid_page_entries()
        out = self.check(inputs, compare=exact)
        self.assertTrue(np.isnan(np.asarray(out, np.float32)[unread]).all())

    # ---- check mode ----------------------------------------------------------------------------------------

    def test_check_names_cache_seqlens(self):
        inputs = self.draw()
        lengths = inputs[3]
        bad = lengths.at[3].set(self.capacity + 1)
        with self.assertRaisesRegex(RaggedAttentionInputError, rf"cache_seqlens\[3\] = {self.capacity + 1}"):
            self.attend_inputs(inputs[:3] + (bad,) + inputs[4:], check=True)
        op, arrays = self.traced(inputs, check=True)
        run = jax.jit(lambda n: op(*arrays[:3], n, *arrays[4:]))
        with self.assertRaisesRegex(RaggedAttentionInputError, r"cache_seqlens\[3\]"), input_errors():
            jax.block_until_ready(run(bad))
        jax.block_until_ready(run(lengths))  # valid: no error

    def test_check_names_page_table(self):
        self.need(True)
        inputs, (b, p) = self.page_table_case()
        self.attend_inputs(inputs, check=True)  # -1 and past-the-cache on unused pages: fine
        bad = inputs[-1].at[b, p].set(-2)
        with self.assertRaisesRegex(RaggedAttentionInputError, rf"page_table\[{b}, {p}\] = -2"):
            self.attend_inputs(inputs[:-1] + (bad,), check=True)
        op, arrays = self.traced(inputs, check=True)
        run = jax.jit(lambda t: op(*arrays[:-1], t))
        with self.assertRaisesRegex(RaggedAttentionInputError, rf"page_table\[{b}, {p}\]"), input_errors():
            jax.block_until_ready(run(bad))

    # ---- forward only --------------------------------------------------------------------------------------

    def test_gradient_raises(self):
        inputs = self.draw()
        inputs = (jnp.nan_to_num(inputs[0]),) + inputs[1:]  # packed q's spare rows are NaN
        self.attend_inputs(inputs)  # skips where declined
        op, arrays = self.traced(inputs)
        loss = lambda q: op(q, *arrays[1:]).astype(jnp.float32).sum()
        with self.assertRaisesRegex(NotImplementedError, "forward-only"):
            jax.grad(loss)(inputs[0])


def attention_tests(cases: dict) -> Callable:
    """test_attention for a suite's class body (`test_attention = attention_tests(CASES)`): one test per case and
    cache layout, test_attention_<case>_<contiguous|paged>, each a call of KVCacheConformance.attention with the
    case's keywords."""
    return parameterized.named_parameters(
        [
            dict(case, testcase_name=f"{name}_{'paged' if paged else 'contiguous'}", paged=paged)
            for name, case in cases.items()
            for paged in (False, True)
        ]
    )(KVCacheConformance.attention)


class XlaKVCacheConformance(KVCacheConformance):
    """What the portable path is held to in both layouts, beyond what every implementation passes."""

    __test__ = False

    @parameterized.parameters(jnp.bfloat16, jnp.float16)
    def test_half_precision(self, dtype):
        with mock.patch.object(self, "dtype", dtype):
            self.check(self.draw(True), local_window_size=(4, 0))

    def test_sinks_gradient(self):
        inputs = self.draw(True)
        sinks = jnp.asarray(self.rng.standard_normal(4), jnp.float32)

        def loss(s):
            op, arrays = self.traced(inputs, sinks=s)
            return self.queries(inputs, op(*arrays)).sum()

        grad = jax.grad(loss)(sinks)
        step = 1e-3
        numeric = [(loss(sinks.at[h].add(step)) - loss(sinks.at[h].add(-step))) / (2 * step) for h in range(4)]
        np.testing.assert_allclose(grad, numeric, rtol=2e-2, atol=1e-3)

    def test_auto_picks_what_serves(self):
        inputs = self.draw(True)
        op, arrays = self.traced(inputs, implementation=None)
        assert_close(op(*arrays), self.reference(inputs)["out"], self.dtype, "out")
        for name in ("cudnn", "fa3"):
            op, arrays = self.traced(inputs, implementation=name)
            with self.assertRaisesRegex(NotImplementedError, f"implementation='{name}' cannot serve"):
                op(*arrays)

    def test_validation_names_the_argument(self):
        for call, message in self.invalid_calls(self.draw(True)):
            with self.assertRaisesRegex(ValueError, message):
                call()
