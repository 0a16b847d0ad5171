"""`python -m jax_ragged_attn.selfcheck`: what this machine can run, and one packed batch checked and timed.

Prints the environment (JAX backend, cuDNN and cudnn-frontend versions, whether the cuDNN path is usable),
runs a packed causal batch forward and backward with the best implementation, compares it with the
float32 xla path and prints the errors and timings. Exits non-zero if the errors exceed the tolerance.
Also prints which libcudnn and libcudart this process loaded (paths from /proc/self/maps, Linux only) and the
known upstream bugs of the loaded versions (backends/shared/known_issues.py), and ends with one verdict line:
"selfcheck: OK (...)" or "selfcheck: FAILED (...)". `--deep` instead checks every feature of every backend
against the float64 reference and prints a table (tools/selfcheck_deep.py; `deep_check()` for a user's CI).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_ragged_attn import testing
from jax_ragged_attn.backends.cudnn import ragged as cudnn
from jax_ragged_attn.backends.shared import extension, known_issues
from jax_ragged_attn.config import AttentionOptions, make_config
from jax_ragged_attn.ops import ragged as api
from jax_ragged_attn.testing.workloads import seeded_lengths
from jax_ragged_attn.tools.bench import median_loop_seconds
from jax_ragged_attn.tools.selfcheck_deep import deep_check, run_deep

__all__ = ["deep_check", "main", "run", "run_deep"]


def _time(fn, *args, iterations: int) -> float:
    """Median seconds of `iterations` single blocked calls, after a compiling one."""
    return median_loop_seconds(fn, args, 1, iterations)


# libcudnn.so.9, libcudnn_graph.so.9.8.0, libcudart.so.12.8.90: the stem, then the version after ".so.".
_LIBRARY = re.compile(r"^(libcudnn[a-z_]*|libcudart)\.so(?:\.([0-9.]+))?$")


def loaded_libraries(maps_text: str) -> dict[str, tuple[str, str]]:
    """{stem: (path, version from the file name or "")} of the libcudnn*/libcudart libraries mapped in a
    /proc/<pid>/maps text, first mapping of each stem; e.g. the line
    "7f..-7f.. r-xp 00000000 fd:01 123 /x/nvidia/cudnn/lib/libcudnn.so.9"
    -> {"libcudnn": ("/x/.../libcudnn.so.9", "9")}."""
    found = {}
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path, which may hold spaces]
        if len(fields) < 6:
            continue
        path = fields[5].strip()
        if path.endswith(" (deleted)"):
            path = path[: -len(" (deleted)")]
        match = _LIBRARY.match(os.path.basename(path))
        if match and match.group(1) not in found:
            found[match.group(1)] = (path, match.group(2) or "")
    return found


def _cudnn_version_text(version: int) -> str:
    # cuDNN 9 encodes major * 10000 + minor * 100 + patch: 90800 -> 9.8.0.
    return f"{version // 10000}.{version % 10000 // 100}.{version % 100}"


def _cudart_version(path: str) -> str:
    """cudaRuntimeGetVersion() of the already-loaded library (12080 -> 12.8), or "" if it cannot be asked."""
    try:
        value = ctypes.c_int()
        if ctypes.CDLL(path).cudaRuntimeGetVersion(ctypes.byref(value)) != 0:
            return ""
    except (OSError, AttributeError):
        return ""
    return f"{value.value // 1000}.{value.value % 1000 // 10}"


# The cuDNN the advice line recommends: 9.28.1 runs this op's cuDNN path fwd+bwd 2-3 % faster than 9.19.0 on the
# same machine (docs/PERFORMANCE.md#per-cudnn-release); the GPU test suite passes on both.
FASTER_CUDNN = 92800
FASTER_CUDNN_NOTE = (
    "cuDNN 9.28 ran this op's cuDNN path 2-3 % faster than 9.19 on the H200 (fwd+bwd, "
    "docs/PERFORMANCE.md): pip install -U nvidia-cudnn-cu13 (or -cu12)"
)


def upgrade_note(version: int) -> str | None:
    """The advice line for a loaded cuDNN older than the fastest one measured, or None."""
    if 0 < version < FASTER_CUDNN:
        return f"  note: libcudnn {_cudnn_version_text(version)} is loaded; {FASTER_CUDNN_NOTE}"
    return None


def headers_note(loaded: int, headers: int) -> str | None:
    """The line for a cuDNN newer than the headers the extension was built against (minor versions), or None:
    cudnn-frontend uses a feature only where both have it, so the library then runs on the headers' paths."""
    if loaded and headers and headers // 100 < loaded // 100:
        return (
            f"  note: the extension was built against cuDNN {_cudnn_version_text(headers)} headers, so "
            f"cudnn-frontend keeps libcudnn {_cudnn_version_text(loaded)} on {_cudnn_version_text(headers)}'s "
            f"paths (a pip install builds against the newest headers; docs/CUDNN_VERSIONS.md)"
        )
    return None


