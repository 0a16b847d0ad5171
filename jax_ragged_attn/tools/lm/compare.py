"""The side-by-side: the same model trained packed and padded (jax.nn.dot_product_attention, cuDNN or XLA),
from the same initialisation on the same stream of documents, every system timed the same way."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Iterator

import jax
import numpy as np
from flax import nnx

from jax_ragged_attn.tools.bench import device_bytes
from jax_ragged_attn.tools.lm.corpus import device_batch, packed_batches, padded_batches, padded_rows
from jax_ragged_attn.tools.lm.model import ByteLM, Setup, packed_loss, padded_loss
from jax_ragged_attn.tools.lm.profiling import Timing, time_calls
from jax_ragged_attn.tools.lm.training import make_trainer, make_tx

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


def _gb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB"


def system_unavailable(system: str, setup: Setup) -> str | None:
    if system == "padded-cudnn" and jax.default_backend() != "gpu":
        return f"jax.nn's cudnn attention needs a CUDA GPU; JAX's backend is {jax.default_backend()!r}"
    if system == "padded-xla":
        scores = padded_rows(setup) * setup.heads * setup.max_seqlen**2 * 4
        if scores > XLA_SCORES_LIMIT_BYTES:
            return (
                f"jax.nn's xla attention materialises [rows, heads, S, S] float32 scores: {scores / 1e9:.0f} GB "
                f"per layer here, over the {XLA_SCORES_LIMIT_BYTES / 1e9:.0f} GB this run allows"
            )
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
    loss_fn = (
        packed_loss if system == "packed" else functools.partial(padded_loss, implementation=system.split("-", 1)[1])
    )
    pipeline = system_batches(system, files, setup, seed)
    prepared = [next(pipeline) for _ in range(timing.warmup + timing.steps)]
    batches = [device_batch(arrays) for arrays, _, _ in prepared]
    result.tokens = float(np.mean([real for _, real, _ in prepared]))
    result.slots = prepared[0][2]
    trainer = make_trainer(ByteLM(setup, rngs=nnx.Rngs(seed)), loss_fn, make_tx(setup.lr, setup.steps))
    start = time.perf_counter()
    compiled = trainer.step.lower(trainer.flat, trainer.opt_state, batches[0]).compile()
    result.compile_s = time.perf_counter() - start
    result.memory = device_bytes(compiled)
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


def side_by_side(
    setup: Setup, files, seed: int, timing: Timing, systems=SYSTEMS, loop_steps: int = 20, label: str = ""
) -> list[SystemResult]:
    """Packed vs padded: the same model and initialisation, the same stream of documents (packed, or padded
    to [rows, max_seqlen] in stream order), one timing method. Prints the method and a table; returns the
    results."""
    rows = padded_rows(setup)
    print(
        f"side-by-side{label}: {setup.layers} layers, width {setup.width}, {setup.dtype}; batches of "
        f"{setup.capacity:,} bytes, sequences <= {setup.max_seqlen:,} (padded: [{rows}, {setup.max_seqlen}])"
    )
    print(
        f"  method: every system the same jitted step (jax.jit over nnx.split state, flat AdamW, donated) from the "
        f"same initialisation (seed {seed}), fed the same stream of documents (windows of <= {setup.window_bytes:,} "
        f"bytes split at {setup.max_seqlen:,}): packed by pack_documents, or padded {rows} pieces per batch in "
        f"stream order, one per row; the first {timing.warmup + timing.steps} batches put on the device before "
        f"timing; {timing.describe()}. tokens/s counts real (non-padding) tokens. 'loop' = {loop_steps} more "
        "steps fed as the training loop feeds them (batches made on the host each step)."
    )
    print(
        f"  {'system':<14} {'ms/step':>9} {'tok/s':>12} {'vs packed':>9} {'fill':>6} {'step memory':>11} "
        f"{'compile':>8} {'loop tok/s':>11} {'loss':>6}",
        flush=True,
    )
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
        print(
            f"  {r.system:<14} {r.step_s * 1e3:9.2f} {r.tokens_per_s:12,.0f} {versus:>9} {r.fill:6.1%} "
            f"{_gb(r.memory):>11} {r.compile_s:7.1f}s {loop:>11} {r.loss / math.log(2):6.2f}",
            flush=True,
        )
    for r in results:
        if r.status == "ok" and r.system != "packed" and packed:
            print(f"  packed is {packed.tokens_per_s / r.tokens_per_s:.2f}x {r.system} in useful tokens/s")
    return results
