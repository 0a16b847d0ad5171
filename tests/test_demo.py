"""The reversal demo (examples/reversal.py) trains, plots, reports and fails loudly; and packing never lets one
sequence see another."""

from __future__ import annotations

import importlib.util
import itertools
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.slow  # the demo end to end

DEMO = pathlib.Path(__file__).resolve().parent.parent / "examples" / "reversal.py"


def _load_demo():
    # An example is a script, not a module of a package: loaded from its file, registered before it runs (its
    # dataclasses look their module up in sys.modules).
    spec = importlib.util.spec_from_file_location("reversal_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


demo = _load_demo()

# A tiny model and short run: a few seconds of CPU, enough for the loss to fall clearly.
TINY = [
    "--steps",
    "60",
    "--batch-tokens",
    "128",
    "--max-len",
    "6",
    "--vocab",
    "9",
    "--width",
    "32",
    "--heads",
    "2",
    "--layers",
    "1",
    "--eval-batches",
    "2",
    "--no-progress",
]


def _setup():
    return demo.setup_from(demo.parse_args(TINY))


def test_training_lowers_the_loss_and_plots_it(tmp_path):
    pytest.importorskip("matplotlib")
    result = demo.train(_setup(), seed=0, eval_batches=2, progress=False)
    losses = result["losses"]
    assert len(losses) == 60 and np.all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), f"loss did not fall: {losses}"
    path = tmp_path / "loss.png"
    assert demo.plot_losses(losses, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_exits_nonzero_and_says_so_below_the_threshold(tmp_path, capsys):
    path = tmp_path / "loss.png"
    assert demo.main(TINY + ["--plot", str(path), "--min-accuracy", "1.01"]) == 1  # 1.01: out of reach
    captured = capsys.readouterr()
    assert "DEMO FAILED" in captured.err and "below --min-accuracy" in captured.err
    assert "attention: ragged_attention -> " in captured.out and "held-out: token accuracy" in captured.out
    assert captured.out.splitlines()[-1].startswith("demo: FAILED (held-out token accuracy ")
    assert demo.main(TINY + ["--plot", "", "--min-accuracy", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("demo: OK (held-out token accuracy ")


def test_script_runs_the_demo():
    run = subprocess.run([sys.executable, str(DEMO), "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "reverse" in run.stdout and "--batch-tokens" in run.stdout


def _packed(setup, seed=0):
    batch = demo.pack(np.random.default_rng(seed), setup)
    lengths = np.diff(batch["cu_seqlens"])
    assert np.sum(lengths > 0) >= 4, "the batch should hold several sequences"
    return batch, lengths


def test_changing_one_sequence_leaves_the_others_logits_unchanged():
    setup = _setup()
    params = demo.init(jax.random.key(1), setup)
    batch, lengths = _packed(setup)
    cu = batch["cu_seqlens"]
    # A middle sequence with room to merge it with its successor in the control below.
    i = next(
        i
        for i in range(1, len(lengths) - 1)
        if 0 < lengths[i] and 0 < lengths[i + 1] and lengths[i] + lengths[i + 1] <= setup.max_seqlen
    )
    inside = np.zeros(setup.batch_tokens, bool)
    inside[cu[i] : cu[i + 1]] = True
    changed = dict(batch, tokens=np.where(inside, (batch["tokens"] % (setup.vocab - 1)) + 1, batch["tokens"]))

    before = np.asarray(demo.logits(params, batch, setup))
    after = np.asarray(demo.logits(params, changed, setup))
    assert not np.allclose(before[inside], after[inside]), "the changed sequence's own logits should change"
    np.testing.assert_array_equal(after[~inside], before[~inside], "another sequence's logits changed")

    # Control: with sequences i and i + 1 merged (one cu_seqlens entry dropped), the same change does reach
    # sequence i + 1, so the equality above is not vacuous.
    merged = np.concatenate([np.delete(cu, i + 1), cu[-1:]]).astype(np.int32)
    following = slice(cu[i + 1], cu[i + 2])
    leaked_before = np.asarray(demo.logits(params, dict(batch, cu_seqlens=merged), setup))[following]
    leaked_after = np.asarray(demo.logits(params, dict(changed, cu_seqlens=merged), setup))[following]
    assert not np.allclose(leaked_before, leaked_after)


def test_padded_batch_gives_the_packed_logits():
    # The GPU comparison runs the same model on a padded copy of the batch; on a CPU its xla implementation
    # must reproduce the packed logits sequence by sequence.
    setup = _setup()
    params = demo.init(jax.random.key(2), setup)
    batch, _ = _packed(setup, seed=3)
    padded = demo.to_padded(batch, setup)
    packed_logits = np.asarray(demo.logits(params, batch, setup))
    padded_logits = np.asarray(demo.logits(params, jax.tree.map(jnp.asarray, padded), setup, padded="xla"))
    cu = batch["cu_seqlens"]
    spans = [(a, b) for a, b in itertools.pairwise(cu) if b > a]
    assert len(spans) == len(padded["lengths"])
    for row, (a, b) in enumerate(spans):
        assert padded["lengths"][row] == b - a
        np.testing.assert_array_equal(padded["tokens"][row, : b - a], batch["tokens"][a:b])
        np.testing.assert_allclose(padded_logits[row, : b - a], packed_logits[a:b], rtol=1e-4, atol=1e-4)
