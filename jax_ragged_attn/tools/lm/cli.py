"""`python -m jax_ragged_attn`: a byte-level language model trained on the Python standard library's source.

Real text found on every machine: the .py files of this interpreter's standard library (about 1,800 files,
from a few hundred bytes to hundreds of KB). One file in ten (chosen by a hash of its path) is held out.
Each epoch every training file contributes one random window of at most --window-bytes, so a few huge files
do not fill whole stretches of training; windows longer than --max-seqlen are split into pieces by the packer.

Documents are packed with `jax_ragged_attn.inputs.data.pack_documents` (first-fit-decreasing) into fixed-shape
buffers of --capacity bytes, and modelled by a pre-norm transformer built from
`jax_ragged_attn.flax.RaggedSelfAttention` (causal, RoPE from the packed positions) and an MLP, trained with
Optax AdamW. Every byte predicts the next byte of its own document only.

The training step is one `jax.jit` of a pure function over the model's `nnx.split` state: the parameters as
one flat float32 vector (so AdamW and the gradient clipping are a handful of fused kernels, not a few per
parameter), donated with the optimizer state; the byte embedding is a one-hot matmul (its backward a matmul,
not a scatter-add of every token into a 256-row table); the loss reads the target's logit through a one-hot
product (no gather, whose backward is a scatter).

Reports: the attention implementation (cuDNN on a GPU, the xla path elsewhere), the fill rate of packing
against padding, a progress bar with loss and useful (non-padding) tokens/s, held-out bits per byte against
the uniform (8) and byte-frequency baselines, a loss plot, a generated sample (ragged attention over a KV
cache, timed against a full forward per byte). Exits 1 if held-out bits per byte stay above
--max-bits-per-byte. --profile prints where a step's device time goes. The side-by-side (default on a GPU,
--compare-steps elsewhere) trains the same model from the same initialisation on the same batches, packed
and padded to [rows, max_seqlen] through `jax.nn.dot_product_attention` (cuDNN, XLA), every system timed the
same way (the method is printed).

--preset cpu (default without cuDNN) finishes in about 3 minutes on 2 CPU cores; --preset gpu is larger;
--preset long packs whole files of up to 16,384 bytes per sequence (where padding to the longest wastes
most of a padded batch).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import statistics
import sys
import sysconfig
import time
import zlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from jax_ragged_attn import cudnn_unavailable_reason, ragged_attention
from jax_ragged_attn.inputs.data import pack_documents
from jax_ragged_attn.tools.progress import progress_bar

try:
    import optax
    from flax import nnx

    from jax_ragged_attn.flax import RaggedSelfAttention
except ImportError as error:
    raise SystemExit(f"the main job needs flax and optax: pip install 'jax_ragged_attn[flax]' ({error})") from None

VOCAB = 256  # bytes

# Defaults per machine; any flag overrides. cpu: about 3 minutes on 2 cores. gpu: a larger model in bfloat16.
# long: the gpu model on whole files of up to 16,384 bytes per sequence (no split below that), 4 padded rows.
PRESETS = {
    "cpu": dict(width=128, heads=4, kv_heads=4, layers=2, capacity=2048, max_seqlen=256, max_seqs=16, steps=400,
                lr=3e-3, window_bytes=4096, eval_bytes=65536, dtype="float32", max_bits_per_byte=3.5),
    "gpu": dict(width=512, heads=8, kv_heads=8, layers=6, capacity=32768, max_seqlen=2048, max_seqs=64, steps=1500,
                lr=1e-3, window_bytes=16384, eval_bytes=1 << 20, dtype="bfloat16", max_bits_per_byte=2.5),
    "long": dict(width=512, heads=8, kv_heads=8, layers=6, capacity=65536, max_seqlen=16384, max_seqs=64, steps=400,
                 lr=1e-3, window_bytes=16384, eval_bytes=1 << 20, dtype="bfloat16", max_bits_per_byte=3.0),
}


@dataclasses.dataclass(frozen=True)
class Setup:
    width: int
    heads: int
    kv_heads: int
    layers: int
    capacity: int  # tokens (bytes) per packed batch
    max_seqlen: int
    max_seqs: int
    steps: int
    lr: float
    window_bytes: int
    eval_bytes: int
    dtype: str
    max_bits_per_byte: float


# ---- The corpus. ----

def stdlib_files(root: str | None = None) -> tuple[list[bytes], list[bytes], str]:
    """(training files, held-out files, root): every non-empty .py file under the standard library (site- and
    dist-packages excluded), split by a hash of the path relative to root, one in ten held out."""
    root = root or sysconfig.get_paths()["stdlib"]
    train, held_out = [], []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            if data:
                relative = os.path.relpath(path, root).replace(os.sep, "/")
                (held_out if zlib.crc32(relative.encode()) % 10 == 0 else train).append(data)
    if not train or not held_out:
        raise SystemExit(f"found too few .py files under {root} ({len(train)} training, {len(held_out)} held out)")
    return train, held_out, root


def windows(files: list[bytes], rng: np.random.Generator, window: int, epochs: int | None = None,
            lengths: list | None = None) -> Iterator:
    """Each epoch, the files in a random order, each as one random window of at most `window` bytes (whose
    lengths are appended to `lengths` when given)."""
    epoch = 0
    while epochs is None or epoch < epochs:
        for i in rng.permutation(len(files)):
            data = files[i]
            start = int(rng.integers(0, len(data) - window + 1)) if len(data) > window else 0
            if lengths is not None:
                lengths.append(min(window, len(data)))
            yield np.frombuffer(data, np.uint8, count=min(window, len(data)), offset=start)
        epoch += 1


# ---- The model. ----
# One definition of the decoder, shared with the training-step benchmark (tools/bench/model_step.py): Block
# takes its attention as a callback attend(attention_module, x), so that the same parameters run packed
# (RaggedSelfAttention), padded (jax.nn.dot_product_attention), or over a KV cache (generation).

class Block(nnx.Module):
    """Pre-norm decoder block: x + attention(norm(x)), then x + MLP(norm(x)) (GELU, hidden `hidden`)."""

    def __init__(self, width: int, heads: int, kv_heads: int, *, dtype, implementation=None,
                 hidden: int | None = None, head_dim: int | None = None, rngs: nnx.Rngs):
        dtype = jnp.dtype(dtype)
        hidden = hidden or 4 * width
        self.attention_norm = nnx.RMSNorm(width, dtype=dtype, rngs=rngs)
        self.attention = RaggedSelfAttention(width, heads, num_kv_heads=kv_heads, head_dim=head_dim, is_causal=True,
                                             dtype=dtype, implementation=implementation, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(width, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(width, hidden, use_bias=False, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(hidden, width, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x, attend):
        x = x + attend(self.attention, self.attention_norm(x))
        return x + self.mlp(x)

    def mlp(self, x):
        return self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


def split_heads(qkv, q, kv):
    """`RaggedSelfAttention.project`'s output as (q [..., Hq, D], k [..., Hkv, D], v [..., Hkv, D])."""
    if qkv is not None:
        return qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
    return q, kv[..., 0, :, :], kv[..., 1, :, :]


