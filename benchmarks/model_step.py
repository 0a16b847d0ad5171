"""`python -m benchmarks.model_step` (or `python -m benchmarks.attention --model`): what a user
buys, measured as one training step of a decoder block on packed variable-length batches.

The block is the main job's (jax_ragged_attn/tools/lm/model.py: one definition for both): `lm.Block`, a pre-norm
decoder block of RMSNorm, RaggedSelfAttention's projections (16 query heads, 4 kv heads of 128: GQA) with RoPE
from positions restarting at each sequence, causal attention, the output projection, RMSNorm, a GELU MLP
(hidden 4 x model width) and residuals; float32 parameters, bfloat16 compute. The step is the main job's too:
`lm.make_trainer` (one jax.jit over the block's nnx.split state, the parameters raveled into one float32
vector, clip + AdamW on that vector, parameters and optimizer state donated), here with loss = mean over real
tokens of mean(y^2) on random activations.

Systems (the same block, the same loss; only how attention sees the batch differs):

    padded      the whole block on [B, max_len, ...] (the data loader pads), jax.nn.dot_product_attention
                (implementation="cudnn") with query/key_value_seq_lengths: padding is computed and thrown away
    pad-unpad   packed [T, ...] for everything but attention; q, k, v gathered into [B, max_len, H, D] around
                the same jax.nn call and the output gathered back (the careful user's way)
    ours-cudnn  packed throughout: ragged_attention(implementation="cudnn")
    ours-xla    packed throughout: ragged_attention(implementation="xla"), the portable path

Lengths: W1 (16 sequences of 193..3980, 32,768 tokens) and short (510 sequences of 16..256, 72,000 tokens);
W3 (512 of 16..256) on request; tiny with --quick.

Timing is the bench's plain method (timing.plain_loop_seconds): N calls of the jitted step, parameters fed
back, then block_until_ready; the median of R such loops. Reported per system: step time, useful tokens/s
(real tokens only), useful TFLOP/s (the block's matmuls over real tokens, 6 FLOPs per parameter per token,
plus attention's causal FLOPs x 3.5) and its fraction of a dense bf16 matmul's rate timed the same way,
the step's compiled memory (arguments + outputs + temporaries - aliased), the attention call alone
forward+backward timed the same way and its share of the step, and tokens/s over the two padded systems'.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import report as bench_report
from benchmarks.systems import XLA_SCORES_LIMIT_BYTES
from benchmarks.timing import Settings, error_status, matmul_rate, plain_loop_seconds, steps_for
from jax_ragged_attn import ragged_attention
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.testing.workloads import WORKLOADS, attention_flops, direction_flops, seeded_lengths

try:
    from flax import nnx

    from jax_ragged_attn.tools import lm
except (ImportError, SystemExit) as error:  # lm exits with the install line when flax/optax are missing
    raise SystemExit(
        f"the training-step benchmark runs the main job's model: pip install 'jax_ragged_attn[flax]' ({error})"
    ) from None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    d_model: int = 2048
    num_heads_q: int = 16
    num_heads_kv: int = 4
    head_dim: int = 128
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * d_model
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6

    @property
    def d_mlp(self) -> int:
        return self.mlp_ratio * self.d_model

    def matmul_parameters(self) -> int:
        d, hd = self.d_model, self.head_dim
        return d * hd * (2 * self.num_heads_q + 2 * self.num_heads_kv) + 2 * d * self.d_mlp  # GELU MLP: up, down

    def useful_flops(self, seqlens) -> float:
        """Forward+backward FLOPs over real tokens: matmuls 6 per parameter per token, attention 3.5x forward."""
        matmuls = 6.0 * self.matmul_parameters() * sum(seqlens)
        attention = attention_flops(seqlens, self.num_heads_q, self.head_dim, causal=True)
        return matmuls + direction_flops(attention, "forward+backward")


REALISTIC = ModelConfig()
TINY = ModelConfig(d_model=64, num_heads_q=4, num_heads_kv=2, head_dim=16)

LENGTHS = {
    "W1": WORKLOADS["W1"].seqlens,
    "short": seeded_lengths(510, 16, 256, total=72_000),
    "W3": WORKLOADS["W3"].seqlens,
    "tiny": (5, 17, 9, 33, 1, 20),
}


# ---- the block: the main job's (lm.Block), its step the main job's (lm.make_trainer) -------------------------


def make_block(config: ModelConfig, seed: int = 0):
    """The main job's decoder block at this configuration: float32 parameters, bfloat16 compute."""
    return lm.Block(
        config.d_model,
        config.num_heads_q,
        config.num_heads_kv,
        head_dim=config.head_dim,
        hidden=config.d_mlp,
        dtype=jnp.bfloat16,
        rngs=nnx.Rngs(seed),
    )


