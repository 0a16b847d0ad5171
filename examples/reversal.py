"""A small transformer learns to reverse sequences packed back to back (the reversal demo).

    python examples/reversal.py                     # 600 steps: about a minute on a CPU
    python examples/reversal.py --steps 100 --plot ''

Every batch is one token buffer holding a few dozen sequences of different lengths (the THD layout), each
`x1 .. xn SEP xn .. x1`, attended with `ragged_attention(..., is_causal=True)`. Emitting the reversal
after SEP needs attention within the sequence (to fetch x_{n-j}), and attention across sequences would
only spoil it: another sequence's tokens sit at the same positions. No padding is stored or computed on.

Prints the attention implementation (cuDNN on a GPU, the xla path elsewhere), progress lines with loss and
tokens/s, the accuracy on held-out packed batches, and writes the loss curve. Exits 1 if the accuracy is
below --min-accuracy. On a GPU it also times the same model on the same batch padded to [B, S] with
`jax.nn.dot_product_attention`. `python -m jax_ragged_attn.selfcheck` checks the op itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_ragged_attn import cudnn_unavailable_reason, ragged_attention
from jax_ragged_attn.backends.cudnn import ragged as cudnn
from jax_ragged_attn.config import AttentionOptions, make_config
from jax_ragged_attn.index import row_positions
from jax_ragged_attn.tools.bench import plain_loop_seconds

SEP = 0  # also what padding rows hold; symbols are 1 .. vocab - 1


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything that fixes the compiled program (a static jit argument)."""

    vocab: int
    width: int
    heads: int
    layers: int
    max_len: int  # longest x; its packed sequence `x SEP reversed(x)`, minus the last token, has 2n rows
    batch_tokens: int  # rows of the packed buffer
    lr: float
    steps: int
    attention_dtype: str  # cuDNN takes bfloat16; the xla path on a CPU is fastest in float32

    @property
    def max_seqlen(self) -> int:
        return 2 * self.max_len

    @property
    def max_seqs(self) -> int:
        # Twice the expected count (mean length max_len + 1): cu_seqlens has a static size, and packing stops
        # early when it is full.
        return max(1, 2 * self.batch_tokens // (self.max_len + 1))


# ---- Data: packed batches in NumPy. ----


def pack(rng: np.random.Generator, setup: Setup) -> dict:
    """One packed batch: tokens, targets and loss mask [T], cu_seqlens [max_seqs + 1] (empty sequences last).

    x = [5, 3] packs as tokens [5, 3, SEP, 3], targets [3, SEP, 3, 5], mask [0, 0, 1, 1].
    """
    t = setup.batch_tokens
    tokens, targets = np.full(t, SEP, np.int32), np.full(t, SEP, np.int32)
    mask = np.zeros(t, np.float32)
    lengths, used = [], 0
    while len(lengths) < setup.max_seqs:
        n = min(int(rng.integers(1, setup.max_len + 1)), (t - used) // 2)
        if n == 0:
            break
        x = rng.integers(1, setup.vocab, size=n)
        sequence = np.concatenate([x, [SEP], x[::-1]])
        tokens[used : used + 2 * n], targets[used : used + 2 * n] = sequence[:-1], sequence[1:]
        mask[used + n : used + 2 * n] = 1
        lengths.append(2 * n)
        used += 2 * n
    cu = np.full(setup.max_seqs + 1, used, np.int32)
    cu[: len(lengths) + 1] = np.concatenate([[0], np.cumsum(lengths)])
    return dict(tokens=tokens, targets=targets, mask=mask, cu_seqlens=cu)


def to_padded(batch: dict, setup: Setup) -> dict:
    """The same sequences as rows of a [B, S] batch, for padded attention: B = real sequences, S = max_seqlen."""
    cu = batch["cu_seqlens"]
    spans = [(int(a), int(b)) for a, b in itertools.pairwise(cu) if b > a]
    padded = {key: np.zeros((len(spans), setup.max_seqlen), batch[key].dtype) for key in ("tokens", "targets", "mask")}
    for row, (start, end) in enumerate(spans):
        for key in padded:
            padded[key][row, : end - start] = batch[key][start:end]
    padded["lengths"] = np.array([end - start for start, end in spans], np.int32)
    return padded


# ---- The model: pre-norm transformer, learned positions, pure jnp. ----


def init(key: jax.Array, setup: Setup) -> dict:
    d = setup.width
    keys = iter(jax.random.split(key, 3 + 4 * setup.layers))

    def dense(fan_in, fan_out):
        return jax.random.normal(next(keys), (fan_in, fan_out)) / math.sqrt(fan_in)

    return dict(
        embed=jax.random.normal(next(keys), (setup.vocab, d)),
        position=jax.random.normal(next(keys), (setup.max_seqlen, d)),
        layers=[
            dict(qkv=dense(d, 3 * d), out=dense(d, d), up=dense(d, 4 * d), down=dense(4 * d, d))
            for _ in range(setup.layers)
        ],
        unembed=dense(d, setup.vocab),
    )


def _norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def forward(params, tokens, positions, attend, setup: Setup):
    """Logits [..., vocab] for tokens [...]: the same model packed ([T]) or padded ([B, S])."""
    x = params["embed"][tokens] + params["position"][positions]
    split = lambda t: t.reshape(*t.shape[:-1], setup.heads, setup.width // setup.heads)
    for layer in params["layers"]:
        q, k, v = jnp.split(_norm(x) @ layer["qkv"], 3, axis=-1)
        x = x + attend(split(q), split(k), split(v)).reshape(x.shape) @ layer["out"]
        x = x + jax.nn.gelu(_norm(x) @ layer["up"]) @ layer["down"]
    return _norm(x) @ params["unembed"]


def _packed_inputs(batch, setup: Setup):
    """Positions restart at every sequence (read from cu_seqlens), and attention stays inside each one."""
    cu = batch["cu_seqlens"]
    _, positions, _ = row_positions(cu, setup.batch_tokens, setup.max_seqlen)

    def attend(q, k, v):
        dtype = jnp.dtype(setup.attention_dtype)
        out = ragged_attention(
            q.astype(dtype),
            k.astype(dtype),
            v.astype(dtype),
            cu,
            cu,
            is_causal=True,
            max_seqlen_q=setup.max_seqlen,
            max_seqlen_kv=setup.max_seqlen,
            implementation=None,
        )  # cuDNN where it can serve the call, else xla
        return out.astype(jnp.float32)

    # Padding rows (past cu_seqlens[-1]) count on past the last sequence: clip them into the table; their
    # loss mask is 0 and no real row attends to them.
    return jnp.clip(positions, 0, setup.max_seqlen - 1), attend


def _padded_inputs(batch, setup: Setup, implementation):
    lengths = batch["lengths"]

    def attend(q, k, v):
        dtype = jnp.dtype(setup.attention_dtype)
        out = jax.nn.dot_product_attention(
            q.astype(dtype),
            k.astype(dtype),
            v.astype(dtype),
            is_causal=True,
            query_seq_lengths=lengths,
            key_value_seq_lengths=lengths,
            implementation=implementation,
        )
        return out.astype(jnp.float32)

    return jnp.broadcast_to(jnp.arange(batch["tokens"].shape[-1]), batch["tokens"].shape), attend


@functools.partial(jax.jit, static_argnames=("setup", "padded"))
def logits(params, batch, setup: Setup, padded: str | None = None):
    """padded=None: the packed batch through ragged_attention; else padded attention with that implementation."""
    positions, attend = _padded_inputs(batch, setup, padded) if padded else _packed_inputs(batch, setup)
    return forward(params, batch["tokens"], positions, attend, setup)


def _loss(params, batch, setup: Setup, padded):
    log_p = jax.nn.log_softmax(logits(params, batch, setup, padded))
    nll = -jnp.take_along_axis(log_p, batch["targets"][..., None], axis=-1)[..., 0]
    # `where`, not a product: rows past a padded sequence's end attend to nothing, and NaN * 0 is NaN.
    return jnp.sum(jnp.where(batch["mask"] > 0, nll, 0.0)) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)


# ---- Training: Adam with warmup, cosine decay and clipping, written out to need no optimiser library. ----


def adam_state(params) -> dict:
    return dict(
        step=jnp.zeros((), jnp.int32), m=jax.tree.map(jnp.zeros_like, params), v=jax.tree.map(jnp.zeros_like, params)
    )


@functools.partial(jax.jit, static_argnames=("setup", "padded"), donate_argnums=(0, 1))
def train_step(params, state, batch, setup: Setup, padded: str | None = None):
    loss, grads = jax.value_and_grad(_loss)(params, batch, setup, padded)
    step = state["step"] + 1
    warmup = max(1, setup.steps // 20)
    progress = jnp.clip((step - warmup) / max(1, setup.steps - warmup), 0.0, 1.0)
    lr = setup.lr * jnp.minimum(1.0, step / warmup) * (0.1 + 0.45 * (1 + jnp.cos(jnp.pi * progress)))
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
    grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, 1.0 / (norm + 1e-6)), grads)
    m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, state["m"], grads)
    v = jax.tree.map(lambda v, g: 0.99 * v + 0.01 * g * g, state["v"], grads)
    correction = jnp.sqrt(1 - 0.99**step) / (1 - 0.9**step)
    params = jax.tree.map(lambda p, m, v: p - lr * correction * m / (jnp.sqrt(v) + 1e-8), params, m, v)
    return params, dict(step=step, m=m, v=v), loss


