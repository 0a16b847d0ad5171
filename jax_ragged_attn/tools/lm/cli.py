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
the uniform (8) and byte-frequency baselines, a loss plot, samples from --sample-prompts prompts at once
(ragged_attention_with_kvcache over a paged KV cache, timed against a full forward per byte; the first
sample printed), then serving (--serve-requests requests of mixed prompt and output lengths by continuous
batching: every step one jitted call carrying prefill chunks and decode rows over packed queries, requests
taking a slot as others finish, the first prompt's continuations sharing its cache pages; its throughput and
p50 / p99 latency beside the fixed-batch generation on the same requests, serving.py). Exits 1 if held-out bits per
byte stay above --max-bits-per-byte. --profile prints where a step's device time goes. The side-by-side (default on a
GPU, --compare-steps elsewhere) trains the same model from the same initialisation on the same batches, packed and
padded to [rows, max_seqlen] through `jax.nn.dot_product_attention` (cuDNN, XLA), every system timed the same way (the
method is printed).

--preset cpu (default without cuDNN) finishes in about 3 minutes on 2 CPU cores; --preset gpu is larger;
--preset long packs whole files of up to 16,384 bytes per sequence (where padding to the longest wastes
most of a padded batch).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

import jax
import numpy as np
from flax import nnx

from jax_ragged_attn import cudnn_unavailable_reason
from jax_ragged_attn.tools.lm.compare import SYSTEMS, side_by_side
from jax_ragged_attn.tools.lm.corpus import stdlib_files
from jax_ragged_attn.tools.lm.generation import sample_and_time, sample_prompts
from jax_ragged_attn.tools.lm.model import ByteLM, Setup
from jax_ragged_attn.tools.lm.profiling import Timing, profile
from jax_ragged_attn.tools.lm.serving import STEPS_PER_CALL, ServingConfig, make_requests, serve_and_compare
from jax_ragged_attn.tools.lm.training import evaluate, train, unigram_bits_per_byte