@functools.cache
def _structure(config: ModelConfig):
    """(graphdef, params treedef, parameter names, non-parameter state) of the block at this configuration."""
    graphdef, params, rest = nnx.split(make_block(config), nnx.Param, ...)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    return graphdef, treedef, tuple(jax.tree_util.keystr(path) for path, _ in leaves), rest


def init_params(config: ModelConfig, seed: int = 0) -> dict:
    """The block's parameters as {name: float32 array}."""
    _, params, _ = nnx.split(make_block(config, seed), nnx.Param, ...)
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


def _merge(params: dict, config: ModelConfig):
    graphdef, treedef, names, rest = _structure(config)
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, [params[name] for name in names]), rest)


def _attend(attention: Callable, positions):
    """lm.Block's attend callback around a system's attention(q, k, v) (q [..., Hq, D], k/v [..., Hkv, D])."""

    def attend(module, h):
        q, k, v = lm.split_heads(*module.project(h, positions))
        return module.project_out(attention(q, k, v))

    return attend


def block(params: dict, x: jax.Array, positions: jax.Array, attention: Callable, config: ModelConfig):
    """One decoder block on x [..., d_model] (packed [T, d] or padded [B, S, d]), bf16 compute."""
    return _merge(params, config)(x, _attend(attention, positions))


def _block_loss(module, x, positions, mask, attention):
    y = module(x, _attend(attention, positions)).astype(jnp.float32)
    # where, not a product: whatever a padded system leaves in padding rows must not reach the loss
    return jnp.sum(jnp.where(mask > 0, jnp.mean(y * y, axis=-1), 0.0)) / jnp.sum(mask)


def _loss(params, x, positions, mask, *, attention, config):
    return _block_loss(_merge(params, config), x, positions, mask, attention)


def make_step(config: ModelConfig, attention: Callable, seed: int = 0) -> lm.Trainer:
    """The main job's step (lm.make_trainer) over the block; batch = dict(x, positions, mask, index)."""

    def loss(module, batch):
        bound = functools.partial(attention, *batch["index"]) if batch["index"] else attention
        return _block_loss(module, batch["x"], batch["positions"], batch["mask"], bound)

    return lm.make_trainer(make_block(config, seed), loss, lm.make_tx(3e-4, 10_000))


# ---- the systems: how attention and the batch are laid out ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Batch:
    """A system's inputs for one lengths set: activations, RoPE positions, loss mask and attention's index."""

    x: jax.Array  # [T, d] packed or [B, S, d] padded, bfloat16
    positions: jax.Array  # int32, x's leading shape; restarts at 0 at each sequence
    mask: jax.Array  # float32, x's leading shape; 1 on real tokens
    index: tuple  # integer arrays attention(*index, q, k, v) reads


@dataclasses.dataclass(frozen=True)
class ModelSystem:
    name: str
    description: str
    padded: bool  # the block runs on [B, S, d]
    # (seqlens, implementation of jax.nn for the padded systems) -> attention(*index, q, k, v)
    attention: Callable
    index: Callable  # seqlens -> tuple of host int32 arrays
    unavailable: Callable[[list], str | None]  # seqlens -> why it cannot run here, or None


def _layout(seqlens):
    """(cu_seqlens [B+1], row of each packed token in the padded [B*S] batch [T], S)."""
    seqlens = np.asarray(seqlens, np.int64)
    s = int(seqlens.max())
    cu = np.concatenate([[0], np.cumsum(seqlens)])
    sequence = np.repeat(np.arange(len(seqlens)), seqlens)
    position = np.arange(cu[-1]) - cu[sequence]
    return cu.astype(np.int32), (sequence * s + position).astype(np.int32), position.astype(np.int32), s


