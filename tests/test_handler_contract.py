"""The two FFI handlers' argument / result / attribute contract, on a CPU.

tests/native/ffi_call_frame.cc calls the real handler symbols with a hand-built XLA call frame, so their
decoding and every check before the launch run here: a call that passes them all stops at "cuDNN is not
loaded" (in a process that loaded cuDNN, a GPU run, the tests skip), every other call must stop with an
error that names the problem. The contract, as ffi/handlers.cc states it:

    forward:  q, k, v, 7 index arrays [, workspace, o, stats]      -> o, stats, workspace
    backward: q, k, v, o, d_o, stats, 7 index arrays [, workspace, one per gradient]
              -> d_q, d_k, d_v | d_q, d_kv | d_qkv (packing none | kv | qkv), workspace
    attributes: every field of extension.config_fields(), by name
"""

from __future__ import annotations

import ctypes
import pathlib
import shutil
import subprocess

import jax
import pytest

from jax_ragged_attn.backends.shared import extension

NATIVE = pathlib.Path(__file__).resolve().parent / "native" / "ffi_call_frame.cc"
BF16, F16, F32, S32, U8, S64 = 16, 10, 11, 4, 6, 5  # XLA_FFI_DataType
REACHED_THE_GRAPH = "cuDNN is not loaded"

B, T, H, D = 2, 64, 4, 128
CONFIG = dict(
    num_seqs=B,
    capacity_q=T,
    capacity_kv=T,
    num_heads_q=H,
    num_heads_kv=H,
    head_dim_qk=D,
    head_dim_v=D,
    max_seqlen_q=40,
    max_seqlen_kv=40,
    dtype=0,
    scale=0.125,
    softcap=0.0,
    bottom_right=0,
    left_bound=-1,
    right_bound=-1,
    stats_token_major=0,
    use_max_total_seq_len=1,
    deterministic=0,
    plan_index=-1,
    packing=0,
    zero_outputs=0,
)
INDEX = [(S32, (B,))] * 2 + [(S32, (B + 1,))] * 5
Q = O = (BF16, (T, H, D))
KV = (BF16, (T, 2, H, D))
QKV = (BF16, (T, 3, H, D))
STATS = (F32, (H, T))
WORKSPACE = (U8, (4096,))


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler to build tests/native/ffi_call_frame.cc")
    library = tmp_path_factory.mktemp("native") / "libffi_call_frame.so"
    subprocess.run(
        [compiler, "-std=c++17", "-shared", "-fPIC", f"-I{jax.ffi.include_dir()}", str(NATIVE), "-o", str(library)],
        check=True,
    )
    lib = ctypes.CDLL(str(library))
    lib.harness_message.restype = ctypes.c_char_p
    lib.harness_traits.restype = ctypes.c_long
    lib.harness_traits.argtypes = [ctypes.c_void_p]
    return lib


@pytest.fixture(scope="module")
def handlers():
    ext = extension.module()
    pointer = ctypes.pythonapi.PyCapsule_GetPointer
    pointer.restype = ctypes.c_void_p
    pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    capsules = ext.registrations()
    # Each attention target is a dict of FFI stages; the contract is its execute stage's.
    return {
        direction: pointer(capsules[extension.targets()[direction]]["execute"], None)
        for direction in ("forward", "backward")
    }


def _array(ctype, values):
    return (ctype * max(len(values), 1))(*values)


def _call(harness, handlers, direction, args, results, attributes=None):
    """(error code, message) of one call: 0 and "" when the handler succeeded."""
    if extension.module().cudnn_version():
        # A call that passes every check would then build a graph and launch it on the fake pointers.
        pytest.skip("cuDNN is loaded in this process (a GPU run): the contract is checked where it is not")
    kinds = dict(extension.config_fields())
    attributes = sorted((CONFIG if attributes is None else attributes).items())  # XLA passes them sorted by name
    code = harness.harness_call(
        ctypes.c_void_p(handlers[direction]),
        len(args),
        _array(ctypes.c_int, [d for d, _ in args]),
        _array(ctypes.c_int, [len(s) for _, s in args]),
        _array(ctypes.c_int64, [x for _, s in args for x in s]),
        len(results),
        _array(ctypes.c_int, [d for d, _ in results]),
        _array(ctypes.c_int, [len(s) for _, s in results]),
        _array(ctypes.c_int64, [x for _, s in results for x in s]),
        len(attributes),
        _array(ctypes.c_char_p, [n.encode() for n, _ in attributes]),
        _array(ctypes.c_int, [F32 if kinds.get(n) == "float32" else S64 for n, _ in attributes]),
        _array(ctypes.c_double, [float(v) for _, v in attributes]),
    )
    return code, harness.harness_message().decode()


