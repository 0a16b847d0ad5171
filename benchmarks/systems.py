"""The systems the benchmark compares, each a way to run the same packed attention.

    raw-cudnn   cudnn-frontend's Python module with torch tensors: the ragged graph this package builds,
                with no JAX around it. The ceiling (bench_cudnn_raw.py).
    raw-cudnn-padded  the same, its backward without max_total_seq_len (intermediates padded to
                [B, H, max_seqlen]: strategy.py's faster layout)
    ours-hm     ragged_attention(implementation="cudnn"), stats head-major [H, T]
    ours-tm     the same with stats token-major [T, H]
    ours-lean   ours-hm with strategy="lean_memory": the backward's intermediates sized by the token capacity
    jax-padded  jax.nn.dot_product_attention(implementation="cudnn") on the batch padded to
                [B, max_len, H, D], with query/key_value_seq_lengths
    jax-packed  JAX's own packed cuDNN path (q_offsets / kv_offsets of
                jax._src.cudnn.fused_attention_stablehlo.dot_product_attention), one row of B segments
    xla         ragged_attention(implementation="xla"), the portable path; only where its padded
                [B, H, S, S] float32 scores stay small (W3 and tiny)
    ours-fa3    ragged_attention(implementation="fa3"): FlashAttention-3 behind this op (_fa3.py); the optional
                flash-attn3-jax wheel, Hopper, head dim 128
    flash-attn3-jax  the wheel's own flash_mha_varlen (FlashAttention-3 as XLA FFI targets), no wrapper of ours

Each system answers why it cannot run here (`unavailable`), why it cannot run a workload (`unsupported`),
and measures one workload (`measure`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import cudnn_raw as bench_cudnn_raw
from benchmarks.timing import JaxCase, Measurement, Settings, measure_jax
from jax_ragged_attn import ragged_attention
from jax_ragged_attn.backends.cudnn import ragged as cudnn
from jax_ragged_attn.backends.fa3 import ragged as _fa3
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.config import AttentionOptions, make_config
from jax_ragged_attn.testing.workloads import Workload

# The xla path holds several [B, H, S, S] float32 tensors at once in its backward; past this size per
# tensor it is minutes per step or out of memory, and it is not the comparison anyone needs.
XLA_SCORES_LIMIT_BYTES = 4_000_000_000


@dataclasses.dataclass(frozen=True)
class System:
    name: str
    description: str
    unavailable: Callable[[], str | None]  # why it cannot run on this machine at all, or None
    unsupported: Callable[[Workload], str | None]  # why it cannot run this workload, or None
    measure: Callable[[Workload, Settings], list[Measurement]]
    runs_on_cpu: bool = False  # False: a GPU system (cuDNN, FA3, torch), left out of the table elsewhere


def _needs_gpu() -> str | None:
    backend = jax.default_backend()
    return None if backend == "gpu" else f"needs a CUDA GPU; JAX's backend is {backend!r}"


def _any_workload(_workload: Workload) -> None:
    return None


def _jax_system(
    name: str,
    description: str,
    case: Callable[[Workload], JaxCase],
    unavailable,
    unsupported=_any_workload,
    runs_on_cpu: bool = False,
) -> System:
    def measure(workload: Workload, settings: Settings) -> list[Measurement]:
        return measure_jax(case(workload), workload, name, settings)

    return System(name, description, functools.cache(unavailable), unsupported, measure, runs_on_cpu)


# ---- this package ----------------------------------------------------------------------------------------


def _ours_case(
    workload: Workload, *, implementation: str, stats_layout: str = "head_major", strategy: str = "fastest"
) -> JaxCase:
    q, k, v, cu = workload.packed_inputs()
    options = dict(max_seqlen_q=workload.max_seqlen, max_seqlen_kv=workload.max_seqlen, is_causal=workload.causal)

    def attention(q, k, v, cu):
        return ragged_attention(
            q, k, v, cu, cu, stats_layout=stats_layout, implementation=implementation, strategy=strategy, **options
        )

    def workspace_bytes(direction: str) -> int:
        config = make_config(
            q,
            k,
            v,
            cu,
            cu,
            AttentionOptions(is_causal=workload.causal, stats_layout=stats_layout, strategy=strategy),
            max_seqlen_q=workload.max_seqlen,
            max_seqlen_kv=workload.max_seqlen,
        )
        graphs = {"forward": ("forward",), "backward": ("backward",), "forward+backward": ("forward", "backward")}
        return sum(cudnn.graph_info(g, config)["workspace_bytes"] for g in graphs[direction])

    return JaxCase(attention, q, k, v, (cu,), workspace_bytes if implementation == "cudnn" else None)


def _xla_unsupported(workload: Workload) -> str | None:
    scores = workload.num_seqs * workload.num_heads_q * workload.max_seqlen**2 * 4
    if scores > XLA_SCORES_LIMIT_BYTES:
        return (
            f"the xla path materialises [B, H, S, S] float32 scores: {scores / 1e9:.1f} GB here, over this "
            f"benchmark's {XLA_SCORES_LIMIT_BYTES / 1e9:.0f} GB limit"
        )
    return None


# ---- jax.nn.dot_product_attention on the padded batch --------------------------------------------------


def _padded(x: jax.Array, workload: Workload) -> jax.Array:
    """[T, H, D] packed -> [B, max_len, H, D], zeros past each sequence's end."""
    cu = workload.cu_seqlens()
    positions = np.arange(workload.max_seqlen)
    rows = np.minimum(cu[:-1, None] + positions[None, :], workload.total_tokens - 1)
    inside = positions[None, :] < np.asarray(workload.seqlens)[:, None]
    return jnp.where(jnp.asarray(inside)[:, :, None, None], x[jnp.asarray(rows)], jnp.zeros((), x.dtype))