def _jax_nn(q, k, v, lengths, implementation):
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths, implementation=implementation
    )


def _padded_attention(seqlens, implementation):
    return lambda lengths, q, k, v: _jax_nn(q, k, v, lengths, implementation)


def _pad_unpad_attention(seqlens, implementation):
    b, s = len(seqlens), max(seqlens)

    def attention(lengths, rows, q, k, v):
        def pad(x):  # [T, H, D] -> [B, S, H, D]; slots past a sequence's end are zero
            return jnp.zeros((b * s, *x.shape[1:]), x.dtype).at[rows].set(x).reshape(b, s, *x.shape[1:])

        out = _jax_nn(pad(q), pad(k), pad(v), lengths, implementation)
        return out.reshape(b * s, *out.shape[2:])[rows]  # [B, S, H, D] -> [T, H, D]

    return attention


def _ragged(seqlens, implementation):
    s = max(seqlens)
    return lambda cu, q, k, v: ragged_attention(
        q, k, v, cu, cu, max_seqlen_q=s, max_seqlen_kv=s, is_causal=True, implementation=implementation
    )


def _needs_gpu(_seqlens) -> str | None:
    backend = jax.default_backend()
    return None if backend == "gpu" else f"jax.nn's cudnn attention needs a CUDA GPU; JAX's backend is {backend!r}"


def _needs_cudnn(_seqlens) -> str | None:
    reason = extension.cudnn_unavailable_reason()
    return None if reason is None else f"the cuDNN path cannot run here: {reason}"


def _xla_fits(config: ModelConfig):
    def reason(seqlens) -> str | None:
        scores = len(seqlens) * config.num_heads_q * max(seqlens) ** 2 * 4
        if scores > XLA_SCORES_LIMIT_BYTES:
            return (
                f"the xla path materialises [B, H, S, S] float32 scores: {scores / 1e9:.1f} GB here, over "
                f"the benchmark's {XLA_SCORES_LIMIT_BYTES / 1e9:.0f} GB limit"
            )
        return None

    return reason


def systems(config: ModelConfig, padded_implementation: str = "cudnn") -> dict[str, ModelSystem]:
    """The four systems; padded_implementation="xla" runs the padded ones through jax.nn's xla path (tests)."""
    lengths = lambda seqlens: (np.asarray(seqlens, np.int32),)
    padded_gate = _needs_gpu if padded_implementation == "cudnn" else (lambda _: None)
    return {
        s.name: s
        for s in (
            ModelSystem(
                "padded",
                "[B, max_len] through the whole block, jax.nn cudnn attention with lengths",
                True,
                functools.partial(_padded_attention, implementation=padded_implementation),
                lengths,
                padded_gate,
            ),
            ModelSystem(
                "pad-unpad",
                "packed block, q/k/v padded around jax.nn cudnn attention, output unpadded",
                False,
                functools.partial(_pad_unpad_attention, implementation=padded_implementation),
                lambda seqlens: (np.asarray(seqlens, np.int32), _layout(seqlens)[1]),
                padded_gate,
            ),
            ModelSystem(
                "ours-cudnn",
                "packed throughout, ragged_attention(implementation='cudnn')",
                False,
                functools.partial(_ragged, implementation="cudnn"),
                lambda seqlens: (_layout(seqlens)[0],),
                _needs_cudnn,
            ),
            ModelSystem(
                "ours-xla",
                "packed throughout, ragged_attention(implementation='xla')",
                False,
                functools.partial(_ragged, implementation="xla"),
                lambda seqlens: (_layout(seqlens)[0],),
                _xla_fits(config),
            ),
        )
    }


