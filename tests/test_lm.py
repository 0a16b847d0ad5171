"""The main job: a byte-level LM on the standard library's source learns, reports, plots and fails loudly."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax.nnx", reason="the main job needs flax and optax: pip install 'jax_ragged_attn[flax]'")
pytest.importorskip("optax", reason="the main job needs flax and optax: pip install 'jax_ragged_attn[flax]'")

from flax import nnx

from jax_ragged_attn.tools import lm

pytestmark = pytest.mark.slow  # the tool end to end

# A tiny model and a short run (under a minute on 2 CPU cores), GQA so that the kv-packed path trains too.
TINY = [
    "--preset",
    "cpu",
    "--steps",
    "80",
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
    "--max-seqs",
    "16",
    "--lr",
    "1e-2",
    "--eval-bytes",
    "16384",
    "--sample-bytes",
    "40",
    "--sample-prompts",
    "3",
    "--serve-requests",
    "2",
    "--serve-slots",
    "2",
    "--serve-budget",
    "8",
    "--no-progress",
]


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
    assert re.search(r"[0-9,]+ useful tokens/s in the training loop", out)
    assert "attention: RaggedSelfAttention -> " in out
    fills = re.search(r"packed ([0-9.]+)%; padded to the longest document \(4096 bytes\) ([0-9.]+)%", out)
    assert float(fills.group(1)) > 95 and float(fills.group(2)) < float(fills.group(1)), out
    assert "sample (temperature 0.7, paged KV cache):\n" + "-" * 60 + "\nimport os\n\n\ndef " in out
    assert re.search(
        r"generation, 3 prompts x 40 bytes: paged KV cache \(ragged_attention_with_kvcache, pages of 64 "
        r"rows\) [0-9,]+ bytes/s; full forward over \[3, 128\] per byte [0-9,]+ bytes/s",
        out,
    ), out
    # Serving: 2 requests (the first with 3 continuations of --prompt), continuous batching beside fixed batches.
    assert re.search(
        r"serving 2 requests \(4 continuations, .*\), 2 slots, packed attention by xla:\n  "
        r"continuous batching: [0-9,]+ "
        r"bytes/s, latency p50 [0-9.]+ s / p99 [0-9.]+ s \([0-9]+ steps of <= 8 tokens, [0-9]+ a call, "
        r"[01] compilations?",  # 0 where an earlier test in this process compiled the same step
        out,
    ), out
    assert re.search(r"fixed batches of 2 \(generation.generate\): [0-9,]+ bytes/s", out), out
    if jax.default_backend() == "cpu":
        assert "side-by-side" not in out  # on a CPU only when asked for (--compare-steps)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_module_entry_point_runs_the_lm():
    run = subprocess.run(
        [sys.executable, "-m", "jax_ragged_attn", "--help"], capture_output=True, text=True, timeout=120
    )
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
        model, jax.tree.map(jnp.asarray, padded)
    )
    cu = batch.cu_seqlens
    compared = 0
    for r in range(min(rows, batch.num_seqs)):
        a, b = int(cu[r]), int(cu[r + 1])
        np.testing.assert_array_equal(padded["tokens"][r, : b - a], batch.tokens[a:b])
        np.testing.assert_allclose(padded_logits[r, : b - a], packed_logits[a:b], rtol=2e-4, atol=2e-4)
        compared += b - a
    assert compared == real > 0


def test_side_by_side_times_every_system_the_same_way(capsys):
    # The side-by-side on a CPU: packed and padded xla train from the same initialisation on the same batches,
    # timed by one method (printed); padded cuDNN is skipped with its reason.
    setup = _setup(capacity=512, max_seqlen=128)
    train, _, _ = lm.stdlib_files()
    timing = lm.Timing(warmup=1, steps=2, repeats=1)
    results = lm.side_by_side(setup, train[:40], 0, timing, loop_steps=2)
    out = capsys.readouterr().out
    assert "method: every system the same jitted step" in out and timing.describe() in out
    by = {r.system: r for r in results}
    assert list(by) == list(lm.SYSTEMS)
    packed, xla = by["packed"], by["padded-xla"]
    assert packed.status == xla.status == "ok", results
    assert packed.step_s > 0 and xla.step_s > 0 and packed.loop_tokens_per_s > 0 and xla.loop_tokens_per_s > 0
    assert packed.slots == setup.capacity and xla.slots == 4 * 128 and 0 < xla.tokens <= packed.tokens
    assert packed.fill > 0.9 and np.isfinite(packed.loss) and np.isfinite(xla.loss)
    if jax.default_backend() == "cpu":
        assert by["padded-cudnn"].status.startswith("skipped: jax.nn's cudnn attention needs a CUDA GPU")
    assert re.search(r"\n  packed +[0-9.]+ +[0-9,]+ +1\.00x", out), out
    assert re.search(r"packed is [0-9.]+x padded-xla in useful tokens/s", out), out


def test_padded_pipeline_feeds_the_packers_stream_in_order():
    # The padded systems see the same windows as the packed one, split at max_seqlen as the packer splits
    # them, `rows` pieces per batch in stream order (a padded data loader's way), one piece per row.
    setup = _setup(capacity=512, max_seqlen=128, window_bytes=300)
    files = [bytes(range(i % 7, i % 7 + 50 * (i % 9 + 1) % 256)) * 2 for i in range(30)]
    files = [f for f in files if f]
    expected = [
        doc[start : start + 128]
        for doc in lm.windows(files, np.random.default_rng([5, 0]), 300, epochs=1)
        for start in range(0, len(doc), 128)
    ]
    pipeline = lm.padded_batches(files, setup, seed=5)
    for b in range(3):
        arrays, real = next(pipeline)
        assert arrays["tokens"].shape == (4, 128)
        pieces = expected[4 * b : 4 * b + 4]
        assert real == sum(map(len, pieces))
        for r, piece in enumerate(pieces):
            n = len(piece)
            np.testing.assert_array_equal(arrays["tokens"][r, :n], piece)
            np.testing.assert_array_equal(arrays["targets"][r, : n - 1], piece[1:])
            assert arrays["loss_mask"][r].sum() == n - 1 and arrays["lengths"][r] == n
            assert not arrays["tokens"][r, n:].any()


def test_padded_xla_is_skipped_where_its_scores_would_not_fit():
    _, long = lm.parse_args(["--preset", "long"])
    assert long.max_seqlen == 16384 and long.window_bytes <= long.max_seqlen and lm.padded_rows(long) == 4
    assert "materialises [rows, heads, S, S] float32 scores: 34 GB" in lm.system_unavailable("padded-xla", long)
    _, gpu = lm.parse_args(["--preset", "gpu"])
    assert lm.system_unavailable("padded-xla", gpu) is None


def test_flat_jitted_step_trains_as_nnx_optimizer_does():
    # The main job's step (one jax.jit over nnx.split state, parameters raveled into one vector, donated) must
    # be the same AdamW as nnx.Optimizer's per-parameter one.
    setup = _setup(capacity=256, max_seqlen=64)
    train, _, _ = lm.stdlib_files()
    packer = lm.packed_batches(train[:20], setup, seed=1)
    batches = [lm.device_batch(next(packer).arrays()) for _ in range(3)]
    tx = lm.make_tx(setup.lr, setup.steps)
    model = lm.ByteLM(setup, rngs=nnx.Rngs(0))
    trainer = lm.make_trainer(model, lm.packed_loss, tx)
    flat, state = trainer.flat, trainer.opt_state
    losses = []
    for batch in batches:
        flat, state, loss = trainer.step(flat, state, batch)
        losses.append(float(loss))
    trainer.update_model(model, flat)
    reference = lm.ByteLM(setup, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(reference, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lm.packed_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    expected = [float(step(reference, optimizer, batch)) for batch in batches]
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(reference, nnx.Param))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_one_hot_embedding_and_loss_are_the_gather_ones():
    setup = _setup()
    model = lm.ByteLM(setup, rngs=nnx.Rngs(0))
    tokens = jnp.array([0, 7, 255, 7, 65], jnp.int32)
    np.testing.assert_array_equal(model.embed_tokens(tokens), model.embed(tokens))
    logits = jax.random.normal(jax.random.key(0), (5, 256)) * 3
    mask = jnp.array([True, True, False, True, True])
    total, count = lm._nll(logits, tokens, mask)
    reference = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, None], axis=-1)[:, 0]
    np.testing.assert_allclose(total, jnp.sum(jnp.where(mask, reference, 0)), rtol=1e-5)
    assert int(count) == 4


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["mha", "gqa"])
def test_paged_kv_cache_gives_the_full_forward_next_byte_distribution(kv_heads):
    # Generation prefills packed prompts of different lengths into a paged cache (pages of 8 rows, not adjacent),
    # then decodes one byte per prompt per step through ragged_attention_with_kvcache; each byte's next-byte
    # distribution must be the full forward's over the same prefix.
    setup = _setup(kv_heads=kv_heads, capacity=256, max_seqlen=64)
    model = lm.ByteLM(setup, rngs=nnx.Rngs(4))
    texts = [
        np.frombuffer(t, np.uint8).astype(np.int32)
        for t in (b"def add(a, b):\n    return a + b\n", b"import os\nprint(os.sep)\n")
    ]
    s, n0, steps, page_size = setup.max_seqlen, np.array([6, 11]), 12, 8
    graphdef, state = nnx.split(model)
    forward = jax.jit(
        lambda state, tokens, n: nnx.merge(graphdef, state)(
            tokens, jnp.stack([jnp.zeros((), jnp.int32), n]), jnp.arange(s, dtype=jnp.int32)
        )
    )
    full = [forward(state, np.pad(t, (0, s - len(t))), len(t)) for t in texts]
    table = lm.page_table_for(n0 + steps, page_size)
    assert table.tolist() == [[0, 2, 4], [1, 3, 5]]
    caches = lm.empty_caches(model, 6, page_size)
    tokens = np.concatenate([t[:n] for t, n in zip(texts, n0)])
    cu = np.array([0, n0[0], n0.sum()], np.int32)
    logits, caches = jax.jit(
        lambda state, tokens, cu, caches: lm.prefill(
            nnx.merge(graphdef, state), tokens, cu, int(n0.max()), caches, table
        )
    )(state, tokens, cu, caches)
    decode = jax.jit(
        lambda state, tokens, lengths, caches: lm.decode(nnx.merge(graphdef, state), tokens, lengths, caches, table)
    )
    for i in range(steps + 1):
        for b in range(2):
            np.testing.assert_allclose(
                jax.nn.softmax(logits[b]),
                jax.nn.softmax(full[b][n0[b] + i - 1]),
                rtol=1e-4,
                atol=1e-6,
                err_msg=f"prompt {b}, position {n0[b] + i - 1}",
            )
        if i < steps:
            lengths = (n0 + i).astype(np.int32)
            logits, caches = decode(state, np.array([t[n] for t, n in zip(texts, lengths)], np.int32), lengths, caches)


def test_cache_path_generates_the_full_forward_bytes():
    # Greedy (and sampled, with the same keys), batched prompts of different lengths: the paged-cache path and a
    # full forward per byte write the same bytes.
    setup = _setup(capacity=256, max_seqlen=64)
    model = lm.ByteLM(setup, rngs=nnx.Rngs(4))
    prompts = [b"import ", b"def add(a, b):\n", b"x"]
    cached, cached_s = lm.generate(model, setup, prompts, 12, seed=3, temperature=0, page_size=8)
    forward, forward_s = lm.generate(model, setup, prompts, 12, seed=3, temperature=0, cached=False)
    assert cached == forward and cached_s > 0 and forward_s > 0
    assert [len(c) for c in cached] == [len(p) + 12 for p in prompts] and all(
        c.startswith(p) for c, p in zip(cached, prompts)
    )
    assert (
        lm.generate(model, setup, prompts, 12, seed=3)[0]
        == lm.generate(model, setup, prompts, 12, seed=3, cached=False)[0]
    )
    # Longer than the buffer: the prompt keeps its last max_seqlen - 1 bytes and the sample fills the rest.
    assert [len(t) for t in lm.generate(model, setup, [b"x" * 100, b"y"], 20, seed=3)[0]] == [64, 2]
    assert lm.sample_prompts(b"first", [b"0123456789" * 9, b"abc"], 4) == [
        b"first",
        b"01234567",
        b"abc",
        b"0123456789" * 2 + b"0123",
    ]


def test_profile_prints_where_the_step_goes(capsys):
    setup = _setup(capacity=256, max_seqlen=64)
    train, _, _ = lm.stdlib_files()
    rows = lm.profile(setup, train[:20], 0, lm.Timing(warmup=1, steps=1, repeats=1), nnx_step=False)
    out = capsys.readouterr().out
    names = [name for name, _, _ in rows]
    assert names[0].startswith("train step: jax.jit") and all(
        seconds > 0 for name, seconds, _ in rows if not name.startswith("rest")
    )
    for part in (
        "embedding (one-hot matmul)",
        "decoder block",
        "  attention alone (ragged op)",
        "  MLP alone",
        "head + loss",
        "optimizer (clip + AdamW on one flat vector",
        "rest of the step",
    ):
        assert any(name.startswith(part) for name in names), (part, names)
    assert "step breakdown (" in out and re.search(r"step: [0-9.]+ ms = [0-9,]+ useful tokens/s; matmuls", out)
    assert "the step and its parts timed in turns" in out
    # The parts that partition the step (not the indented ones inside a block) and the rest add up to the step,
    # or the table says that and why they exceed it.
    parts = sum(seconds * count for name, seconds, count in rows[1:] if count and not name.startswith("  "))
    assert parts == pytest.approx(rows[0][1]) or "the parts timed alone add up to" in out, out


def test_progress_counts_only_finished_steps(monkeypatch):
    # The host runs ahead of the device: a step's call returns at once, its result is ready later (here a
    # fake device taking 20 ms a step). The tok/s figures must count the steps finished when the clock is
    # read, not those only enqueued (the first reading once claimed 1.3 M tok/s on a GPU).
    device_step_s = 0.02
    free = [0.0]

    class Pending:
        def __init__(self):
            free[0] = max(free[0], time.perf_counter()) + device_step_s
            self.ready_at = free[0]

        def block_until_ready(self):
            time.sleep(max(0.0, self.ready_at - time.perf_counter()))
            return self

        def __float__(self):
            self.block_until_ready()
            return 2.0

    class FakeTrainer:
        flat = opt_state = None

        def step(self, flat, opt_state, batch):
            return flat, opt_state, Pending()

        def update_model(self, model, flat):
            pass

    readings = []
    monkeypatch.setattr(lm.training, "make_trainer", lambda *args: FakeTrainer())
    monkeypatch.setattr(
        lm.training, "progress_bar", lambda total: (lambda text, done=None: readings.append(text), lambda: None)
    )
    setup = _setup(capacity=512, max_seqlen=128, steps=41)
    train, _, _ = lm.stdlib_files()
    result = lm.train(None, setup, train[:20], seed=0)
    rates = [float(re.search(r"([0-9,]+) tok/s", text).group(1).replace(",", "")) for text in readings]
    assert len(rates) == 3 and rates[-1] == pytest.approx(result["tokens_per_s"], rel=0.01), readings
    ceiling = setup.capacity / device_step_s  # every step at most a full buffer
    assert all(0 < rate <= 1.05 * ceiling for rate in rates), (rates, ceiling)


def test_bad_flags_exit_with_the_flag_named(capsys):
    with pytest.raises(SystemExit):
        lm.parse_args(["--width", "30", "--heads", "4"])
    assert "--width (30) must split into --heads (4)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lm.parse_args(["--max-seqlen", "4096", "--capacity", "1024"])
    assert "--max-seqlen (4096) must be <= --capacity (1024)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lm.parse_args(["--compare-systems", "packed,padded"])
    assert "--compare-systems: choose from packed, padded-cudnn, padded-xla" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lm.parse_args(["--sample-prompts", "0"])
    assert "--sample-prompts must be >= 1, got 0" in capsys.readouterr().err


def test_generation_report_survives_a_failing_cache_call(monkeypatch, capsys):
    # On a GPU the cache's attention call might be refused where it runs: the report says so, runs the xla path
    # instead, and the full-forward figure and everything after still print.
    calls = []

    def fake_generate(model, setup, prompts, length, seed, temperature=0.7, cached=True, implementation=None):
        calls.append((cached, implementation))
        if cached and implementation is None:
            raise NotImplementedError("cuDNN cannot serve this call\nsecond line")
        return [p + b"x" * length for p in prompts], 0.5 if cached else 2.0

    monkeypatch.setattr(lm.generation, "generate", fake_generate)
    lm.sample_and_time(None, _setup(), [b"import ", b"def "], 10, 0)
    out = capsys.readouterr().out
    assert calls == [(True, None), (True, "xla"), (False, None)]
    assert (
        "generation, 2 prompts x 10 bytes: paged KV cache (ragged_attention_with_kvcache, pages of 64 rows) "
        "(the default implementation failed: NotImplementedError: cuDNN cannot serve this call; xla instead) "
        "40 bytes/s; full forward over [2, 128] per byte 10 bytes/s (4.0x slower); the same bytes"
    ) in out, out
