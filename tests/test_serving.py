"""The main job's serving (tools/lm/serving.py): continuous batching writes the bytes today's fixed-batch
generation writes, compiles its step once, shares a prompt's pages among its continuations, and draws the
same bytes however the requests are scheduled."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

pytest.importorskip("flax.nnx", reason="the main job needs flax and optax: pip install 'jax_ragged_attn[flax]'")
pytest.importorskip("optax", reason="the main job needs flax and optax: pip install 'jax_ragged_attn[flax]'")

from flax import nnx
from tiers import some_fast  # tests/ is on sys.path under pytest

from jax_ragged_attn.tools import lm
from jax_ragged_attn.tools.lm import serving

TINY = [
    "--preset",
    "cpu",
    "--width",
    "64",
    "--heads",
    "2",
    "--kv-heads",
    "1",
    "--layers",
    "1",
    "--capacity",
    "1024",
    "--max-seqlen",
    "128",
]


@pytest.fixture(scope="module")
def tiny():
    _, setup = lm.parse_args(TINY)
    return lm.ByteLM(setup, rngs=nnx.Rngs(2)), setup


REQUESTS = [
    serving.Request(b"import os\nimport sys\n\ndef ", 12, samples=3),  # 25 bytes: 3 full pages of 8
    serving.Request(b"x", 20),
    serving.Request(b"class A:\n    def f(self):\n", 5),
    serving.Request(b"# comment\n", 9),
    serving.Request(b"for i in range(10):\n    print(i)\n", 16),
]


@some_fast({"steps_per_call": [1, 8]}, fast=["8"])
def test_continuous_batching_writes_the_fixed_batch_bytes(tiny, steps_per_call):
    # Greedy: each continuation is the fixed-batch generation's (generation.generate, prefilled as a phase of
    # its own, decoded in batches of 3), though here prompts are read in chunks of at most 7 rows beside other
    # slots' decode rows, requests take slots as others finish, and the first prompt's pages are shared; one
    # step a call, or 8 (a scan, the last call filled with idle steps).
    model, setup = tiny
    config = serving.ServingConfig.for_setup(setup, slots=3, budget=7, page_size=8, steps_per_call=steps_per_call)
    served = serving.serve(model, setup, REQUESTS, config, seed=0, temperature=0)
    fixed = serving.serve_fixed(model, setup, REQUESTS, slots=3, seed=0, temperature=0)
    assert served.texts == fixed.texts
    for request, texts in zip(REQUESTS, served.texts):
        assert [len(t) for t in texts] == [len(request.prompt) + request.max_new] * request.samples
        assert all(t.startswith(request.prompt) for t in texts)
    # At most one compilation for the whole run (none where an earlier test in this process compiled the step).
    assert served.compilations <= 1 and served.steps > sum(r.max_new for r in REQUESTS) // 3
    # The first prompt's 25 rows: pages 0-2 full (rows 0-23) are shared, its last row prefilled by each.
    assert serving.shared_rows(25, 8) == 24 and served.shared_reads == 2 * 3
    assert served.generated == sum(r.max_new * r.samples for r in REQUESTS) == fixed.generated
    assert np.all(served.latency > 0) and served.seconds >= served.latency.max() - 1e-6


@pytest.mark.slow  # schedule-independence (the bytes against the fixed batches' stay fast)
def test_draws_follow_the_request_not_the_schedule(tiny):
    # Sampled (temperature 0.7): a request's bytes depend on its keys alone, so two slots or four, a large
    # token budget or a small one, give the same continuations.
    model, setup = tiny
    configs = [
        serving.ServingConfig.for_setup(setup, slots, budget, 8, steps_per_call=n)
        for slots, budget, n in ((2, 2, 1), (4, 40, 5))
    ]
    runs = [serving.serve(model, setup, REQUESTS, config, seed=5) for config in configs]
    assert runs[0].texts == runs[1].texts
    assert runs[0].steps > runs[1].steps
    # Continuations of one prompt differ (their own keys), while reading the same pages.
    assert len(set(runs[0].texts[0])) > 1


def test_page_pool_counts_shared_pages():
    pool = serving.PagePool(6)
    first = pool.take(3)
    pool.hold(first[:2] * 2)  # two more continuations will read the first two pages
    assert pool.in_use == 3 and len(pool.free) == 3
    pool.release(first)  # the first continuation finishes: its shared pages stay held
    assert first[2] in pool.free and pool.in_use == 2
    pool.release(first[:2])
    pool.release(first[:2])
    assert pool.in_use == 0 and len(pool.free) == 6
    with pytest.raises(RuntimeError, match="6 free pages, 7 asked for"):
        pool.take(7)


def test_requests_that_do_not_fit_are_refused(tiny):
    model, setup = tiny
    config = serving.ServingConfig.for_setup(setup, slots=2, budget=4, page_size=8)
    with pytest.raises(ValueError, match="request 0: a prompt of 1 .. max_seqlen - max_new bytes"):
        serving.serve(model, setup, [serving.Request(b"x" * 100, 40)], config, seed=0)
    with pytest.raises(ValueError, match="the token budget \\(2\\) must be at least the slots \\(3\\)"):
        serving.ServingConfig.for_setup(setup, slots=3, budget=2, page_size=8)
    with pytest.raises(ValueError, match="steps_per_call must be >= 1, got 0"):
        serving.ServingConfig.for_setup(setup, slots=3, budget=4, page_size=8, steps_per_call=0)


@pytest.mark.slow
def test_report_prints_both_side_by_side(tiny, capsys):
    model, setup = tiny
    _, held_out, _ = lm.stdlib_files()
    requests = serving.make_requests(b"import os\n", held_out, 3, setup, (4, 12), samples=2, seed=1)
    assert [r.samples for r in requests] == [2, 1, 1] and all(4 <= r.max_new <= 12 for r in requests)
    config = serving.ServingConfig.for_setup(setup, slots=2, budget=8, page_size=8)
    served, fixed = serving.serve_and_compare(model, setup, requests, config, seed=0)
    out = capsys.readouterr().out
    assert served is not None and fixed is not None, out
    label = re.search(r", 2 slots, packed attention by (\w+):\n", out)
    assert label and label.group(1) in serving.backends.KVCACHE, out
    if jax.default_backend() == "cpu":
        assert label.group(1) == "xla", out  # FA3 and cuDNN are GPU kernels
    assert re.search(
        r"continuous batching: [0-9,]+ bytes/s, latency p50 [0-9.]+ s / p99 [0-9.]+ s \([0-9]+ steps "
        r"of <= 8 tokens, 8 a call, [01] compilations?; pages of 8 rows",  # 0: compiled by an earlier test
        out,
    ), out
    assert re.search(r"fixed batches of 2 \(generation.generate\): [0-9,]+ bytes/s, latency p50", out), out
    assert re.search(r"continuous / fixed: [0-9.]+x the throughput, p99 latency [0-9.]+x", out), out


def test_the_reported_backend_is_chosen_for_the_steps_own_call(tiny, monkeypatch):
    """The report's "packed attention by X" asks the op's policy about the call the step makes (causal, the
    attention's scale), not a look-alike: FA3 declines a non-causal call for packed steps wider than its tile
    while it serves the causal step, so a non-causal stand-in would name the wrong backend."""
    model, setup = tiny
    config = serving.ServingConfig.for_setup(setup, slots=2, budget=8, page_size=8)
    asked = []
    choose = serving.backends.choose

    def spy(implementation, call, index, **kwargs):
        if kwargs.get("op") == "kvcache":
            asked.append(call)
        return choose(implementation, call, index, **kwargs)

    monkeypatch.setattr(serving.backends, "choose", spy)
    serving.packed_implementation(model, config)
    _, held_out, _ = lm.stdlib_files()
    requests = serving.make_requests(b"import os\n", held_out, 1, setup, (2, 3), samples=1, seed=3)
    served, _ = serving.serve_and_compare(model, setup, requests, config, seed=0)
    assert served is not None
    reported, step_calls = asked[0], [call for call in asked[1:] if call.packed]  # not the fixed batches' decode
    assert step_calls and all(call == reported for call in step_calls), (reported, step_calls)
    assert reported.is_causal


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="shows the fallback where cuDNN cannot run (a CPU)")
def test_a_named_implementation_reaches_the_step(tiny, capsys):
    """--serve-implementation: the named backend runs the packed attention; where it cannot (cuDNN on a CPU)
    the report says so and serves with xla."""
    model, setup = tiny
    _, held_out, _ = lm.stdlib_files()
    requests = serving.make_requests(b"import os\n", held_out, 2, setup, (4, 8), samples=1, seed=2)
    config = serving.ServingConfig.for_setup(setup, slots=2, budget=8, page_size=8)
    served, _ = serving.serve_and_compare(model, setup, requests, config, seed=0, implementation="cudnn")
    out = capsys.readouterr().out
    assert served is not None, out
    assert "packed attention by cudnn:" in out and "(implementation cudnn failed: NotImplementedError" in out, out