def make_batch(system: ModelSystem, seqlens, config: ModelConfig, seed: int = 0) -> Batch:
    """The same real tokens for every system: packed as drawn, or scattered into [B, S] with zero padding."""
    cu, rows, position, s = _layout(seqlens)
    t, b = int(cu[-1]), len(seqlens)
    x = jax.random.normal(jax.random.key(seed), (t, config.d_model), jnp.bfloat16)
    index = tuple(jnp.asarray(a) for a in system.index(seqlens))
    if not system.padded:
        return Batch(x, jnp.asarray(position), jnp.ones((t,), jnp.float32), index)
    padded = jnp.zeros((b * s, config.d_model), x.dtype).at[rows].set(x).reshape(b, s, config.d_model)
    mask = np.zeros(b * s, np.float32)
    mask[rows] = 1
    positions = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    return Batch(padded, jnp.asarray(positions), jnp.asarray(mask.reshape(b, s)), index)


# ---- measuring ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class StepResult:
    lengths: str
    system: str
    status: str = "ok"
    tokens: int = 0  # real tokens per step
    computed_tokens: int = 0  # tokens the block's matmuls run on (padding included)
    step_s: float | None = None
    attention_s: float | None = None  # the attention call alone, forward+backward
    step_bytes: int | None = None
    attention_bytes: int | None = None
    useful_flops: float = 0.0
    loss: float | None = None
    calls: int = 0
    repetitions: int = 0
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.step_s if self.ok and self.step_s else None

    @property
    def tflops(self) -> float | None:
        return self.useful_flops / self.step_s / 1e12 if self.ok and self.step_s else None

    @property
    def attention_share(self) -> float | None:
        return self.attention_s / self.step_s if self.ok and self.step_s and self.attention_s else None


def _memory(compiled) -> int | None:
    try:
        m = compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def _timed(call, flops: float, settings: Settings) -> tuple[list[float], int]:
    """The plain method: warm-up calls, N calls per loop sized to about target_call_s, R loops."""
    for _ in range(settings.warmup_calls):
        jax.block_until_ready(call())
    one = plain_loop_seconds(call, 1, 1)[0]
    calls = max(1, min(steps_for(flops, settings), math.ceil(settings.target_call_s / max(one, 1e-6))))
    return plain_loop_seconds(call, calls, settings.iterations), calls


def measure(system: ModelSystem, name: str, seqlens, config: ModelConfig, settings: Settings) -> StepResult:
    result = StepResult(
        name,
        system.name,
        tokens=sum(seqlens),
        computed_tokens=len(seqlens) * max(seqlens) if system.padded else sum(seqlens),
        useful_flops=config.useful_flops(seqlens),
    )
    reason = system.unavailable(seqlens)
    if reason:
        result.status = f"skipped: {reason}"
        return result
    batch = make_batch(system, seqlens, config)
    attention = system.attention(seqlens)
    trainer = make_step(config, attention)
    inputs = dict(x=batch.x, positions=batch.positions, mask=batch.mask, index=batch.index)
    compiled = trainer.step.lower(trainer.flat, trainer.opt_state, inputs).compile()
    result.step_bytes = _memory(compiled)
    state = [trainer.flat, trainer.opt_state]

    def call():
        state[0], state[1], loss = compiled(state[0], state[1], inputs)
        return state[0], state[1], loss

    first = call()
    result.loss = float(first[2])  # at the initial parameters: the same for every system
    times, result.calls = _timed(call, result.useful_flops, settings)
    result.step_s, result.repetitions = statistics.median(times), len(times)
    if not bool(jnp.isfinite(state[0]).all()):
        result.note = "WARNING: parameters not finite after the timed steps"

    # The attention call alone (with the pad/unpad of pad-unpad), forward+backward, timed the same way.
    lead = batch.x.shape[:-1]
    keys = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(keys[0], (*lead, config.num_heads_q, config.head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (*lead, config.num_heads_kv, config.head_dim), jnp.bfloat16) for key in keys[1:3])
    d_out = jax.random.normal(keys[3], q.shape, q.dtype)

    def forward_backward(q, k, v, d_out, index):
        out, pullback = jax.vjp(lambda q, k, v: attention(*index, q, k, v), q, k, v)
        return (out, *pullback(d_out))

    alone = jax.jit(forward_backward)
    args = (q, k, v, d_out, batch.index)
    result.attention_bytes = _memory(alone.lower(*args).compile())
    attention_flops_ = direction_flops(
        attention_flops(seqlens, config.num_heads_q, config.head_dim, True), "forward+backward"
    )
    times, _ = _timed(lambda: alone(*args), attention_flops_, settings)
    result.attention_s = statistics.median(times)
    return result


