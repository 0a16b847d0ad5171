"""The main job's training: one jax.jit of a pure step over the model's nnx.split state (the parameters as one
flat float32 vector, donated with the AdamW state), the training loop, and the held-out evaluation."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.flatten_util import ravel_pytree

from jax_ragged_attn.inputs.data import pack_documents
from jax_ragged_attn.tools.lm.corpus import device_batch, packed_batches, windows
from jax_ragged_attn.tools.lm.model import VOCAB, Setup, eval_nll, packed_loss
from jax_ragged_attn.tools.lm.progress import progress_bar


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


def train(model, setup: Setup, files, seed: int, progress: bool = True, steps: int | None = None) -> dict:
    """Trains `model` in place for `steps` (default setup.steps) on packed batches through the jitted step.
    The host packs batch i+1 while the device runs step i; the progress bar waits for the step before the
    newest one and reports it, so the host never waits for the device it has just fed."""
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
            # Read the clock only once step - 1 has finished, and count only the steps finished by then: the
            # host runs ahead of the device (asynchronous dispatch), so the time to enqueue steps is not the
            # time to run them (a first reading once claimed 1.3 M tok/s).
            previous = float(losses[-2])
            seconds = time.perf_counter() - start
            finished = tokens - batch.num_tokens
            update(f"{previous / math.log(2):.2f} bits/byte, {finished / max(seconds, 1e-9):,.0f} tok/s", step + 1)
    jax.block_until_ready((flat, losses[-1]))
    seconds = time.perf_counter() - start
    update(f"{float(losses[-1]) / math.log(2):.2f} bits/byte, {tokens / max(seconds, 1e-9):,.0f} tok/s", steps)
    close()
    trainer.update_model(model, flat)
    # fill_rate: real tokens / buffer rows, as trained on. The padded alternatives, from the same documents:
    # each document (window) in a row as long as the longest document can be; or, split at max_seqlen as for
    # packing, one piece per max_seqlen row.
    return dict(
        losses=np.array([float(x) for x in losses]),
        tokens_per_s=tokens / max(seconds, 1e-9),
        seconds=seconds,
        fill_rate=packer.tokens / max(packer.batches * setup.capacity, 1),
        padded_document_fill=float(np.mean(document_lengths)) / setup.window_bytes,
        padded_rows_fill=packer.tokens / max(packer.pieces * setup.max_seqlen, 1),
    )


def evaluate(model, files, setup: Setup) -> dict:
    """Held-out bits per byte over up to setup.eval_bytes predicted bytes (fixed windows: seed 0 always)."""
    packer = pack_documents(
        windows(files, np.random.default_rng(0), setup.window_bytes, epochs=1),
        setup.capacity,
        max_seqs=setup.max_seqs,
        max_seqlen=setup.max_seqlen,
    )
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
