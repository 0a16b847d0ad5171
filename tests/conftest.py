"""Test-session settings, applied before any test module imports jax.

`--jax-config=NAME[,NAME...]` runs the whole session (and the child processes tests start, which inherit the
environment) under the global JAX settings large codebases run with, so the library is tested the way it is
adopted, not only under JAX's defaults:

    pytest --jax-config=strict tests/test_semantics.py     # rank promotion "raise" + dtype promotion "strict"
    pytest --jax-config=x64 tests/test_semantics.py        # jax_enable_x64: jnp.array([0, 3]) is int64

The settings travel as JAX's own environment variables (read when jax is first imported, here and in every
subprocess), and are applied with jax.config.update too in case a plugin imported jax first.
"""

import faulthandler
import os
import signal
import threading

# `pytest -n 2` starts two processes; on a GPU each would otherwise preallocate 75 % of its memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _cuda_plugin_installed() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(name) for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


# Most of a CPU test's time is XLA compiling programs that then run on a few hundred rows, and most of that is
# LLVM optimising the generated code: at LLVM's -O0 tests take 30-45 % less time on 2 cores (test_seqused.py +
# test_sinks.py, -n 2: 79-84 s -> 56-58 s; the fast tier about half, 2026-12-07). The programs do the same
# operations (XLA's CPU fast-math is off at every level): at most rounding differs, inside the dtype's
# tolerances. Only where JAX runs on the CPU (no CUDA plugin installed, or JAX_PLATFORMS=cpu): GPU kernels keep
# XLA's default. Children inherit it (XLA_FLAGS); a level set by the caller is kept.
TEST_XLA_FLAG = "--xla_backend_optimization_level=0"
if (os.environ.get("JAX_PLATFORMS") == "cpu" or not _cuda_plugin_installed()) and \
        "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAG}".strip()

import pytest  # noqa: E402 - after the environment above, which must be set before jax is imported

# Each name: JAX's environment variables and the jax.config values they stand for.
JAX_CONFIGS = {
    "strict": {"JAX_NUMPY_RANK_PROMOTION": ("jax_numpy_rank_promotion", "raise"),
               "JAX_NUMPY_DTYPE_PROMOTION": ("jax_numpy_dtype_promotion", "strict")},
    "x64": {"JAX_ENABLE_X64": ("jax_enable_x64", True)},
    "checks": {"JAX_ENABLE_CHECKS": ("jax_enable_checks", True)},
    "matmul_bf16": {"JAX_DEFAULT_MATMUL_PRECISION": ("jax_default_matmul_precision", "bfloat16")},
    "matmul_highest": {"JAX_DEFAULT_MATMUL_PRECISION": ("jax_default_matmul_precision", "highest")},
}


def pytest_addoption(parser):
    parser.addoption("--jax-config", default=os.environ.get("JAX_RAGGED_ATTN_TEST_CONFIG", ""),
                     help="comma-separated global JAX settings for the whole session (and its subprocesses): "
                          + ", ".join(JAX_CONFIGS))


def _requested(config) -> list[str]:
    names = [n.strip() for n in config.getoption("--jax-config").split(",") if n.strip()]
    unknown = [n for n in names if n not in JAX_CONFIGS]
    if unknown:
        raise pytest.UsageError(f"--jax-config: unknown {unknown}, choose from {sorted(JAX_CONFIGS)}")
    return names


def pytest_configure(config):
    names = _requested(config)
    if not names:
        return
    os.environ["JAX_RAGGED_ATTN_TEST_CONFIG"] = ",".join(names)  # pytest-xdist workers read it back
    settings = {}
    for name in names:
        for env, (option, value) in JAX_CONFIGS[name].items():
            os.environ[env] = str(value).lower() if isinstance(value, bool) else value
            settings[option] = value
    import jax

    for option, value in settings.items():
        jax.config.update(option, value)


def pytest_report_header(config):
    names = _requested(config)
    if names:
        return "jax configuration: " + ", ".join(f"{n} ({', '.join(f'{o}={v}' for o, v in JAX_CONFIGS[n].values())})"
                                                 for n in names)
    return None