def _expect(result, needle):
    code, message = result
    assert code != 0 and needle in message, (code, message)


def test_exactly_two_handlers_both_command_buffer_compatible(harness, handlers):
    assert set(handlers) == {"forward", "backward"}
    attention = {
        name
        for name in extension.module().registrations()
        if name
        not in (extension.PAGED_FORWARD_TARGET, "jax_ragged_attn_zero_rows", "jax_ragged_attn_clamp_cache_index")
    }
    assert attention == {extension.FORWARD_TARGET, extension.BACKWARD_TARGET}
    for pointer in handlers.values():
        assert harness.harness_traits(pointer) & 1, "XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE"


FORWARD_ARGS = [Q, Q, Q, *INDEX]
FORWARD_RESULTS = [O, STATS, WORKSPACE]
BACKWARD_RESULTS = {0: [Q, Q, Q, WORKSPACE], 1: [Q, KV, WORKSPACE], 2: [QKV, WORKSPACE]}
BACKWARD_INPUTS = {0: [Q, Q, Q], 1: [Q, KV, KV], 2: [QKV, QKV, QKV]}


@pytest.mark.parametrize("guarded", [False, True])
@pytest.mark.parametrize("packing", [0, 1, 2])
def test_every_mode_and_packing_passes_every_check(harness, handlers, packing, guarded):
    config = {**CONFIG, "packing": packing}
    inputs = BACKWARD_INPUTS[packing]
    # Check mode: the workspace, then each other result, aliased to the results.
    extra = lambda results: [results[-1], *results[:-1]] if guarded else []
    _expect(
        _call(harness, handlers, "forward", [*inputs, *INDEX, *extra(FORWARD_RESULTS)], FORWARD_RESULTS, config),
        REACHED_THE_GRAPH,
    )
    results = BACKWARD_RESULTS[packing]
    _expect(
        _call(harness, handlers, "backward", [*inputs, O, O, STATS, *INDEX, *extra(results)], results, config),
        REACHED_THE_GRAPH,
    )


@pytest.mark.parametrize("packing", [0, 1, 2])
def test_the_backward_results_must_match_the_packing(harness, handlers, packing):
    config = {**CONFIG, "packing": packing}
    args = [*BACKWARD_INPUTS[packing], O, O, STATS, *INDEX]
    for other in {0, 1, 2} - {packing}:
        _expect(
            _call(harness, handlers, "backward", args, BACKWARD_RESULTS[other], config),
            f"returns {len(BACKWARD_RESULTS[packing]) - 1} gradient buffer(s) and then the workspace",
        )
    results = BACKWARD_RESULTS[packing]
    _expect(
        _call(harness, handlers, "backward", args, [*results[:-1], (BF16, (4096,))], config),
        "the backward's last result is the workspace, uint8",
    )


def test_a_packed_gradient_of_the_wrong_shape_is_named(harness, handlers):
    config = {**CONFIG, "packing": 1}
    _expect(
        _call(harness, handlers, "backward", [Q, KV, KV, O, O, STATS, *INDEX], [Q, QKV, WORKSPACE], config),
        "d_kv is [64, 3, 4, 128]",
    )
    _expect(
        _call(harness, handlers, "backward", [Q, Q, Q, O, O, STATS, *INDEX], [Q, Q, (BF16, (T, H, 64)), WORKSPACE]),
        "d_v is",
    )


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_initial_buffers_must_be_each_result_or_the_workspace_then_each_result(harness, handlers, direction):
    """Zero-filled outputs come as one buffer per result but the workspace; check mode's as the workspace,
    then one per result. Any other count, or a buffer that is not its result's, is refused."""
    inputs = FORWARD_ARGS if direction == "forward" else [Q, Q, Q, O, O, STATS, *INDEX]
    results = FORWARD_RESULTS if direction == "forward" else BACKWARD_RESULTS[0]
    _expect(
        _call(harness, handlers, direction, [*inputs, *results, results[-1]], results),
        f"after the index arrays come either the {len(results) - 1} results but the workspace",
    )
    _expect(_call(harness, handlers, direction, [*inputs, *results[:-2]], results), "after the index arrays")
    _expect(
        _call(harness, handlers, direction, [*inputs, results[-1], *results[:-2]], results),
        f"the initial buffer aliased to {'o' if direction == 'forward' else 'd_q'} is",
    )
    _expect(
        _call(harness, handlers, direction, [*inputs, *results], results), "the initial buffer aliased to workspace is"
    )


