"""autotune=True with implementation=None: run whichever of cuDNN and FlashAttention-3 is faster for this shape.

"FlashAttention-3" is implementation="fa3" with the provider it would run (fa3/providers.py: dew-flash-attn's
kernels where they serve the call, else the flash-attn3-jax wheel's); the one timed is the `provider` below, and
a choice stored for one provider is never read for the other. The scratch call has no seqused, so dew is timed
on its one-gap-a-slot layout (fa3/dew.py PAIRED); a call with seqused runs its three-a-slot layout, a little
slower: the stored choice does not tell them apart.

Where both can serve a call (FA3: an optional wheel, a Hopper GPU, head dim 128, or 64 to 256 with dew's,
16-bit inputs), neither is faster everywhere: cuDNN leads on many short sequences and FA3 on long ones
(docs/PERFORMANCE.md#against-every-peer). So with autotune the choice is measured once per configuration: a
jitted forward + backward of each, on scratch buffers shaped as the call (equal-length sequences filling the
capacities, the way cudnn/autotune.py times cuDNN's plans) made inside the step as a model makes them, timed
as a user's loop meets it (CALLS calls, then one block; the median of SAMPLES such loops after a warm-up).
cuDNN, which serves every semantic the op has, is kept unless FA3 is faster by more than autotune.MARGIN.

The choice is stored beside cuDNN's plan choices (same file, see cudnn/autotune.py), keyed by GPU model, cuDNN,
cudnn-frontend and flash-attn3-jax versions and every field of the configuration that reaches a kernel, so
a later process reuses it without measuring. Measuring happens at trace time, on a thread of its own (so no
enclosing jit trace captures the scratch computation), and synchronises the device.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

from jax_ragged_attn.config import AttentionConfig
from jax_ragged_attn.features.stacklevel import users_stacklevel

CALLS = 5  # calls per timed loop (plain dispatch, one block at the end)
SAMPLES = 7  # timed loops; their median is the figure
DIRECTION = "implementation"  # the cache entries' kind, beside cuDNN's "forward" / "backward" plan choices
# How the timed step gets its inputs (see _step); in the key, so choices timed on jit arguments are not
# reused.
TIMED_INPUTS = "computed"

FLASH_ATTN3_JAX = "flash-attn3-jax"  # the provider whose wheel version every key holds (_versions)

_lock = threading.Lock()
_chosen: dict[str, dict] = {}  # key -> entry, this process


def _versions() -> tuple[list, str]:
    """([GPU model, cuDNN version, cudnn-frontend version], flash-attn3-jax version or "none")."""
    import importlib.metadata

    import jax

    from jax_ragged_attn.backends.shared import extension

    ext = extension.module()
    try:
        fa3_version = importlib.metadata.version("flash-attn3-jax")
    except importlib.metadata.PackageNotFoundError:
        fa3_version = "none"
    gpu = jax.devices("gpu")[0].device_kind if jax.default_backend() == "gpu" else "none"
    return [gpu, ext.cudnn_version(), list(ext.frontend_version)], fa3_version


# Config fields neither GPU kernel's timing depends on: the xla path's blocks.
UNTIMED_FIELDS = ("xla_block_size",)


def timed_config(config: AttentionConfig) -> AttentionConfig:
    """The configuration both candidates are timed with: separate q, k, v (packing only changes how the
    gradients are assembled), no sinks (an epilogue the same on both), cuDNN's plans as the call tunes them."""
    return dataclasses.replace(config, packing="none", has_sinks=False)