# Test tiers. The default run (`pytest`, the README's test command) is the fast tier: every public entry point
# and every implementation's semantics (test_semantics.py's XlaTest and the stand-in classes); each tier's time
# is in docs/TESTING.md. The tests below are `slow` (left out by pyproject.toml's addopts; `pytest -m "not soak"`
# runs everything, `pytest -m slow` only them; .ci/run runs the fast tier, then these). Chosen by measured time
# (`pytest -n 2 --durations`, 2026-12-03, docs/TESTING.md): multi-device children and several processes, the
# tools' end-to-end runs, the suites under global JAX settings, and the costliest single tests of files whose
# other tests cover the same entry point in the fast tier. One list here, so test files need no marks.
SLOW_FILES = {
    "test_ring.py",           # 4-device children: the ring against all-gather, masks and meshes
    "test_multiprocess.py",   # 2 processes under jax.distributed
    "test_load_balance.py",   # 4-device children: the reorder on sharded arrays for every T = 2n*k
    "test_sharded_sinks.py",  # 4-device children
    "test_jax_configs.py",    # every global JAX setting (the semantic suite also runs under strict,x64 in CI)
    "test_debug_infs.py",     # every call under jax.debug_infs / debug_nans, eager and jitted
    "test_xla_memory.py",     # children capped at +1 GiB of address space
    "test_xla_blocks.py",     # 1-5 row tiles of the xla path (its semantics: test_semantics.py's XlaTest, fast)
    "test_bench.py", "test_sweep.py", "test_demo.py", "test_lm.py",  # the tools end to end
}
SLOW_TESTS = (  # node-id prefixes
    "tests/test_flax.py::test_sharded_parameters_match_unsharded",         # 4 devices; test_sharding.py is fast
    "tests/test_readme.py::test_example_script_runs",                     # 4 devices; the same calls fast above
    "tests/test_overflow.py::test_gradient_with_overflow_as_aux",
    "tests/test_context_parallel.py::test_bench_tool_runs",
    # random packings through every device's call on the xla path: seed 0 stays fast
    "tests/test_context_parallel.py::test_device_calls_on_random_packings_on_the_xla_path[1]",
    "tests/test_context_parallel.py::test_device_calls_on_random_packings_on_the_xla_path[2]",
    "tests/test_kvcache.py::test_decode_bench_quick_runs",
    # every KV-cache case through cuDNN's paged route on a stand-in; the split it shares with FA3 stays fast
    # (test_kvcache.py's Fa3SplitKVCacheTest)
    "tests/test_kvcache_cudnn.py::CudnnPagedRouteStandInTest",
    "tests/test_stats_grad.py::test_dv_past_the_head_dim_limit_raises_naming_it",
    "tests/test_stats_grad.py::test_split_bottom_right_backward_matches_the_reference",
    "tests/test_cudnn_wrapper.py::test_quiet_under_jax_debug_flags_eagerly",  # as test_debug_infs.py
    # every feature of the deep self-check (a few of them stay fast: test_deep_check_of_a_few_features_...)
    "tests/test_selfcheck.py::test_deep_check_of_every_feature",
    # packed queries over a KV cache: FA3's tiles on a stand-in, and the xla path's extra mixes, dtypes, vmap
    # (every case on the xla path, the appends and the tiles' arithmetic stay fast)
    "tests/test_kvcache_varlen.py::Fa3TilesStandInTest",
    "tests/test_kvcache_varlen.py::XlaPackedTest::test_random_mixes",
    "tests/test_kvcache_varlen.py::XlaPackedTest::test_half_precision",
    "tests/test_kvcache_varlen.py::XlaPackedTest::test_vmap",
    "tests/test_kvcache_varlen.py::XlaPackedTest::test_default_tiles_and_blocks",
    "tests/test_kvcache_varlen.py::XlaPackedTest::test_sinks_gradient",
    "tests/test_kvcache_varlen.py::test_mixed_bench_quick_runs",
    # serving's schedule-independence and report (its bytes against the fixed batches' stay fast)
    "tests/test_serving.py::test_draws_follow_the_request_not_the_schedule",
    "tests/test_serving.py::test_report_prints_both_side_by_side",
    # 2026-12-07, to bring the fast tier back under its 10 minutes (it had grown to 17.4 min on 2 idle cores):
    # the tools end to end, a second sharded-batch shape class, the cuDNN packed route's random mixes (the xla
    # path's are slow above), FA3's decode variants past the one-call route (test_decode_pieces.py keeps the split's
    # merge fast), and the docs pages' blocks (the README's stay fast)
    "tests/test_peers_bench.py::test_interleave_times_a_rows_cells_together",
    "tests/test_decode_pieces.py::test_quick_run_prints_a_row_per_variant",
    "tests/test_policy.py::test_the_sharded_op_passes_its_whole_batchs_shape_class",
    "tests/test_kvcache_varlen.py::CudnnPackedStandInTest::test_random_mixes",
    "tests/test_kvcache.py::Fa3SplitKVCacheTest",
    "tests/test_kvcache.py::Fa3OneCallUnmaskedKVCacheTest",
    "tests/test_readme.py::test_python_blocks_run_in_order_in_one_process[docs/",
    "tests/test_peers_bench.py::test_quick_",
)
# Cases of a KV-cache base class run by a route that takes a contiguous cache as pages of one page per sequence:
# the fast tier runs their paged cases and one contiguous case (the contiguous cache's own gathers stay fast in
# the xla classes), the slow tier the other contiguous ones.
SLOW_TESTS += tuple(f"tests/test_kvcache_varlen.py::CudnnPackedStandInTest::test_attention_{case}_contiguous"
                    for case in ("causal", "mqa", "sinks", "mha", "non_causal", "scale", "softcap"))