def _jax_padded_case(workload: Workload) -> JaxCase:
    q, k, v, _ = workload.packed_inputs()
    lengths = jnp.asarray(workload.seqlens, jnp.int32)

    def attention(q, k, v, lengths):
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            is_causal=workload.causal,
            query_seq_lengths=lengths,
            key_value_seq_lengths=lengths,
            implementation="cudnn",
        )

    return JaxCase(attention, _padded(q, workload), _padded(k, workload), _padded(v, workload), (lengths,))


# ---- JAX's packed cuDNN path ----------------------------------------------------------------------------

_PACKED_PARAMETERS = ("q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "scale", "mask_type", "qkv_layout")


def _jax_packed_api():
    """(dot_product_attention, MaskType) of JAX's private cuDNN module; raises with the reason if absent."""
    from jax._src.cudnn import fused_attention_stablehlo as fused  # private: checked, not assumed

    function, mask_type = getattr(fused, "dot_product_attention", None), getattr(fused, "MaskType", None)
    if function is None or mask_type is None:
        raise NotImplementedError("jax._src.cudnn.fused_attention_stablehlo has no dot_product_attention/MaskType")
    parameters = inspect.signature(function).parameters
    missing = [p for p in _PACKED_PARAMETERS if p not in parameters]
    if missing:
        raise NotImplementedError(f"its dot_product_attention{inspect.signature(function)} lacks {missing}")
    return function, mask_type


def _jax_packed_unavailable() -> str | None:
    reason = _needs_gpu()
    if reason is not None:
        return reason
    try:
        _jax_packed_api()
    except Exception as error:  # noqa: BLE001 - any failure to find the private API is a reason to skip
        return f"JAX's packed cuDNN API is not usable here: {error}"
    return None


def _jax_packed_case(workload: Workload) -> JaxCase:
    function, mask_type = _jax_packed_api()
    q, k, v, cu = workload.packed_inputs()
    # One batch row holding B segments: seqlen [1, B], offsets [1, B + 1] (JAX pads both with -1 when rows
    # hold fewer segments; ours hold exactly B).
    lengths = jnp.asarray(workload.seqlens, jnp.int32)[None, :]
    offsets = cu[None, :]
    mask = mask_type.PADDING_CAUSAL if workload.causal else mask_type.PADDING

    def attention(q, k, v, lengths, offsets):
        out = function(
            q,
            k,
            v,
            q_seqlen=lengths,
            kv_seqlen=lengths,
            q_offsets=offsets,
            kv_offsets=offsets,
            scale=1.0 / math.sqrt(workload.head_dim),
            mask_type=mask,
            qkv_layout="BTNH",
        )
        return out[0] if isinstance(out, (tuple, list)) else out

    return JaxCase(attention, q[None], k[None], v[None], (lengths, offsets))


# ---- FlashAttention-3 (the optional flash-attn3-jax wheel) ----------------------------------------------


def _fa3_unsupported(workload: Workload) -> str | None:
    if workload.head_dim != _fa3.FA3_HEAD_DIM:
        return (
            f"the {_fa3.WHEEL} wheel's kernels take head dim {_fa3.FA3_HEAD_DIM} only, this workload "
            f"{workload.head_dim}"
        )
    return None


def _fa3_raw_unavailable() -> str | None:
    reason = _fa3.unavailable_reason()
    if reason is not None:
        return reason
    try:
        import flash_attn3_jax  # noqa: F401 - the wheel's own Python wrapper
    except Exception as error:  # noqa: BLE001
        return f"the {_fa3.WHEEL} wheel's Python wrapper does not import: {type(error).__name__}: {error}"
    return None


def _fa3_raw_case(workload: Workload) -> JaxCase:
    from flash_attn3_jax import flash_mha_varlen

    q, k, v, cu = workload.packed_inputs()

    def attention(q, k, v, cu):
        return flash_mha_varlen(
            q,
            k,
            v,
            cu,
            cu,
            max_seqlen_q=workload.max_seqlen,
            max_seqlen_k=workload.max_seqlen,
            is_causal=workload.causal,
        )

    return JaxCase(attention, q, k, v, (cu,))


# ---- the registry ---------------------------------------------------------------------------------------


def _raw_measure(workload: Workload, settings: Settings) -> list[Measurement]:
    return bench_cudnn_raw.measure(workload, settings)


def _raw_padded_measure(workload: Workload, settings: Settings) -> list[Measurement]:
    return bench_cudnn_raw.measure(workload, settings, bench_cudnn_raw.PADDED_SYSTEM, padded_intermediates=True)


SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System(
            "raw-cudnn",
            "cudnn-frontend Python + torch, the same ragged graph: the ceiling",
            functools.cache(bench_cudnn_raw.unavailable_reason),
            _any_workload,
            _raw_measure,
        ),
        System(
            bench_cudnn_raw.PADDED_SYSTEM,
            "the same without max_total_seq_len: backward intermediates padded",
            functools.cache(bench_cudnn_raw.unavailable_reason),
            _any_workload,
            _raw_padded_measure,
        ),
        _jax_system(
            "ours-hm",
            "ragged_attention(implementation='cudnn'), stats head-major",
            functools.partial(_ours_case, implementation="cudnn", stats_layout="head_major"),
            extension.cudnn_unavailable_reason,
        ),
        _jax_system(
            "ours-lean",
            "the same with strategy='lean_memory' (backward sized by the token capacity)",
            functools.partial(_ours_case, implementation="cudnn", strategy="lean_memory"),
            extension.cudnn_unavailable_reason,
        ),
        _jax_system(
            "ours-tm",
            "ragged_attention(implementation='cudnn'), stats token-major",
            functools.partial(_ours_case, implementation="cudnn", stats_layout="token_major"),
            extension.cudnn_unavailable_reason,
        ),
        _jax_system(
            "jax-padded",
            "jax.nn.dot_product_attention(implementation='cudnn'), padded [B, S, H, D]",
            _jax_padded_case,
            _needs_gpu,
        ),
        _jax_system(
            "jax-packed", "JAX's packed cuDNN path (q_offsets/kv_offsets)", _jax_packed_case, _jax_packed_unavailable
        ),
        _jax_system(
            "xla",
            "ragged_attention(implementation='xla'), the portable path",
            functools.partial(_ours_case, implementation="xla"),
            lambda: None,
            _xla_unsupported,
            runs_on_cpu=True,
        ),
        _jax_system(
            "ours-fa3",
            "ragged_attention(implementation='fa3'): FlashAttention-3 behind this op",
            functools.partial(_ours_case, implementation="fa3"),
            _fa3.unavailable_reason,
            _fa3_unsupported,
        ),
        _jax_system(
            "flash-attn3-jax",
            "the flash-attn3-jax wheel's flash_mha_varlen, FlashAttention-3 unwrapped",
            _fa3_raw_case,
            _fa3_raw_unavailable,
            _fa3_unsupported,
        ),
    )
}


def select(spec: str) -> list[System]:
    """Systems named by a comma-separated list, or "all"."""
    if spec.strip() == "all":
        return list(SYSTEMS.values())
    names = [t.strip() for t in spec.split(",") if t.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        raise ValueError(f"unknown system(s) {unknown or spec!r}; choose from {', '.join(SYSTEMS)} or 'all'")
    return [SYSTEMS[n] for n in dict.fromkeys(names)]
