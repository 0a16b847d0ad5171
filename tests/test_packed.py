"""Fused projections: qkv [T, 3, H, D] and kv [T, 2, Hkv, D].

CPU: the xla path against the float64 reference; the cuDNN path's lowering (its kernels need a GPU) passes
the packed buffer itself to the handlers and builds no full-size concatenate. GPU: the cuDNN path against
the reference over a fuzz of packings, stats layouts, head counts and padding.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ragged_attn.backends.cudnn import graphs, launch
from jax_ragged_attn.backends.cudnn import options as cudnn_options
from jax_ragged_attn.backends.cudnn import ragged as cudnn
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.config import AttentionOptions, make_config
from jax_ragged_attn.features import checks
from jax_ragged_attn.index import cu_seqlens_from_lengths
from jax_ragged_attn.inputs import packed
from jax_ragged_attn.testing import assert_close
from jax_ragged_attn.testing.private_config import backend_options
from jax_ragged_attn.testing.reference import reference_attention

OPTIONS = dict(is_causal=True, diagonal_alignment="bottom_right")


def _packed_inputs(rng, lengths_q, lengths_kv, heads_q, heads_kv, dim, dtype, slack, layout):
    """(arrays for the op, float64 q, k, v for the reference, cu_q, cu_kv); padding rows are NaN."""
    tq, tkv = sum(lengths_q) + slack, sum(lengths_kv) + slack
    q = rng.standard_normal((tq, heads_q, dim))
    k = rng.standard_normal((tkv, heads_kv, dim))
    v = rng.standard_normal((tkv, heads_kv, dim))
    q[sum(lengths_q) :] = np.nan
    k[sum(lengths_kv) :] = np.nan
    v[sum(lengths_kv) :] = np.nan
    q, k, v = (x.astype(dtype) for x in (q, k, v))  # the reference sees exactly the rounded values
    cu_q, cu_kv = cu_seqlens_from_lengths(lengths_q), cu_seqlens_from_lengths(lengths_kv)
    if layout == "qkv":
        arrays = (jnp.asarray(np.stack([q, k, v], axis=1)),)
    else:
        arrays = (jnp.asarray(q), jnp.asarray(np.stack([k, v], axis=1)))
    return arrays, tuple(x.astype(np.float64) for x in (q, k, v)), jnp.asarray(cu_q), jnp.asarray(cu_kv)


def _attend(layout, arrays, cu_q, cu_kv, max_q, max_kv, **options):
    if layout == "qkv":
        return packed.ragged_attention_qkvpacked(arrays[0], cu_q, max_seqlen=max_q, return_stats=True, **options)
    return packed.ragged_attention_kvpacked(
        *arrays, cu_q, cu_kv, max_seqlen_q=max_q, max_seqlen_kv=max_kv, return_stats=True, **options
    )


def _check_against_reference(layout, arrays, ref_qkv, cu_q, cu_kv, max_q, max_kv, dtype, stats_layout, rng, **options):
    tq, hq = ref_qkv[0].shape[:2]
    d_out = rng.standard_normal((tq, hq, ref_qkv[2].shape[2])).astype(dtype)
    d_out[int(cu_q[-1]) :] = np.nan  # the cotangent of padding rows must never be read

    @jax.jit
    def step(arrays, d_out):
        def attend(*arrays):
            return _attend(layout, arrays, cu_q, cu_kv, max_q, max_kv, stats_layout=stats_layout, **OPTIONS, **options)

        (out, stats), vjp = jax.vjp(attend, *arrays)
        return (
            out,
            stats,
            vjp((d_out, jnp.zeros_like(stats)) if options.get("implementation") == "xla" else (d_out, None)),
        )

    if options.get("implementation") == "xla":
        out, stats, grads = step(arrays, jnp.asarray(d_out))
    else:  # stats as aux: no stats cotangent on the cuDNN path's plain backward

        @jax.jit
        def step_aux(arrays, d_out):
            def attend(*arrays):
                out, stats = _attend(
                    layout, arrays, cu_q, cu_kv, max_q, max_kv, stats_layout=stats_layout, **OPTIONS, **options
                )
                return out, stats

            out, vjp, stats = jax.vjp(attend, *arrays, has_aux=True)
            return out, stats, vjp(d_out)

        out, stats, grads = step_aux(arrays, jnp.asarray(d_out))
    expected = reference_attention(
        *ref_qkv,
        np.asarray(cu_q),
        np.asarray(cu_kv),
        max_seqlen_q=max_q,
        max_seqlen_kv=max_kv,
        d_out=d_out.astype(np.float64),
        **OPTIONS,
    )
    assert_close(np.asarray(out, np.float64), expected["out"], dtype, "out")
    stats = np.asarray(stats, np.float64)
    assert_close(stats.T if stats_layout == "head_major" else stats, expected["stats"], "float32", "stats")
    if layout == "qkv":
        (d_qkv,) = grads
        assert d_qkv.shape == arrays[0].shape
        parts = {"dq": d_qkv[:, 0], "dk": d_qkv[:, 1], "dv": d_qkv[:, 2]}
    else:
        d_q, d_kv = grads
        assert d_q.shape == arrays[0].shape and d_kv.shape == arrays[1].shape
        parts = {"dq": d_q, "dk": d_kv[:, 0], "dv": d_kv[:, 1]}
    for name, grad in parts.items():
        assert_close(np.asarray(grad, np.float64), expected[name], dtype, name)


@pytest.mark.parametrize("layout", ["qkv", "kv"])
@pytest.mark.parametrize("stats_layout", ["head_major", "token_major"])
def test_xla_path_matches_the_reference(layout, stats_layout):
    rng = np.random.default_rng([3, len(layout), len(stats_layout)])
    heads_kv = 4 if layout == "qkv" else 2
    lengths_q = [9, 0, 13, 4]
    lengths_kv = lengths_q if layout == "qkv" else [7, 3, 13, 0]
    arrays, ref_qkv, cu_q, cu_kv = _packed_inputs(rng, lengths_q, lengths_kv, 4, heads_kv, 16, "float32", 5, layout)
    _check_against_reference(
        layout, arrays, ref_qkv, cu_q, cu_kv, 13, 13, "float32", stats_layout, rng, implementation="xla"
    )


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: packed.ragged_attention_qkvpacked(
                jnp.zeros((8, 2, 4, 16)), jnp.array([0, 8], jnp.int32), max_seqlen=8
            ),
            r"qkv must be \[T, 3, H, D\], got shape \(8, 2, 4, 16\)",
        ),
        (
            lambda: packed.ragged_attention_qkvpacked(
                jnp.zeros((8, 3, 64)), jnp.array([0, 8], jnp.int32), max_seqlen=8
            ),
            r"qkv must be \[T, 3, H, D\]",
        ),
        (
            lambda: packed.ragged_attention_kvpacked(
                jnp.zeros((8, 4, 16)),
                jnp.zeros((8, 3, 2, 16)),
                jnp.array([0, 8], jnp.int32),
                jnp.array([0, 8], jnp.int32),
                max_seqlen_q=8,
                max_seqlen_kv=8,
            ),
            r"kv must be \[Tkv, 2, Hkv, D\]",
        ),
        (
            lambda: packed.ragged_attention_kvpacked(
                jnp.zeros((8, 3, 16), jnp.float32),
                jnp.zeros((8, 2, 2, 16), jnp.float32),
                jnp.array([0, 8], jnp.int32),
                jnp.array([0, 8], jnp.int32),
                max_seqlen_q=8,
                max_seqlen_kv=8,
            ),
            r"q's heads \(3\)",
        ),
    ],
)
def test_malformed_packed_inputs_name_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def _lowered_cudnn_grad(monkeypatch, layout, guard=False, poison=False):
    """The StableHLO of jax.grad through the cuDNN path (lowering needs no GPU; graph_info is stubbed)."""
    monkeypatch.setattr(launch, "graph_info", lambda direction, config, layout=None: {"workspace_bytes": 64})
    t, h, d = 32, 4, 16
    cu = jnp.array([0, 10, 20, 25], jnp.int32)
    view = jax.ShapeDtypeStruct((t, h, d), jnp.bfloat16)
    config = make_config(
        view, view, view, cu, cu, AttentionOptions(is_causal=True), max_seqlen_q=16, max_seqlen_kv=16, packing=layout
    )
    config = dataclasses.replace(config, guard_workspace=guard)
    monkeypatch.setattr(cudnn_options, "OPTIONS", cudnn_options.CudnnOptions(poison_outputs=poison))
    if layout == "qkv":
        args = (jnp.zeros((t, 3, h, d), jnp.bfloat16),)
    elif layout == "kv":
        args = (jnp.zeros((t, h, d), jnp.bfloat16), jnp.zeros((t, 2, h, d), jnp.bfloat16))
    else:
        args = tuple(jnp.zeros((t, h, d), jnp.bfloat16) for _ in range(3))

    def loss(*args):
        return jnp.sum(launch.attention(args, cu, cu, config)[0].astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))).lower(*args).as_text()


@pytest.mark.parametrize("layout", ["qkv", "kv"])
def test_cudnn_path_hands_the_packed_buffer_to_the_kernels_and_never_concatenates(monkeypatch, layout):
    text = _lowered_cudnn_grad(monkeypatch, layout)
    calls = {m.group(1): m.group(2) for m in re.finditer(r"custom_call @(jax_ragged_attn_\w+)\(([^)]*)\)", text)}
    assert set(calls) == {extension.FORWARD_TARGET, extension.BACKWARD_TARGET}, calls
    packed_arg = "%arg0" if layout == "qkv" else "%arg1"
    for target in (extension.FORWARD_TARGET, extension.BACKWARD_TARGET):
        operands = calls[target].split(", ")
        assert operands[1:3] == [packed_arg, packed_arg], (target, operands)  # k and v: the packed buffer itself
        if layout == "qkv":
            assert operands[0] == packed_arg, (target, operands)
    # The backward writes one gradient per packed input, in its shape: (dq, dkv) or (dqkv,), then the workspace.
    backward = re.search(r"custom_call @" + extension.BACKWARD_TARGET + r"\([^)]*\)[^\n]*-> \(([^)]*)\)", text)
    results = re.findall(r"tensor<([^>]*)>", backward.group(1))
    expected = ["32x3x4x16xbf16"] if layout == "qkv" else ["32x4x16xbf16", "32x2x4x16xbf16"]
    assert results[:-1] == expected and results[-1].endswith("xui8"), results
    full = "32x3x4x16xbf16" if layout == "qkv" else "32x2x4x16xbf16"
    concatenates = [line for line in text.splitlines() if "concatenate" in line]
    assert not [line for line in concatenates if full in line], concatenates
    slices = [line for line in text.splitlines() if "slice" in line and full in line]
    assert not slices, slices  # nor does it split the packed buffer


@pytest.mark.parametrize("mode", ["unowned", "poisoned", "check_mode"])
@pytest.mark.parametrize("layout", ["none", "kv", "qkv"])
def test_every_packing_calls_the_two_handlers_with_one_gradient_per_input(monkeypatch, layout, mode):
    """The handlers' contract (ffi/handlers.cc): one forward and one backward target for every packing and
    mode. Their arguments are q, k, v (the buffer holding each) [, out, d_out, stats], 7 index arrays, then
    initial buffers aliased to results: none unguarded (the zero_outputs attribute has the handler zero the
    rows it does not own, with poison_outputs after filling every output with NaN), and in check mode a
    canary-filled workspace and one larger canary-filled buffer per result; the backward's results are one
    gradient per input buffer in its shape, then the workspace."""
    guard = mode == "check_mode"
    text = _lowered_cudnn_grad(monkeypatch, layout, guard, poison=mode == "poisoned")
    calls = re.findall(r"custom_call @(jax_ragged_attn_\w+)\(([^)]*)\)(.*)", text)
    assert sorted(target for target, _, _ in calls) == sorted([extension.FORWARD_TARGET, extension.BACKWARD_TARGET])
    gradients = {"none": ["32x4x16xbf16"] * 3, "kv": ["32x4x16xbf16", "32x2x4x16xbf16"], "qkv": ["32x3x4x16xbf16"]}[
        layout
    ]
    for target, operands, rest in calls:
        results = re.findall(r"tensor<([^>]*)>", rest.rsplit("-> ", 1)[1])
        rows = 32 + 2 * checks.GUARD_ROWS if guard else 32  # check mode adds canary rows to every output
        if target == extension.BACKWARD_TARGET:
            expected = [g.replace("32x", f"{rows}x", 1) for g in gradients]
            assert results[:-1] == expected and results[-1].endswith("xui8"), results
        plain = (3 if target == extension.FORWARD_TARGET else 6) + 7
        initial = {"unowned": 0, "poisoned": 0, "check_mode": len(results)}[mode]
        assert len(operands.split(", ")) == plain + initial, (target, operands)
        aliases = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", rest)
        # Check mode: the workspace (the last result) is the first guarded argument, then one per result in
        # order.
        expected_aliases = {
            "unowned": set(),
            "poisoned": set(),
            "check_mode": {(len(results) - 1, plain)} | {(i, plain + 1 + i) for i in range(len(results) - 1)},
        }[mode]
        assert {(int(r), int(o)) for r, o in aliases} == expected_aliases, (target, aliases)
        # Unguarded, the handler zeroes the rows it does not own itself (the zero_outputs attribute,
        # graphs.ZERO_OUTPUTS); check mode leaves that to Python.
        expected_zeroing = graphs.ZERO_OUTPUTS.index({"check_mode": "no"}.get(mode, mode))
        assert f"zero_outputs = {expected_zeroing}" in rest, (target, rest)


@pytest.mark.parametrize("packing, parts", [("none", (1, 1)), ("kv", (1, 2)), ("qkv", (3, 3))])
def test_ragged_offsets_step_over_every_part_of_a_packed_row(packing, parts):
    view_q = jax.ShapeDtypeStruct((20, 4, 16), jnp.bfloat16)
    view_kv = jax.ShapeDtypeStruct((20, 4 if packing == "qkv" else 2, 16), jnp.bfloat16)
    cu = jnp.array([0, 7, 7, 19], jnp.int32)
    config = make_config(
        view_q,
        view_kv,
        view_kv,
        cu,
        cu,
        AttentionOptions(stats_layout="token_major"),
        max_seqlen_q=12,
        max_seqlen_kv=12,
        packing=packing,
    )
    _, _, offset_q, offset_k, offset_v, offset_o, offset_stats = launch._index_arrays(cu, cu, config)
    hkv = view_kv.shape[1]
    np.testing.assert_array_equal(offset_q, np.asarray(cu) * parts[0] * 4 * 16)
    np.testing.assert_array_equal(offset_k, np.asarray(cu) * parts[1] * hkv * 16)
    np.testing.assert_array_equal(offset_v, np.asarray(cu) * parts[1] * hkv * 16)
    np.testing.assert_array_equal(offset_o, np.asarray(cu) * 4 * 16)  # out has its own buffer
    np.testing.assert_array_equal(offset_stats, np.asarray(cu) * 4)


_REASON = extension.cudnn_unavailable_reason()


def _fuzz_cases(count: int):
    """Packings x stats layouts x head counts x dims x lengths x slack, drawn from one seed per case (the
    way cudnn-frontend's strided-layout fuzzing draws per-tensor token strides)."""
    cases = []
    for seed in range(count):
        rng = np.random.default_rng([2026, seed])
        layout = ("qkv", "kv")[seed % 2]
        heads_q = int(rng.choice([4, 8, 16]))
        heads_kv = heads_q if layout == "qkv" else int(rng.choice([h for h in (1, 2, 4, 8) if heads_q % h == 0]))
        dim = int(rng.choice([64, 128]))
        batch = int(rng.integers(1, 9))
        lengths_q = [int(n) for n in rng.integers(0, 300, batch)]
        lengths_kv = lengths_q if layout == "qkv" else [int(n) for n in rng.integers(0, 300, batch)]
        cases.append(
            dict(
                seed=seed,
                layout=layout,
                heads=(heads_q, heads_kv),
                dim=dim,
                lengths_q=lengths_q,
                lengths_kv=lengths_kv,
                slack=int(rng.integers(0, 40)),
                stats_layout=str(rng.choice(["head_major", "token_major"])),
                dtype=str(rng.choice(["bfloat16", "float16"])),
                check=bool(seed % 5 == 0),
                autotune=bool(seed % 4 == 1),
                # NaN in every output row cuDNN is trusted to write, both packings, both sides
                poison_outputs=seed % 3 == 1,
            )
        )
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("case", _fuzz_cases(12), ids=lambda c: f"seed{c['seed']}-{c['layout']}")
def test_cudnn_packed_strides_match_the_reference(case, monkeypatch, tmp_path):
    if _REASON is not None:
        pytest.skip(f"cuDNN path unavailable: {_REASON}")
    from jax_ragged_attn.backends.cudnn import autotune

    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path / "autotune.json"))  # autotune measures packed graphs
    rng = np.random.default_rng([case["seed"], 1])
    arrays, ref_qkv, cu_q, cu_kv = _packed_inputs(
        rng,
        case["lengths_q"],
        case["lengths_kv"],
        *case["heads"],
        case["dim"],
        case["dtype"],
        case["slack"],
        case["layout"],
    )
    max_q = max(max(case["lengths_q"]), 1)
    max_kv = max(max(case["lengths_kv"]), 1)
    try:
        with backend_options(poison_outputs=case["poison_outputs"]):
            _check_against_reference(
                case["layout"],
                arrays,
                ref_qkv,
                cu_q,
                cu_kv,
                max_q,
                max_kv,
                case["dtype"],
                case["stats_layout"],
                rng,
                implementation="cudnn",
                check=case["check"],
                autotune=case["autotune"],
            )
    except AssertionError as error:
        raise AssertionError(f"{case}: {error}") from None


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["qkv", "kv"])
def test_cudnn_compiled_program_has_no_full_size_concatenate(layout):
    if _REASON is not None:
        pytest.skip(f"cuDNN path unavailable: {_REASON}")
    rng = np.random.default_rng(5)
    arrays, _, cu_q, cu_kv = _packed_inputs(rng, [100, 50], [100, 50], 8, 8, 64, "bfloat16", 6, layout)
    arrays = tuple(jnp.nan_to_num(a) for a in arrays)

    def loss(*arrays):
        out = _attend(layout, arrays, cu_q, cu_kv, 100, 100, implementation="cudnn")[0]
        return jnp.sum(out.astype(jnp.float32))

    compiled = jax.jit(jax.grad(loss, argnums=tuple(range(len(arrays))))).lower(*arrays).compile().as_text()
    full = "bf16[156,3,8,64]" if layout == "qkv" else "bf16[156,2,8,64]"
    # Optimised HLO reads `%name = bf16[...] concatenate(...)`: the result type follows the `=`.
    concatenates = [line for line in compiled.splitlines() if " concatenate(" in line]
    assert not [line for line in concatenates if full in line.split("=", 1)[1].split("concatenate(")[0]], concatenates