def library_lines(on_gpu: bool) -> list[str]:
    """What the self-check prints about the cuDNN and CUDA runtime libraries this process loaded."""
    if not on_gpu:
        return [f"  {name}: not loaded (no CUDA device)" for name in ("libcudnn", "libcudart")]
    try:
        with open("/proc/self/maps") as maps:
            found = loaded_libraries(maps.read())
    except OSError:
        return ["  libcudnn, libcudart: unknown (no /proc/self/maps: not Linux)"]
    lines = []
    for name in ("libcudnn", "libcudart"):
        if name not in found:
            lines.append(f"  {name}: not loaded in this process")
            continue
        path, file_version = found[name]
        notes = []
        if name == "libcudnn":
            number = extension.module().cudnn_version()
            version = _cudnn_version_text(number) if number else file_version
            notes = [upgrade_note(number), headers_note(number, extension.module().cudnn_header_version)]
        else:
            version = _cudart_version(path) or file_version
        lines.append(f"  {name}: {version or 'version unknown'} at {path}")
        lines.extend(note for note in notes if note)
    others = sorted(stem for stem in found if stem not in ("libcudnn", "libcudart"))
    if others:
        lines.append(f"  also loaded: {', '.join(others)}")
    return lines


def default_choice(q, k, v, cu, max_len: int) -> str:
    """What implementation=None picks for this batch, and why (backends.choose, as the op asks it)."""
    from jax_ragged_attn import backends
    from jax_ragged_attn.backends import policy
    from jax_ragged_attn.index import RaggedIndex

    config = make_config(q, k, v, cu, cu, AttentionOptions(is_causal=True), max_seqlen_q=max_len, max_seqlen_kv=max_len)
    name = backends.choose(None, config, RaggedIndex(cu, cu, same=True)).NAME
    pinned = policy.pinned()
    why = (
        f"pinned by {policy.ENV_VAR}={pinned}"
        if pinned == name
        else "the shipped policy prefers FA3 here (backends/policy.py)"
        if name == "fa3"
        else "the shipped policy keeps cuDNN here (backends/policy.py)"
        if name == "cudnn"
        else "no GPU kernel serves this call here"
    )
    return f"{name} ({why})"


