"""The configurations each backend is expected to decline, so that a test tells a designed decline from a
regression.

A backend declines a call it cannot serve with NotImplementedError (`backends.choose` names its reason). The
tests run every case on every backend, so some cases are declined by design (cuDNN and float32, FA3 and
softcap): those are skips. Any other decline is a failure: a change that made cuDNN decline a configuration
it served would otherwise pass CI as one more skip. `call` runs a test's call and tells the two apart:

- the backend cannot run here at all (no GPU, no extension, no wheel: its availability reason): a skip,
  the environment's, not a decline;
- the decline is in EXPECTED (its backend and op, a fragment of its reason, and a predicate on the call's
  configuration that must hold too): a skip naming the entry and the reason;
- anything else: AssertionError with the backend's reason and the configuration.

Each entry follows the backend's own check (`source`); an upstream bug the loaded release has is a decline by
design where backends/shared/known_issues.py fences it (its table lists them). The checks:
backends/cudnn/graphs.py unsupported_reason and cudnn/ragged.py stats_gradient_unsupported (cuDNN,
ragged_attention); backends/cudnn/kvcache.py and paged.py static_reason (cuDNN, the KV-cache op, whose contiguous
caches may run as a ragged call: its ragged entries apply to that call's configuration); backends/fa3/ragged.py
and backends/fa3/kvcache.py unsupported_reason. The xla path declines nothing. A decline added to a backend is
added here with the predicate that says which configurations it covers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable
from typing import Any
from unittest import mock

from jax_ragged_attn import backends


@dataclasses.dataclass(frozen=True)
class Decline:
    """One configuration class a backend declines by design."""

    backend: str  # "cudnn", "fa3"
    op: str  # "ragged" (ragged_attention and every wrapper of it) or "kvcache" (ragged_attention_with_kvcache)
    says: str  # a fragment of the backend's reason
    when: Callable  # config (AttentionConfig / KVCacheConfig) -> bool: the configurations it covers
    source: str  # where the backend decides it


def _bounded(config) -> bool:
    return config.left_bound is not None or config.right_bound is not None


def _cudnn_dtype(config) -> bool:
    from jax_ragged_attn.backends.cudnn.graphs import CUDNN_DTYPES

    return config.dtype not in CUDNN_DTYPES


def _cudnn_head_dims(config) -> bool:
    from jax_ragged_attn.backends.cudnn.graphs import MAX_HEAD_DIM

    return any(dim % 8 or dim > MAX_HEAD_DIM for dim in (config.head_dim_qk, config.head_dim_v))


def _cudnn_too_large(config) -> bool:
    """Even one query head per call passes the int32 ragged offsets (extents.py's arithmetic)."""
    from jax_ragged_attn.backends.cudnn import extents

    return extents.groups(config) is None or extents.groups(config, stats_gradient=True) is None


def _cudnn_stats_gradient_too_wide(config) -> bool:
    from jax_ragged_attn.backends.cudnn.graphs import MAX_HEAD_DIM
    from jax_ragged_attn.backends.shared.stats_grad import EXTRA_COLUMNS

    return config.head_dim_v + EXTRA_COLUMNS > MAX_HEAD_DIM


def _window_splits_badly(tail: Callable[[Any], int]) -> Callable:
    """A left window that reaches past a sequence's head into its last `tail(config)` rows but not through them
    (shared/head_tail.py window_reason's condition)."""

    def when(config) -> bool:
        left = config.left_bound
        return left is not None and left < tail(config) < left + config.seqlen_q

    return when


def _cudnn_kvcache_tail(config) -> int:
    from jax_ragged_attn.backends.cudnn import kvcache

    return kvcache.tail(config)


def _fa3_kvcache_tail(config) -> int:
    from jax_ragged_attn.backends.fa3 import kvcache

    return kvcache.tail(config)


def _fa3_module():
    from jax_ragged_attn.backends.fa3 import ragged

    return ragged


def _as_ragged(config):
    """The ragged call cuDNN runs a contiguous cache as (cudnn/kvcache.py ragged_config)."""
    from jax_ragged_attn.backends.cudnn import kvcache

    return kvcache.ragged_config(config)


def _cudnn_paged_window(config) -> bool:
    """The paged graph's window decline, where the call takes the paged route (cudnn/kvcache.py route: a paged
    cache, the route pinned, or a contiguous cache whose ragged call cuDNN declines too)."""
    from jax_ragged_attn.backends.cudnn import kvcache

    return _window_splits_badly(_cudnn_kvcache_tail)(config) and kvcache.route(config) == "paged"


def _fenced(backend: str, op: str) -> Callable:
    """Where backends/shared/known_issues.py fences the call off: an upstream bug of the loaded release (its
    TABLE is the list of those declines, each with its version range, GPU and feature)."""

    def when(config) -> bool:
        from jax_ragged_attn.backends.shared import known_issues

        return known_issues.fence(backend, op, config) is not None

    return when


def _fenced_stats_gradient(config) -> bool:
    """Where the backward a stats cotangent runs (Dv widened by 16 columns) is fenced off."""
    from jax_ragged_attn.backends.shared import known_issues, stats_grad

    return known_issues.fence("cudnn", "ragged", stats_grad.widened_config(config)) is not None


def _fa3_dtype(config) -> bool:
    return config.dtype not in _fa3_module().FA3_DTYPES


def _fa3_head_dims(config) -> bool:
    return _fa3_module().FA3_HEAD_DIM != config.head_dim_qk or _fa3_module().FA3_HEAD_DIM != config.head_dim_v


def _dew_head_dims(config) -> bool:
    from jax_ragged_attn.backends.fa3 import dew

    return config.head_dim_qk != config.head_dim_v or config.head_dim_qk not in dew.HEAD_DIMS


def _fa3_packed_tile_rows(config) -> int:
    from jax_ragged_attn.backends.fa3 import kvcache

    return kvcache.packed_tile_rows(config)


_CUDNN = "backends/cudnn/graphs.py unsupported_reason"
_CUDNN_KVCACHE = "backends/cudnn/kvcache.py unsupported_reason, paged.py static_reason"
_FA3 = "backends/fa3/ragged.py unsupported_reason"
_DEW = "backends/fa3/dew.py unsupported_reason"
_FA3_KVCACHE = "backends/fa3/kvcache.py unsupported_reason"
_FA3_PACKED = "backends/fa3/kvcache.py packed_reason"

EXPECTED = (
    # cuDNN, ragged_attention
    Decline("cudnn", "ragged", "takes bfloat16 or float16 inputs", _cudnn_dtype, _CUDNN),
    Decline("cudnn", "ragged", "head dims that are multiples of 8 up to", _cudnn_head_dims, _CUDNN),
    Decline("cudnn", "ragged", "ragged offsets are int32", _cudnn_too_large, _CUDNN + " (extents.py)"),
    Decline(
        "cudnn",
        "ragged",
        "which has a known bug there",
        _fenced("cudnn", "ragged"),
        _CUDNN + " (shared/known_issues.py fence)",
    ),
    Decline(
        "cudnn",
        "ragged",
        "which has a known bug there",
        _fenced_stats_gradient,
        "backends/cudnn/launch.py stats_gradient_unsupported (the widened backward's fence)",
    ),
    Decline(
        "cudnn",
        "ragged",
        "cannot differentiate through stats",
        _cudnn_stats_gradient_too_wide,
        "backends/cudnn/launch.py stats_gradient_unsupported (Dv + 16 value columns)",
    ),
    # cuDNN, ragged_attention_with_kvcache
    Decline("cudnn", "kvcache", "takes bfloat16 or float16 inputs", _cudnn_dtype, _CUDNN_KVCACHE),
    Decline("cudnn", "kvcache", "head dims that are multiples of 8 up to", _cudnn_head_dims, _CUDNN_KVCACHE),
    Decline(
        "cudnn",
        "kvcache",
        "page sizes that are powers of 2",
        lambda c: c.paged and c.page_size & (c.page_size - 1) != 0,
        _CUDNN_KVCACHE,
    ),
    Decline("cudnn", "kvcache", "of at most 2**31 - 1 rows", lambda c: c.capacity > 2**31 - 1, _CUDNN_KVCACHE),
    Decline(
        "cudnn",
        "kvcache",
        "which has a known bug there",
        _fenced("cudnn", "kvcache"),
        "backends/cudnn/kvcache.py paged_reason (shared/known_issues.py fence)",
    ),
    Decline(
        "cudnn",
        "kvcache",
        "packed queries (cu_seqlens_q) over a paged cache take cuDNN",
        lambda c: c.packed,
        "backends/cudnn/kvcache.py packed_version_reason (cuDNN < 9.8)",
    ),
    Decline(
        "cudnn",
        "kvcache",
        "reaches into the rows cuDNN's paged graph reads",
        _cudnn_paged_window,
        "backends/cudnn/kvcache.py paged_reason (shared/head_tail.py window_reason)",
    ),
    # FlashAttention-3, ragged_attention (fa3/providers.py): dew-flash-attn's declines, both providers', then
    # flash-attn3-jax's
    Decline("fa3", "ragged", "kernels are built without softcap", lambda c: bool(c.softcap), _DEW),
    Decline("fa3", "ragged", "kernels take equal head dims of", _dew_head_dims, _DEW),
    Decline("fa3", "ragged", "backward has no deterministic mode", lambda c: bool(c.deterministic), _DEW),
    Decline("fa3", "ragged", "FlashAttention-3 takes bfloat16 or float16 inputs", _fa3_dtype, _FA3 + ", " + _DEW),
    Decline(
        "fa3",
        "ragged",
        "aligns its causal mask and windows bottom-right",
        lambda c: _bounded(c) and c.diagonal_alignment == "top_left",
        _FA3 + " (alignment_reason), " + _DEW,
    ),
    Decline("fa3", "ragged", "called with softcap 0", lambda c: bool(c.softcap), _FA3),
    Decline("fa3", "ragged", "kernels are built for head dim", _fa3_head_dims, _FA3),
    # FlashAttention-3, ragged_attention_with_kvcache
    Decline("fa3", "kvcache", "called with softcap 0", lambda c: bool(c.softcap), _FA3_KVCACHE),
    Decline("fa3", "kvcache", "FlashAttention-3 takes bfloat16 or float16 inputs", _fa3_dtype, _FA3_KVCACHE),
    Decline("fa3", "kvcache", "kernels are built for head dim", _fa3_head_dims, _FA3_KVCACHE),
    Decline(
        "fa3",
        "kvcache",
        "reaches into the rows FA3 reads",
        _window_splits_badly(_fa3_kvcache_tail),
        "backends/fa3/kvcache.py unsupported_reason (shared/head_tail.py window_reason)",
    ),
    # Packed queries (cu_seqlens_q) of the KV-cache op
    Decline(
        "fa3",
        "kvcache",
        "FA3 serves packed queries in tiles of at most",
        lambda c: c.packed and c.group_size > _fa3_packed_tile_rows(c),
        _FA3_PACKED,
    ),
    Decline(
        "fa3",
        "kvcache",
        "packed queries with keys right of the diagonal",
        lambda c: c.packed and c.right_bound != 0 and c.seqlen_q * c.group_size > _fa3_packed_tile_rows(c),
        _FA3_PACKED,
    ),
)


def _provider_reasons(reason: str) -> list[str]:
    """The reasons of each FA3 provider in a decline that joins them (fa3/providers.py unsupported_reason:
    "dew-flash-attn: ...; flash-attn3-jax: ..."), or [reason]."""
    from jax_ragged_attn.config import FA3_PROVIDERS

    pattern = "(?:^|; )(?:" + "|".join(re.escape(name) for name in FA3_PROVIDERS) + "): "
    parts = [part for part in re.split(pattern, reason) if part]
    return parts if re.match(pattern, reason) else [reason]


def expected(backend: str, op: str, config, reason: str) -> Decline | None:
    """The entry of EXPECTED that covers this decline, or None. cuDNN's KV-cache op runs a contiguous cache as
    a ragged call: a ragged reason there is held to the ragged entries, on that call's configuration. A decline
    joining several FA3 providers' reasons is expected where each of them is."""
    parts = _provider_reasons(reason)
    if len(parts) > 1:
        entries = [expected(backend, op, config, part) for part in parts]
        return entries[0] if all(entries) else None
    for entry in EXPECTED:
        if (entry.backend, entry.op) == (backend, op) and entry.says in reason and entry.when(config):
            return entry
    if (backend, op) == ("cudnn", "kvcache") and not config.paged and not config.packed:
        return expected("cudnn", "ragged", _as_ragged(config), reason)
    return None


def unavailable_reason(backend: str) -> str | None:
    """Why `backend` cannot run here at all (no GPU, extension or wheel), or None."""
    if backend == "cudnn":
        from jax_ragged_attn.backends.shared import extension

        return extension.cudnn_unavailable_reason()
    if backend == "fa3":
        from jax_ragged_attn.backends.fa3 import providers

        return providers.unavailable_reason()
    return None


@dataclasses.dataclass(frozen=True)
class Declined:
    """A decline backends.unsupported_reason reported: which backend, for which op and configuration, why."""

    backend: str
    op: str
    config: object
    reason: str


def _registered_as(module) -> tuple[str, str]:
    """(the implementation name, the op) a backend module is registered as: its registry entry, not its path
    (fa3/providers.py is implementation="fa3" of ragged_attention)."""
    for op, registry in backends.REGISTRIES.items():
        for name, path in registry.items():
            if path == module.__name__:
                return name, op
    raise LookupError(f"{module.__name__} is in no registry of jax_ragged_attn/backends/__init__.py")


@contextlib.contextmanager
def recorded():
    """The declines backends.unsupported_reason reports while the block runs (choose asks it for every
    backend it considers), and cuDNN's stats_gradient_unsupported (its backward asks it when a stats cotangent
    arrives), in a list."""
    seen = []
    original = backends.unsupported_reason

    def recording(backend, config, index, **kwargs):
        reason = original(backend, config, index, **kwargs)
        if reason is not None:
            seen.append(Declined(*_registered_as(backend), config, reason))
        return reason

    from jax_ragged_attn.backends.cudnn import launch

    stats_gradient_unsupported = launch.stats_gradient_unsupported

    def recording_stats_gradient(config):  # cuDNN's backward asks this itself, when a stats cotangent comes
        reason = stats_gradient_unsupported(config)
        if reason is not None:
            seen.append(Declined("cudnn", "ragged", config, reason))
        return reason

    with (
        mock.patch.object(backends, "unsupported_reason", recording),
        mock.patch.object(launch, "stats_gradient_unsupported", recording_stats_gradient),
    ):
        yield seen


def verdict(implementation: str, error: NotImplementedError, seen: list[Declined]) -> str:
    """The skip message for `error` where it is `implementation` declining as expected (or unable to run
    here); raises AssertionError for a decline EXPECTED does not name, and re-raises `error` where it is no
    backend's decline (a feature the op refuses: the test's own business)."""
    declined = [d for d in seen if d.backend == implementation and d.reason in str(error)]
    if not declined:
        raise error
    decline = declined[-1]
    unavailable = unavailable_reason(decline.backend)
    if unavailable is not None and decline.reason == unavailable:
        return f"{implementation} cannot run here: {unavailable}"
    entry = expected(decline.backend, decline.op, decline.config, decline.reason)
    if entry is None:
        raise AssertionError(
            f"{implementation} declined a configuration that jax_ragged_attn/testing/declines.py does not list as "
            f"declined by design (a regression, or a decline to list there with its predicate): "
            f"{decline.reason}\nconfiguration: {decline.config}"
        ) from error
    return f"{implementation} declines this configuration by design ({entry.source}): {decline.reason}"


def call(backend: str, f: Callable, /, *args, skip: Callable[[str], None], **kwargs):
    """f(*args, **kwargs); a decline by `backend` is skip(reason) where EXPECTED lists it (or the backend cannot
    run here), an AssertionError naming the reason where it does not."""
    with recorded() as seen:
        try:
            return f(*args, **kwargs)
        except NotImplementedError as error:
            message = verdict(backend, error, seen)
    skip(message)
    raise AssertionError(f"skip({message!r}) returned")  # pytest.skip and skipTest raise
