"""Every peer side by side in one run: one markdown table, printed last.

    python -m benchmarks.peers [--workloads W1,W2,W5,W6,W4-d64,W4-d256,MLA] [--inputs computed,arguments]
                               [--systems ...] [--calls 20] [--loops 7] [--time-budget S] [--out DIR]
    python -m benchmarks.peers --quick      # the CPU smoke run: tiny shapes of every row, xla where nothing else
    python -m benchmarks.peers --interleave # a row's JAX cells timed in the same rounds

Peers (columns): this package's `ragged_attention` with implementation=None ("ours default": the label names
the backend the policy picked) and pinned to "cudnn", "fa3" (each provider) and "xla"; the flash-attn3-jax wheel's own
`flash_mha_varlen`; dew-flash-attn's `flash_mha_varlen`; raw cuDNN (benchmarks/cudnn_raw.py: cudnn-frontend's
Python module on torch buffers, the ceiling). Rows: workload x direction (fwd, fwd+bwd) x inputs, where
"computed" makes q, k, v and the output's cotangent inside the jitted step (each jit argument times a traced
scalar, fa3_compare's `--inputs computed`, as in a model) and "arguments" passes them as the jit's arguments;
the two rows of one workload and direction sit together. Timing: benchmarks/timing.py's `median_loop_seconds`,
a plain Python loop of `--calls` jitted calls then one block_until_ready, the median of `--loops` loops, per
call, after a compiling call (fa3_compare's method and counts); with `--interleave`, a row's JAX cells are
compiled first and timed together, `--loops` rounds of one loop of each, the median round (a clock or load that
drifts moves every column alike, so ratios within a row are tighter). Raw cuDNN is timed by cudnn_raw's plain method
(the same loop around `--calls` graph executions and a synchronize) and has no computed-inputs form. Each
figure is ms with its ratio to the fastest figure of its row; a cell that has no figure names a reason,
listed under the table ("not installed", "needs a CUDA GPU", the backend's own decline, an error).

Rows: W1, W2, W5, W6 and W4-d64 / W4-d256 (W1's lengths with head dim 64 / 256, "hd64" and "hd256" of the
issue) are jax_ragged_attn/testing/workloads.py's; MLA (W1's lengths, 16 / 16 heads, Dqk 192, Dv 128: DeepSeek's
training shape) is defined here, as that module has no Dqk != Dv workload. `--quick` replaces each row by a
tiny one of the same head dims and head grouping (4 sequences of 8..64 tokens), 2 calls, 2 loops.

dew-flash-attn, as read in the wheel dew_flash_attn_cu13-0.3.6-py3-none-manylinux_2_28_x86_64.whl (PyPI,
77.8 MB; every fact below is from its dew_flash_attn/__init__.py, its METADATA, and `readelf` / `nm` /
`strings` of its two libraries):
  - METADATA: Requires-Python >=3.11, Requires-Dist jax>=0.11.2 (nothing else); a py3-none wheel, so the
    host's Python 3.12 and JAX 0.11.2 qualify. "The wheel ships no CUDA runtime: it needs a CUDA build of JAX
    of the same major" (cu13 here). Both libraries are NEEDED libcudart.so.13 with RUNPATH
    $ORIGIN/../nvidia/cuda_runtime/lib:$ORIGIN/../nvidia/cu13/lib, and `import dew_flash_attn` loads both
    with ctypes at import (libdew_flash_attn.so, 338 MB, FlashAttention-2 for sm80 and sm120;
    libdew_flash_attn3.so, 18 MB, FlashAttention-3 for sm90a). Installed with `--target` away from
    site-packages that RUNPATH misses, so `_import_dew` below starts JAX's GPU backend first (its plugin
    maps libcudart.so.13) and else preloads it from an nvidia/cu13/lib on sys.path.
  - API: `flash_mha(query, key, value, softmax_scale=None, is_causal=False, window_size=(-1, -1), sinks=None)`
    on [B, S, H, D], and `flash_mha_varlen(query, key, value, cu_seqlens, max_seqlen: int, softmax_scale=None,
    is_causal=False, window_size=(-1, -1), sinks=None, key_cu_seqlens=None, key_max_seqlen=None)` on packed
    [T, H, D] with int32 cu_seqlens [N + 1] (one set for q and k unless key_cu_seqlens / key_max_seqlen are
    both given; max_seqlen is a Python int, static). Both return `out` only: **no log-sum-exp** through
    the public API. Inside (`_forward3`), FA3's varlen forward makes it float32 **[H, T]** (head-major,
    FlashAttention's layout; FA2's packed one is [N, H, max_seqlen]), kept as a residual of its custom_vjp.
  - Differentiation: `jax.custom_vjp` around the kernels' own backward (`dew_flash3_mha_varlen_bwd`, GQA's
    dK/dV per key head), with two float32 scratch buffers of Hq * (T + 128 * (N + 1)) as extra outputs.
    Its patched backward launches CTAs over the batch's blocks (a sequence's blocks start at
    cu_seqlens[i] / block + i, a CTA finds its sequence by binary search), not over N x max_seqlen.
  - Masks: is_causal aligned bottom-right ("to the last key", as FlashAttention; the same as top-left for
    self-attention), window_size (left, right) with -1 unbounded, both per sequence. Sinks: [Hq], applied
    in Python around the kernel (out * sigmoid(lse - sink); the backward gets lse logaddexp sink).
  - Not there: **no seqused**, **no page table / KV cache** entry point, **no softcap** (METADATA: "without
    split keys, paged caches, softcap or fp8"), no dropout, no LSE output, no deterministic switch (its FA2
    backward passes deterministic=False), no clearing of rows past cu_seqlens[-1].
  - Shapes: bf16 or fp16 only, q, k, v of one dtype; key heads divide query heads (MHA, GQA, MQA); D <= 256,
    padded in Python to a multiple of 8; the FA3 library holds hdim 64, 128, 192 and 256 kernels
    (flash_{fwd,bwd}_hdim{64,128,192,256}_{bf16,fp16}_sm90), "a narrower head is padded up to the next".
    `_check` requires key.shape == value.shape and q's width == k's: **Dqk != Dv (MLA 192 / 128) is refused**
    (the C++ port's strings know of a different V head dim, but no 192 / 128 kernel is compiled).
  - Kernel choice: `_hopper()` = the device's compute capability in the FA3 library's architectures (sm90);
    FA3 there, FA2 on sm8x / sm120.
  - FFI targets (registered for platform "CUDA" at the first call, `_registered`): libdew_flash_attn3.so
    `dew_flash3_mha_fwd`, `dew_flash3_mha_bwd`, `dew_flash3_mha_varlen_fwd`, `dew_flash3_mha_varlen_bwd`;
    libdew_flash_attn.so `dew_flash_mha_fwd`, `dew_flash_mha_bwd`, `dew_flash_mha_varlen_fwd`,
    `dew_flash_mha_varlen_bwd`. Checked here by lowering a GQA varlen fwd+bwd for CUDA on a CPU: one
    `dew_flash3_mha_varlen_fwd` (out, lse f32[Hq, T], two 1-element scratch) and one `..._varlen_bwd`.
Install it with `pip install dew-flash-attn-cu13` on a Hopper GPU host.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import importlib.metadata
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp

from benchmarks.timing import Settings, interleaved_loop_seconds, median_loop_seconds
from jax_ragged_attn.testing import workloads as workloads_module
from jax_ragged_attn.testing.workloads import Workload, attention_flops, direction_flops, seeded_lengths

CALLS, LOOPS = 20, 7  # fa3_compare's
QUICK_CALLS, QUICK_LOOPS = 2, 2
DEW_DIST, DEW_VERSION = "dew-flash-attn-cu13", "0.3.6"
DEW_HEAD_DIMS = (64, 128, 192, 256)  # the FA3 library's kernels; narrower heads are padded up
INPUTS = ("computed", "arguments")
DIRECTIONS = ("fwd", "fwd+bwd")


# ---- the rows ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class UnequalWorkload(Workload):
    """A Workload whose value head dim differs from the query / key one (`head_dim` is Dqk)."""

    head_dim_v: int = 0

    def flops(self, direction: str = "forward") -> float:
        # q.k costs 2 s^2 h Dqk, p.v 2 s^2 h Dv: the shared formula's 4 s^2 h d with d = (Dqk + Dv) / 2.
        mean = (self.head_dim + self.head_dim_v) / 2
        return direction_flops(attention_flops(self.seqlens, self.num_heads_q, 1, self.causal) * mean, direction)

    def summary(self) -> str:
        return super().summary().replace(f"head dim {self.head_dim}", f"Dqk {self.head_dim} / Dv {self.head_dim_v}")

    def packed_inputs(self, seed: int = 0):
        q, k, _, cu = super().packed_inputs(seed)
        v = jax.random.normal(
            jax.random.fold_in(jax.random.key(seed), 7),
            (self.total_tokens, self.num_heads_kv, self.head_dim_v),
            jnp.dtype(self.dtype),
        )
        return q, k, v, cu


def head_dims(w: Workload) -> tuple[int, int]:
    return w.head_dim, getattr(w, "head_dim_v", 0) or w.head_dim


_W1 = workloads_module.WORKLOADS["W1"]
# The MLA row (not in workloads.py, which has no Dqk != Dv shape): W1's lengths and heads.
LOCAL = {
    "MLA": UnequalWorkload(
        "MLA", "W1 with Dqk 192 / Dv 128 (DeepSeek's MLA training shape)", _W1.seqlens, 16, 16, 192, head_dim_v=128
    )
}
ALIASES = {"hd64": "W4-d64", "hd256": "W4-d256", "mla": "MLA"}
DEFAULT_ROWS = ("W1", "W2", "W5", "W6", "W4-d64", "W4-d256", "MLA")


def workload(name: str) -> Workload:
    name = ALIASES.get(name, name)
    if name in LOCAL:
        return LOCAL[name]
    if name in workloads_module.WORKLOADS:
        return workloads_module.WORKLOADS[name]
    raise SystemExit(
        f"unknown workload {name!r}; choose from {', '.join(DEFAULT_ROWS)}, "
        f"{', '.join(workloads_module.WORKLOADS)} or {', '.join(ALIASES)}"
    )


def quick(w: Workload) -> Workload:
    """A tiny workload with w's head dims and head grouping: the CPU smoke run of w's row."""
    grouped = w.num_heads_q != w.num_heads_kv
    return dataclasses.replace(
        w,
        name=f"{w.name}~tiny",
        description=f"tiny shape with {w.name}'s head dims",
        seqlens=seeded_lengths(4, 8, 64),
        num_heads_q=4,
        num_heads_kv=2 if grouped else 4,
    )


# ---- the peers ---------------------------------------------------------------------------------------------


class Declined(Exception):
    """A system cannot serve this row; the message is the reason printed under the table."""


@dataclasses.dataclass(frozen=True)
class Peer:
    name: str
    unavailable: Callable[[], str | None]  # why not on this machine at all
    attention: Callable[[Workload], Callable]  # (q, k, v, cu) -> out; raises Declined with the reason
    label: Callable[[Workload], str] | None = None  # a note on the figure (ours default: the backend it picked)


def _on_gpu() -> str | None:
    backend = jax.default_backend()
    return None if backend == "gpu" else f"needs a CUDA GPU; JAX's backend is {backend!r}"


def _config(w: Workload, **options):
    from jax_ragged_attn.config import AttentionOptions, make_config
    from jax_ragged_attn.index import RaggedIndex

    q, k, v, cu = jax.eval_shape(w.packed_inputs)  # shapes only: nothing is allocated
    cu = jnp.asarray(w.cu_seqlens())
    config = make_config(
        q,
        k,
        v,
        cu,
        cu,
        AttentionOptions(is_causal=w.causal, **options),
        max_seqlen_q=w.max_seqlen,
        max_seqlen_kv=w.max_seqlen,
    )
    return config, RaggedIndex(cu, cu, same=True)


def _ours(implementation: str | None):
    def attention(w: Workload):
        from benchmarks.systems import _xla_unsupported
        from jax_ragged_attn import backends, ragged_attention
        from jax_ragged_attn.testing import implementation_options

        options = implementation_options(implementation) if implementation else {}

        # implementation=None on a GPU falls back to the xla path where no GPU kernel serves the row: on these
        # shapes that is minutes or out of memory, so it is declined as "ours xla" is.
        if implementation == "xla" or (implementation is None and _on_gpu() is None and _default_label(w) == "xla"):
            reason = _xla_unsupported(w)
            if reason is not None:
                raise Declined(
                    reason
                    if implementation
                    else f"it would run the xla path here (no GPU kernel serves this row) and {reason}"
                )
        if implementation is not None:
            try:
                backends.choose(options["implementation"], *_config(w, **options))
            except NotImplementedError as error:
                raise Declined(str(error)) from None

        def f(q, k, v, cu):
            return ragged_attention(
                q, k, v, cu, cu, max_seqlen_q=w.max_seqlen, max_seqlen_kv=w.max_seqlen, is_causal=w.causal, **options
            )

        return f

    return attention


def _default_label(w: Workload) -> str:
    from jax_ragged_attn import backends

    try:
        return backends.choose(None, *_config(w)).NAME
    except Exception as error:  # noqa: BLE001 - only a label
        return f"? ({type(error).__name__})"


def _cudnn_unavailable() -> str | None:
    from jax_ragged_attn.backends.shared import extension

    return extension.cudnn_unavailable_reason()


def _fa3_unavailable() -> str | None:
    from jax_ragged_attn.backends.fa3 import ragged as _fa3

    return _fa3.unavailable_reason()


def _ours_dew_unavailable() -> str | None:
    from jax_ragged_attn.backends.fa3 import dew

    return dew.unavailable_reason()


def _fa3_raw_unavailable() -> str | None:
    from benchmarks.systems import _fa3_raw_unavailable as reason

    return reason()


def _fa3_raw(w: Workload):
    from jax_ragged_attn.backends.fa3 import ragged as _fa3

    dqk, dv = head_dims(w)
    if dqk != _fa3.FA3_HEAD_DIM or dv != _fa3.FA3_HEAD_DIM:
        raise Declined(
            f"the {_fa3.WHEEL} wheel's kernels are built for head dim {_fa3.FA3_HEAD_DIM} only "
            f"(Dqk = Dv = {_fa3.FA3_HEAD_DIM}); this row has Dqk {dqk}, Dv {dv}"
        )
    from flash_attn3_jax import flash_mha_varlen

    def f(q, k, v, cu):
        return flash_mha_varlen(
            q, k, v, cu, cu, max_seqlen_q=w.max_seqlen, max_seqlen_k=w.max_seqlen, is_causal=w.causal
        )

    return f


def _preload_cudart() -> str | None:
    """Maps libcudart.so.13 from an nvidia/cu13/lib (or nvidia/cuda_runtime/lib) on sys.path, for a dew
    installed with --target, whose RUNPATH ($ORIGIN/../nvidia/...) then points nowhere. The path, or None."""
    for entry in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cuda_runtime/lib"):
            path = os.path.join(entry or ".", sub, "libcudart.so.13")
            if os.path.exists(path):
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                return path
    return None


@functools.cache
def _import_dew():
    """(dew_flash_attn, None) or (None, the reason it is not usable here)."""
    if importlib.util.find_spec("dew_flash_attn") is None:
        return None, f"not installed ({DEW_DIST}=={DEW_VERSION}: pip install {DEW_DIST})"
    reason = _on_gpu()
    if reason is not None:
        return None, reason
    jax.devices()  # JAX's CUDA plugin maps libcudart.so.13, which dew's libraries need at import
    try:
        import dew_flash_attn
    except OSError as first:
        try:
            where = _preload_cudart()
            import dew_flash_attn
        except Exception as error:  # noqa: BLE001
            return None, (
                f"does not import: {type(first).__name__}: {first}; with libcudart preloaded "
                f"({where or 'none found on sys.path'}): {type(error).__name__}: {error}"
            )
    except Exception as error:  # noqa: BLE001
        return None, f"does not import: {type(error).__name__}: {error}"
    return dew_flash_attn, None


def _dew_unavailable() -> str | None:
    return _import_dew()[1]


def _dew(w: Workload):
    dqk, dv = head_dims(w)
    if dqk != dv:
        raise Declined(
            f"flash_mha_varlen takes k and v of one shape and q, k of one width (its _check), so no "
            f"Dqk {dqk} / Dv {dv}; its FA3 library has symmetric hdim {DEW_HEAD_DIMS} kernels only "
            f"(padding V to {dqk} would time another kernel, not this row)"
        )
    if dqk > max(DEW_HEAD_DIMS):
        raise Declined(f"head dim {dqk} is over dew's 256")
    if w.dtype not in ("bfloat16", "float16"):
        raise Declined(f"dew takes bf16 or fp16 only, this row is {w.dtype}")
    dew, reason = _import_dew()
    if dew is None:
        raise Declined(reason)

    def f(q, k, v, cu):
        return dew.flash_mha_varlen(q, k, v, cu, w.max_seqlen, is_causal=w.causal)

    return f


PEERS: dict[str, Peer] = {
    p.name: p
    for p in (
        Peer("ours default", lambda: None, _ours(None), _default_label),
        Peer("ours cudnn", _cudnn_unavailable, _ours("cudnn")),
        Peer("ours fa3", _fa3_unavailable, _ours("flash-attn3-jax")),
        Peer("ours dew", _ours_dew_unavailable, _ours("dew-flash-attn")),
        Peer("ours xla", lambda: None, _ours("xla")),
        Peer("flash-attn3-jax", _fa3_raw_unavailable, _fa3_raw),
        Peer("dew-flash-attn", _dew_unavailable, _dew),
    )
}
RAW_CUDNN = "raw cuDNN"
SYSTEMS = (*PEERS, RAW_CUDNN)


# ---- measuring ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Cell:
    workload: str
    inputs: str
    direction: str
    system: str
    ms: float | None = None
    reason: str | None = None  # why there is no figure
    label: str = ""  # a note printed beside the figure

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _short(error: BaseException) -> str:
    message = " ".join(str(error).split()) or "(no message)"
    return f"error: {type(error).__name__}: {message[:300]}"


def _steps(f, inputs: str):
    from benchmarks.fa3_compare import steps

    return steps(f, inputs)


class Budget:
    def __init__(self, seconds: float | None):
        self.seconds, self.start = seconds, time.perf_counter()

    def reason(self) -> str | None:
        if self.seconds is not None and time.perf_counter() - self.start > self.seconds:
            return f"not run: the --time-budget of {self.seconds:.0f} s ran out before it"
        return None


def _measure_jax(
    peer: Peer, w: Workload, arrays, calls: int, loops: int, budget: Budget, pending: list | None = None
) -> list[Cell]:
    """The peer's cells of one workload, each timed now, or with `pending` (interleaved timing) compiled now and
    appended as (cell, fn, args) for _time_interleaved."""
    cells = {(i, d): Cell(w.name, i, d, peer.name) for i in INPUTS for d in DIRECTIONS}

    def all_cells(reason):
        for cell in cells.values():
            cell.reason = reason
        return list(cells.values())

    reason = peer.unavailable()
    if reason is not None:
        return all_cells(reason)
    try:
        f = peer.attention(w)
    except Declined as declined:
        return all_cells(str(declined))
    except Exception as error:  # noqa: BLE001
        traceback.print_exc(file=sys.stderr)
        return all_cells(_short(error))
    label = peer.label(w) if peer.label else ""
    q, k, v, cu, d_out, scale = arrays
    for inputs in INPUTS:
        forward, both = _steps(f, inputs)
        for direction, fn, args in (
            ("fwd", forward, (q, k, v, cu, scale)),
            ("fwd+bwd", both, (q, k, v, cu, scale, d_out)),
        ):
            cell = cells[(inputs, direction)]
            cell.label = label
            cell.reason = budget.reason()
            if cell.reason:
                continue
            try:
                if pending is None:
                    cell.ms = median_loop_seconds(fn, args, calls, loops) * 1e3
                else:
                    jax.block_until_ready(fn(*args))  # compiled (and failing, if it fails) now
                    pending.append((cell, fn, args))
            except Exception as error:  # noqa: BLE001 - reported in the table; the others still run
                traceback.print_exc(file=sys.stderr)
                cell.reason = _short(error)
    return list(cells.values())


def _raw_cudnn_unavailable() -> str | None:
    from benchmarks import cudnn_raw

    return _on_gpu() or cudnn_raw.unavailable_reason()


def _measure_raw_cudnn(w: Workload, calls: int, loops: int, budget: Budget) -> list[Cell]:
    cells = {(i, d): Cell(w.name, i, d, RAW_CUDNN) for i in INPUTS for d in DIRECTIONS}
    for d in DIRECTIONS:
        cells[("computed", d)].reason = (
            "no computed-inputs form: cudnn_raw runs its graphs on torch buffers made "
            "once, outside any jit (its figure is in the arguments row)"
        )
    dqk, dv = head_dims(w)
    reason = (
        _raw_cudnn_unavailable()
        or (
            f"benchmarks/cudnn_raw.py builds Dqk = Dv graphs only; this row has Dqk {dqk}, Dv {dv}"
            if dqk != dv
            else None
        )
        or budget.reason()
    )
    if reason is None:
        from benchmarks import cudnn_raw

        # cudnn_raw's plain method: `calls` executions then a synchronize (a huge target_call_s makes max_steps
        # the count), the median of `loops`.
        settings = Settings(iterations=loops, target_call_s=1e9, max_steps=calls, methods=("plain",))
        try:
            rows = {m.direction: m for m in cudnn_raw.measure(w, settings)}
        except Exception as error:  # noqa: BLE001
            traceback.print_exc(file=sys.stderr)
            reason = _short(error)
        else:
            for d, name in (("fwd", "forward"), ("fwd+bwd", "forward+backward")):
                m, cell = rows[name], cells[("arguments", d)]
                if m.ok:
                    cell.ms, cell.label = m.median_s * 1e3, ("host-bound" if "host-bound" in m.note else "")
                else:
                    cell.reason = m.status
            return list(cells.values())
    for d in DIRECTIONS:
        cells[("arguments", d)].reason = reason
    return list(cells.values())


def _arrays(w: Workload):
    q, k, v, cu = w.packed_inputs()
    out = jax.eval_shape(lambda: jnp.zeros((q.shape[0], q.shape[1], v.shape[2]), q.dtype))
    d_out = jax.random.normal(jax.random.key(1), out.shape, out.dtype)
    scale = jnp.float32(1.0)  # traced, so XLA cannot fold x * scale away (inputs="computed")
    return q, k, v, cu, d_out, scale


def _time_interleaved(pending: list, calls: int, loops: int) -> None:
    """Times the compiled cells of one workload in `loops` rounds, each round one plain loop of `calls` calls of
    every cell (tools/bench.interleaved_loop_seconds), and sets each cell's ms to its median loop: a clock or
    load that drifts during the run moves every column of the row alike."""
    entries = {i: ((lambda fn=fn, args=args: fn(*args)), calls) for i, (_, fn, args) in enumerate(pending)}
    for i, seconds in interleaved_loop_seconds(entries, loops).items():
        pending[i][0].ms = statistics.median(seconds) * 1e3


def _print(cells: list[Cell]) -> None:
    for c in cells:
        text = f"{c.ms:9.3f} ms" + (f" ({c.label})" if c.label else "") if c.ms is not None else c.reason
        print(f"{c.workload:<10} {c.inputs:<9} {c.direction:<7} {c.system:<16} {text}", flush=True)


def measure(
    rows: list[Workload],
    systems: list[str],
    calls: int,
    loops: int,
    budget: Budget | None = None,
    interleave: bool = False,
) -> list[Cell]:
    """Every system's cells of every row. interleave: the JAX systems' cells of a row are compiled first, then
    timed together in rounds (_time_interleaved); raw cuDNN (torch, outside JAX) is timed on its own."""
    budget = budget or Budget(None)
    cells: list[Cell] = []
    for w in rows:
        print(f"--- {w.summary()}", flush=True)
        arrays = None
        pending: list | None = [] if interleave else None
        row: list[Cell] = []
        for system in systems:
            if system == RAW_CUDNN:
                new = _measure_raw_cudnn(w, calls, loops, budget)
            else:
                if arrays is None:
                    arrays = _arrays(w)
                new = _measure_jax(PEERS[system], w, arrays, calls, loops, budget, pending)
            row += new
            if not interleave:
                _print(new)
        if pending:
            try:
                _time_interleaved(pending, calls, loops)
            except Exception as error:  # noqa: BLE001 - the row's cells say so; the other rows still run
                traceback.print_exc(file=sys.stderr)
                for cell, _, _ in pending:
                    cell.ms, cell.reason = None, _short(error)
        if interleave:
            _print(row)
        cells += row
        del arrays, pending
    return cells


# ---- the table ---------------------------------------------------------------------------------------------


def title(w: Workload) -> str:
    dqk, dv = head_dims(w)
    dims = f"d {dqk}" if dqk == dv else f"Dqk {dqk} / Dv {dv}"
    return f"{w.name} ({w.num_seqs} of {min(w.seqlens)}..{w.max_seqlen}, {w.num_heads_q}/{w.num_heads_kv}, {dims})"


def table(cells: list[Cell], rows: list[tuple[str, str]], systems: list[str]) -> str:
    """The markdown table of rows [(workload name, title)]: a row per workload x direction x inputs, a column per
    system; each figure is ms and its ratio to the row's fastest; a cell without one names a note [n], listed
    below the table with its reason."""
    by_key = {(c.workload, c.inputs, c.direction, c.system): c for c in cells}
    notes: dict[str, int] = {}
    lines = [
        "| workload | dir | inputs | " + " | ".join(systems) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in systems) + " |",
    ]
    for name, heading in rows:
        for direction in DIRECTIONS:
            for inputs in INPUTS:
                row = [
                    by_key.get((name, inputs, direction, s))
                    or Cell(name, inputs, direction, s, reason="not measured (not in this run)")
                    for s in systems
                ]
                figures = [c.ms for c in row if c.ms is not None]
                best = min(figures) if figures else None
                texts = []
                for c in row:
                    if c.ms is not None:
                        note = f", {c.label}" if c.label else ""
                        mark = "**" if c.ms == best else ""
                        texts.append(f"{mark}{c.ms:.3f}{mark} ({c.ms / best:.2f}x{note})")
                    else:
                        number = notes.setdefault(f"{c.system}: {c.reason}", len(notes) + 1)
                        texts.append(f"n/a [{number}]")
                lines.append(f"| {heading} | {direction} | {inputs} | " + " | ".join(texts) + " |")
    lines.append("")
    lines.append(
        "ms per call (ratio to the row's fastest, in **bold**); ours default names the backend it ran. "
        "No figure: the reason below."
    )
    lines += [f"[{n}] {key}" for key, n in notes.items()]
    return "\n".join(lines)


def merged(paths: list[str]) -> str:
    """One table of several runs' peers.json (runs of a few rows each): rows in file order,
    systems in first-seen order; a later file's cell replaces an earlier one's."""
    cells: dict[tuple, Cell] = {}
    rows: dict[str, str] = {}
    systems: dict[str, None] = {}
    headers = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        headers.append(f"{path}: " + "; ".join(data.get("header", [])[:1]))
        rows.update({r["name"]: r["title"] for r in data["rows"]})
        systems.update(dict.fromkeys(data["systems"]))
        for c in data["cells"]:
            cell = Cell(**c)
            cells[(cell.workload, cell.inputs, cell.direction, cell.system)] = cell
    return "\n".join(headers) + "\n\n" + table(list(cells.values()), list(rows.items()), list(systems))


# ---- the run -----------------------------------------------------------------------------------------------


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment() -> list[str]:
    device = jax.devices()[0]
    lines = [
        f"jax {jax.__version__}, backend {jax.default_backend()}, device {device.device_kind}"
        + (f" (compute capability {device.compute_capability})" if hasattr(device, "compute_capability") else ""),
        f"flash-attn3-jax {_version('flash-attn3-jax')}, {DEW_DIST} {_version(DEW_DIST)}, "
        f"nvidia-cudnn-frontend {_version('nvidia-cudnn-frontend')}, torch {_version('torch')}",
    ]
    dew, reason = _import_dew()
    if dew is None:
        lines.append(f"dew-flash-attn: {reason}")
    else:
        try:
            kernel = "FlashAttention-3" if dew._hopper() else "FlashAttention-2"
        except Exception as error:  # noqa: BLE001 - a header line only
            kernel = f"? ({type(error).__name__})"
        built = ", ".join(getattr(dew, "ARCHITECTURES", ()))
        lines.append(f"dew-flash-attn: {getattr(dew, '__file__', dew)}, built for {built}; {kernel} here")
    try:
        from jax_ragged_attn.backends.shared import extension

        lines.append("extension: " + ", ".join(f"{k} {v}" for k, v in extension.versions().items()))
    except Exception as error:  # noqa: BLE001 - a header line only
        lines.append(f"extension: {type(error).__name__}: {error}")
    return lines


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.peers",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--workloads",
        default=",".join(DEFAULT_ROWS),
        help=f"comma-separated rows (default {','.join(DEFAULT_ROWS)}; hd64, hd256, mla alias W4-d64, W4-d256, MLA)",
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated of {', '.join(SYSTEMS)}")
    parser.add_argument("--calls", type=int, default=None, help=f"jitted calls per timed loop (default {CALLS})")
    parser.add_argument("--loops", type=int, default=None, help=f"timed loops, median reported (default {LOOPS})")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"CPU smoke run: each row as a tiny shape of its head dims, {QUICK_CALLS} calls, {QUICK_LOOPS} loops",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="time a row's JAX cells together: each of --loops rounds runs one loop of every "
        "cell, the median round reported (drift moves every column alike)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="measurements not started within this many seconds are rows saying so: the table "
        "still prints (leave a command's limit room for the last measurement)",
    )
    parser.add_argument("--out", default=None, help="directory for peers.json and table.md (default: none)")
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="PEERS_JSON",
        help="measure nothing: print one table of these runs' peers.json (--out's), in order",
    )
    args = parser.parse_args(argv)
    unknown = [s for s in args.systems.split(",") if s.strip() and s.strip() not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.merge:
        print(merged(args.merge), flush=True)
        return 0
    # torch (raw cuDNN) shares the GPU with JAX: no 75 % preallocation (read when JAX makes its GPU client).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    rows = [workload(n.strip()) for n in args.workloads.split(",") if n.strip()]
    if args.quick:
        rows = [quick(w) for w in rows]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    calls = args.calls or (QUICK_CALLS if args.quick else CALLS)
    loops = args.loops or (QUICK_LOOPS if args.quick else LOOPS)
    timing = f"timing: a plain loop of {calls} jitted calls then one block, per call; " + (
        f"{loops} rounds, each one loop of every JAX cell of the row, the median round "
        f"(benchmarks/timing.py interleaved_loop_seconds; raw cuDNN: the median of {loops} loops)"
        if args.interleave
        else f"median of {loops} loops (benchmarks/timing.py median_loop_seconds)"
    )
    header = environment() + [timing]
    print("\n".join(header), flush=True)
    started = time.perf_counter()
    cells = measure(rows, systems, calls, loops, Budget(args.time_budget), interleave=args.interleave)
    titles = [(w.name, title(w)) for w in rows]
    text = table(cells, titles, systems)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "peers.json"), "w") as f:
            json.dump(
                {
                    "header": header,
                    "rows": [dict(name=n, title=t) for n, t in titles],
                    "systems": systems,
                    "cells": [c.as_dict() for c in cells],
                },
                f,
                indent=1,
            )
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write("\n".join(header) + "\n\n" + text + "\n")
    print(f"\n{len(rows)} rows in {time.perf_counter() - started:.0f} s\n", flush=True)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