def _dew_version() -> str:
    import importlib.metadata

    from jax_ragged_attn.backends.fa3 import dew

    try:
        return importlib.metadata.version(dew.WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def key(config: AttentionConfig, same_index: bool, provider: str = FLASH_ATTN3_JAX) -> str:
    # Laid out as cuDNN's plan entries ([gpu, cudnn, frontend, kind, attributes]), the FA3 provider's wheel
    # version among the attributes; other providers' entries name their provider too (flash-attn3-jax's keys
    # name none, so the choices already stored for it stay valid).
    versions, fa3_version = _versions()
    fields = dataclasses.asdict(timed_config(config))
    for name in UNTIMED_FIELDS + ("fa3_provider",):  # so that a stored choice stays valid whatever they are
        fields.pop(name)
    wheel = (
        dict(fa3_wheel=fa3_version)
        if provider == FLASH_ATTN3_JAX
        else dict(fa3_build=provider, fa3_wheel=_dew_version())
    )
    return json.dumps(
        [*versions, DIRECTION, dict(sorted(fields.items()), **wheel, same_cu_seqlens=same_index, inputs=TIMED_INPUTS)]
    )


def choose(cudnn_ms: float, fa3_ms: float) -> str:
    """ "fa3" only when it is faster than cuDNN by more than autotune.MARGIN (timing noise is about 1 %)."""
    from jax_ragged_attn.backends.cudnn import autotune

    return "fa3" if fa3_ms < cudnn_ms * (1 - autotune.MARGIN) else "cudnn"


def _scratch(config: AttentionConfig, same_index: bool):
    """Random q, k, v, an output cotangent and cu_seqlens of equal-length sequences filling the capacities."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def cu(capacity, max_seqlen):
        length = max(1, min(max_seqlen, capacity // config.num_seqs))
        return jnp.asarray(np.arange(config.num_seqs + 1, dtype=np.int32) * length)

    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [
        (config.capacity_q, config.num_heads_q, config.head_dim_qk),
        (config.capacity_kv, config.num_heads_kv, config.head_dim_qk),
        (config.capacity_kv, config.num_heads_kv, config.head_dim_v),
        (config.capacity_q, config.num_heads_q, config.head_dim_v),
    ]
    q, k, v, d_out = (jax.random.normal(key, shape, config.dtype) for key, shape in zip(keys, shapes))
    cu_q = cu(config.capacity_q, config.max_seqlen_q)
    cu_kv = cu_q if same_index else cu(config.capacity_kv, config.max_seqlen_kv)
    return (q, k, v, d_out), cu_q, cu_kv


def _step(implementation: str, config: AttentionConfig, cu_q, cu_kv):
    """A jitted forward + backward (the output's cotangent given) through one implementation."""
    import jax

    from jax_ragged_attn import backends
    from jax_ragged_attn.index import RaggedIndex

    def attend(q, k, v):
        # Each backend's attend, as the op calls it (cuDNN: a call past the int32 offsets as its head groups).
        return backends.get(implementation).attend((q, k, v), RaggedIndex(cu_q, cu_kv), config)[0]

    def step(q, k, v, d_out, scale):
        # The tuned call runs inside a model's step, where q, k, v and the output's cotangent are intermediates
        # (a projection's output, a later layer's gradient), not jit arguments: made here the same way, so
        # FA3's padding clearing zeroes them in place as it would there, instead of being timed with XLA's
        # copies of arguments, which reverse the order on short sequences
        # (docs/PERFORMANCE.md#what-the-measurements-found, "The FA3 / cuDNN policy").
        q, k, v, d_out = (x * scale.astype(x.dtype) for x in (q, k, v, d_out))
        out, pullback = jax.vjp(attend, q, k, v)
        return out, pullback(d_out)

    return jax.jit(step)


def plain_loop_seconds(call, calls: int, repetitions: int) -> list[float]:
    """Seconds per call of `repetitions` timed loops, each `calls` calls of `call()` then one block_until_ready
    of the last result: what a training loop meets (JAX dispatches asynchronously, so the host enqueues call
    n+1 while the device runs call n, and only the last result is waited for). `call` may thread state
    between calls (a training step feeds its donated parameters back in); calls=1 times single blocked calls.

    The package's one timing loop: autotune's choice here, and every tool through benchmarks/timing.py
    (a tool may import the library, the library never a tool)."""
    import jax

    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        for _ in range(calls):
            out = call()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return times


def median_loop_seconds(fn, args, calls: int = CALLS, samples: int = SAMPLES) -> float:
    """Seconds per call of fn(*args) as a user's loop meets it: after a compiling warm-up call, `samples` loops
    of `calls` calls each followed by one block; the median loop's time / calls."""
    import jax

    jax.block_until_ready(fn(*args))
    return statistics.median(plain_loop_seconds(lambda: fn(*args), calls, samples))


def _loop_ms(step, args) -> float:
    return median_loop_seconds(step, args) * 1e3


def measure(config: AttentionConfig, same_index: bool, provider: str = FLASH_ATTN3_JAX) -> dict:
    """Times cuDNN and FA3 through `provider` now (no cache) and returns the entry that would be stored (fa3_ms:
    FA3's time)."""
    from jax_ragged_attn import backends
    from jax_ragged_attn.index import RaggedIndex

    config = dataclasses.replace(timed_config(config), fa3_provider=provider)
    buffers, cu_q, cu_kv = _scratch(config, same_index)
    reason = backends.get("fa3").unsupported_reason(config, RaggedIndex(cu_q, cu_kv))
    if reason is not None:  # e.g. a top-left mask the scratch lengths cannot prove: nothing to compare
        return dict(implementation="cudnn", fa3_declined=reason)
    import jax.numpy as jnp

    args = (*buffers, jnp.float32(1))
    times = {name: _loop_ms(_step(name, config, cu_q, cu_kv), args) for name in ("cudnn", "fa3")}
    return dict(implementation=choose(times["cudnn"], times["fa3"]), cudnn_ms=times["cudnn"], fa3_ms=times["fa3"])


def _measure_outside_any_trace(config: AttentionConfig, same_index: bool, provider: str = FLASH_ATTN3_JAX) -> dict:
    # JAX's current trace is thread-local: on a fresh thread the scratch computation runs eagerly even when
    # the call being tuned is being traced under jit.
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(measure, config, same_index, provider).result()


def entry(config: AttentionConfig, same_index: bool, provider: str = FLASH_ATTN3_JAX) -> dict:
    """The stored choice for this configuration: from this process, else the disk cache, else measured now."""
    from jax_ragged_attn.backends.cudnn import autotune

    def measure():
        try:
            return _measure_outside_any_trace(config, same_index, provider), True
        except Exception as error:  # noqa: BLE001 - e.g. no memory for scratch: keep cuDNN, say why
            warnings.warn(
                f"timing cuDNN against FlashAttention-3 failed, using cuDNN: {type(error).__name__}: {error}",
                RuntimeWarning,
                stacklevel=users_stacklevel(),
            )
            return dict(implementation="cudnn", failed=f"{type(error).__name__}: {error}"), False

    return autotune.remembered(key(config, same_index, provider), _chosen, _lock, measure)


def faster(config: AttentionConfig, index) -> str:
    """ "cudnn" or "fa3": the measured faster of the two for this call (both can serve it), FA3 timed through the
    provider that would run it."""
    from jax_ragged_attn.backends.fa3 import providers

    same_index = index.cu_seqlens_q is index.cu_seqlens_kv
    provider = providers.provider(config, index)
    assert provider is not None  # FA3 serves the call: some provider does
    return entry(config, same_index, provider)["implementation"]
