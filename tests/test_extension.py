"""The C++ extension builds, imports and registers on any machine, and its sizing math is right.

These run in CI without a GPU: the full-extent arithmetic is what decides whether a cuDNN backward can
write past its workspace, so it is pinned here, independently of cuDNN.
"""

import dataclasses
import pathlib
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import pytest

from jax_ragged_attn.backends.cudnn import ragged as cudnn
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.config import AttentionOptions, make_config

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ext():
    # A failed build fails these tests one by one instead of stopping the whole suite at collection.
    return extension.module()


def _config(**overrides):
    shapes = dict(tq=1000, tkv=1200, hq=16, hkv=16, dqk=128, dv=128, b=4, layout="head_major")
    shapes.update(overrides)
    q = jax.ShapeDtypeStruct((shapes["tq"], shapes["hq"], shapes["dqk"]), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((shapes["tkv"], shapes["hkv"], shapes["dqk"]), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((shapes["tkv"], shapes["hkv"], shapes["dv"]), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((shapes["b"] + 1,), jnp.int32)
    return make_config(
        q,
        k,
        v,
        cu,
        cu,
        AttentionOptions(is_causal=True, stats_layout=shapes["layout"]),
        max_seqlen_q=300,
        max_seqlen_kv=400,
    )


def test_extension_registers_one_forward_and_one_backward_handler(ext):
    """Check mode and the packed layouts are the same two handlers (tests/test_handler_contract.py)."""
    capsules = ext.registrations()
    assert extension.targets() == {
        "forward": extension.FORWARD_TARGET,
        "backward": extension.BACKWARD_TARGET,
        "paged_forward": extension.PAGED_FORWARD_TARGET,
        "zero_rows": "jax_ragged_attn_zero_rows",
        "clamp_cache_index": "jax_ragged_attn_clamp_cache_index",
    }
    assert set(capsules) == set(extension.targets().values())
    # A handler is a capsule, or a dict of FFI stage capsules.
    assert all(
        type(c).__name__ == "PyCapsule"
        for handler in capsules.values()
        for c in (handler.values() if isinstance(handler, dict) else [handler])
    )


def test_reports_the_cudnn_headers_it_was_built_against(ext):
    # pyproject.toml's build requires nvidia-cudnn >= 9.8; the value is major * 10000 + minor * 100 + patch.
    assert 90800 <= ext.cudnn_header_version < 100000


def test_built_against_a_fixed_frontend(ext):
    # 1.28 is the first cudnn-frontend that sizes ragged intermediates from every axis.
    assert tuple(ext.frontend_version[:2]) >= (1, 28)


def test_token_major_stats_full_extent_equals_old_formula(ext):
    t, h, s, b = 1000, 16, 300, 4
    dim, stride = [b, h, s, 1], [s * h, 1, h, 1]  # token-major [T, H]
    assert ext.ragged_span_bytes(t, dim, stride, 4) == t * h * 4
    assert ext.ragged_span_bytes(t, dim, stride, 4) == ext.token_stride_only_bytes(t, stride, 4)


def test_head_major_stats_full_extent_exceeds_old_formula_by_h_minus_one_rows(ext):
    t, h, s, b = 1000, 16, 300, 4
    dim, stride = [b, h, s, 1], [h * t, t, 1, 1]  # head-major [H, T]
    full = ext.ragged_span_bytes(t, dim, stride, 4)
    old = ext.token_stride_only_bytes(t, stride, 4)
    assert old == t * 4  # what frontends <= 1.27 reserved: one head's worth
    assert full - old == (h - 1) * t * 4
    assert full == h * t * 4


def test_full_extent_of_thd_tensor_is_the_whole_buffer(ext):
    t, h, s, d, b = 777, 8, 100, 64, 3
    assert ext.ragged_span_bytes(t, [b, h, s, d], [s * h * d, d, h * d, 1], 4) == t * h * d * 4


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
def test_backward_intermediates_cover_every_buffer(ext, layout):
    config = _config(layout=layout)
    sizes = ext.full_extent_backward_intermediates(cudnn.ffi_attributes(config))
    assert sizes["softmax_sum"] == config.capacity_q * config.num_heads_q * 4
    assert sizes["dq_accum"] == config.capacity_q * config.num_heads_q * config.head_dim_qk * 4
    assert sizes["dk_fullhead"] == sizes["dv_fullhead"] == 0  # MHA: dK and dV are written directly
    assert sizes["total"] == sizes["softmax_sum"] + sizes["dq_accum"]


def test_backward_intermediates_for_gqa_hold_every_query_head(ext):
    config = _config(hq=16, hkv=4, dv=64)
    sizes = ext.full_extent_backward_intermediates(cudnn.ffi_attributes(config))
    assert sizes["dk_fullhead"] == config.capacity_kv * 16 * config.head_dim_qk * 4
    assert sizes["dv_fullhead"] == config.capacity_kv * 16 * config.head_dim_v * 4


def test_graph_queries_without_cuda_report_a_reason():
    if extension.cudnn_unavailable_reason() is None:
        pytest.skip("a CUDA device is present; this checks the CPU-only answer")
    assert "CUDA" in extension.cudnn_unavailable_reason() or "cuda" in extension.cudnn_unavailable_reason()
    assert cudnn.unsupported_reason(_config()) == extension.cudnn_unavailable_reason()


def test_graph_queries_without_a_gpu_name_the_cuda_error(ext):
    """Without a GPU the graph query stops at making the device current, with an error that names the CUDA
    runtime's status (cudaGetErrorName and cudaGetErrorString), not a bare number."""
    if ext.cudnn_version():
        pytest.skip("cuDNN is loaded in this process (a GPU run)")
    info = ext.graph_info("forward", 0, cudnn.ffi_attributes(_config()))
    assert info["status"] in ("error", "unavailable"), info
    if "cudaGetDevice" in info["message"]:  # a CUDA runtime was found, without a driver or a device behind it
        assert re.search(r"cudaGetDevice: cudaError\w+ \(\d+\): \S", info["message"]), info["message"]


def test_backward_intermediates_follow_packed_strides(ext):
    """cuDNN lays dQ_accum on dQ's strides and dK/dV per query head on dK/dV's: a packed row's stride
    widens their extent (the frontend sizes from every axis; so must our check)."""
    config = dataclasses.replace(_config(tkv=1000), packing="qkv")
    t, h, d = config.capacity_q, config.num_heads_q, config.head_dim_qk
    sizes = ext.full_extent_backward_intermediates(cudnn.ffi_attributes(config))
    assert sizes["dq_accum"] == ((t - 1) * 3 * h * d + h * d) * 4

    config = dataclasses.replace(_config(hq=16, hkv=4), packing="kv")
    t, hq, d = config.capacity_kv, config.num_heads_q, config.head_dim_qk
    sizes = ext.full_extent_backward_intermediates(cudnn.ffi_attributes(config))
    assert sizes["dk_fullhead"] == ((t - 1) * 2 * hq * d + hq * d) * 4  # kv token stride 2*Hkv*D, times 4 heads


def _run_native_test(tmp_path, name: str, header: str) -> None:
    """Builds the native test `name` (its .cc under tests/native) against ffi/`header` and the XLA FFI headers,
    runs it and asserts it exits 0."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip(f"no C++ compiler to build tests/native/{name}.cc")
    if not (ROOT / "ffi" / header).exists():  # tests run from an installed wheel, away from ffi/
        pytest.skip(f"ffi/{header} is not beside these tests (tests copied away from the source tree)")
    program = tmp_path / name
    subprocess.run(
        [
            compiler,
            "-std=c++17",
            "-pthread",
            f"-I{ROOT / 'ffi'}",
            "-isystem",
            jax.ffi.include_dir(),
            str(ROOT / "tests" / "native" / f"{name}.cc"),
            "-o",
            str(program),
        ],
        check=True,
    )
    result = subprocess.run([str(program)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_graph_cache_template_builds_each_key_once_and_never_stalls_other_keys(tmp_path):
    """ffi/lru_graph_cache.h, which caches the ragged and the paged graphs, exercised by
    tests/native/lru_graph_cache_test.cc with stand-in builds that block until the test releases them: LRU
    order and counters, one build however many callers ask for a key at once, other keys found and built
    meanwhile, failures handed to every waiter and not cached."""
    _run_native_test(tmp_path, "lru_graph_cache_test", "lru_graph_cache.h")


def test_forward_graphs_fall_back_to_the_second_implementation_only_where_the_first_fails(tmp_path):
    """ffi/build_fallback.h, how the forward and paged graphs try the frontend's AUTO implementation and then its
    COMPOSITE node (cuDNN 9.28 has no Hopper engine for AUTO's softcap graphs), with stand-in builds."""
    _run_native_test(tmp_path, "build_fallback_test", "build_fallback.h")


def test_an_install_without_the_extension_says_it_is_not_built(tmp_path):
    """The package without its compiled module (a CPU-only install): the reason says the extension is not built
    and where the build is described, not Python's "partially initialized module ... circular import"."""
    import sys

    import jax_ragged_attn

    # The package this run imports (the source tree, or an installed wheel when tests run from a copy of tests/).
    shutil.copytree(
        pathlib.Path(jax_ragged_attn.__file__).parent,
        tmp_path / "jax_ragged_attn",
        ignore=shutil.ignore_patterns("_ext*.so", "_ext*.pyd", "__pycache__"),
    )
    script = (
        "from jax_ragged_attn.backends.shared import extension\n"
        "print(extension.__file__)\n"
        "print(extension.cudnn_unavailable_reason())\n"
        "print(extension.versions()['extension'])\n"
        "try:\n    extension.module()\nexcept NotImplementedError as error:\n    print(error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)},
        check=True,
    )
    where, *lines = result.stdout.splitlines()
    if not where.startswith(str(tmp_path)):
        pytest.skip(f"an editable install's import hook serves jax_ragged_attn from {where}, ahead of PYTHONPATH")
    assert len(lines) == 3 and len(set(lines)) == 1, result.stdout
    assert lines[0].startswith("the C++ extension is not built in this install") and "docs/INSTALL.md" in lines[0]
    assert "circular" not in result.stdout


def test_an_extension_that_is_built_but_fails_to_import_says_why(monkeypatch):
    monkeypatch.setattr(extension.importlib.util, "find_spec", lambda name: object())
    reason = extension.unimportable_reason(ImportError("libcudart.so.12: cannot open shared object file"))
    assert reason == "the C++ extension is built but does not import: libcudart.so.12: cannot open shared object file"
