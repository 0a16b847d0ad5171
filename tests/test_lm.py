"""The main job: a byte-level LM on the standard library's source learns, reports, plots and fails loudly."""

from __future__ import annotations

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax.nnx", reason="the main job needs flax and optax: pip install 'jax_ragged_attn[flax]'")
pytest.importorskip("optax", reason="the main job needs flax and optax: pip install 'jax_ragged_attn[flax]'")

from flax import nnx  # noqa: E402

from jax_ragged_attn.tools import lm  # noqa: E402

# A tiny model and a short run (under a minute on 2 CPU cores), GQA so that the kv-packed path trains too.
TINY = ["--preset", "cpu", "--steps", "80", "--width", "64", "--heads", "2", "--kv-heads", "1", "--layers", "1",
        "--capacity", "1024", "--max-seqlen", "128", "--max-seqs", "16", "--lr", "1e-2", "--eval-bytes", "16384",
        "--sample-bytes", "40", "--no-progress"]


def test_main_learns_reports_plots_and_fails_above_the_bound(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "loss.png"
    # One run serves both checks: an unreachable bound makes it exit 1, and the figures it printed show
    # what it learned.
    assert lm.main(TINY + ["--plot", str(path), "--max-bits-per-byte", "0.5"]) == 1
    captured = capsys.readouterr()
    out = captured.out
    assert "LM FAILED" in captured.err and "above --max-bits-per-byte 0.5" in captured.err
    held_out = float(re.search(r"held-out: ([0-9.]+) bits per byte", out).group(1))
    unigram = float(re.search(r"byte frequencies ([0-9.]+)\)", out).group(1))
    # Learned: far below uniform bytes (8 bits), and clearly below what byte frequencies alone give.
    assert held_out < 5.0 and held_out < unigram - 0.5, out
    assert re.search(r"[0-9,]+ useful tokens/s", out) and "attention: RaggedSelfAttention -> " in out
    fills = re.search(r"packed ([0-9.]+)%; padded to the longest document \(4096 bytes\) ([0-9.]+)%", out)
    assert float(fills.group(1)) > 95 and float(fills.group(2)) < float(fills.group(1)), out
    assert "sample (temperature 0.7):\n" + "-" * 60 + "\nimport os\n\n\ndef " in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_module_entry_point_runs_the_lm():
    run = subprocess.run([sys.executable, "-m", "jax_ragged_attn", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert "byte-level language model" in run.stdout and "--max-bits-per-byte" in run.stdout


def test_corpus_split_is_disjoint_and_stable():
    train, held_out, root = lm.stdlib_files()
    assert len(train) > 200 and len(held_out) > 20, (len(train), len(held_out), root)
    assert 0.05 < len(held_out) / (len(train) + len(held_out)) < 0.2
    again = lm.stdlib_files(root)
    assert again[0] == train and again[1] == held_out


def test_windows_cap_long_files_and_record_lengths():
    files = [bytes(range(10)), bytes(1000)]
    lengths = []
    docs = list(lm.windows(files, np.random.default_rng(0), 64, epochs=2, lengths=lengths))
    assert sorted(len(d) for d in docs) == [10, 10, 64, 64] and sorted(lengths) == [10, 10, 64, 64]
    assert all(d.dtype == np.uint8 for d in docs)


def _setup(**changes):
    _, setup = lm.parse_args(TINY)
    return lm.Setup(**{**setup.__dict__, **changes})


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["mha", "gqa"])
def test_padded_run_computes_the_packed_logits(kv_heads):
    # The GPU comparison trains the same model on padded rows through jax.nn.dot_product_attention; on a CPU
    # its xla implementation must give the packed logits row by row.
    setup = _setup(kv_heads=kv_heads, capacity=512, max_seqlen=128)
    train, _, _ = lm.stdlib_files()
    model = lm.ByteLM(setup, rngs=nnx.Rngs(1))
    batch = next(lm.packed_batches(train[:40], setup, seed=3))
    padded, real = lm.padded_batch(batch, setup)
    rows = setup.capacity // setup.max_seqlen
    assert padded["tokens"].shape == (rows, setup.max_seqlen)
    packed_logits = nnx.jit(lambda m, b: m(b["tokens"], b["cu_seqlens"], b["positions"]))(model, batch.arrays())
    padded_logits = nnx.jit(lambda m, b: m.padded(b["tokens"], b["lengths"], "xla"))(
        model, jax.tree.map(jnp.asarray, padded))
    cu = batch.cu_seqlens
    compared = 0
    for r in range(min(rows, batch.num_seqs)):
        a, b = int(cu[r]), int(cu[r + 1])
        np.testing.assert_array_equal(padded["tokens"][r, :b - a], batch.tokens[a:b])
        np.testing.assert_allclose(padded_logits[r, :b - a], packed_logits[a:b], rtol=2e-4, atol=2e-4)
        compared += b - a
    assert compared == real > 0


def test_padded_comparison_trains_and_reports(capsys):
    # The GPU-only report, run here on a CPU: the cuDNN padded run is reported unavailable, the xla one trains.
    args, _ = lm.parse_args(TINY + ["--compare-steps", "3"])
    setup = _setup(capacity=512, max_seqlen=128)
    train, _, _ = lm.stdlib_files()
    packed = dict(tokens_per_s=1000.0, fill_rate=0.99)
    lm.compare_padded(setup, train[:40], args, packed)
    out = capsys.readouterr().out
    assert "packed vs padded, 3 training steps each" in out
    line = next(line for line in out.splitlines() if "dot_product_attention('xla')" in line)
    assert re.search(r"padded \[4, 128\], dot_product_attention\('xla'\): [0-9,]+ tokens/s \(packed: [0-9.]+x that\), "
                     r"fill [0-9.]+%, last loss [0-9.]+$", line), line
    assert "dot_product_attention('cudnn')" in out


def test_bad_flags_exit_with_the_flag_named(capsys):
    with pytest.raises(SystemExit):
        lm.parse_args(["--width", "30", "--heads", "4"])
    assert "--width (30) must split into --heads (4)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lm.parse_args(["--max-seqlen", "4096", "--capacity", "1024"])
    assert "--max-seqlen (4096) must be <= --capacity (1024)" in capsys.readouterr().err