def run(args) -> int:
    on_gpu = extension.cudnn_unavailable_reason() is None
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}")
    for key, value in extension.versions().items():
        print(f"  {key}: {value}")
    # After versions(): it initialised the extension, which is what loads cuDNN.
    print("\n".join(library_lines(jax.default_backend() == "gpu")))
    for line in known_issues.summary_lines():
        print(f"  known issue: {line}")

    # The same seeded draw as the benchmark's W1 (jax_ragged_attn/testing/workloads.py) with the default flags.
    lengths = np.asarray(seeded_lengths(args.num_seqs, args.min_len, args.max_len, total=args.total, seed=args.seed))
    rng = np.random.default_rng(args.seed + 1)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    tokens, max_len = int(lengths.sum()), int(lengths.max())
    dtype = jnp.dtype(args.dtype)
    shape_q = (tokens, args.heads, args.head_dim)
    q, k, v = (jnp.asarray(rng.standard_normal(shape_q), dtype) for _ in range(3))
    kwargs = dict(max_seqlen_q=max_len, max_seqlen_kv=max_len, is_causal=True)
    print(
        f"batch: {args.num_seqs} sequences of {lengths.min()}..{max_len} tokens ({tokens} in all), "
        f"{args.heads} heads, head dim {args.head_dim}, {args.dtype}, causal"
    )
    print(f"implementation=None runs: {default_choice(q, k, v, cu, max_len)}")

    status = 0
    grads_by_layout = {}
    for layout in ("head_major", "token_major"):

        def loss(q, k, v, implementation):
            out = api.ragged_attention(q, k, v, cu, cu, stats_layout=layout, implementation=implementation, **kwargs)
            weights = jnp.cos(jnp.arange(out.shape[-1], dtype=jnp.float32))[None, None, :]  # explicit ranks: a
            return jnp.sum(out.astype(jnp.float32) * weights)  # user's jax_numpy_rank_promotion='raise' holds

        best = "cudnn" if on_gpu and args.dtype != "float32" else "xla"
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)
        forward = jax.jit(loss, static_argnums=3)
        value, grads = step(q, k, v, best)
        step_s = _time(step, q, k, v, best, iterations=args.iterations)
        forward_s = _time(forward, q, k, v, best, iterations=args.iterations)

        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        ref_value, ref_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)(*f32, "xla")
        errors = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - r))) for g, r in zip(grads, ref_grads)]
        scale = max(float(jnp.max(jnp.abs(r))) for r in ref_grads)
        # The tests' dtype-derived bound, relative to the largest gradient (jax_ragged_attn/testing/helpers.py).
        tolerance = testing.tolerance(args.dtype)[0]
        ok = all(e <= tolerance * scale for e in errors) and all(float(jnp.abs(g).max()) > 0 for g in grads)
        grads_by_layout[layout] = grads
        status |= not ok
        extra = ""
        if best == "cudnn":
            config = make_config(
                q,
                k,
                v,
                cu,
                cu,
                AttentionOptions(is_causal=True, stats_layout=layout),
                max_seqlen_q=max_len,
                max_seqlen_kv=max_len,
            )
            extra = f", backward workspace {cudnn.graph_info('backward', config)['workspace_bytes']:,} bytes"
        print(f"[{layout}] {best}: forward {forward_s * 1e3:.3f} ms, forward+backward {step_s * 1e3:.3f} ms{extra}")
        print(
            f"[{layout}] max |grad - float32 xla| (dq, dk, dv) = {', '.join(f'{e:.3g}' for e in errors)} "
            f"(max |grad| {scale:.3g}) -> {'OK' if ok else 'FAIL'}"
        )
    # Head-major stats are the layout that cudnn-frontend <= 1.27 got wrong: both must give the same gradients.
    differences = [
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        for a, b in zip(grads_by_layout["head_major"], grads_by_layout["token_major"])
    ]
    print(f"max |grad(head_major) - grad(token_major)| (dq, dk, dv) = {', '.join(f'{d:.3g}' for d in differences)}")
    verdict = "FAILED" if status else "OK"
    gradients = "off the float32 xla path" if status else "within tolerance of the float32 xla path"
    print(
        f"selfcheck: {verdict} ({best} path, {args.dtype}, {tokens} tokens, gradients {gradients} "
        "in both stats layouts)"
    )
    return status


def command_line(on_gpu: bool) -> argparse.ArgumentParser:
    """The command line, its defaults those of a GPU or of a CPU."""
    parser = argparse.ArgumentParser(
        prog="python -m jax_ragged_attn.selfcheck",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # On a GPU the default batch is the project's reference workload; on a CPU a small one.
    batch = parser.add_argument_group("the packed batch checked and timed (defaults: this machine's)")
    batch.add_argument("--num-seqs", type=int, default=16 if on_gpu else 8, help="sequences (default %(default)s)")
    batch.add_argument(
        "--min-len", type=int, default=128 if on_gpu else 16, help="shortest sequence, tokens (default %(default)s)"
    )
    batch.add_argument(
        "--max-len", type=int, default=4096 if on_gpu else 128, help="longest sequence, tokens (default %(default)s)"
    )
    batch.add_argument(
        "--total",
        type=int,
        default=32768 if on_gpu else None,
        help="tokens in all: the last sequences are cut to fit it (default %(default)s; None: no cut)",
    )
    batch.add_argument(
        "--heads", type=int, default=16 if on_gpu else 4, help="attention heads of q, k and v (default %(default)s)"
    )
    batch.add_argument("--head-dim", type=int, default=128 if on_gpu else 64, help="head dim (default %(default)s)")
    batch.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="dtype of q, k and v (default %(default)s)",
    )
    batch.add_argument(
        "--iterations",
        type=int,
        default=20 if on_gpu else 3,
        help="timed calls; the median is printed (default %(default)s)",
    )
    batch.add_argument("--seed", type=int, default=0, help="seed of the lengths and the data (default %(default)s)")
    parser.add_argument(
        "--deep",
        action="store_true",
        help="instead, every feature of every backend here against the float64 reference, as a "
        "table (the batch options do not apply)",
    )
    return parser


def main(argv=None) -> int:
    args = command_line(extension.cudnn_unavailable_reason() is None).parse_args(argv)
    if args.deep:  # the loaded libraries' paths too: which cuDNN this process mapped
        return run_deep(library_lines=library_lines(jax.default_backend() == "gpu"))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