SLOW_TESTS += tuple(f"tests/test_kvcache.py::Fa3OneCallKVCacheTest::test_attention_{case}_contiguous"
                    for case in ("long_chunk", "mqa_five_queries", "chunked_prefill", "window", "mha"))
# Parametrized tests whose every case runs in the slow tier but a few here: the fast tier keeps cases that between
# them take each code path a parameter chooses (both stats layouts, each mask, each packing, each implementation
# that runs on a CPU, 2 and 4 devices), the slow tier the rest of the product (sizes, counts, each output's guard,
# each named scenario). Base node id -> the case ids that stay fast.
FAST_CASES = {
    "tests/test_dew.py::test_unused_rows_go_over_as_gap_sequences": (
        "emulated-head_major-none-long_slots", "emulated-token_major-causal_bottom_right-same_long_slot",
        "emulated-head_major-window_bottom_right-same_slots", "emulated-token_major-none-seqused",
        "emulated-head_major-causal_bottom_right-slots_fit", "emulated-token_major-window_bottom_right-truncated"),
    "tests/test_dew.py::test_every_head_dim_it_advertises": (
        "emulated-head_major-64", "emulated-token_major-192", "emulated-head_major-256"),
    "tests/test_head_groups.py::test_the_cudnn_backend_splits_a_call_past_the_limit_into_head_groups": (
        "kv-8-8-token_major", "none-8-1-head_major", "qkv-6-6-head_major"),
    "tests/test_seqused.py::test_seqused_against_reference": (
        "head_major-none-cache-xla", "token_major-causal-gaps-xla", "head_major-causal_bottom_right-full-xla"),
    "tests/test_overflow.py::test_default_mode_runs_and_counts_what_was_dropped": (
        "xla-valid", "xla-q_past_capacity", "xla-kv_negative", "xla-q_not_starting_at_0",
        "cudnn_stand_in-kv_decreasing", "cudnn_stand_in-kv_longer_than_max_seqlen_kv",
        "cudnn_stand_in-q_longer_than_max_seqlen_q"),
    "tests/test_overflow.py::test_check_mode_raises_naming_argument_index_and_values": (
        "xla-q_past_capacity", "xla-kv_negative", "xla-q_longer_than_max_seqlen_q",
        "cudnn_stand_in-kv_decreasing", "cudnn_stand_in-kv_longer_than_max_seqlen_kv",
        "cudnn_stand_in-q_not_starting_at_0"),
    "tests/test_flax.py::test_packed_equals_each_sequence_alone": ("gqa_causal", "mha_bidirectional_window", "mqa_window",
                                                                  "gqa_sinks"),
    "tests/test_flax.py::test_gradients_equal_the_sum_over_sequences_alone": ("plain-mha_causal", "remat-gqa_sinks",
                                                                              "plain-mqa_window"),
    "tests/test_stats_grad.py::test_packed_buffers_get_gradients_in_their_own_layout": (
        "kv-stats_as_aux-check_mode", "kv-stats_in_the_loss-poisoned", "qkv-stats_as_aux-unowned",
        "qkv-stats_in_the_loss-check_mode"),
    "tests/test_cudnn_wrapper.py::test_a_write_outside_an_outputs_rows_stops_the_computation": ("out", "dk"),
    "tests/test_cudnn_wrapper.py::test_outputs_and_gradients_match_the_xla_path_with_padding_cleaned": (
        "head_major-poisoned", "token_major-unowned"),
    "tests/test_context_parallel.py::test_device_calls_match_the_op_on_the_xla_path": ("2-False-causal",
                                                                                     "4-True-no_mask"),
    "tests/test_serving.py::test_continuous_batching_writes_the_fixed_batch_bytes": ("8",),
    "tests/test_segments.py::test_default_mode_counts_dropped_segments_and_cut_tokens": (
        "fits", "segments_longer_than_max_seqlen", "two_segments_past_max_segments"),
    "tests/test_segments.py::test_numpy_segment_ids_warn_outside_check_mode": (
        "both", "segments_longer_than_max_seqlen", "two_segments_past_max_segments"),
}