# ---- the report ---------------------------------------------------------------------------------------------


def table(results: list[StepResult], limit: float | None) -> str:
    base = {(r.lengths, r.system): r.tokens_per_s for r in results}
    header = (
        "lengths",
        "system",
        "step ms",
        "Mtok/s",
        "vs padded",
        "vs pad-unpad",
        "TFLOP/s",
        "of limit",
        "attn ms",
        "attn share",
        "step mem",
        "loss",
        "status",
    )
    lines = [header]
    for r in results:

        def versus(other):
            theirs = base.get((r.lengths, other))
            return f"{r.tokens_per_s / theirs:.2f}x" if r.tokens_per_s and theirs else "-"

        status = "; ".join(filter(None, [r.status, r.note]))
        status = status if len(status) <= 110 else status[:107] + "..."
        lines.append(
            (
                r.lengths,
                r.system,
                "-" if r.step_s is None else f"{r.step_s * 1e3:.3f}",
                "-" if r.tokens_per_s is None else f"{r.tokens_per_s / 1e6:.3f}",
                versus("padded"),
                versus("pad-unpad"),
                "-" if r.tflops is None else bench_report.format_tflops(r.tflops),
                bench_report.format_fraction(r.tflops * 1e12 / limit if r.tflops is not None and limit else None),
                "-" if r.attention_s is None else f"{r.attention_s * 1e3:.3f}",
                "-" if r.attention_share is None else f"{r.attention_share:.0%}",
                "-" if r.step_bytes is None else f"{r.step_bytes / 1e6:,.0f} MB",
                "-" if r.loss is None else f"{r.loss:.4f}",
                status,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.rjust(w) if 2 <= i <= 11 else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths)))
        + "  "
        + line[-1]
        for line in lines
    )


CSV_FIELDS = (
    "lengths",
    "system",
    "status",
    "tokens",
    "computed_tokens",
    "step_ms",
    "tokens_per_s",
    "tflops",
    "fraction_of_limit",
    "attention_ms",
    "attention_share",
    "step_bytes",
    "attention_bytes",
    "loss",
    "calls",
    "repetitions",
)