@pytest.mark.parametrize(
    "args, results, attributes, message",
    [
        ([(BF16, (T, H, 64)), Q, Q, *INDEX], FORWARD_RESULTS, CONFIG, "q is [64, 4, 64]"),
        ([Q, KV, KV, *INDEX], FORWARD_RESULTS, {**CONFIG, "packing": 2}, "q is"),
        ([Q, Q, Q, (S32, (B + 1,)), *INDEX[1:]], FORWARD_RESULTS, CONFIG, "seq_len_q is [3]"),
        ([Q, Q, Q, *INDEX[:-1], (S32, (B,))], FORWARD_RESULTS, CONFIG, "offset_stats is [2]"),
        (FORWARD_ARGS, [(F16, (T, H, D)), STATS, WORKSPACE], CONFIG, "o is"),
        (FORWARD_ARGS, FORWARD_RESULTS, {**CONFIG, "stats_token_major": 1}, "stats is [4, 64]"),
        (FORWARD_ARGS, [O, STATS, (S32, (16,))], CONFIG, "Wrong buffer dtype: expected U8"),
        (FORWARD_ARGS, FORWARD_RESULTS, {**CONFIG, "packing": 3}, "packing must be 0"),
        (FORWARD_ARGS, FORWARD_RESULTS, {**CONFIG, "zero_outputs": 4}, "zero_outputs must be 0 (no), 1 (all)"),
        (
            [Q, KV, KV, *INDEX],
            [(BF16, (T, H, 64)), STATS, WORKSPACE],
            {**CONFIG, "packing": 1, "head_dim_v": 64},
            "packed k and v need Dqk == Dv",
        ),
        (
            [QKV, QKV, QKV, *INDEX],
            FORWARD_RESULTS,
            {**CONFIG, "packing": 2, "num_heads_kv": 2},
            "packed qkv needs Hq == Hkv",
        ),
    ],
    ids=[
        "q-shape",
        "packing-vs-buffers",
        "seq_len_q",
        "offset_stats",
        "o-dtype",
        "stats-layout",
        "workspace-dtype",
        "packing-range",
        "zero-outputs-range",
        "kv-head-dims",
        "qkv-heads",
    ],
)
def test_the_forward_names_what_is_wrong(harness, handlers, args, results, attributes, message):
    _expect(_call(harness, handlers, "forward", args, results, attributes), message)


def test_the_backward_checks_its_inputs(harness, handlers):
    _expect(
        _call(
            harness,
            handlers,
            "backward",
            [Q, Q, Q, O, O, STATS, *INDEX],
            BACKWARD_RESULTS[0],
            {**CONFIG, "zero_outputs": -1},
        ),
        "zero_outputs must be 0",
    )
    _expect(
        _call(harness, handlers, "backward", [Q, Q, Q, O, (BF16, (T, H, 64)), STATS, *INDEX], BACKWARD_RESULTS[0]),
        "d_o is",
    )
    _expect(
        _call(harness, handlers, "backward", [Q, Q, Q, O, O, (BF16, (H, T)), *INDEX], BACKWARD_RESULTS[0]),
        "Wrong buffer dtype: expected F32",
    )


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_the_attributes_must_be_exactly_the_exported_fields(harness, handlers, direction):
    args = FORWARD_ARGS if direction == "forward" else [Q, Q, Q, O, O, STATS, *INDEX]
    results = FORWARD_RESULTS if direction == "forward" else BACKWARD_RESULTS[0]
    missing = {k: v for k, v in CONFIG.items() if k != "plan_index"}
    _expect(_call(harness, handlers, direction, args, results, missing), "Wrong number of attributes")
    _expect(
        _call(harness, handlers, direction, args, results, {**CONFIG, "new_field": 1}), "Wrong number of attributes"
    )


def test_the_ffi_decoder_reads_every_field_into_its_own_slot(harness, handlers):
    """A value per field that no other has; the handler's error message describes the configuration it
    decoded, which must equal what the trace-time dict decoder makes of the same values."""
    ext = extension.module()
    values = {name: (0.375 + i if kind == "float32" else 3 + i) for i, (name, kind) in enumerate(ext.config_fields())}
    code, message = _call(harness, handlers, "forward", [*FORWARD_ARGS, WORKSPACE], FORWARD_RESULTS, values)
    assert code != 0 and "after the index arrays come either" in message, (
        message
    )  # the first check, before any shape check
    assert message.endswith(f"[{ext.describe_config(values)}]"), message