@pytest.mark.gpu
@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(packing=2, num_heads_kv=2), "packed qkv needs Hq == Hkv and Tq == Tkv"),
        (dict(packing=1, head_dim_v=64), "packed k and v need Dqk == Dv"),
        (dict(packing=3), "packing must be 0"),
    ],
)
def test_the_extension_refuses_packed_attributes_that_would_run_past_a_buffer(changes, message):
    """Defence in depth under the Python wrappers: graph building and tuning reject a packed layout whose
    parts do not fit one row, so no handler ever runs with it."""
    if _REASON is not None:
        pytest.skip(f"cuDNN path unavailable: {_REASON}")
    view = jax.ShapeDtypeStruct((64, 4, 128), jnp.bfloat16)
    cu = jnp.array([0, 30, 64], jnp.int32)
    config = make_config(view, view, view, cu, cu, AttentionOptions(is_causal=True), max_seqlen_q=40, max_seqlen_kv=40)
    attributes = {**cudnn.ffi_attributes(config), **changes}
    ext = extension.module()
    for direction in ("forward", "backward"):
        info = ext.graph_info(direction, 0, attributes)
        assert info["status"] == "error" and message in info["message"], info
        tuned = ext.tune_plans(direction, 0, attributes)
        assert tuned["status"] == "error" and message in tuned["message"], tuned