def packed_attend(cu_seqlens, positions, max_seqlen: int):
    """attend for packed tokens [T, d]: the module's own ragged attention (cuDNN where it serves)."""
    def attend(attention, x):
        return attention(x, cu_seqlens, positions, max_seqlen=max_seqlen)
    return attend


def padded_attend(lengths, positions, implementation):
    """attend for padded rows [R, S, d]: the same projections around jax.nn.dot_product_attention."""
    def attend(attention, x):
        q, k, v = split_heads(*attention.project(x, positions))
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                           key_value_seq_lengths=lengths, implementation=implementation)
        return attention.project_out(out)
    return attend


class ByteLM(nnx.Module):
    """Bytes -> next-byte logits (float32). `__call__` takes a packed batch; `padded` the same model on
    [rows, S] padded rows through jax.nn.dot_product_attention (the side-by-side); `forward` any attend."""

    def __init__(self, setup: Setup, implementation=None, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(setup.dtype)
        self.embed = nnx.Embed(VOCAB, setup.width, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(setup.width, setup.heads, setup.kv_heads, dtype=dtype,
                                      implementation=implementation, rngs=rngs) for _ in range(setup.layers)])
        self.norm = nnx.RMSNorm(setup.width, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(setup.width, VOCAB, use_bias=False, dtype=dtype, rngs=rngs)
        self.max_seqlen = setup.max_seqlen
        self.dtype = dtype

    def __call__(self, tokens, cu_seqlens, positions):
        return self.forward(tokens, packed_attend(cu_seqlens, positions, self.max_seqlen))

    def padded(self, tokens, lengths, implementation=None):
        """tokens [R, S], lengths [R] -> logits [R, S, 256], attention by jax.nn.dot_product_attention."""
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        return self.forward(tokens, padded_attend(lengths, positions, implementation))

    def forward(self, tokens, attend):
        x = self.embed_tokens(tokens)
        for block in self.blocks:
            x = block(x, attend)
        return self.logits(x)

    def embed_tokens(self, tokens):
        """A one-hot matmul: exact, and its backward is a [256, T] @ [T, d] matmul, not a scatter-add."""
        table = self.embed.embedding[...].astype(self.dtype)
        return jnp.dot(jax.nn.one_hot(tokens, VOCAB, dtype=self.dtype), table)

    def logits(self, x):
        return self.head(self.norm(x)).astype(jnp.float32)


def _nll(logits, targets, mask):
    """(summed negative log-likelihood in nats over masked positions, their count). The target's logit is
    read through a one-hot product, whose backward is elementwise (a gather's would be a scatter)."""
    picked = jnp.sum(logits * jax.nn.one_hot(targets, VOCAB, dtype=logits.dtype), axis=-1)
    nll = jax.nn.logsumexp(logits, axis=-1) - picked
    # `where`, not a product: padded rows past a sequence's end may hold anything, and NaN * 0 is NaN.
    return jnp.sum(jnp.where(mask, nll, 0.0)), jnp.sum(mask)


def packed_loss(model, batch):
    total, count = _nll(model(batch["tokens"], batch["cu_seqlens"], batch["positions"]), batch["targets"],
                        batch["loss_mask"])
    return total / jnp.maximum(count, 1)


def padded_loss(model, batch, implementation):
    total, count = _nll(model.padded(batch["tokens"], batch["lengths"], implementation), batch["targets"],
                        batch["loss_mask"])
    return total / jnp.maximum(count, 1)


@nnx.jit
def eval_nll(model, batch):
    return _nll(model(batch["tokens"], batch["cu_seqlens"], batch["positions"]), batch["targets"],
                batch["loss_mask"])


# ---- The training step: one jax.jit over nnx.split state, flat parameters, donated buffers. ----

def make_tx(lr: float, steps: int):
    warmup = max(1, steps // 20)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end_value=lr / 10)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.99, weight_decay=0.1))


@dataclasses.dataclass
class Trainer:
    """A model's training step as a pure function: `step(flat, opt_state, batch) -> (flat, opt_state, loss)`,
    jitted with flat and opt_state donated. flat: every nnx.Param of the model raveled into one float32
    vector (unravel gives the nnx.State back); the optimizer runs on that one vector."""

    graphdef: object
    rest: object  # the model's non-Param state (none for ByteLM)
    unravel: Callable
    tx: object
    loss_fn: Callable  # (model, batch) -> scalar
    step: Callable  # jitted, donate_argnums=(0, 1)
    flat: jax.Array
    opt_state: object

    def merge(self, flat):
        return nnx.merge(self.graphdef, self.unravel(flat), self.rest)

    def loss(self, flat, batch):
        return self.loss_fn(self.merge(flat), batch)

    def update_model(self, model, flat) -> None:
        """Writes flat's parameters into `model` (the nnx object the trainer was made from)."""
        nnx.update(model, self.unravel(flat))


def make_trainer(model, loss_fn, tx) -> Trainer:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    flat, unravel = ravel_pytree(params)
    flat = flat.astype(jnp.float32)
    trainer = Trainer(graphdef, rest, unravel, tx, loss_fn, None, flat, tx.init(flat))

    def step(flat, opt_state, batch):
        loss, grads = jax.value_and_grad(trainer.loss)(flat, batch)
        updates, opt_state = tx.update(grads, opt_state, flat)
        return optax.apply_updates(flat, updates), opt_state, loss

    trainer.step = jax.jit(step, donate_argnums=(0, 1))
    return trainer


def device_batch(arrays: dict) -> dict:
    """Host arrays -> device arrays (asynchronous), with the keys the losses read."""
    return {key: jax.device_put(value) for key, value in arrays.items() if key != "segment_ids"}


# ---- Training and evaluation. ----

def packed_batches(files, setup: Setup, seed: int, lengths: list | None = None):
    """The packer over endless training windows (document lengths appended to `lengths`)."""
    documents = windows(files, np.random.default_rng([seed, 0]), setup.window_bytes, lengths=lengths)
    return pack_documents(documents, setup.capacity, max_seqs=setup.max_seqs, max_seqlen=setup.max_seqlen,
                          rng=np.random.default_rng([seed, 1]))


def padded_rows(setup: Setup) -> int:
    return max(1, setup.capacity // setup.max_seqlen)


def padded_pieces(pieces: list, setup: Setup) -> tuple[dict, int]:
    """Pieces (1-D token arrays of at most max_seqlen) as rows of [rows, max_seqlen], one per row, the first
    `rows` of them; (batch, the rows' real tokens). An empty row gets length 1 (a masked pad byte): a row with
    no key at all is undefined for some backends."""
    rows, s = padded_rows(setup), setup.max_seqlen
    arrays = {key: np.zeros((rows, s), dtype) for key, dtype in
              (("tokens", np.int32), ("targets", np.int32), ("loss_mask", bool))}
    lengths = np.zeros(rows, np.int32)
    for r, piece in enumerate(pieces[:rows]):
        n = len(piece)
        arrays["tokens"][r, :n] = piece
        arrays["targets"][r, :n - 1] = piece[1:]
        arrays["loss_mask"][r, :n - 1] = True
        lengths[r] = n
    return dict(arrays, lengths=np.maximum(lengths, 1)), int(lengths.sum())


def padded_batch(batch, setup: Setup) -> tuple[dict, int]:
    """The first rows = capacity // max_seqlen sequences of a packed batch as rows of [rows, max_seqlen] (the
    same token buffer), one per row; (batch, rows' real tokens). The rest of the batch is dropped."""
    cu = batch.cu_seqlens
    return padded_pieces([batch.tokens[int(cu[r]):int(cu[r + 1])] for r in range(batch.num_seqs)], setup)


def padded_batches(files, setup: Setup, seed: int) -> Iterator[tuple[dict, int]]:
    """The padded pipeline over the same windows as `packed_batches(files, setup, seed)`: each window split
    at max_seqlen as the packer splits it, the pieces in stream order, `rows` of them per [rows, max_seqlen]
    batch; yields (batch, real tokens)."""
    s, rows = setup.max_seqlen, padded_rows(setup)
    pieces = (doc[start:start + s].astype(np.int32)
              for doc in windows(files, np.random.default_rng([seed, 0]), setup.window_bytes)
              for start in range(0, len(doc), s))
    while True:
        yield padded_pieces([next(pieces) for _ in range(rows)], setup)


def train(model, setup: Setup, files, seed: int, progress: bool = True, steps: int | None = None) -> dict:
    """Trains `model` in place for `steps` (default setup.steps) on packed batches through the jitted step.
    The host packs batch i+1 while the device runs step i; the progress bar reads the loss of the step
    before the newest one, so the host never waits for the device it has just fed."""
    steps = setup.steps if steps is None else steps
    trainer = make_trainer(model, packed_loss, make_tx(setup.lr, setup.steps))
    document_lengths = []
    packer = packed_batches(files, setup, seed, document_lengths)
    update, close = progress_bar(steps) if progress else (lambda text, done: None, lambda: None)
    flat, opt_state = trainer.flat, trainer.opt_state
    losses, tokens, start = [], 0, None
    for step in range(steps):
        batch = next(packer)
        flat, opt_state, loss = trainer.step(flat, opt_state, device_batch(batch.arrays()))
        losses.append(loss)  # a device array, read later
        if step == 0:
            jax.block_until_ready(loss)
            start = time.perf_counter()  # the first step compiled; count from here
        else:
            tokens += batch.num_tokens
        if step % 20 == 0 and step > 0:
            seconds = time.perf_counter() - start
            update(f"{float(losses[-2]) / math.log(2):.2f} bits/byte, {tokens / max(seconds, 1e-9):,.0f} tok/s",
                   step + 1)
    jax.block_until_ready((flat, losses[-1]))
    seconds = time.perf_counter() - start
    update(f"{float(losses[-1]) / math.log(2):.2f} bits/byte, {tokens / max(seconds, 1e-9):,.0f} tok/s", steps)
    close()
    trainer.update_model(model, flat)
    # fill_rate: real tokens / buffer rows, as trained on. The padded alternatives, from the same documents:
    # each document (window) in a row as long as the longest document can be; or, split at max_seqlen as for
    # packing, one piece per max_seqlen row.
    return dict(losses=np.array([float(x) for x in losses]), tokens_per_s=tokens / max(seconds, 1e-9),
                seconds=seconds, fill_rate=packer.tokens / max(packer.batches * setup.capacity, 1),
                padded_document_fill=float(np.mean(document_lengths)) / setup.window_bytes,
                padded_rows_fill=packer.tokens / max(packer.pieces * setup.max_seqlen, 1))


def evaluate(model, files, setup: Setup) -> dict:
    """Held-out bits per byte over up to setup.eval_bytes predicted bytes (fixed windows: seed 0 always)."""
    packer = pack_documents(windows(files, np.random.default_rng(0), setup.window_bytes, epochs=1),
                            setup.capacity, max_seqs=setup.max_seqs, max_seqlen=setup.max_seqlen)
    nats = count = 0.0
    for batch in packer:
        total, n = eval_nll(model, device_batch(batch.arrays()))
        nats, count = nats + float(total), count + float(n)
        if count >= setup.eval_bytes:
            break
    return dict(bits_per_byte=nats / max(count, 1.0) / math.log(2), bytes=int(count))


def unigram_bits_per_byte(train_files, held_out_files) -> float:
    """Held-out cross-entropy of the training files' byte frequencies (add-one smoothed): what a model that
    ignores context entirely would reach."""
    counts = np.ones(VOCAB)
    for data in train_files:
        counts += np.bincount(np.frombuffer(data, np.uint8), minlength=VOCAB)
    log_p = np.log2(counts / counts.sum())
    held = sum(np.bincount(np.frombuffer(data, np.uint8), minlength=VOCAB) for data in held_out_files)
    return float(-(held * log_p).sum() / held.sum())


# ---- Measuring: one method for every timing this file prints. ----

@dataclasses.dataclass(frozen=True)
class Timing:
    """warmup calls, then `repeats` loops of `steps` calls each, one block_until_ready at a loop's end; the
    median loop's seconds per call. Compilation is done (and timed) before, apart."""

    warmup: int = 2
    steps: int = 10
    repeats: int = 5

    def describe(self) -> str:
        return (f"compiled first (timed apart), {self.warmup} warm-up steps, then {self.repeats} x {self.steps} "
                "steps each ended by one block_until_ready, median per step")


def time_calls(call: Callable, timing: Timing) -> float:
    """Median seconds per call of `call()` (see Timing). call returns what to block on."""
    for _ in range(timing.warmup):
        jax.block_until_ready(call())
    times = []
    for _ in range(timing.repeats):
        start = time.perf_counter()
        for _ in range(timing.steps):
            out = call()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / timing.steps)
    return statistics.median(times)


def compiled_bytes(compiled) -> int | None:
    """XLA's buffer assignment for one call: arguments + outputs + temporaries - donated (aliased) buffers,
    the device memory the step needs at its peak."""
    try:
        m = compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB"


def matmul_parameters(setup: Setup) -> int:
    """Parameters the matmuls of one token run through (embedding one-hot and head included)."""
    d, head_dim = setup.width, setup.width // setup.heads
    attention = d * head_dim * (2 * setup.heads + 2 * setup.kv_heads)
    return setup.layers * (attention + 2 * d * 4 * d) + 2 * VOCAB * d


def step_flops(setup: Setup, seqlens) -> tuple[float, float]:
    """(matmul FLOPs over the whole buffer, causal attention FLOPs over the real sequences) of one training
    step: 6 per parameter per token; attention forward 2 * sum(L^2) * H * D, backward 2.5x that."""
    matmuls = 6.0 * matmul_parameters(setup) * setup.capacity
    seqlens = np.asarray(seqlens, np.float64)
    attention = 3.5 * 2.0 * float(np.sum(seqlens ** 2)) * setup.width * setup.layers
    return matmuls, attention


# ---- Where a step's time goes (--profile). ----

def profile(setup: Setup, files, seed: int, timing: Timing, nnx_step: bool = True) -> list[tuple[str, float, int]]:
    """Times the training step and its parts alone on one packed batch, each fwd+bwd as the step runs it, by
    `time_calls`; prints a table and returns [(part, seconds per call, calls per step)]."""
    host = next(packed_batches(files, setup, seed))
    batch = device_batch(host.arrays())
    model = ByteLM(setup, rngs=nnx.Rngs(seed))
    dtype, t, s = jnp.dtype(setup.dtype), setup.capacity, setup.max_seqlen
    trainer = make_trainer(model, packed_loss, make_tx(setup.lr, setup.steps))
    rows: list[tuple[str, float, int]] = []

    def feed_back(compiled, state, *rest):
        def call():
            state[0], state[1], out = compiled(state[0], state[1], *rest)
            return out
        return call

    start = time.perf_counter()
    step = trainer.step.lower(trainer.flat, trainer.opt_state, batch).compile()
    compile_s = time.perf_counter() - start
    step_state = [trainer.flat, trainer.opt_state]
    step_s = time_calls(feed_back(step, step_state, batch), timing)
    print(f"step breakdown ({timing.describe()}; compile {compile_s:.1f} s; one packed batch of "
          f"{host.num_tokens:,} real bytes in {host.num_seqs} sequences):")
    print(f"  {'part':<62} {'ms/call':>9} {'x':>3} {'ms/step':>9} {'share':>6}")

    def emit(name, seconds, count):
        rows.append((name, seconds, count))
        per_step = seconds * max(count, 1)
        share = "" if not count or name.startswith("train step") else f"{per_step / step_s:6.0%}"
        print(f"  {name:<62} {seconds * 1e3:9.3f} {count if count else '-':>3} {per_step * 1e3:9.3f} {share:>6}",
              flush=True)
    emit("train step: jax.jit, flat AdamW, donated (the main job's)", step_s, 1)

    keys = iter(jax.random.split(jax.random.key(seed), 16))

    def alone(name, fn, *args, count=1):
        """fn(*args) -> array, timed forward + backward (a vjp with a ones cotangent) to every arg."""
        def fwd_bwd(*args):
            out, pull = jax.vjp(fn, *args)
            return pull(jnp.ones_like(out))
        compiled = jax.jit(fwd_bwd).lower(*args).compile()
        emit(name, time_calls(lambda: compiled(*args), timing), count)

    x = jax.random.normal(next(keys), (t, setup.width), dtype)
    table = model.embed.embedding[...]
    alone("embedding (one-hot matmul)",
          lambda table: jnp.dot(jax.nn.one_hot(batch["tokens"], VOCAB, dtype=dtype), table.astype(dtype)), table)
    block_def, block_state = nnx.split(model.blocks[0])
    attend = packed_attend(batch["cu_seqlens"], batch["positions"], s)
    alone("decoder block", lambda st, x: nnx.merge(block_def, st)(x, attend), block_state, x, count=setup.layers)
    attention = model.blocks[0].attention
    qkv, q, kv = attention.project(x, batch["positions"])
    buffers = tuple(b for b in (qkv, q, kv) if b is not None)

    def attention_only(*buffers):
        parts = iter(buffers)
        qkv_, q_, kv_ = ((next(parts), None, None) if qkv is not None else (None, next(parts), next(parts)))
        return attention.attend(qkv_, q_, kv_, batch["cu_seqlens"], max_seqlen=s)
    alone("  attention alone (ragged op)", attention_only, *buffers, count=setup.layers)
    alone("  MLP alone", lambda st, x: nnx.merge(block_def, st).mlp(x), block_state, x, count=setup.layers)
    norm_def, norm_state = nnx.split(model.norm)
    head_def, head_state = nnx.split(model.head)

    def head_loss(norm_state, head_state, x):
        logits = nnx.merge(head_def, head_state)(nnx.merge(norm_def, norm_state)(x)).astype(jnp.float32)
        return _nll(logits, batch["targets"], batch["loss_mask"])[0]
    alone("head + loss", head_loss, norm_state, head_state, x)

    tx = trainer.tx
    grads = jax.random.normal(next(keys), trainer.flat.shape, jnp.float32) * 1e-3

    def update(flat, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, flat)
        flat = optax.apply_updates(flat, updates)
        return flat, opt_state, flat[:1]
    flat2 = jnp.copy(step_state[0])  # the step donated trainer.flat
    opt2 = tx.init(flat2)
    optimizer = jax.jit(update, donate_argnums=(0, 1)).lower(flat2, opt2, grads).compile()
    emit(f"optimizer (clip + AdamW on one flat vector of {trainer.flat.size:,})",
         time_calls(feed_back(optimizer, [flat2, opt2], grads), timing), 1)
    parts = [r for r in rows[1:] if r[2] and not r[0].startswith("  ")]
    emit("rest of the step (step - the parts above)", step_s - sum(seconds * count for _, seconds, count in parts), 1)

    if nnx_step:
        # The previous way, for reference: nnx.jit over the module and an nnx.Optimizer (per-parameter
        # updates), the same model and loss. Its extra time is per-call Python and small kernels.
        other = ByteLM(setup, rngs=nnx.Rngs(seed))
        optimizer_ = nnx.Optimizer(other, make_tx(setup.lr, setup.steps), wrt=nnx.Param)

        @nnx.jit
        def nnx_train_step(model, optimizer, batch):
            loss, grads = nnx.value_and_grad(packed_loss)(model, batch)
            optimizer.update(model, grads)
            return loss
        jax.block_until_ready(nnx_train_step(other, optimizer_, batch))
        emit("for reference: the same step as nnx.jit + nnx.Optimizer",
             time_calls(lambda: nnx_train_step(other, optimizer_, batch), timing), 0)

    seqlens = np.diff(host.cu_seqlens)
    matmuls, attention_flops = step_flops(setup, seqlens[seqlens > 0])
    print(f"  step: {step_s * 1e3:.2f} ms = {host.num_tokens / step_s:,.0f} useful tokens/s; matmuls "
          f"{matmuls / 1e12:.2f} TFLOP + attention {attention_flops / 1e12:.2f} TFLOP per step = "
          f"{(matmuls + attention_flops) / step_s / 1e12:.1f} TFLOP/s")
    return rows


# ---- The side-by-side: packed and padded, every system timed the same way. ----

SYSTEMS = ("packed", "padded-cudnn", "padded-xla")
XLA_SCORES_LIMIT_BYTES = 8e9  # one layer's [rows, heads, S, S] float32 scores, above which padded-xla is skipped


@dataclasses.dataclass
class SystemResult:
    system: str
    status: str = "ok"
    step_s: float | None = None
    tokens: float = 0.0  # real tokens per step (mean over the batches timed)
    slots: int = 0  # token slots per step (the buffer)
    memory: int | None = None  # compiled step: arguments + outputs + temporaries - donated
    compile_s: float | None = None
    loop_tokens_per_s: float | None = None  # the training loop's way: packed on the host every step
    loss: float | None = None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.step_s if self.step_s else None

    @property
    def fill(self) -> float:
        return self.tokens / self.slots if self.slots else 0.0


def system_unavailable(system: str, setup: Setup) -> str | None:
    if system == "padded-cudnn" and jax.default_backend() != "gpu":
        return f"jax.nn's cudnn attention needs a CUDA GPU; JAX's backend is {jax.default_backend()!r}"
    if system == "padded-xla":
        scores = padded_rows(setup) * setup.heads * setup.max_seqlen ** 2 * 4
        if scores > XLA_SCORES_LIMIT_BYTES:
            return (f"jax.nn's xla attention materialises [rows, heads, S, S] float32 scores: {scores / 1e9:.0f} GB "
                    f"per layer here, over the {XLA_SCORES_LIMIT_BYTES / 1e9:.0f} GB this run allows")
    return None


def system_batches(system: str, files, setup: Setup, seed: int) -> Iterator[tuple[dict, int, int]]:
    """(host arrays, real tokens, token slots) per step, as the system's pipeline feeds it: packed batches,
    or padded ones of the same stream of windows."""
    if system == "packed":
        return ((b.arrays(), b.num_tokens, setup.capacity) for b in packed_batches(files, setup, seed))
    return ((arrays, real, arrays["tokens"].size) for arrays, real in padded_batches(files, setup, seed))


def measure_system(system: str, setup: Setup, files, seed: int, timing: Timing, loop_steps: int = 0) -> SystemResult:
    """One system of the side-by-side: a fresh ByteLM from `seed`, the jitted donated step, the first
    warmup + steps batches of the system's pipeline on the device before timing (cycled through in order),
    timed by `time_calls`; then `loop_steps` steps fed from the pipeline afresh, as the training loop does."""
    result = SystemResult(system)
    reason = system_unavailable(system, setup)
    if reason:
        result.status = f"skipped: {reason}"
        return result
    loss_fn = (packed_loss if system == "packed"
               else functools.partial(padded_loss, implementation=system.split("-", 1)[1]))
    pipeline = system_batches(system, files, setup, seed)
    prepared = [next(pipeline) for _ in range(timing.warmup + timing.steps)]
    batches = [device_batch(arrays) for arrays, _, _ in prepared]
    result.tokens = float(np.mean([real for _, real, _ in prepared]))
    result.slots = prepared[0][2]
    trainer = make_trainer(ByteLM(setup, rngs=nnx.Rngs(seed)), loss_fn, make_tx(setup.lr, setup.steps))
    start = time.perf_counter()
    compiled = trainer.step.lower(trainer.flat, trainer.opt_state, batches[0]).compile()
    result.compile_s = time.perf_counter() - start
    result.memory = compiled_bytes(compiled)
    state = [trainer.flat, trainer.opt_state, None]
    calls = [0]

    def call():
        state[0], state[1], state[2] = compiled(state[0], state[1], batches[calls[0] % len(batches)])
        calls[0] += 1
        return state[2]

    result.step_s = time_calls(call, timing)
    result.loss = float(state[2])
    if loop_steps:
        # The training loop's way: each step's batch made on the host (packed or padded), transferred, then
        # the step; one block at the end. The same documents again, from the start of the stream.
        pipeline = system_batches(system, files, setup, seed)
        start, tokens = time.perf_counter(), 0
        for _ in range(loop_steps):
            arrays, real, _ = next(pipeline)
            state[0], state[1], state[2] = compiled(state[0], state[1], device_batch(arrays))
            tokens += real
        jax.block_until_ready(state[:3])
        result.loop_tokens_per_s = tokens / (time.perf_counter() - start)
    return result


def side_by_side(setup: Setup, files, seed: int, timing: Timing, systems=SYSTEMS, loop_steps: int = 20,
                 label: str = "") -> list[SystemResult]:
    """Packed vs padded: the same model and initialisation, the same stream of documents (packed, or padded
    to [rows, max_seqlen] in stream order), one timing method. Prints the method and a table; returns the
    results."""
    rows = padded_rows(setup)
    print(f"side-by-side{label}: {setup.layers} layers, width {setup.width}, {setup.dtype}; batches of "
          f"{setup.capacity:,} bytes, sequences <= {setup.max_seqlen:,} (padded: [{rows}, {setup.max_seqlen}])")
    print(f"  method: every system the same jitted step (jax.jit over nnx.split state, flat AdamW, donated) from the "
          f"same initialisation (seed {seed}), fed the same stream of documents (windows of <= {setup.window_bytes:,} "
          f"bytes split at {setup.max_seqlen:,}): packed by pack_documents, or padded {rows} pieces per batch in "
          f"stream order, one per row; the first {timing.warmup + timing.steps} batches put on the device before "
          f"timing; {timing.describe()}. tokens/s counts real (non-padding) tokens. 'loop' = {loop_steps} more "
          "steps fed as the training loop feeds them (batches made on the host each step).")
    print(f"  {'system':<14} {'ms/step':>9} {'tok/s':>12} {'vs packed':>9} {'fill':>6} {'step memory':>11} "
          f"{'compile':>8} {'loop tok/s':>11} {'loss':>6}", flush=True)
    results, packed = [], None
    for system in systems:  # each row printed as it is measured: a run cut short keeps the rows it has
        try:
            r = measure_system(system, setup, files, seed, timing, loop_steps)
        except Exception as error:  # noqa: BLE001 - e.g. cuDNN refusing the padded shape: report it, keep the others
            message = str(error).splitlines()[0][:200] if str(error) else ""
            r = SystemResult(system, f"error: {type(error).__name__}: {message}")
        results.append(r)
        if r.status != "ok":
            print(f"  {r.system:<14} {r.status}", flush=True)
            continue
        packed = r if r.system == "packed" else packed
        versus = f"{r.tokens_per_s / packed.tokens_per_s:.2f}x" if packed else "-"
        loop = f"{r.loop_tokens_per_s:,.0f}" if r.loop_tokens_per_s else "-"
        print(f"  {r.system:<14} {r.step_s * 1e3:9.2f} {r.tokens_per_s:12,.0f} {versus:>9} {r.fill:6.1%} "
              f"{_gb(r.memory):>11} {r.compile_s:7.1f}s {loop:>11} {r.loss / math.log(2):6.2f}", flush=True)
    for r in results:
        if r.status == "ok" and r.system != "packed" and packed:
            print(f"  packed is {packed.tokens_per_s / r.tokens_per_s:.2f}x {r.system} in useful tokens/s")
    return results


# ---- Generation: ragged attention over a KV cache, against a full forward per byte. ----

def prefill(model: ByteLM, tokens, n):
    """tokens [S] with the first n real -> (logits [256] of row n - 1, k, v [layers, S, Hkv, D]): the prompt's
    forward, keeping every layer's rotated keys and values as the cache (rows >= n are never read)."""
    s = tokens.shape[0]
    cu = jnp.stack([jnp.zeros((), jnp.int32), jnp.asarray(n, jnp.int32)])
    positions = jnp.arange(s, dtype=jnp.int32)
    keys, values = [], []

    def attend(attention, x):
        qkv, q, kv = attention.project(x, positions)
        _, k, v = split_heads(qkv, q, kv)
        keys.append(k)
        values.append(v)
        return attention.project_out(attention.attend(qkv, q, kv, cu, max_seqlen=s))
    logits = model.forward(tokens, attend)
    return logits[n - 1], jnp.stack(keys), jnp.stack(values)


def decode(model: ByteLM, token, n, keys, values, implementation=None):
    """The byte at position n (its predecessors cached in keys/values [layers, S, Hkv, D]) -> (logits [256]
    of the byte after it, the caches with row n written). Attention: one query row against the cache slot,
    ragged_attention(is_causal=True, diagonal_alignment='bottom_right', seqused_kv=[n + 1])."""
    s = keys.shape[1]
    position = jnp.reshape(jnp.asarray(n, jnp.int32), (1,))
    cu_q = jnp.array([0, 1], jnp.int32)
    cu_kv = jnp.array([0, s], jnp.int32)
    layer = iter(range(keys.shape[0]))
    new_keys, new_values = [], []

    def attend(attention, x):
        i = next(layer)
        q, k, v = split_heads(*attention.project(x, position))
        k_cache = jax.lax.dynamic_update_slice(keys[i], k.astype(keys.dtype), (position[0], 0, 0))
        v_cache = jax.lax.dynamic_update_slice(values[i], v.astype(values.dtype), (position[0], 0, 0))
        new_keys.append(k_cache)
        new_values.append(v_cache)
        out = ragged_attention(q, k_cache, v_cache, cu_q, cu_kv, max_seqlen_q=1, max_seqlen_kv=s, is_causal=True,
                               diagonal_alignment="bottom_right", seqused_kv=position + 1, scale=attention.scale,
                               implementation=implementation or attention.implementation)
        return attention.project_out(out)
    logits = model.forward(jnp.reshape(token, (1,)), attend)
    return logits[0], jnp.stack(new_keys), jnp.stack(new_values)


def _sample(logits, key, i, temperature):
    return jax.random.categorical(jax.random.fold_in(key, i), logits / temperature).astype(jnp.int32)


def _generate_cached(graphdef, state, buffer, key, *, n0, length, temperature, implementation):
    model = nnx.merge(graphdef, state)
    logits, keys, values = prefill(model, buffer, n0)

    def body(i, carry):
        buffer, logits, keys, values = carry
        token = _sample(logits, key, i, temperature)
        buffer = buffer.at[n0 + i].set(token)
        logits, keys, values = decode(model, token, n0 + i, keys, values, implementation)
        return buffer, logits, keys, values
    return jax.lax.fori_loop(0, length, body, (buffer, logits, keys, values))[0]


def _generate_full(graphdef, state, buffer, key, *, n0, length, temperature, implementation):
    del implementation
    model = nnx.merge(graphdef, state)
    positions = jnp.arange(buffer.shape[0], dtype=jnp.int32)

    def body(i, buffer):
        n = n0 + i
        logits = model(buffer, jnp.stack([jnp.zeros((), jnp.int32), n]), positions)[n - 1]
        return buffer.at[n].set(_sample(logits, key, i, temperature))
    return jax.lax.fori_loop(0, length, body, buffer)


def generate(model: ByteLM, setup: Setup, prompt: bytes, length: int, seed: int, temperature: float = 0.7,
             cached: bool = True, implementation: str | None = None) -> tuple[bytes, float]:
    """(prompt + up to `length` sampled bytes, seconds the generation took once compiled). The whole loop
    runs on the device (lax.fori_loop, jax.random sampling with the same keys either way): cached=True
    prefills the prompt once, then one `decode` per byte; cached=False runs the packed model over the whole
    [max_seqlen] buffer for every byte. The prompt and the bytes fit in max_seqlen (length is cut to fit)."""
    s = setup.max_seqlen
    prompt = prompt[-(s - 1):] or b"\n"
    length = max(0, min(length, s - len(prompt)))
    buffer = np.zeros(s, np.int32)
    buffer[:len(prompt)] = np.frombuffer(prompt, np.uint8)
    graphdef, state = nnx.split(model)
    fn = _generate_cached if cached else _generate_full
    run = jax.jit(functools.partial(fn, graphdef, n0=len(prompt), length=length, temperature=temperature,
                                    implementation=implementation))
    key = jax.random.key(seed)
    compiled = run.lower(state, buffer, key).compile()
    start = time.perf_counter()
    out = np.asarray(jax.block_until_ready(compiled(state, buffer, key)))
    return bytes(out[:len(prompt) + length].astype(np.uint8)), time.perf_counter() - start


def sample_and_time(model: ByteLM, setup: Setup, prompt: bytes, length: int, seed: int) -> None:
    """Prints the cached sample and bytes/s cached vs a full forward per byte (a failure is printed, not
    raised: the reports after it still run)."""
    def attempt(**options):
        try:
            return generate(model, setup, prompt, length, seed, **options), None
        except Exception as error:  # noqa: BLE001
            return (None, None), f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    (text, cached_s), error = attempt()
    note = ""
    if error:  # the cache's attention call refused where it runs (e.g. cuDNN): say so, run the xla path
        note = f" (the default implementation failed: {error}; xla instead)"
        (text, cached_s), error = attempt(implementation="xla")
    (full_text, full_s), full_error = attempt(cached=False)
    rule = "-" * 60
    if text is not None:
        print(f"sample (temperature 0.7, KV cache):\n{rule}\n{text.decode('utf-8', errors='replace')}\n{rule}")
    n = len(text or full_text or b"") - len(prompt[-(setup.max_seqlen - 1):] or b"\n")
    cached = f"{n / max(cached_s, 1e-9):,.0f} bytes/s" if text is not None else f"failed ({error})"
    full = f"{n / max(full_s, 1e-9):,.0f} bytes/s" if full_text is not None else f"failed ({full_error})"
    tail = ""
    if text is not None and full_text is not None:
        same = "the same bytes" if full_text == text else "different bytes (rounding tipped a draw)"
        tail = f" ({full_s / max(cached_s, 1e-9):.1f}x slower); {same}"
    print(f"generation, {n} bytes: KV cache (ragged attention, bottom-right, seqused_kv){note} {cached}; full "
          f"forward over [{setup.max_seqlen}] per byte {full}{tail}")


# ---- Reporting. ----

def plot_losses(losses, held_out: float, path: str) -> bool:
    """Writes the training loss curve (bits per byte) and the held-out figure; False when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure  # the object API: no pyplot, no display backend needed
    except ImportError:
        print(f"matplotlib is not installed, so no loss plot at {path} (pip install matplotlib)")
        return False
    bits = np.asarray(losses) / math.log(2)
    window = max(1, len(bits) // 50)
    smooth = np.convolve(bits, np.ones(window) / window, mode="valid")
    figure = Figure(figsize=(7, 4))
    ax = figure.subplots()
    ax.plot(bits, alpha=0.3, label="training batch")
    ax.plot(np.arange(len(smooth)) + window - 1, smooth, label=f"mean of {window}")
    ax.axhline(held_out, color="k", linestyle="--", label=f"held out after training: {held_out:.2f}")
    ax.set(xlabel="step", ylabel="bits per byte", title="byte-level LM on the Python standard library, packed")
    ax.legend()
    figure.savefig(path, dpi=100, bbox_inches="tight")
    return True


def attention_implementation() -> str:
    reason = cudnn_unavailable_reason()
    return "cudnn" if reason is None else f"xla ({reason})"


def parse_args(argv=None) -> tuple[argparse.Namespace, Setup]:
    parser = argparse.ArgumentParser(prog="python -m jax_ragged_attn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="defaults for the flags below: gpu when cuDNN is available here, else cpu")
    for name, value in PRESETS["cpu"].items():
        flag = "--" + name.replace("_", "-")
        if name == "dtype":
            parser.add_argument(flag, choices=["float32", "bfloat16", "float16"], default=None,
                                help="activations and attention (cuDNN takes bfloat16 / float16)")
        else:
            parser.add_argument(flag, type=type(value), default=None, help=f"cpu preset {value}, "
                                f"gpu preset {PRESETS['gpu'][name]}, long preset {PRESETS['long'][name]}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stdlib", default=None, help="corpus root (default: this interpreter's standard library)")
    parser.add_argument("--profile", action="store_true",
                        help="before training, print where a step's time goes (the step and its parts timed alone)")
    parser.add_argument("--compare-steps", type=int, default=None,
                        help="the packed vs padded side-by-side: timed steps per repetition (default 10 where cuDNN "
                             "runs, else 0 = none)")
    parser.add_argument("--compare-repeats", type=int, default=5, help="side-by-side and --profile: repetitions, "
                                                                       "median reported")
    parser.add_argument("--compare-warmup", type=int, default=2, help="side-by-side and --profile: warm-up steps")
    parser.add_argument("--compare-systems", default=",".join(SYSTEMS),
                        help=f"comma-separated of {', '.join(SYSTEMS)}")
    parser.add_argument("--sample-bytes", type=int, default=200, help="bytes to generate after training (0: none)")
    parser.add_argument("--prompt", default="import os\n\n\ndef ", help="the sample's prompt")
    parser.add_argument("--plot", default="lm_loss.png", help="where to write the loss curve ('' for none)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    preset = args.preset or ("gpu" if cudnn_unavailable_reason() is None else "cpu")
    values = {name: getattr(args, name) if getattr(args, name) is not None else default
              for name, default in PRESETS[preset].items()}
    setup = Setup(**values)
    args.preset = preset
    for name in ("width", "heads", "kv_heads", "layers", "capacity", "max_seqlen", "max_seqs", "steps",
                 "window_bytes", "eval_bytes"):
        if getattr(setup, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(setup, name)}")
    if setup.width % setup.heads or setup.heads % setup.kv_heads or (setup.width // setup.heads) % 2:
        parser.error(f"--width ({setup.width}) must split into --heads ({setup.heads}) of even size, and --heads "
                     f"must be a multiple of --kv-heads ({setup.kv_heads})")
    if setup.max_seqlen > setup.capacity:
        parser.error(f"--max-seqlen ({setup.max_seqlen}) must be <= --capacity ({setup.capacity})")
    if args.compare_steps is None:
        args.compare_steps = 10 if cudnn_unavailable_reason() is None else 0
    if args.compare_steps < 0 or args.compare_repeats < 1 or args.compare_warmup < 0:
        parser.error("--compare-steps and --compare-warmup must be >= 0, --compare-repeats >= 1")
    args.compare_systems = [s.strip() for s in args.compare_systems.split(",") if s.strip()]
    if not args.compare_systems or any(s not in SYSTEMS for s in args.compare_systems):
        parser.error(f"--compare-systems: choose from {', '.join(SYSTEMS)}, got {args.compare_systems}")
    return args, setup


def main(argv=None) -> int:
    args, setup = parse_args(argv)
    implementation = attention_implementation()
    train_files, held_out_files, root = stdlib_files(args.stdlib)
    size = sum(map(len, train_files)) + sum(map(len, held_out_files))
    print(f"jax {jax.__version__}, backend {jax.default_backend()}; attention: RaggedSelfAttention -> {implementation}")
    longest = max(map(len, train_files + held_out_files))
    count = len(train_files) + len(held_out_files)
    print(f"corpus: {count} .py files ({size / 1e6:.1f} MB, {size / count / 1e3:.1f} KB on average, the longest "
          f"{longest / 1e3:.0f} KB: whole files padded to it would fill {size / (count * longest):.1%}) under {root}; "
          f"{len(held_out_files)} held out")
    print(f"model ({args.preset} preset): {setup.layers} layers, width {setup.width}, {setup.heads} heads "
          f"({setup.kv_heads} kv), {setup.dtype}; batches of {setup.capacity} bytes, sequences <= {setup.max_seqlen}, "
          f"<= {setup.max_seqs} per batch; {setup.steps} steps of AdamW")
    timing = Timing(warmup=args.compare_warmup, steps=max(args.compare_steps, 1), repeats=args.compare_repeats)
    started = time.perf_counter()
    if args.profile:
        profile(setup, train_files, args.seed, dataclasses.replace(timing, steps=max(args.compare_steps, 5)))
    model = ByteLM(setup, rngs=nnx.Rngs(args.seed))
    result = train(model, setup, train_files, args.seed, progress=not args.no_progress)
    held = evaluate(model, held_out_files, setup)
    unigram = unigram_bits_per_byte(train_files, held_out_files)
    bits = result["losses"] / math.log(2)
    print(f"trained {setup.steps} steps in {result['seconds']:.0f} s (after the first, compiling, step): training "
          f"loss {np.mean(bits[:10]):.2f} -> {np.mean(bits[-10:]):.2f} bits/byte; {result['tokens_per_s']:,.0f} "
          f"useful tokens/s in the training loop (host packing included)")
    print(f"fill rate (real bytes / buffer): packed {result['fill_rate']:.1%}; padded to the longest document "
          f"({setup.window_bytes} bytes) {result['padded_document_fill']:.1%}; split at max_seqlen and padded to "
          f"{setup.max_seqlen}-byte rows {result['padded_rows_fill']:.1%}")
    # Printed before the measurements that follow, so that a run cut short by a time limit still shows it.
    print(f"held-out: {held['bits_per_byte']:.3f} bits per byte over {held['bytes']:,} bytes of "
          f"{len(held_out_files)} unseen files (uniform 8.000, byte frequencies {unigram:.3f})")
    if args.plot and plot_losses(result["losses"], held["bits_per_byte"], args.plot):
        print(f"loss curve: {args.plot}")
    if args.sample_bytes > 0:
        sample_and_time(model, setup, args.prompt.encode(), args.sample_bytes, args.seed)
    if args.compare_steps > 0:
        side_by_side(setup, train_files, args.seed, timing, args.compare_systems,
                     label=f" ({args.preset} preset)")
    print(f"total {time.perf_counter() - started:.0f} s")
    if not held["bits_per_byte"] <= setup.max_bits_per_byte:
        print(f"\n*** LM FAILED: held-out {held['bits_per_byte']:.3f} bits per byte is above --max-bits-per-byte "
              f"{setup.max_bits_per_byte}; the model did not learn ***", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