def write_csv(path: str, results: list[StepResult], limit: float | None) -> None:
    import csv

    def value(x, fmt="{:.6g}"):
        return "" if x is None else fmt.format(x)

    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_FIELDS)
        for r in results:
            writer.writerow(
                (
                    r.lengths,
                    r.system,
                    r.status,
                    r.tokens,
                    r.computed_tokens,
                    value(r.step_s and r.step_s * 1e3),
                    value(r.tokens_per_s),
                    value(r.tflops),
                    value(r.tflops * 1e12 / limit if r.tflops is not None and limit else None),
                    value(r.attention_s and r.attention_s * 1e3),
                    value(r.attention_share),
                    value(r.step_bytes, "{}"),
                    value(r.attention_bytes, "{}"),
                    value(r.loss),
                    r.calls,
                    r.repetitions,
                )
            )


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.model_step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--lengths", default=None, help=f"comma-separated of {', '.join(LENGTHS)} (default W1,short; tiny with --quick)"
    )
    parser.add_argument(
        "--systems", default="all", help="comma-separated of padded, pad-unpad, ours-cudnn, ours-xla, or all (default)"
    )
    parser.add_argument("--iterations", type=int, default=None, help="timed loops, median reported (default 7)")
    parser.add_argument("--quick", action="store_true", help="tiny block and lengths, 2 timed loops: a smoke run")
    parser.add_argument(
        "--matmul-size",
        type=int,
        default=None,
        help="the dense limit's matmul size (default 8192 on a GPU, 512 elsewhere)",
    )
    parser.add_argument("--out", default="bench_out", help="directory for model_step.csv and model_step.txt")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="skip systems not started within this many seconds",
    )
    args = parser.parse_args(argv)
    if args.iterations is not None and args.iterations < 1:
        parser.error(f"--iterations must be >= 1, got {args.iterations}")
    return args


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    config = TINY if args.quick else REALISTIC
    names = [n.strip() for n in (args.lengths or ("tiny" if args.quick else "W1,short")).split(",") if n.strip()]
    unknown = [n for n in names if n not in LENGTHS]
    if unknown or not names:
        raise SystemExit(f"unknown lengths {unknown or names}; choose from {', '.join(LENGTHS)}")
    available = systems(config)
    chosen = list(available) if args.systems == "all" else [s.strip() for s in args.systems.split(",") if s.strip()]
    if not chosen or any(s not in available for s in chosen):
        raise SystemExit(f"unknown systems {args.systems!r}; choose from {', '.join(available)} or all")
    on_gpu = jax.default_backend() == "gpu"
    rate = 3e14 if on_gpu else 2e10
    settings = (
        Settings(
            iterations=args.iterations or 2, target_call_s=0.01, max_steps=3, warmup_calls=1, assumed_flops_per_s=rate
        )
        if args.quick
        else Settings(
            iterations=args.iterations or 7, target_call_s=0.1, max_steps=20, warmup_calls=2, assumed_flops_per_s=rate
        )
    )
    os.makedirs(args.out, exist_ok=True)
    size = args.matmul_size or (8192 if on_gpu else 512)
    try:
        limit = matmul_rate(size, settings, "plain")
        limit_line = (
            f"dense limit: jitted bf16 [{size}, {size}] @ [{size}, {size}], plain method: "
            f"{limit / 1e12:.1f} TFLOP/s" + ("" if on_gpu else " (not a GPU: the fraction means nothing)")
        )
    except Exception as error:  # noqa: BLE001
        limit, limit_line = None, f"dense limit: {error_status(error)}"
    header = [
        f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}",
        f"block: d_model {config.d_model}, {config.num_heads_q}/{config.num_heads_kv} heads of "
        f"{config.head_dim}, GELU MLP {config.d_mlp}, {config.matmul_parameters() / 1e6:.1f}M matmul parameters, "
        "bf16 compute, the main job's block and step (lm.Block, lm.make_trainer: flat f32 AdamW); "
        "plain timing: N jitted steps then block_until_ready, median of "
        f"{settings.iterations}",
        limit_line,
    ]
    header += [
        f"lengths {n}: {len(LENGTHS[n])} sequences of {min(LENGTHS[n])}..{max(LENGTHS[n])}, {sum(LENGTHS[n]):,} tokens"
        for n in names
    ]
    print("\n".join(header), flush=True)
    started = time.perf_counter()
    results = []
    for name in names:
        for system_name in chosen:
            begun = time.perf_counter()
            if args.time_budget is not None and begun - started > args.time_budget:
                results.append(StepResult(name, system_name, f"skipped: time budget of {args.time_budget:.0f} s spent"))
            else:
                try:
                    results.append(measure(available[system_name], name, LENGTHS[name], config, settings))
                except Exception as error:  # noqa: BLE001 - one failing system must not stop the others
                    traceback.print_exc(file=sys.stderr)
                    results.append(StepResult(name, system_name, error_status(error)))
            r = results[-1]
            print(
                f"{name} {system_name} ({time.perf_counter() - begun:.1f} s): "
                + (
                    f"step {r.step_s * 1e3:.3f} ms, attention {r.attention_s * 1e3:.3f} ms, loss {r.loss:.4f}"
                    if r.ok
                    else r.status
                ),
                flush=True,
            )
            write_csv(os.path.join(args.out, "model_step.csv"), results, limit)
    text = table(results, limit)
    with open(os.path.join(args.out, "model_step.txt"), "w") as f:
        f.write("\n".join(header + ["", text]) + "\n")
    print(f"wrote {os.path.join(args.out, 'model_step.csv')}; {time.perf_counter() - started:.0f} s\n")
    print(text, flush=True)
    return 1 if any(r.status.startswith("error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
