"""How the main job times steps (Timing, one method for every figure it prints) and where a step's device time
goes (--profile)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jax_ragged_attn.tools.bench import interleaved_loop_seconds, plain_loop_seconds
from jax_ragged_attn.tools.lm.corpus import device_batch, packed_batches
from jax_ragged_attn.tools.lm.model import VOCAB, ByteLM, Setup, _nll, packed_attend, packed_loss
from jax_ragged_attn.tools.lm.training import make_trainer, make_tx


@dataclasses.dataclass(frozen=True)
class Timing:
    """warmup calls, then `repeats` loops of `steps` calls each, one block_until_ready at a loop's end (the
    plain loop of jax_ragged_attn/tools/bench.py); the median loop's seconds per call. Compilation is done (and
    timed) before, apart."""

    warmup: int = 2
    steps: int = 10
    repeats: int = 5

    def describe(self) -> str:
        return (
            f"compiled first (timed apart), {self.warmup} warm-up steps, then {self.repeats} x {self.steps} "
            "steps each ended by one block_until_ready, median per step"
        )


def _warm(call: Callable, timing: Timing) -> None:
    for _ in range(timing.warmup):
        jax.block_until_ready(call())


def time_calls(call: Callable, timing: Timing) -> float:
    """Median seconds per call of `call()` (see Timing). call returns what to block on."""
    _warm(call, timing)
    return statistics.median(plain_loop_seconds(call, timing.steps, timing.repeats))


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
    attention = 3.5 * 2.0 * float(np.sum(seqlens**2)) * setup.width * setup.layers
    return matmuls, attention


def profile(setup: Setup, files, seed: int, timing: Timing, nnx_step: bool = True) -> list[tuple[str, float, int]]:
    """Times the training step and its parts alone on one packed batch, each fwd+bwd as the step runs it;
    prints a table and returns [(part, seconds per call, calls per step)].

    The step and every part are timed in turns (one timed loop of each per round, `timing.repeats` rounds,
    the median per part): timed one after another, a change in load between the step's loops and a part's
    (another process on a shared machine) made the parts add up to more than the step."""
    host = next(packed_batches(files, setup, seed))
    batch = device_batch(host.arrays())
    model = ByteLM(setup, rngs=nnx.Rngs(seed))
    dtype, t, s = jnp.dtype(setup.dtype), setup.capacity, setup.max_seqlen
    trainer = make_trainer(model, packed_loss, make_tx(setup.lr, setup.steps))
    parts: list[tuple[str, Callable, int]] = []  # (name, call, calls per step; 0 = not part of the step)

    def feed_back(compiled, state, *rest):
        def call():
            state[0], state[1], out = compiled(state[0], state[1], *rest)
            return out

        return call

    start = time.perf_counter()
    step = trainer.step.lower(trainer.flat, trainer.opt_state, batch).compile()
    compile_s = time.perf_counter() - start
    step_state = [trainer.flat, trainer.opt_state]
    step_name = "train step: jax.jit, flat AdamW, donated (the main job's)"
    parts.append((step_name, feed_back(step, step_state, batch), 1))
    keys = iter(jax.random.split(jax.random.key(seed), 16))

    def alone(name, fn, *args, count=1):
        """fn(*args) -> array, timed forward + backward (a vjp with a ones cotangent) to every arg."""

        def fwd_bwd(*args):
            out, pull = jax.vjp(fn, *args)
            return pull(jnp.ones_like(out))

        compiled = jax.jit(fwd_bwd).lower(*args).compile()
        parts.append((name, lambda: compiled(*args), count))

    x = jax.random.normal(next(keys), (t, setup.width), dtype)
    table = model.embed.embedding[...]
    alone(
        "embedding (one-hot matmul)",
        lambda table: jnp.dot(jax.nn.one_hot(batch["tokens"], VOCAB, dtype=dtype), table.astype(dtype)),
        table,
    )
    block_def, block_state = nnx.split(model.blocks[0])
    attend = packed_attend(batch["cu_seqlens"], batch["positions"], s)
    alone("decoder block", lambda st, x: nnx.merge(block_def, st)(x, attend), block_state, x, count=setup.layers)
    attention = model.blocks[0].attention
    qkv, q, kv = attention.project(x, batch["positions"])
    buffers = tuple(b for b in (qkv, q, kv) if b is not None)

    def attention_only(*buffers):
        parts_ = iter(buffers)
        qkv_, q_, kv_ = (next(parts_), None, None) if qkv is not None else (None, next(parts_), next(parts_))
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

    flat2 = jnp.copy(trainer.flat)  # the step donates its state: the optimizer gets buffers of its own
    opt2 = tx.init(flat2)
    optimizer = jax.jit(update, donate_argnums=(0, 1)).lower(flat2, opt2, grads).compile()
    parts.append(
        (
            f"optimizer (clip + AdamW on one flat vector of {trainer.flat.size:,})",
            feed_back(optimizer, [flat2, opt2], grads),
            1,
        )
    )

    if nnx_step:
        # Flax's usual way, for reference: nnx.jit over the module and an nnx.Optimizer (per-parameter
        # updates), the same model and loss. Its extra time is per-call Python and small kernels.
        other = ByteLM(setup, rngs=nnx.Rngs(seed))
        optimizer_ = nnx.Optimizer(other, make_tx(setup.lr, setup.steps), wrt=nnx.Param)

        @nnx.jit
        def nnx_train_step(model, optimizer, batch):
            loss, grads = nnx.value_and_grad(packed_loss)(model, batch)
            optimizer.update(model, grads)
            return loss

        parts.append(
            (
                "for reference: the same step as nnx.jit + nnx.Optimizer",
                lambda: nnx_train_step(other, optimizer_, batch),
                0,
            )
        )

    for _, call, _ in parts:
        _warm(call, timing)
    times = interleaved_loop_seconds({name: (call, timing.steps) for name, call, _ in parts}, timing.repeats)
    step_times = times[step_name]
    step_s = statistics.median(step_times)
    print(
        f"step breakdown ({timing.describe()}; the step and its parts timed in turns, one loop of each per "
        f"round; compile {compile_s:.1f} s; one packed batch of {host.num_tokens:,} real bytes in "
        f"{host.num_seqs} sequences):"
    )
    print(f"  {'part':<62} {'ms/call':>9} {'x':>3} {'ms/step':>9} {'share':>6}")
    rows: list[tuple[str, float, int]] = []

    def emit(name, seconds, count):
        rows.append((name, seconds, count))
        per_step = seconds * max(count, 1)
        share = "" if not count or name == step_name else f"{per_step / step_s:6.0%}"
        print(
            f"  {name:<62} {seconds * 1e3:9.3f} {count if count else '-':>3} {per_step * 1e3:9.3f} {share:>6}",
            flush=True,
        )

    for name, _, count in parts:
        if count:
            emit(name, statistics.median(times[name]), count)
    # The parts that partition the step: not the indented ones (inside a decoder block), not the reference.
    summed = sum(seconds * count for name, seconds, count in rows[1:] if count and not name.startswith("  "))
    rest = step_s - summed
    if rest >= 0:
        emit("rest of the step (step - the parts above)", rest, 1)
    else:
        emit("rest of the step: none, the parts alone exceed the step", 0.0, 1)
        spread = max(step_times) / min(step_times)
        print(
            f"  the parts timed alone add up to {summed / step_s:.0%} of the step: alone, each is a call of its "
            "own (dispatch, launches) that reads its inputs and writes\n  its outputs and gradients through "
            "memory, where the one jitted step fuses across their edges; the step's loops ranged "
            f"{min(step_times) * 1e3:.1f}-{max(step_times) * 1e3:.1f} ms"
            + (" (the load changed while timing)" if spread > 1.2 else "")
        )
    for name, _, count in parts:
        if not count:
            emit(name, statistics.median(times[name]), count)

    seqlens = np.diff(host.cu_seqlens)
    matmuls, attention_flops = step_flops(setup, seqlens[seqlens > 0])
    print(
        f"  step: {step_s * 1e3:.2f} ms = {host.num_tokens / step_s:,.0f} useful tokens/s; matmuls "
        f"{matmuls / 1e12:.2f} TFLOP + attention {attention_flops / 1e12:.2f} TFLOP per step = "
        f"{(matmuls + attention_flops) / step_s / 1e12:.1f} TFLOP/s"
    )
    return rows
