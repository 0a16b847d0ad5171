"""FlashAttention's calls, with their names and their semantics, through jax_ragged_attn.flash_attn_varlen_func and
flash_attn_with_kvcache (inputs/flash_attn.py), run per implementation.

The expected values come from `fa_attention` below: a dense float64 NumPy attention per sequence that spells out
FlashAttention's own rule from its docstring (flash_attn_interface.py, 2.1 and later; FlashAttention 3 the same):
query i of a sequence with sq queries and sk keys attends keys j with

    i + sk - sq - window_size[0] <= j <= i + sk - sq + window_size[1]      (a -1 side unlimited)

and causal=True caps the right side at the diagonal i + sk - sq (bottom-right). It shares no code with the
package; gradients are held to the package's float64 reference (testing/reference.py) with bottom-right masks.
Sequences have different numbers of queries and keys (more queries than keys, fewer, none of either), so the
bottom-right alignment is what is tested; every row outside a sequence is NaN in q, k, v and the cotangent.

`FlashAttnCompatTest` holds the checks; `XlaFlashAttnCompatTest` runs them on the xla path (CPU in CI),
`CudnnFlashAttnCompatTest` and `Fa3FlashAttnCompatTest` on the GPU (`-m gpu`; skipped with the reason elsewhere).
The KV-cache classes do the same for flash_attn_with_kvcache.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import jax_ragged_attn
from jax_ragged_attn import (
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
    ragged_attention,
    ragged_attention_with_kvcache,
)
from jax_ragged_attn.backends.fa3 import ragged as _fa3
from jax_ragged_attn.testing import assert_close, declines, packed_batch, reference_attention
from jax_ragged_attn.testing.helpers import SeededCacheCase
from jax_ragged_attn.testing.private_config import config_overrides


def fa_attention(q, k, v, cu_q, cu_k, *, causal, window_size, scale=None, softcap=0.0):
    """FlashAttention's varlen attention, dense, float64: (out [Tq, Hq, Dv], lse [Hq, Tq]); rows without a key
    and rows past cu_q[-1] read out 0 and lse -inf."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    cu_q, cu_k = np.asarray(cu_q), np.asarray(cu_k)
    tq, hq, d = q.shape
    group = hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    left, right = window_size
    out = np.zeros((tq, hq, v.shape[2]))
    lse = np.full((hq, tq), -np.inf)
    for b in range(len(cu_q) - 1):
        sq, sk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        for i in range(sq):
            diagonal = i + sk - sq
            first = 0 if left < 0 else max(0, diagonal - left)
            last = sk - 1 if right < 0 else min(sk - 1, diagonal + right)
            if causal:
                last = min(last, diagonal)
            if last < first:
                continue  # no key: out 0, lse -inf
            row = cu_q[b] + i
            keys = slice(cu_k[b] + first, cu_k[b] + last + 1)
            for h in range(hq):
                scores = scale * k[keys, h // group] @ q[row, h]
                if softcap:
                    scores = softcap * np.tanh(scores / softcap)
                top = scores.max()
                weights = np.exp(scores - top)
                out[row, h] = weights @ v[keys, h // group] / weights.sum()
                lse[h, row] = top + np.log(weights.sum())
    return out, lse


@dataclasses.dataclass(frozen=True)
class Sizes:
    lengths: tuple[tuple[int, int], ...]  # (sq, sk) per sequence, bottom-right's cases among them
    slack: tuple[int, int]  # NaN rows past the last sequence, of q and of k / v
    head_dim: int
    window_unit: int  # a case's window sides are multiples of this


# (sq, sk): more queries than keys (the first sq - sk rows see no key under causal), fewer, equal, no key,
# no query, and one of each bound.
XLA_LENGTHS = ((7, 3), (2, 9), (5, 5), (4, 0), (0, 6), (6, 8))
GPU_LENGTHS = ((160, 64), (40, 192), (128, 128), (96, 0), (0, 150), (150, 181))

# name -> flash_attn_varlen_func keywords (window sides in window_units; -1 stays -1).
CASES = {
    "causal": dict(causal=True),
    "not_causal": dict(causal=False),
    "causal_gqa": dict(causal=True, heads=(6, 2)),
    "causal_mqa_scale": dict(causal=True, heads=(4, 1), softmax_scale=0.3),
    "window": dict(window_size=(2, 1)),
    "window_causal": dict(causal=True, window_size=(3, 0)),
    "window_causal_right_ignored": dict(causal=True, window_size=(2, 2)),  # causal caps the right side at 0
    "window_left_only": dict(window_size=(2, -1)),
    "window_right_only": dict(window_size=(-1, 1)),
    "window_left_zero": dict(causal=True, window_size=(0, 0)),  # the diagonal key alone
    "softcap_causal": dict(causal=True, softcap=1.5, heads=(4, 2)),
}
ALL_DTYPES = ("causal", "window_causal", "softcap_causal")  # every dtype of the implementation; the rest its first


class FlashAttnCompatTest(parameterized.TestCase):
    """FlashAttention's varlen call, its names and bottom-right semantics; a subclass names the implementation."""

    __test__ = False  # the subclasses run these, each against its implementation
    implementation: str
    dtypes: tuple[str, ...]
    sizes: Sizes

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(zlib.crc32(f"{type(self).__name__}.{self._testMethodName}".encode()))

    def batch(self, rng, dtype, heads=(4, 2)):
        lengths_q, lengths_k = zip(*self.sizes.lengths)
        d = self.sizes.head_dim
        return packed_batch(
            rng,
            lengths_q,
            lengths_k,
            num_heads_q=heads[0],
            num_heads_kv=heads[1],
            head_dim_qk=d,
            head_dim_v=d,
            dtype=dtype,
            slack_q=self.sizes.slack[0],
            slack_kv=self.sizes.slack[1],
        )

    def options(self, case: dict) -> dict:
        options = {key: value for key, value in case.items() if key != "heads"}
        if "window_size" in options:
            unit = self.sizes.window_unit
            options["window_size"] = tuple(side if side < 0 else side * unit for side in options["window_size"])
        return options

    def jit(self, f):
        return jax.jit(f, compiler_options=self.compiler_options())

    def compiler_options(self) -> dict:
        return {}

    def run_op(self, f, *args):
        """f(*args), ready; a decline testing/declines.py lists for this implementation is a skip, any other
        decline or error fails."""
        return declines.call(self.implementation, lambda: jax.block_until_ready(f(*args)), skip=self.skipTest)

    def varlen(self, batch, **options):
        """flash_attn_varlen_func over the batch as a function of (q, k, v), FlashAttention's argument names."""
        return lambda q, k, v: flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=batch.cu_seqlens_q,
            cu_seqlens_k=batch.cu_seqlens_kv,
            max_seqlen_q=batch.max_seqlen_q,
            max_seqlen_k=batch.max_seqlen_kv,
            implementation=self.implementation,
            **options,
        )

    @parameterized.named_parameters(*[dict(testcase_name=name, case_name=name) for name in CASES])
    def test_forward_and_lse(self, case_name):
        """out and softmax_lse ([Hq, total_q], float32) against FlashAttention's rule; (out, lse, None)."""
        case, rng = CASES[case_name], self.rng()
        options = self.options(case)
        for dtype in self.dtypes if case_name in ALL_DTYPES else self.dtypes[:1]:
            batch = self.batch(rng, dtype, case.get("heads", (4, 2)))
            out, lse, probabilities = self.run_op(
                self.jit(self.varlen(batch, return_attn_probs=True, **options)), *batch.args[:3]
            )
            self.assertIsNone(probabilities)
            expected_out, expected_lse = fa_attention(
                batch.q64,
                batch.k64,
                batch.v64,
                batch.cu_seqlens_q,
                batch.cu_seqlens_kv,
                causal=options.get("causal", False),
                window_size=options.get("window_size", (-1, -1)),
                scale=options.get("softmax_scale"),
                softcap=options.get("softcap", 0.0),
            )
            self.assertEqual(out.dtype, batch.q.dtype)
            self.assertEqual((lse.shape, lse.dtype), ((batch.q.shape[1], batch.q.shape[0]), jnp.float32))
            assert_close(out, expected_out, dtype, f"{dtype} out")
            assert_close(lse, expected_lse, "float32", f"{dtype} softmax_lse")
            empty = np.isneginf(expected_lse).T  # [Tq, Hq]: rows without a key, and padding
            np.testing.assert_array_equal(np.asarray(out, np.float64)[empty], 0.0)
            if case_name == "causal":  # the first sq - sk rows of sequence 0 (more queries than keys) see no key
                sq, sk = self.sizes.lengths[0]
                self.assertTrue(np.isneginf(np.asarray(lse)[:, : sq - sk]).all())
                self.assertTrue(np.isfinite(np.asarray(lse)[:, sq - sk : sq]).all())

    @parameterized.named_parameters(
        *[dict(testcase_name=name, case_name=name) for name in ("causal", "causal_gqa", "window_causal", "window")]
    )
    def test_gradients(self, case_name):
        """dq, dk, dv through FlashAttention's call, held to the float64 reference with bottom-right masks; the
        out cotangent is NaN on rows no sequence owns."""
        case, rng = CASES[case_name], self.rng()
        options = self.options(case)
        dtype = self.dtypes[0]
        batch = self.batch(rng, dtype, case.get("heads", (4, 2)))
        owned = ~batch.padding_q
        d_out = rng.standard_normal((batch.q.shape[0], batch.q.shape[1], batch.v.shape[2])).astype(dtype)
        d_out[~owned] = np.nan
        f = self.varlen(batch, **options)
        grads = self.run_op(self.jit(lambda q, k, v, g: jax.vjp(f, q, k, v)[1](g)), *batch.args[:3], jnp.asarray(d_out))
        window = options.get("window_size", (-1, -1))
        expected = reference_attention(
            *batch.reference_args,
            max_seqlen_q=batch.max_seqlen_q,
            max_seqlen_kv=batch.max_seqlen_kv,
            is_causal=options.get("causal", False),
            diagonal_alignment="bottom_right",
            local_window_size=None if window == (-1, -1) else window,
            d_out=np.nan_to_num(d_out.astype(np.float64)),
        )
        for name, grad in zip(("dq", "dk", "dv"), grads):
            assert_close(grad, expected[name], dtype, f"{dtype} {name}")
        self.assertGreater(np.abs(expected["dq"]).max(), 0)

    def test_positional_call_in_flash_attention_order(self):
        """FlashAttention 2's positional order: ..., max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
        softcap, alibi_slopes, deterministic, return_attn_probs."""
        batch = self.batch(self.rng(), self.dtypes[0])
        window = (2 * self.sizes.window_unit, 0)
        out, lse, _ = self.run_op(
            self.jit(
                lambda q, k, v: flash_attn_varlen_func(
                    q,
                    k,
                    v,
                    batch.cu_seqlens_q,
                    batch.cu_seqlens_kv,
                    batch.max_seqlen_q,
                    batch.max_seqlen_kv,
                    0.0,
                    0.5,
                    True,
                    window,
                    0.0,
                    None,
                    False,
                    True,
                )
            ),
            *batch.args[:3],
        )
        expected_out, expected_lse = fa_attention(
            batch.q64,
            batch.k64,
            batch.v64,
            batch.cu_seqlens_q,
            batch.cu_seqlens_kv,
            causal=True,
            window_size=window,
            scale=0.5,
        )
        assert_close(out, expected_out, self.dtypes[0], "out")
        assert_close(lse, expected_lse, "float32", "softmax_lse")

    def test_without_return_attn_probs_returns_out_alone(self):
        batch = self.batch(self.rng(), self.dtypes[0])
        out = self.run_op(self.jit(self.varlen(batch, causal=True)), *batch.args[:3])
        self.assertIsInstance(out, jax.Array)
        self.assertEqual(out.shape, batch.q.shape)

    def test_deterministic_reruns_are_bit_identical(self):
        batch = self.batch(self.rng(), self.dtypes[0])
        f = self.varlen(batch, causal=True, deterministic=True)
        loss = self.jit(
            jax.grad(
                lambda q, k, v: jnp.sum(
                    jnp.where(jnp.asarray(~batch.padding_q)[:, None, None], f(q, k, v), 0).astype(jnp.float32)
                ),
                argnums=(0, 1, 2),
            )
        )
        first, second = self.run_op(loss, *batch.args[:3]), self.run_op(loss, *batch.args[:3])
        for name, a, b in zip(("dq", "dk", "dv"), first, second):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)