# Defaults per machine; any flag overrides. cpu: about 3 minutes on 2 cores. gpu: a larger model in bfloat16.
# long: the gpu model on whole files of up to 16,384 bytes per sequence (no split below that), 4 padded rows.
PRESETS = {
    "cpu": dict(
        width=128,
        heads=4,
        kv_heads=4,
        layers=2,
        capacity=2048,
        max_seqlen=256,
        max_seqs=16,
        steps=400,
        lr=3e-3,
        window_bytes=4096,
        eval_bytes=65536,
        dtype="float32",
        max_bits_per_byte=3.5,
    ),
    "gpu": dict(
        width=512,
        heads=8,
        kv_heads=8,
        layers=6,
        capacity=32768,
        max_seqlen=2048,
        max_seqs=64,
        steps=1500,
        lr=1e-3,
        window_bytes=16384,
        eval_bytes=1 << 20,
        dtype="bfloat16",
        max_bits_per_byte=2.5,
    ),
    "long": dict(
        width=512,
        heads=8,
        kv_heads=8,
        layers=6,
        capacity=65536,
        max_seqlen=16384,
        max_seqs=64,
        steps=400,
        lr=1e-3,
        window_bytes=16384,
        eval_bytes=1 << 20,
        dtype="bfloat16",
        max_bits_per_byte=3.0,
    ),
}
# Serving's defaults per preset (--serve-*): requests, slots, tokens a step, rows a page, new bytes (low, high).
# Every step carries the whole budget through the model, decode-only steps too: on 2 CPU cores a budget of 32
# ran the cpu preset's 6 requests at 0.55x the fixed batches' bytes/s, 8 at 0.93x (a small budget costs
# prompts more steps, not more time).
SERVING = {
    "cpu": dict(requests=6, slots=4, budget=8, page_size=8, max_new=(8, 40)),
    "gpu": dict(requests=64, slots=16, budget=128, page_size=64, max_new=(32, 1024)),
    "long": dict(requests=64, slots=16, budget=128, page_size=64, max_new=(32, 1024)),
}


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
    parser = argparse.ArgumentParser(
        prog="python -m jax_ragged_attn", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="defaults for the flags below: gpu when cuDNN is available here, else cpu",
    )
    for name, value in PRESETS["cpu"].items():
        flag = "--" + name.replace("_", "-")
        if name == "dtype":
            parser.add_argument(
                flag,
                choices=["float32", "bfloat16", "float16"],
                default=None,
                help="activations and attention (cuDNN takes bfloat16 / float16)",
            )
        else:
            parser.add_argument(
                flag,
                type=type(value),
                default=None,
                help=f"cpu preset {value}, gpu preset {PRESETS['gpu'][name]}, long preset {PRESETS['long'][name]}",
            )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stdlib", default=None, help="corpus root (default: this interpreter's standard library)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="before training, print where a step's time goes (the step and its parts timed alone)",
    )
    parser.add_argument(
        "--compare-steps",
        type=int,
        default=None,
        help="the packed vs padded side-by-side: timed steps per repetition (default 10 where cuDNN "
        "runs, else 0 = none)",
    )
    parser.add_argument(
        "--compare-repeats", type=int, default=5, help="side-by-side and --profile: repetitions, median reported"
    )
    parser.add_argument("--compare-warmup", type=int, default=2, help="side-by-side and --profile: warm-up steps")
    parser.add_argument("--compare-systems", default=",".join(SYSTEMS), help=f"comma-separated of {', '.join(SYSTEMS)}")
    parser.add_argument(
        "--sample-bytes", type=int, default=200, help="bytes to generate per prompt after training (0: none)"
    )
    parser.add_argument("--prompt", default="import os\n\n\ndef ", help="the printed sample's prompt")
    parser.add_argument(
        "--sample-prompts",
        type=int,
        default=None,
        help="prompts generated from at once through the paged KV cache: --prompt, then the "
        "openings of held-out files (default 16 where cuDNN runs, else 4)",
    )
    parser.add_argument(
        "--serve-requests",
        type=int,
        default=None,
        help="requests served by continuous batching beside fixed batches (0: none; cpu preset "
        f"{SERVING['cpu']['requests']}, gpu {SERVING['gpu']['requests']})",
    )
    parser.add_argument(
        "--serve-slots",
        type=int,
        default=None,
        help="sequences a serving step carries (cpu preset "
        f"{SERVING['cpu']['slots']}, gpu {SERVING['gpu']['slots']}); also the fixed batches' size",
    )
    parser.add_argument(
        "--serve-budget",
        type=int,
        default=None,
        help="new tokens a serving step carries, decode "
        f"rows and prefill chunks (cpu preset {SERVING['cpu']['budget']}, gpu "
        f"{SERVING['gpu']['budget']})",
    )
    parser.add_argument(
        "--serve-page-size",
        type=int,
        default=None,
        help=f"cache rows a page (cpu preset {SERVING['cpu']['page_size']}, gpu {SERVING['gpu']['page_size']})",
    )
    parser.add_argument(
        "--serve-steps-per-call",
        type=int,
        default=STEPS_PER_CALL,
        help="serving steps one jitted call runs (a scan; the host's cost of a call paid once for "
        f"them, a request's latency taken at the end of its call; default {STEPS_PER_CALL})",
    )
    parser.add_argument(
        "--serve-implementation",
        choices=("cudnn", "fa3", "xla"),
        default=None,
        help="the serving step's packed attention (default: the op's choice)",
    )
    parser.add_argument("--plot", default="lm_loss.png", help="where to write the loss curve ('' for none)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    preset = args.preset or ("gpu" if cudnn_unavailable_reason() is None else "cpu")
    values = {
        name: getattr(args, name) if getattr(args, name) is not None else default
        for name, default in PRESETS[preset].items()
    }
    setup = Setup(**values)
    args.preset = preset
    for name in (
        "width",
        "heads",
        "kv_heads",
        "layers",
        "capacity",
        "max_seqlen",
        "max_seqs",
        "steps",
        "window_bytes",
        "eval_bytes",
    ):
        if getattr(setup, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(setup, name)}")
    if setup.width % setup.heads or setup.heads % setup.kv_heads or (setup.width // setup.heads) % 2:
        parser.error(
            f"--width ({setup.width}) must split into --heads ({setup.heads}) of even size, and --heads "
            f"must be a multiple of --kv-heads ({setup.kv_heads})"
        )
    if setup.max_seqlen > setup.capacity:
        parser.error(f"--max-seqlen ({setup.max_seqlen}) must be <= --capacity ({setup.capacity})")
    if args.sample_prompts is None:
        args.sample_prompts = 16 if cudnn_unavailable_reason() is None else 4
    if args.sample_prompts < 1:
        parser.error(f"--sample-prompts must be >= 1, got {args.sample_prompts}")
    serving = SERVING[preset]
    for name in ("requests", "slots", "budget", "page_size"):
        if getattr(args, f"serve_{name}") is None:
            setattr(args, f"serve_{name}", serving[name])
    args.serve_max_new = serving["max_new"]
    if (
        args.serve_requests < 0
        or min(args.serve_slots, args.serve_page_size) < 1
        or args.serve_budget < args.serve_slots
        or args.serve_steps_per_call < 1
    ):
        parser.error(
            f"--serve-requests must be >= 0, --serve-slots, --serve-page-size and --serve-steps-per-call >= "
            f"1, --serve-budget >= --serve-slots, got {args.serve_requests}, {args.serve_slots}, "
            f"{args.serve_page_size}, {args.serve_steps_per_call}, {args.serve_budget}"
        )
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
    print(
        f"corpus: {count} .py files ({size / 1e6:.1f} MB, {size / count / 1e3:.1f} KB on average, the longest "
        f"{longest / 1e3:.0f} KB: whole files padded to it would fill {size / (count * longest):.1%}) under {root}; "
        f"{len(held_out_files)} held out"
    )
    print(
        f"model ({args.preset} preset): {setup.layers} layers, width {setup.width}, {setup.heads} heads "
        f"({setup.kv_heads} kv), {setup.dtype}; batches of {setup.capacity} bytes, sequences <= {setup.max_seqlen}, "
        f"<= {setup.max_seqs} per batch; {setup.steps} steps of AdamW"
    )
    timing = Timing(warmup=args.compare_warmup, steps=max(args.compare_steps, 1), repeats=args.compare_repeats)
    started = time.perf_counter()
    if args.profile:
        profile(setup, train_files, args.seed, dataclasses.replace(timing, steps=max(args.compare_steps, 5)))
    model = ByteLM(setup, rngs=nnx.Rngs(args.seed))
    result = train(model, setup, train_files, args.seed, progress=not args.no_progress)
    held = evaluate(model, held_out_files, setup)
    unigram = unigram_bits_per_byte(train_files, held_out_files)
    bits = result["losses"] / math.log(2)
    print(
        f"trained {setup.steps} steps in {result['seconds']:.0f} s (after the first, compiling, step): training "
        f"loss {np.mean(bits[:10]):.2f} -> {np.mean(bits[-10:]):.2f} bits/byte; {result['tokens_per_s']:,.0f} "
        f"useful tokens/s in the training loop (host packing included)"
    )
    print(
        f"fill rate (real bytes / buffer): packed {result['fill_rate']:.1%}; padded to the longest document "
        f"({setup.window_bytes} bytes) {result['padded_document_fill']:.1%}; split at max_seqlen and padded to "
        f"{setup.max_seqlen}-byte rows {result['padded_rows_fill']:.1%}"
    )
    # Printed before the measurements that follow, so that a run cut short by a time limit still shows it.
    print(
        f"held-out: {held['bits_per_byte']:.3f} bits per byte over {held['bytes']:,} bytes of "
        f"{len(held_out_files)} unseen files (uniform 8.000, byte frequencies {unigram:.3f})"
    )
    if args.plot and plot_losses(result["losses"], held["bits_per_byte"], args.plot):
        print(f"loss curve: {args.plot}")
    if args.sample_bytes > 0:
        prompts = sample_prompts(args.prompt.encode(), held_out_files, args.sample_prompts)
        sample_and_time(model, setup, prompts, args.sample_bytes, args.seed)
    if args.serve_requests > 0:
        requests = make_requests(
            args.prompt.encode(), held_out_files, args.serve_requests, setup, args.serve_max_new, seed=args.seed
        )
        config = ServingConfig.for_setup(
            setup, args.serve_slots, args.serve_budget, args.serve_page_size, steps_per_call=args.serve_steps_per_call
        )
        serve_and_compare(model, setup, requests, config, args.seed, implementation=args.serve_implementation)
    if args.compare_steps > 0:
        side_by_side(setup, train_files, args.seed, timing, args.compare_systems, label=f" ({args.preset} preset)")
    print(f"total {time.perf_counter() - started:.0f} s")
    if not held["bits_per_byte"] <= setup.max_bits_per_byte:
        print(
            f"\n*** LM FAILED: held-out {held['bits_per_byte']:.3f} bits per byte is above --max-bits-per-byte "
            f"{setup.max_bits_per_byte}; the model did not learn ***",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