def train(setup: Setup, seed: int, eval_batches: int, progress: bool = True) -> dict:
    """Trains, evaluates on held-out batches; returns losses, tokens/s, accuracy and the final params."""
    train_rng, eval_rng = np.random.default_rng([seed, 0]), np.random.default_rng([seed, 1])
    params = init(jax.random.key(seed), setup)
    state = adam_state(params)
    losses, tokens, start = [], 0, None
    for step in range(setup.steps):
        batch = pack(train_rng, setup)
        params, state, loss = train_step(params, state, batch, setup)
        losses.append(float(loss))  # waits for the step, so the rate below is what the loop sustains
        if step == 0:
            start = time.perf_counter()  # the first step compiled; count from here
        else:
            tokens += int(batch["cu_seqlens"][-1])
        seconds = time.perf_counter() - start
        if progress and ((step + 1) % max(1, setup.steps // 10) == 0 or step + 1 == setup.steps):
            print(
                f"  step {step + 1}/{setup.steps}: loss {losses[-1]:.3f}, {tokens / max(seconds, 1e-9):,.0f} tokens/s",
                flush=True,
            )

    correct = total = exact = sequences = 0
    for _ in range(eval_batches):
        batch = pack(eval_rng, setup)
        right = np.asarray(jnp.argmax(logits(params, batch, setup), axis=-1)) == batch["targets"]
        mask = batch["mask"] > 0
        correct, total = correct + int(right[mask].sum()), total + int(mask.sum())
        cu = batch["cu_seqlens"]
        for a, b in itertools.pairwise(cu):
            if b > a:
                exact, sequences = exact + bool(right[a:b][mask[a:b]].all()), sequences + 1
    return dict(
        losses=losses,
        tokens_per_s=tokens / max(seconds, 1e-9),
        accuracy=correct / max(total, 1),
        exact=exact / max(sequences, 1),
        params=params,
        eval_tokens=total,
        eval_sequences=sequences,
    )


def attention_implementation(setup: Setup) -> str:
    """What implementation=None picks for the model's attention call here: 'cudnn', or 'xla (why not cuDNN)'."""
    reason = cudnn_unavailable_reason()  # first, so a CPU reads "no CUDA device", not the dtype chosen for it
    if reason is None:
        shape = jax.ShapeDtypeStruct(
            (setup.batch_tokens, setup.heads, setup.width // setup.heads), setup.attention_dtype
        )
        cu = jax.ShapeDtypeStruct((setup.max_seqs + 1,), jnp.int32)
        reason = cudnn.unsupported_reason(
            make_config(
                shape,
                shape,
                shape,
                cu,
                cu,
                AttentionOptions(is_causal=True),
                max_seqlen_q=setup.max_seqlen,
                max_seqlen_kv=setup.max_seqlen,
            )
        )
    return "cudnn" if reason is None else f"xla ({reason})"


def compare_padded(params, setup: Setup, seed: int) -> None:
    """Times one training step packed (ragged_attention) and padded (jax.nn.dot_product_attention)."""
    batch = pack(np.random.default_rng([seed, 2]), setup)
    real = int(batch["cu_seqlens"][-1])
    padded = to_padded(batch, setup)
    timings = [("packed, ragged_attention", None)]
    timings += [
        (f"padded {padded['tokens'].shape}, jax.nn.dot_product_attention({name!r})", name) for name in ("cudnn", "xla")
    ]
    for label, implementation in timings:
        data = batch if implementation is None else padded
        try:
            seconds = _step_seconds(params, data, setup, implementation)
        except Exception as error:  # noqa: BLE001  e.g. cuDNN refusing this shape: report it, keep the other timings
            print(f"  {label}: unavailable ({type(error).__name__}: {str(error).splitlines()[0]})")
            continue
        print(f"  {label}: {real / seconds:,.0f} real tokens/s ({seconds * 1e3:.2f} ms per training step)")


def _step_seconds(params, batch, setup: Setup, padded, iterations: int = 20) -> float:
    # Copies, since train_step donates its params and optimiser state.
    p = jax.tree.map(jnp.copy, params)
    s = adam_state(p)
    batch = jax.device_put(batch)
    state = list(train_step(p, s, batch, setup, padded))  # compiles
    jax.block_until_ready(state)

    def call():
        state[:] = train_step(state[0], state[1], batch, setup, padded)
        return state[2]

    return plain_loop_seconds(call, iterations, 1)[0]


def plot_losses(losses, path: str) -> bool:
    """Writes the loss curve to path; False (with a note) when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure  # the object API: no pyplot, no display backend needed
    except ImportError:
        print(f"matplotlib is not installed, so no loss plot at {path} (pip install matplotlib)")
        return False
    losses = np.asarray(losses)
    window = max(1, len(losses) // 50)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    figure = Figure(figsize=(7, 4))
    ax = figure.subplots()
    ax.plot(losses, alpha=0.3, label="per batch")
    ax.plot(np.arange(len(smooth)) + window - 1, smooth, label=f"mean of {window}")
    ax.set(
        xlabel="step",
        ylabel="cross-entropy on the reversed half",
        yscale="log",
        title="reversing packed variable-length sequences",
    )
    ax.legend()
    figure.savefig(path, dpi=100, bbox_inches="tight")
    return True


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python examples/reversal.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-tokens", type=int, default=1024, help="rows of each packed batch")
    parser.add_argument("--max-len", type=int, default=12, help="longest sequence to reverse")
    parser.add_argument("--vocab", type=int, default=17, help="symbols, SEP included")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--min-accuracy", type=float, default=0.9, help="held-out token accuracy to reach")
    parser.add_argument("--plot", default="demo_loss.png", help="where to write the loss curve ('' for none)")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.eval_batches < 1:
        parser.error(f"--steps and --eval-batches must be >= 1, got {args.steps} and {args.eval_batches}")
    if args.width % args.heads:
        parser.error(f"--width ({args.width}) must be a multiple of --heads ({args.heads})")
    return args


def setup_from(args: argparse.Namespace) -> Setup:
    return Setup(
        vocab=args.vocab,
        width=args.width,
        heads=args.heads,
        layers=args.layers,
        max_len=args.max_len,
        batch_tokens=args.batch_tokens,
        lr=args.lr,
        steps=args.steps,
        attention_dtype="bfloat16" if cudnn_unavailable_reason() is None else "float32",
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    setup = setup_from(args)
    implementation = attention_implementation(setup)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}; attention: ragged_attention -> {implementation}")
    print(
        f"task: reverse sequences of 1..{args.max_len} symbols, packed {setup.batch_tokens} rows per batch "
        f"(up to {setup.max_seqs} sequences); model: {setup.layers} layers, width {setup.width}, "
        f"{setup.heads} heads, {setup.attention_dtype} attention"
    )
    result = train(setup, args.seed, args.eval_batches, progress=not args.no_progress)
    print(
        f"trained {setup.steps} steps: loss {np.mean(result['losses'][:10]):.3f} -> "
        f"{np.mean(result['losses'][-10:]):.3f}, {result['tokens_per_s']:,.0f} tokens/s"
    )
    if args.plot and plot_losses(result["losses"], args.plot):
        print(f"loss curve: {args.plot}")
    if implementation == "cudnn":
        print("one training step on one batch, packed vs padded:")
        compare_padded(result["params"], setup, args.seed)
    print(
        f"held-out: token accuracy {result['accuracy']:.1%} over {result['eval_tokens']} tokens, "
        f"{result['exact']:.1%} of {result['eval_sequences']} sequences reversed exactly"
    )
    if result["accuracy"] < args.min_accuracy:
        print(
            f"\n*** DEMO FAILED: held-out token accuracy {result['accuracy']:.1%} is below --min-accuracy "
            f"{args.min_accuracy:.1%}; the model did not learn to reverse packed sequences ***",
            file=sys.stderr,
        )
        print(f"demo: FAILED (held-out token accuracy {result['accuracy']:.1%} < {args.min_accuracy:.1%})")
        return 1
    print(
        f"demo: OK (held-out token accuracy {result['accuracy']:.1%} >= {args.min_accuracy:.1%}, "
        f"attention {implementation.split(' ')[0]})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
