"""The kernels behind the ops, and the registry that picks one for a call.

Three kernel families, each a package serving both ops (`ragged.py` for ragged_attention, `kvcache.py` for
ragged_attention_with_kvcache) with its private helpers beside them, and what several families share:

    cudnn/     cuDNN's fused SDPA graphs through this package's C++ FFI extension
    fa3/       FlashAttention-3 (Hopper) from an optional wheel, its provider: dew-flash-attn or flash-attn3-jax
    xla/       pure JAX: serves every call, everywhere (the portable fallback and the tests' second reference)
    shared/    the extension, head groups, the stats-gradient formula, row zeroing, the KV-cache index clamp,
               attention over a cache in jnp, the head/tail split; imported by any family, importing none

Families never import each other (tests/test_layout.py holds it). Each op's backend surface is a Protocol
in protocol.py (RaggedBackend, KVCacheBackend); every registered module satisfies its op's.

`REGISTRIES` maps each op to its backends in preference order, each imported when first asked for, and `OPS`
to how implementation=None chooses among them (OpSpec). Adding a backend is a module and one line here.
`choose` serves implementation=None and names the reason when a requested backend cannot serve the call;
policy.py holds the measured policy and tuning.py the autotune between GPU kernels.
"""

from __future__ import annotations

import dataclasses
import importlib

from jax_ragged_attn.backends import policy

# Preference order for implementation=None: the first that is an automatic candidate and serves the call.
REGISTRY = {
    # A candidate where the measured policy prefers it (providers.auto_candidate); its provider: fa3_provider, or
    # the first installed that serves (providers.PROVIDERS).
    "fa3": "jax_ragged_attn.backends.fa3.providers",
    "cudnn": "jax_ragged_attn.backends.cudnn.ragged",
    "xla": "jax_ragged_attn.backends.xla.ragged",  # serves everything, everywhere: the portable fallback
}
FALLBACK = "xla"

# ragged_attention_with_kvcache's backends, in the same preference order.
KVCACHE = {
    "fa3": "jax_ragged_attn.backends.fa3.kvcache",  # FlashAttention-3's kvcache kernels (contiguous and paged)
    "cudnn": "jax_ragged_attn.backends.cudnn.kvcache",  # cuDNN: paged SDPA graph, or the ragged kernel (contiguous)
    "xla": "jax_ragged_attn.backends.xla.kvcache",  # blocked online softmax in jnp: serves everything
}
REGISTRIES = {"ragged": REGISTRY, "kvcache": KVCACHE}


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """How implementation=None chooses among one op's backends (REGISTRIES[op], in preference order).

    measured: the shipped policy applies (policy.py): JAX_RAGGED_ATTN_IMPLEMENTATION pins a backend, every
    candidate is asked (autotune=True times the GPU kernels that serve), and a GPU call left to the fallback
    warns. Otherwise the first candidate that serves runs."""

    measured: bool
    fallback: str = FALLBACK


OPS = {"ragged": OpSpec(measured=True), "kvcache": OpSpec(measured=False)}


def get(name: str, op: str = "ragged"):
    """The backend module registered as `name` for `op`; NotImplementedError where `op` has none of that name."""
    if name not in REGISTRIES[op]:
        raise NotImplementedError(
            f"implementation={name!r} does not serve {op} calls (its backends: {', '.join(REGISTRIES[op])})"
        )
    return importlib.import_module(REGISTRIES[op][name])


def _auto_candidate(backend, config) -> bool:
    return getattr(backend, "auto_candidate", lambda config: True)(config)


def unsupported_reason(backend, config, index, *, stats_gradient: bool = False) -> str | None:
    """Why `backend` cannot serve this call, or None (its unsupported_reason, then its stats gradient's)."""
    reason = (
        backend.unsupported_reason(config, index)
        if getattr(backend, "READS_INDEX", False)
        else backend.unsupported_reason(config)
    )
    if reason is None and stats_gradient and hasattr(backend, "stats_gradient_unsupported"):
        reason = backend.stats_gradient_unsupported(config)
    return reason


def choose(implementation: str | None, config, index, *, stats_gradient: bool = False, op: str = "ragged"):
    """The backend module that runs this call. A named implementation that cannot serve it raises
    NotImplementedError with the reason; implementation=None takes the first automatic candidate in the op's
    registry that serves it, as its OpSpec says (measured: the pin, with autotune=True the measured faster of
    the GPU kernels that serve it, and a warning on a GPU when only the portable fallback is left)."""
    spec = OPS[op]
    if implementation is not None:
        backend = get(implementation, op)
        reason = unsupported_reason(backend, config, index, stats_gradient=stats_gradient)
        if reason is not None:
            raise NotImplementedError(f"implementation={implementation!r} cannot serve this call: {reason}")
        return backend
    if spec.measured:
        pin = policy.pinned()
        if pin is not None:
            if pin not in REGISTRIES[op]:
                raise ValueError(f"{policy.ENV_VAR} must name one of {tuple(REGISTRIES[op])}, got {pin!r}")
            if unsupported_reason(get(pin, op), config, index, stats_gradient=stats_gradient) is None:
                policy.report(pin, config, f"pinned by {policy.ENV_VAR}")
                return get(pin, op)
    serving: list[tuple[str, object]] = []  # (name, backend)
    declined: list[tuple[str, str]] = []  # (name, reason)
    for name in REGISTRIES[op]:
        backend = get(name, op)
        if name == spec.fallback or not _auto_candidate(backend, config):
            continue
        reason = unsupported_reason(backend, config, index, stats_gradient=stats_gradient)
        (declined if reason else serving).append((name, reason or backend))
        if serving and not spec.measured:
            return backend
    if not serving:
        if spec.measured:
            from jax_ragged_attn.backends.xla.memory import warn_cudnn_fallback

            reasons = dict(declined)
            reason = reasons.get("cudnn") or next(iter(reasons.values()), "no GPU kernel serves it")
            warn_cudnn_fallback(reason, config)
            policy.report(spec.fallback, config, reason)
        return get(spec.fallback, op)
    names = [name for name, _ in serving]
    if config.autotune and {"cudnn", "fa3"} <= set(names):
        from jax_ragged_attn.backends import tuning

        name = tuning.faster(config, index)
        policy.report(name, config, "measured faster (autotune=True)")
        return get(name, op)
    policy.report(serving[0][0], config, "the first serving candidate of the policy (backends/policy.py)")
    return serving[0][1]