def _base_and_case(nodeid: str) -> tuple[str, str]:
    """A node id's test (the id before "[") and case (between the brackets; "" for a test without cases)."""
    base, _, case = nodeid.partition("[")
    return base, case.rstrip("]")


def _is_slow(item, base: str, case: str) -> bool:
    if item.path.name in SLOW_FILES or item.nodeid.startswith(SLOW_TESTS):
        return True
    return base in FAST_CASES and case not in FAST_CASES[base]


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    cases = {}
    for item in items:
        base, case = _base_and_case(item.nodeid)
        cases.setdefault(base, set()).add(case)
        if _is_slow(item, base, case):
            item.add_marker(pytest.mark.slow)
    # A case renamed in its test file would leave FAST_CASES naming nothing, and that test out of the fast tier.
    # (Not checked when the command line names single cases: then only those are collected.)
    if any("[" in arg for arg in config.args):
        return
    for base, fast in FAST_CASES.items():
        if base in cases and not set(fast) <= cases[base]:
            raise pytest.UsageError(f"tests/conftest.py FAST_CASES names cases {sorted(set(fast) - cases[base])} of "
                                    f"{base}, which has {sorted(cases[base])}")


# A test that runs away (an endless generator, a wait on a collective that never comes) must fail with its
# name and a traceback, not use up CI's time limit in silence. The longest tests (4-device children) take a
# couple of minutes on 2 cores (test_readme, test_multiprocess: about 100 s).
TEST_TIME_LIMIT_ENV = "JAX_RAGGED_ATTN_TEST_TIME_LIMIT"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    limit = int(os.environ.get(TEST_TIME_LIMIT_ENV, "600"))
    if limit <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        faulthandler.dump_traceback(all_threads=True)
        raise TimeoutError(f"{item.nodeid} ran past {limit} s ({TEST_TIME_LIMIT_ENV}); the stacks are above")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def install_extension(monkeypatch, tmp_path):
    """install(ext): trace-time questions go to `ext` instead of the compiled extension, on device 0, with an
    autotune cache of this test's own (file and process). For tests of the Python layer's choices on a CPU."""
    from jax_ragged_attn.backends.cudnn import autotune, graphs
    from jax_ragged_attn.backends.shared import extension

    monkeypatch.setattr(graphs, "device_ordinal", lambda: 0)
    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path / "autotune.json"))
    monkeypatch.setattr(autotune, "_chosen", {})

    def install(ext):
        monkeypatch.setattr(extension, "module", lambda: ext)
        return ext

    return install