class XlaFlashAttnCompatTest(FlashAttnCompatTest):
    """The xla path, on whatever backend runs the tests (the CPU in CI), with small blocks so that sequences
    straddle them."""

    __test__ = True
    implementation = "xla"
    dtypes = ("float32", "bfloat16")
    sizes = Sizes(lengths=XLA_LENGTHS, slack=(3, 2), head_dim=16, window_unit=1)

    def setUp(self):
        super().setUp()
        self.enter_context(config_overrides(xla_block_size=(8, 5)))

    def compiler_options(self) -> dict:
        # Compiling dominates on the CPU; LLVM's -O0 about halves it and leaves XLA's HLO passes as they are.
        return {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else {}


_CUDNN_REASON = jax_ragged_attn.cudnn_unavailable_reason()
_FA3_REASON = _fa3.unavailable_reason()
GPU_SIZES = Sizes(lengths=GPU_LENGTHS, slack=(37, 21), head_dim=128, window_unit=16)


@pytest.mark.gpu
@pytest.mark.skipif(_CUDNN_REASON is not None, reason=f"cuDNN path unavailable: {_CUDNN_REASON}")
class CudnnFlashAttnCompatTest(FlashAttnCompatTest):
    __test__ = True
    implementation = "cudnn"
    dtypes = ("bfloat16", "float16")
    sizes = GPU_SIZES


@pytest.mark.gpu
@pytest.mark.skipif(_FA3_REASON is not None, reason=f"FlashAttention-3 unavailable: {_FA3_REASON}")
class Fa3FlashAttnCompatTest(FlashAttnCompatTest):
    __test__ = True
    implementation = "fa3"
    dtypes = ("bfloat16", "float16")
    sizes = GPU_SIZES


# ---- flash_attn_with_kvcache ---------------------------------------------------------------------------------


def fa_kvcache_attention(q, k_rows, v_rows, *, causal, window_size, scale=None):
    """FlashAttention's kvcache attention, dense, float64, from each sequence's key rows (lists of [n, Hkv, D]):
    (out [B, Sq, Hq, Dv], lse [B, Hq, Sq]); the queries are the sequence's last Sq positions."""
    batch, sq = q.shape[:2]
    outs, lses = [], []
    for b in range(batch):
        cu_q, cu_k = np.array([0, sq]), np.array([0, len(k_rows[b])])
        out, lse = fa_attention(
            q[b], k_rows[b], v_rows[b], cu_q, cu_k, causal=causal, window_size=window_size, scale=scale
        )
        outs.append(out)
        lses.append(lse)
    return np.stack(outs), np.stack(lses)


class FlashAttnKVCacheCompatTest(SeededCacheCase, parameterized.TestCase):
    """flash_attn_with_kvcache: cache_seqlens before the append, the append returned, bottom-right queries."""

    __test__ = False
    implementation: str
    dtype: str
    head_dim: int
    page_size: int
    max_pages: int
    contiguous_only = False

    def make(self, *, paged, new_rows, seqlen_q=3, heads=(4, 2)):
        """q, the caches (NaN on every row no sequence uses yet, the rows to be appended included), the new k, v,
        cache_seqlens before the append, the page table, and each sequence's key rows after the append."""
        if paged and self.contiguous_only:
            self.skipTest(f"{self.implementation} serves contiguous caches only")
        (hq, hkv), d = heads, self.head_dim
        room = self.capacity - new_rows
        before = np.array([room, 0, 1, room // 2, self.page_size], np.int32)  # full, empty, short, ...
        batch = len(before)
        cast = lambda x: np.asarray(x, self.dtype).astype(np.float64)
        q = cast(self.rng.standard_normal((batch, seqlen_q, hq, d)))
        rows_k = [cast(self.rng.standard_normal((n + new_rows, hkv, d))) for n in before]
        rows_v = [cast(self.rng.standard_normal((n + new_rows, hkv, d))) for n in before]
        if paged:
            num_pages = batch * self.max_pages + 1
            order = self.rng.permutation(num_pages)  # sequence b's pages anywhere in the cache
            table = order[: batch * self.max_pages].reshape(batch, self.max_pages).astype(np.int32)
            k_cache = np.full((num_pages, self.page_size, hkv, d), np.nan)
        else:
            table = None
            k_cache = np.full((batch, self.capacity, hkv, d), np.nan)
        v_cache = k_cache.copy()
        for b, n in enumerate(before):
            for r in range(n):  # the rows in use before the append
                at = (b, r) if table is None else (table[b, r // self.page_size], r % self.page_size)
                k_cache[at], v_cache[at] = rows_k[b][r], rows_v[b][r]
        new_k = np.stack([rows[n:] for rows, n in zip(rows_k, before)]) if new_rows else None
        new_v = np.stack([rows[n:] for rows, n in zip(rows_v, before)]) if new_rows else None
        device = lambda x: None if x is None else jnp.asarray(x, self.dtype)
        return dict(
            q=device(q),
            k_cache=device(k_cache),
            v_cache=device(v_cache),
            k=device(new_k),
            v=device(new_v),
            cache_seqlens=jnp.asarray(before),
            table=None if table is None else jnp.asarray(table),
        ), (q, rows_k, rows_v)

    def call(self, arguments, **options):
        """flash_attn_with_kvcache through self.implementation; a decline testing/declines.py lists is a skip."""
        return declines.call(
            self.implementation,
            flash_attn_with_kvcache,
            arguments["q"],
            arguments["k_cache"],
            arguments["v_cache"],
            arguments["k"],
            arguments["v"],
            cache_seqlens=arguments["cache_seqlens"],
            block_table=arguments["table"],
            implementation=self.implementation,
            skip=self.skipTest,
            **options,
        )

    @parameterized.named_parameters(
        [
            dict(testcase_name=f"{name}_{'paged' if paged else 'contiguous'}", paged=paged, **options)
            for name, options in (
                ("causal", dict(causal=True)),
                ("not_causal", dict(causal=False)),
                ("window", dict(causal=True, window_size=(4, 0))),
                ("mqa_scale", dict(causal=True, heads=(4, 1), softmax_scale=0.3)),
            )
            for paged in (False, True)
        ]
    )
    def test_append_then_attend(self, paged, heads=(4, 2), **options):
        """k and v written at cache_seqlens (the length before them), the queries attending the appended cache
        bottom-right; (out, softmax_lse, k_cache, v_cache)."""
        arguments, (q, rows_k, rows_v) = self.make(paged=paged, new_rows=2, heads=heads)
        out, lse, k_cache, v_cache = self.call(arguments, return_softmax_lse=True, **options)
        expected_out, expected_lse = fa_kvcache_attention(
            q,
            rows_k,
            rows_v,
            causal=options["causal"],
            window_size=options.get("window_size", (-1, -1)),
            scale=options.get("softmax_scale"),
        )
        assert_close(out, expected_out, self.dtype, "out")
        assert_close(lse, expected_lse, self.dtype, "softmax_lse")
        self.assertEqual(lse.shape, (q.shape[0], q.shape[2], q.shape[1]))  # [B, Hq, Sq]
        table = arguments["table"]
        for b, n in enumerate(np.asarray(arguments["cache_seqlens"])):
            for r in range(n + 2):  # every row in use after the append, from the returned caches
                at = (b, r) if table is None else (int(table[b, r // self.page_size]), r % self.page_size)
                np.testing.assert_array_equal(np.asarray(k_cache[at], np.float64), rows_k[b][r])
                np.testing.assert_array_equal(np.asarray(v_cache[at], np.float64), rows_v[b][r])

    @parameterized.named_parameters(
        [
            dict(testcase_name=f"{name}_{'paged' if paged else 'contiguous'}", paged=paged, causal=causal)
            for name, causal in (("causal", True), ("not_causal", False))
            for paged in (False, True)
        ]
    )
    def test_packed_queries_and_new_keys(self, paged, causal):
        """FlashAttention 3's varlen form (a serving step): sequence b appends m_b packed rows (cu_seqlens_k_new)
        and its m_b queries (cu_seqlens_q) attend the appended cache; out [T, Hq, Dv], softmax_lse [Hq, T]."""
        new = np.array([3, 1, 0, 2, 1])  # a prefill chunk, decode rows, a sequence with nothing this step
        arguments, (q, rows_k, rows_v) = self.make(paged=paged, new_rows=int(new.max()), seqlen_q=int(new.max()))
        before = np.asarray(arguments["cache_seqlens"])
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(new)]), jnp.int32)
        pack = lambda x: jnp.concatenate([x[b, :m] for b, m in enumerate(new)])
        out, lse, k_cache, _ = self.call(
            dict(arguments, q=pack(arguments["q"]), k=pack(arguments["k"]), v=pack(arguments["v"])),
            cu_seqlens_q=cu,
            cu_seqlens_k_new=cu,
            max_seqlen_q=int(new.max()),
            return_softmax_lse=True,
            causal=causal,
        )
        self.assertEqual(out.shape, (int(new.sum()),) + q.shape[2:])
        self.assertEqual(lse.shape, (q.shape[2], int(new.sum())))  # [Hq, T]
        for b, m in enumerate(new):
            if not m:
                continue
            rows = slice(int(cu[b]), int(cu[b + 1]))
            expected_out, expected_lse = fa_kvcache_attention(
                q[b : b + 1, :m],
                [rows_k[b][: before[b] + m]],
                [rows_v[b][: before[b] + m]],
                causal=causal,
                window_size=(-1, -1),
            )
            assert_close(out[rows], expected_out[0], self.dtype, f"out of sequence {b}")
            assert_close(lse[:, rows], expected_lse[0], self.dtype, f"softmax_lse of sequence {b}")
            table = arguments["table"]
            for r in range(before[b], before[b] + m):  # the appended rows, from the returned cache
                at = (b, r) if table is None else (int(table[b, r // self.page_size]), r % self.page_size)
                np.testing.assert_array_equal(np.asarray(k_cache[at], np.float64), rows_k[b][r])

    @parameterized.parameters(False, True)
    def test_without_new_keys_returns_out_alone(self, paged):
        arguments, (q, rows_k, rows_v) = self.make(paged=paged, new_rows=0, seqlen_q=1)
        out = self.call(arguments, causal=True)
        self.assertIsInstance(out, jax.Array)
        expected_out, _ = fa_kvcache_attention(q, rows_k, rows_v, causal=True, window_size=(-1, -1))
        assert_close(out, expected_out, self.dtype, "out")

    def test_int_cache_seqlens_and_page_table_name(self):
        """An int cache_seqlens is every sequence's length (0 here: the new row is written at row 0 and is the
        only key); FlashAttention 3's page_table names the table."""
        arguments, (q, rows_k, rows_v) = self.make(paged=not self.contiguous_only, new_rows=1, seqlen_q=2)
        out, k_cache, _ = declines.call(
            self.implementation,
            flash_attn_with_kvcache,
            arguments["q"],
            arguments["k_cache"],
            arguments["v_cache"],
            arguments["k"],
            arguments["v"],
            cache_seqlens=0,
            page_table=arguments["table"],
            causal=False,
            implementation=self.implementation,
            skip=self.skipTest,
        )
        before = np.asarray(arguments["cache_seqlens"])
        new_k = [rows[n:] for rows, n in zip(rows_k, before)]
        new_v = [rows[n:] for rows, n in zip(rows_v, before)]
        expected_out, _ = fa_kvcache_attention(q, new_k, new_v, causal=False, window_size=(-1, -1))
        assert_close(out, expected_out, self.dtype, "out")
        table = arguments["table"]
        for b in range(q.shape[0]):
            at = (b, 0) if table is None else (int(table[b, 0]), 0)
            np.testing.assert_array_equal(np.asarray(k_cache[at], np.float64), new_k[b][0])


class XlaFlashAttnKVCacheCompatTest(FlashAttnKVCacheCompatTest):
    __test__ = True
    implementation = "xla"
    dtype = "float32"
    head_dim = 16
    page_size = 4
    max_pages = 5


@pytest.mark.gpu
@pytest.mark.skipif(_CUDNN_REASON is not None, reason=f"cuDNN path unavailable: {_CUDNN_REASON}")
class CudnnFlashAttnKVCacheCompatTest(FlashAttnKVCacheCompatTest):
    __test__ = True
    implementation = "cudnn"
    dtype = "bfloat16"
    head_dim = 64
    page_size = 64
    max_pages = 4


@pytest.mark.gpu
@pytest.mark.skipif(_FA3_REASON is not None, reason=f"FlashAttention-3 unavailable: {_FA3_REASON}")
class Fa3FlashAttnKVCacheCompatTest(FlashAttnKVCacheCompatTest):
    __test__ = True
    implementation = "fa3"
    dtype = "bfloat16"
    head_dim = 128
    page_size = 40
    max_pages = 8


# ---- what FlashAttention has and this package does not; FlashAttention's names given to our own calls ---------


def _small_batch():
    return packed_batch(
        np.random.default_rng(0),
        (3, 2),
        (4, 2),
        num_heads_q=2,
        num_heads_kv=2,
        head_dim_qk=8,
        head_dim_v=8,
        dtype="float32",
    )


@pytest.mark.parametrize(
    "keywords, argument",
    [
        (dict(dropout_p=0.1), "dropout_p"),
        (dict(alibi_slopes=jnp.ones(2)), "alibi_slopes"),
        (dict(block_table=jnp.zeros((2, 1), jnp.int32)), "block_table"),
    ],
)
def test_varlen_unsupported_arguments_raise_naming_them(keywords, argument):
    batch = _small_batch()
    with pytest.raises(NotImplementedError, match=f"^{argument} is not supported: "):
        flash_attn_varlen_func(*batch.args, batch.max_seqlen_q, batch.max_seqlen_kv, **keywords)


@pytest.mark.parametrize(
    "keywords, argument",
    [
        (dict(rotary_cos=jnp.ones((8, 4)), rotary_sin=jnp.ones((8, 4))), "rotary_cos"),
        (dict(rotary_sin=jnp.ones((8, 4))), "rotary_sin"),
        (dict(cache_batch_idx=jnp.arange(2)), "cache_batch_idx"),
        (dict(cache_leftpad=jnp.zeros(2, jnp.int32)), "cache_leftpad"),
        (dict(alibi_slopes=jnp.ones(2)), "alibi_slopes"),
        (dict(num_splits=2), "num_splits"),
    ],
)
def test_kvcache_unsupported_arguments_raise_naming_them(keywords, argument):
    q, cache = jnp.ones((2, 1, 2, 8)), jnp.ones((2, 8, 2, 8))
    with pytest.raises(NotImplementedError, match=f"^{argument} is not supported: "):
        flash_attn_with_kvcache(q, cache, cache, cache_seqlens=3, **keywords)


def test_kvcache_argument_errors():
    q, cache = jnp.ones((2, 1, 2, 8), jnp.float32), jnp.ones((2, 8, 2, 8), jnp.float32)
    new = jnp.ones((2, 1, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match="k and v come together"):
        flash_attn_with_kvcache(q, cache, cache, k=new, cache_seqlens=3)
    with pytest.raises(ValueError, match="cache_seqlens is required with k and v"):
        flash_attn_with_kvcache(q, cache, cache, k=new, v=new)
    with pytest.raises(ValueError, match="not both"):
        flash_attn_with_kvcache(
            q,
            cache,
            cache,
            cache_seqlens=3,
            block_table=jnp.zeros((2, 1), jnp.int32),
            page_table=jnp.zeros((2, 1), jnp.int32),
        )
    # No cache_seqlens: the whole cache (FlashAttention's meaning without lengths).
    out = flash_attn_with_kvcache(q, cache, cache, causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(out), 1.0, rtol=1e-6)


@pytest.mark.parametrize("window_size", [(-1,), 3, (1.5, 0), (True, 0)])
def test_window_size_must_be_a_pair_of_ints(window_size):
    batch = _small_batch()
    with pytest.raises(ValueError, match="window_size must be a \\(left, right\\) pair of ints"):
        flash_attn_varlen_func(*batch.args, batch.max_seqlen_q, batch.max_seqlen_kv, window_size=window_size)


def test_causal_cross_attention_is_bottom_right_not_ragged_attentions_default():
    """The trap: for cross-attention FlashAttention's causal=True is ragged_attention's
    diagonal_alignment="bottom_right", not its default top-left."""
    batch = _small_batch()
    bounds = dict(max_seqlen_q=batch.max_seqlen_q, max_seqlen_kv=batch.max_seqlen_kv)
    ours, bottom_right, top_left = jax.jit(
        lambda q, k, v, cu_q, cu_k: (
            flash_attn_varlen_func(q, k, v, cu_q, cu_k, batch.max_seqlen_q, batch.max_seqlen_kv, causal=True),
            ragged_attention(q, k, v, cu_q, cu_k, **bounds, is_causal=True, diagonal_alignment="bottom_right"),
            ragged_attention(q, k, v, cu_q, cu_k, **bounds, is_causal=True),
        )
    )(*batch.args)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(bottom_right))
    assert np.abs(np.asarray(ours) - np.asarray(top_left)).max() > 0.1


# FlashAttention's keyword -> ours: a TypeError naming ours (never a silent translation).
FA_NAMES = {
    "window_size": ((-1, 0), "local_window_size="),
    "softmax_scale": (0.5, "scale="),
    "causal": (True, "is_causal="),
    "return_softmax_lse": (True, "return_stats="),
    "return_attn_probs": (True, "return_stats="),
    "cu_seqlens_k": (None, "cu_seqlens_kv="),
    "max_seqlen_k": (4, "max_seqlen_kv="),
    "seqused_k": (None, "seqused_kv="),
}


@pytest.mark.parametrize("name", FA_NAMES)
def test_flash_attention_names_given_to_ragged_attention_name_ours(name):
    batch = _small_batch()
    value, ours = FA_NAMES[name]
    with pytest.raises(
        TypeError, match=f"^ragged_attention\\(\\) got an unexpected keyword argument '{name}': pass {ours} instead"
    ) as raised:
        ragged_attention(*batch.args, max_seqlen_q=4, max_seqlen_kv=4, **{name: value})
    assert "flash_attn_varlen_func" in str(raised.value)
    if name in ("causal", "window_size"):
        assert 'diagonal_alignment="bottom_right"' in str(raised.value)
    if name == "window_size":
        assert "-1" in str(raised.value)


def test_unknown_keywords_are_still_named():
    batch = _small_batch()
    with pytest.raises(TypeError, match="^ragged_attention\\(\\) got an unexpected keyword argument 'colour'"):
        ragged_attention(*batch.args, max_seqlen_q=4, max_seqlen_kv=4, colour=1)
    with pytest.raises(TypeError, match="'is_casual': did you mean is_causal="):
        ragged_attention(*batch.args, max_seqlen_q=4, max_seqlen_kv=4, is_casual=True)
    with pytest.raises(TypeError, match="takes 5 positional arguments"):  # the positional refusal is unchanged
        ragged_attention(*batch.args, 4, 4)


@pytest.mark.parametrize(
    "name, value, ours",
    [
        ("window_size", (2, 0), "local_window_size="),
        ("softmax_scale", 0.5, "scale="),
        ("causal", False, "is_causal="),
        ("return_softmax_lse", True, "return_stats="),
        ("block_table", None, "page_table="),
    ],
)
def test_flash_attention_names_given_to_ragged_attention_with_kvcache_name_ours(name, value, ours):
    q, cache = jnp.ones((2, 1, 2, 8)), jnp.ones((2, 8, 2, 8))
    with pytest.raises(
        TypeError,
        match=f"^ragged_attention_with_kvcache\\(\\) got an unexpected keyword argument '{name}': pass {ours} instead",
    ):
        ragged_attention_with_kvcache(q, cache, cache, jnp.full(2, 3), **{name: value})
    with pytest.raises(TypeError, match="'k': append new keys and values with kvcache_append"):
        ragged_attention_with_kvcache(q, cache, cache, jnp.full(2, 3), k=q)
