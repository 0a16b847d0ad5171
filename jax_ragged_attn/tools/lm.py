"""`python -m jax_ragged_attn`: a byte-level language model trained on the Python standard library's source.

Real text found on every machine: the .py files of this interpreter's standard library (about 1,800 files,
from a few hundred bytes to hundreds of KB). One file in ten (chosen by a hash of its path) is held out.
Each epoch every training file contributes one random window of at most --window-bytes, so a few huge files
do not fill whole stretches of training; windows longer than --max-seqlen are split into pieces by the packer.

Documents are packed with `jax_ragged_attn.data.pack_documents` (first-fit-decreasing) into fixed-shape
buffers of --capacity bytes, and modelled by a pre-norm transformer built from
`jax_ragged_attn.flax.RaggedSelfAttention` (causal, RoPE from the packed positions) and an MLP, trained with
Optax AdamW. Every byte predicts the next byte of its own document only.

Reports: the attention implementation (cuDNN on a GPU, the xla path elsewhere), the fill rate of packing
against padding, a progress bar with loss and useful (non-padding) tokens/s, held-out bits per byte against
the uniform (8) and byte-frequency baselines, a loss plot, a generated sample. Exits 1 if held-out bits per
byte stay above --max-bits-per-byte. On a GPU it also trains the same model on the same documents padded to
[rows, max_seqlen] with `jax.nn.dot_product_attention` and prints both tokens/s side by side.

--preset cpu (default without cuDNN) finishes in about 3 minutes on 2 CPU cores; --preset gpu is larger.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import sysconfig
import time
import zlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jax_ragged_attn import cudnn_unavailable_reason
from jax_ragged_attn.data import pack_documents
from jax_ragged_attn.tools.progress import progress_bar

try:
    import optax
    from flax import nnx

    from jax_ragged_attn.flax import RaggedSelfAttention
except ImportError as error:
    raise SystemExit(f"the main job needs flax and optax: pip install 'jax_ragged_attn[flax]' ({error})") from None

VOCAB = 256  # bytes

# Defaults per machine; any flag overrides. cpu: about 3 minutes on 2 cores. gpu: a larger model in bfloat16.
PRESETS = {
    "cpu": dict(width=128, heads=4, kv_heads=4, layers=2, capacity=2048, max_seqlen=256, max_seqs=16, steps=400,
                lr=3e-3, window_bytes=4096, eval_bytes=65536, dtype="float32", max_bits_per_byte=3.5),
    "gpu": dict(width=512, heads=8, kv_heads=8, layers=6, capacity=32768, max_seqlen=2048, max_seqs=64, steps=1500,
                lr=1e-3, window_bytes=16384, eval_bytes=1 << 20, dtype="bfloat16", max_bits_per_byte=2.5),
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

class Block(nnx.Module):
    def __init__(self, setup: Setup, implementation, rngs: nnx.Rngs):
        dtype = jnp.dtype(setup.dtype)
        self.attention_norm = nnx.RMSNorm(setup.width, dtype=dtype, rngs=rngs)
        self.attention = RaggedSelfAttention(setup.width, setup.heads, num_kv_heads=setup.kv_heads, is_causal=True,
                                             dtype=dtype, implementation=implementation, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(setup.width, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(setup.width, 4 * setup.width, use_bias=False, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(4 * setup.width, setup.width, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x, attend):
        x = x + attend(self.attention, self.attention_norm(x))
        return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class ByteLM(nnx.Module):
    """Bytes -> next-byte logits (float32). `__call__` takes a packed batch; `padded` the same model on
    [rows, S] padded rows through jax.nn.dot_product_attention (the GPU comparison)."""

    def __init__(self, setup: Setup, implementation=None, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, setup.width, dtype=jnp.dtype(setup.dtype), rngs=rngs)
        self.blocks = nnx.List([Block(setup, implementation, rngs) for _ in range(setup.layers)])
        self.norm = nnx.RMSNorm(setup.width, dtype=jnp.dtype(setup.dtype), rngs=rngs)
        self.head = nnx.Linear(setup.width, VOCAB, use_bias=False, dtype=jnp.dtype(setup.dtype), rngs=rngs)
        self.max_seqlen = setup.max_seqlen

    def __call__(self, tokens, cu_seqlens, positions):
        def attend(attention, x):
            return attention(x, cu_seqlens, positions, max_seqlen=self.max_seqlen)
        return self._run(tokens, attend)

    def padded(self, tokens, lengths, implementation=None):
        """tokens [R, S], lengths [R] -> logits [R, S, 256], attention by jax.nn.dot_product_attention."""
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)

        def attend(attention, x):
            qkv, q, kv = attention.project(x, positions)
            q, k, v = (qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]) if qkv is not None else (q, kv[:, :, 0], kv[:, :, 1])
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                               key_value_seq_lengths=lengths, implementation=implementation)
            return attention.project_out(out)
        return self._run(tokens, attend)

    def _run(self, tokens, attend):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, attend)
        return self.head(self.norm(x)).astype(jnp.float32)


def _nll(logits, targets, mask):
    """(summed negative log-likelihood in nats over masked positions, their count)."""
    log_p = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]
    # `where`, not a product: padded rows past a sequence's end may hold anything, and NaN * 0 is NaN.
    return jnp.sum(jnp.where(mask, nll, 0.0)), jnp.sum(mask)


def _packed_loss(model, batch):
    total, count = _nll(model(batch["tokens"], batch["cu_seqlens"], batch["positions"]), batch["targets"],
                        batch["loss_mask"])
    return total / jnp.maximum(count, 1)


def _padded_loss(model, batch, implementation):
    total, count = _nll(model.padded(batch["tokens"], batch["lengths"], implementation), batch["targets"],
                        batch["loss_mask"])
    return total / jnp.maximum(count, 1)


@nnx.jit
def train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(_packed_loss)(model, batch)
    optimizer.update(model, grads)
    return loss


@nnx.jit(static_argnames="implementation")
def padded_train_step(model, optimizer, batch, implementation):
    loss, grads = nnx.value_and_grad(_padded_loss)(model, batch, implementation)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def eval_nll(model, batch):
    return _nll(model(batch["tokens"], batch["cu_seqlens"], batch["positions"]), batch["targets"],
                batch["loss_mask"])


def make_optimizer(model, setup: Setup):
    warmup = max(1, setup.steps // 20)
    schedule = optax.warmup_cosine_decay_schedule(0.0, setup.lr, warmup, max(setup.steps, warmup + 1),
                                                  end_value=setup.lr / 10)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.99, weight_decay=0.1))
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


# ---- Training and evaluation. ----

def packed_batches(files, setup: Setup, seed: int, lengths: list | None = None):
    """The packer over endless training windows (document lengths appended to `lengths`)."""
    documents = windows(files, np.random.default_rng([seed, 0]), setup.window_bytes, lengths=lengths)
    return pack_documents(documents, setup.capacity, max_seqs=setup.max_seqs, max_seqlen=setup.max_seqlen,
                          rng=np.random.default_rng([seed, 1]))


def padded_batch(batch, setup: Setup) -> tuple[dict, int]:
    """The sequences of a packed batch as rows of [rows, max_seqlen] (rows = capacity // max_seqlen: the same
    token buffer), one sequence per row, as a padded pipeline feeds them; (batch, rows' real tokens).
    Sequences beyond the rows wait for no one: they are dropped (the padded run reports its own fill)."""
    rows, s = max(1, setup.capacity // setup.max_seqlen), setup.max_seqlen
    arrays = {key: np.zeros((rows, s), dtype) for key, dtype in
              (("tokens", np.int32), ("targets", np.int32), ("loss_mask", bool))}
    lengths = np.zeros(rows, np.int32)
    cu = batch.cu_seqlens
    for r in range(min(rows, batch.num_seqs)):
        a, b = int(cu[r]), int(cu[r + 1])
        for key in arrays:
            arrays[key][r, :b - a] = batch[key][a:b]
        lengths[r] = b - a
    # An empty row gets length 1 (a masked pad byte): a row with no key at all is undefined for some backends.
    return dict(arrays, lengths=np.maximum(lengths, 1)), int(lengths.sum())


def train(model, setup: Setup, files, seed: int, progress: bool = True, padded: str | None = None,
          steps: int | None = None) -> dict:
    """Trains for `steps` (default setup.steps); padded=None trains on packed batches, else on the same
    documents padded to [rows, max_seqlen] with jax.nn.dot_product_attention(implementation=padded)."""
    steps = setup.steps if steps is None else steps
    optimizer = make_optimizer(model, setup)
    document_lengths = []
    packer = packed_batches(files, setup, seed, document_lengths)
    update, close = progress_bar(steps) if progress else (lambda text, done: None, lambda: None)
    losses, tokens, fed, slots, start, seconds = [], 0, 0, 0, None, 0.0
    for step in range(steps):
        batch = next(packer)
        if padded is None:
            loss, real = train_step(model, optimizer, batch.arrays()), batch.num_tokens
        else:
            data, real = padded_batch(batch, setup)
            loss = padded_train_step(model, optimizer, data, padded)
        fed, slots = fed + real, slots + (setup.capacity if padded is None else data["tokens"].size)
        losses.append(loss)  # a device array: reading it every step would stall the host's packing
        if step == 0:
            jax.block_until_ready(loss)
            start = time.perf_counter()  # the first step compiled; count from here
        else:
            tokens += real
        if step % 20 == 0 or step == steps - 1:
            losses[-1] = float(losses[-1])
            seconds = time.perf_counter() - start
            update(f"{losses[-1] / math.log(2):.2f} bits/byte, {tokens / max(seconds, 1e-9):,.0f} tok/s", step + 1)
    jax.block_until_ready(losses[-1])
    seconds = time.perf_counter() - start
    close()
    # fill_rate: real tokens / buffer rows, as trained on. The padded alternatives, from the same documents:
    # each document (window) in a row as long as the longest document can be; or, split at max_seqlen as for
    # packing, one piece per max_seqlen row.
    return dict(losses=np.array([float(x) for x in losses]), tokens_per_s=tokens / max(seconds, 1e-9),
                seconds=seconds, fill_rate=fed / max(slots, 1),
                padded_document_fill=float(np.mean(document_lengths)) / setup.window_bytes,
                padded_rows_fill=packer.tokens / max(packer.pieces * setup.max_seqlen, 1))


def evaluate(model, files, setup: Setup) -> dict:
    """Held-out bits per byte over up to setup.eval_bytes predicted bytes (fixed windows: seed 0 always)."""
    packer = pack_documents(windows(files, np.random.default_rng(0), setup.window_bytes, epochs=1),
                            setup.capacity, max_seqs=setup.max_seqs, max_seqlen=setup.max_seqlen)
    nats = count = 0.0
    for batch in packer:
        total, n = eval_nll(model, batch.arrays())
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


def sample(model, setup: Setup, prompt: bytes, length: int, seed: int, temperature: float = 0.7) -> bytes:
    """Extends prompt by `length` bytes, one full forward per byte over a [max_seqlen] buffer (no KV cache)."""
    s = setup.max_seqlen
    buffer = np.zeros(s, np.int32)
    text = list(prompt[-(s - 1):])
    rng = np.random.default_rng(seed)

    @nnx.jit
    def next_logits(model, tokens, n):
        cu = jnp.stack([jnp.zeros((), jnp.int32), n])
        return model(tokens, cu, jnp.arange(s, dtype=jnp.int32))[n - 1]

    for _ in range(length):
        window = text[-(s - 1):]
        buffer[:len(window)] = window
        logits = np.asarray(next_logits(model, buffer, jnp.int32(len(window))), np.float64) / temperature
        p = np.exp(logits - logits.max())
        text.append(int(rng.choice(VOCAB, p=p / p.sum())))
    return bytes(text)


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
                                f"gpu preset {PRESETS['gpu'][name]}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stdlib", default=None, help="corpus root (default: this interpreter's standard library)")
    parser.add_argument("--compare-steps", type=int, default=200,
                        help="GPU only: steps of the padded jax.nn.dot_product_attention run (0: none)")
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
    model = ByteLM(setup, rngs=nnx.Rngs(args.seed))
    started = time.perf_counter()
    result = train(model, setup, train_files, args.seed, progress=not args.no_progress)
    held = evaluate(model, held_out_files, setup)
    unigram = unigram_bits_per_byte(train_files, held_out_files)
    bits = result["losses"] / math.log(2)
    print(f"trained {setup.steps} steps in {result['seconds']:.0f} s (after the first, compiling, step): training "
          f"loss {np.mean(bits[:10]):.2f} -> {np.mean(bits[-10:]):.2f} bits/byte; {result['tokens_per_s']:,.0f} "
          f"useful tokens/s")
    print(f"fill rate (real bytes / buffer): packed {result['fill_rate']:.1%}; padded to the longest document "
          f"({setup.window_bytes} bytes) {result['padded_document_fill']:.1%}; split at max_seqlen and padded to "
          f"{setup.max_seqlen}-byte rows {result['padded_rows_fill']:.1%}")
    if args.plot and plot_losses(result["losses"], held["bits_per_byte"], args.plot):
        print(f"loss curve: {args.plot}")
    if args.sample_bytes > 0:
        prompt = args.prompt.encode()
        text = sample(model, setup, prompt, args.sample_bytes, args.seed)
        rule = "-" * 60
        print(f"sample (temperature 0.7):\n{rule}\n{text.decode('utf-8', errors='replace')}\n{rule}")
    if implementation == "cudnn" and args.compare_steps > 0:
        compare_padded(setup, train_files, args, result)
    print(f"held-out: {held['bits_per_byte']:.3f} bits per byte over {held['bytes']:,} bytes of "
          f"{len(held_out_files)} unseen files (uniform 8.000, byte frequencies {unigram:.3f}); "
          f"total {time.perf_counter() - started:.0f} s")
    if not held["bits_per_byte"] <= setup.max_bits_per_byte:
        print(f"\n*** LM FAILED: held-out {held['bits_per_byte']:.3f} bits per byte is above --max-bits-per-byte "
              f"{setup.max_bits_per_byte}; the model did not learn ***", file=sys.stderr)
        return 1
    return 0


def compare_padded(setup: Setup, files, args, packed: dict) -> None:
    """Trains the same model from the same initialisation on the same documents padded to [rows, max_seqlen],
    through jax.nn.dot_product_attention on cuDNN and on XLA, and prints useful tokens/s beside the packed run."""
    steps = min(args.compare_steps, setup.steps)
    print(f"packed vs padded, {steps} training steps each (useful tokens/s; same model, same documents):")
    print(f"  packed, RaggedSelfAttention: {packed['tokens_per_s']:,.0f} tokens/s (fill {packed['fill_rate']:.1%})")
    for implementation in ("cudnn", "xla"):
        model = ByteLM(setup, rngs=nnx.Rngs(args.seed))
        try:
            result = train(model, setup, files, args.seed, progress=False, padded=implementation, steps=steps)
        except Exception as error:  # e.g. cuDNN refusing the padded shape: report it, keep the others
            print(f"  padded, dot_product_attention({implementation!r}): unavailable ({type(error).__name__}: "
                  f"{str(error).splitlines()[0][:200]})")
            continue
        rows = max(1, setup.capacity // setup.max_seqlen)
        print(f"  padded [{rows}, {setup.max_seqlen}], dot_product_attention({implementation!r}): "
              f"{result['tokens_per_s']:,.0f} tokens/s (packed: {packed['tokens_per_s'] / result['tokens_per_s']:.2f}x "
              f"that), fill {result['fill_rate']:.1%}, last loss {np.mean(result['losses'][-10:]) / math.log(2):.2f}")


if __name__ == "__main__":
    sys.exit(main())
