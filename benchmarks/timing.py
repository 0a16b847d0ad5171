"""Timing of a JAX attention by two methods, reported side by side (the `method` column).

    fori   one jitted call runs `jax.lax.fori_loop` over N steps; the call's time divided by N
    plain  what a training loop does: a Python loop of N calls of the jitted op, then block_until_ready;
           the loop's time divided by N (asynchronous dispatch lets the host run ahead of the device)

Both report the median of `iterations` timed calls (plain: timed loops). docs/PERFORMANCE.md ("Two timing
methods") explains why they differ and which one a training step sees. Every timed loop of the bench tools
(and of the main job) is `plain_loop_seconds`, the library's (backends/tuning.py, autotune's), re-exported
here with `median_loop_seconds`, `interleaved_loop_seconds` and `device_bytes` from jax_ragged_attn/tools/bench.py.

fori: each timed call runs `jax.lax.fori_loop` over N steps and is divided by N, so Python dispatch never sits
between two steps. Three things keep XLA from measuring less than a real training step would:
  - One element of q toggles in place every step, so no call can be hoisted out of the loop; the integer
    index arrays get an update that keeps their values but that XLA cannot prove keeps them, so the op's
    own index arithmetic stays in the loop too. Both cost nothing next to attention, where a full-size
    elementwise op in the loop would cost a few percent and distort the comparison.
  - Outputs (and gradients) are carried through the loop and returned whole. Reading back one element
    instead lets XLA fuse the slice into whatever elementwise op follows the attention kernel, which then
    computes one element instead of the whole tensor: a masked `where` on the output would disappear.
  - The median of `iterations` timed calls is reported, after `warmup_calls` untimed ones.

Backward time is forward+backward minus forward (see `derive_backward`): a backward timed on its own from
precomputed residuals would let XLA hoist the op's index arithmetic, which a training step pays.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import statistics
import sys
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp

from benchmarks import capture as command_buffers
from jax_ragged_attn.ops.ragged import ragged_attention
from jax_ragged_attn.testing.workloads import Workload

# The one timing loop (plain_loop_seconds, the library's: autotune's choice uses it too) and the helpers the main
# job shares with the benchmarks come from the package's bench (jax_ragged_attn/tools/bench.py).
from jax_ragged_attn.tools.bench import device_bytes, interleaved_loop_seconds, median_loop_seconds, plain_loop_seconds  # noqa: F401


@dataclasses.dataclass(frozen=True)
class Settings:
    iterations: int = 20  # timed calls per measurement; the median is reported
    target_call_s: float = 0.02  # each timed call runs enough steps to last about this long
    max_steps: int = 200
    warmup_calls: int = 2  # untimed calls first: the first may capture CUDA graphs or load kernels
    assumed_flops_per_s: float = 3e14  # only to pick the number of steps before the first call
    methods: tuple[str, ...] = ("fori",)  # any of METHODS, each measured in turn


METHODS = ("fori", "plain")


@dataclasses.dataclass
class Measurement:
    """One row of the results: a (workload, system, direction) and what was measured, or why not."""

    workload: str
    system: str
    direction: str
    status: str = "ok"  # "ok", "skipped: <reason>" or "error: <message>"
    median_s: float | None = None  # per step
    min_s: float | None = None
    max_s: float | None = None
    iterations: int = 0
    steps: int = 0
    flops: float = 0.0
    workspace_bytes: int | None = None
    peak_bytes: int | None = None
    loop_copy_bytes: int | None = None  # full-size copies per loop step XLA added (should be 0)
    note: str = ""
    method: str = "fori"  # how it was timed: one of METHODS (last, so older JSON rows still load)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def tflops(self) -> float | None:
        return self.flops / self.median_s / 1e12 if self.ok and self.median_s and self.median_s > 0 else None


def error_status(error: BaseException) -> str:
    message = " ".join(str(error).split()) or "(no message)"
    return f"error: {type(error).__name__}: {message}"


def rows_with_status(workload: Workload, system: str, status: str, directions, methods=("fori",)) -> list[Measurement]:
    return [
        Measurement(workload.name, system, d, status=status, flops=workload.flops(d), method=m)
        for m in methods
        for d in directions
    ]


def steps_for(flops: float, settings: Settings) -> int:
    """Steps per timed call so that a call lasts about target_call_s (20 us per step for launch latency)."""
    step_s = flops / settings.assumed_flops_per_s + 2e-5
    return max(1, min(settings.max_steps, math.ceil(settings.target_call_s / step_s)))


def derive_backward(forward: Measurement, both: Measurement, workspace_bytes: int | None) -> Measurement:
    """The backward row: forward+backward minus forward, from the same steps-per-call timing method."""
    row = Measurement(
        forward.workload,
        forward.system,
        "backward",
        flops=both.flops - forward.flops,
        workspace_bytes=workspace_bytes,
        note="forward+backward minus forward",
        method=both.method,
    )
    if forward.ok and both.ok:
        row.median_s = both.median_s - forward.median_s
        row.iterations, row.steps = both.iterations, both.steps
        if row.median_s <= 0:  # possible on a tiny or noisy run: no figure rather than a wrong one
            row.status, row.median_s = "skipped: forward+backward was not slower than forward (timing noise)", None
    elif both.status.startswith("skipped") or forward.status.startswith("skipped"):
        row.status = both.status if both.status.startswith("skipped") else forward.status
    else:
        failed = forward if not forward.ok else both
        row.status = f"error: needs forward and forward+backward; {failed.direction} failed"
    return row


@dataclasses.dataclass(frozen=True)
class JaxCase:
    """A JAX system on one workload: its attention as a function, and the arrays to call it with."""

    attention: Callable  # (q, k, v, *index) -> out; traced inside the timing loop
    q: jax.Array
    k: jax.Array
    v: jax.Array
    index: tuple  # integer arrays the op reads each step (cu_seqlens, lengths, offsets)
    # Workspace bytes per direction from the op itself; None reads the cuDNN calls' scratch from the HLO.
    workspace_bytes: Callable[[str], int | None] | None = None


def _nudge(x: jax.Array, i) -> jax.Array:
    # One element toggles between two values each step, so nothing that reads x can be hoisted out of the
    # loop. A dynamic_update_slice of a value that does not read x: XLA does it in place. (`x.at[...]`
    # reading x, or bf16 arithmetic that CPU XLA upcasts, made it copy all of x every step.)
    value = jnp.where(i % 2 == 0, 0.5, -0.5).astype(x.dtype).reshape((1,) * x.ndim)
    return jax.lax.dynamic_update_slice(x, value, (0,) * x.ndim)


def _same_but_opaque(a: jax.Array, i) -> jax.Array:
    # min(a0, a0 + i) == a0 for the loop counter i >= 0, but XLA cannot prove it, so the op's index
    # arithmetic (offsets, row masks) is recomputed every step as a real training step recomputes it.
    first = a[(0,) * a.ndim]
    return a.at[(0,) * a.ndim].set(jnp.minimum(first, first + i.astype(a.dtype)))


def _forward_loop(attention, steps, q, k, v, index):
    out = jax.eval_shape(attention, q, k, v, *index)

    def step(i, carry):
        q, index, _ = carry
        q = _nudge(q, i)
        index = tuple(_same_but_opaque(a, i) for a in index)
        return q, index, attention(q, k, v, *index)

    return jax.lax.fori_loop(0, steps, step, (q, index, jnp.zeros(out.shape, out.dtype)))


def _forward_backward_loop(attention, steps, q, k, v, index, d_out):
    def step(i, carry):
        q, index, _ = carry
        q = _nudge(q, i)
        index = tuple(_same_but_opaque(a, i) for a in index)
        out, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, *index), q, k, v)
        return q, index, (out, *pullback(d_out))

    zeros = tuple(jnp.zeros(x.shape, x.dtype) for x in (d_out, q, k, v))
    return jax.lax.fori_loop(0, steps, step, (q, index, zeros))


def _call_seconds(compiled, args) -> float:
    return plain_loop_seconds(lambda: compiled(*args), 1, 1)[0]


_BYTES_PER_ELEMENT = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
_RESULT = re.compile(r"^\s*%?(\S+) = (\w+)\[([\d,]*)\]")


def _array_bytes(dtype: str, dims: str) -> int:
    return math.prod(int(d) for d in dims.split(",") if d) * _BYTES_PER_ELEMENT.get(dtype, 0)


def loop_copy_bytes(hlo: str, at_least: int = 1 << 20) -> int:
    """Bytes per step of copies into or out of a while loop's carried state (at least `at_least` each).

    XLA inserts such copies when a value cannot be written in place into the loop's carried buffer, e.g.
    if carrying an output forced a copy of it. That is work the loop adds, which a training step would not
    do: it should be 0. Layout copies inside an op's own computation (the xla path's transposes) do not
    read loop state directly and are not counted, nor are copies of a broadcast: XLA hoists a constant
    initial value (the xla path's zero accumulators) out of the loop and copies it in each step, in place
    of the broadcast a step would run anyway.
    """
    computations = command_buffers.computations(hlo)
    total = 0
    for body in set(re.findall(r"body=%?([\w.\-]+)", hlo)):
        lines = computations.get(body, [])
        state = {m.group(1) for line in lines if "get-tuple-element(" in line and (m := _RESULT.match(line))}
        root = next((line for line in lines if line.lstrip().startswith("ROOT") and " tuple(" in line), "")
        carried = set(re.findall(r"%([\w.\-]+)", root.split(" tuple(", 1)[1])) if root else set()
        for line in lines:
            result, source = _RESULT.match(line), re.search(r"\scopy\(%?([\w.\-]+)\)", line)
            if source and re.match(r"(wrapped_)?broadcast", source.group(1)):
                continue
            if result and source and (source.group(1) in state or result.group(1) in carried):
                size = _array_bytes(result.group(2), result.group(3))
                total += size if size >= at_least else 0
    return total


def cudnn_scratch_bytes(hlo: str) -> int | None:
    """Scratch (u8) outputs of the cuDNN calls in compiled HLO, or None if there are none to read."""
    sizes = []
    for line in hlo.splitlines():
        if "cudnn" in line.lower() and ("custom-call(" in line or "fusion(" in line) and " = " in line:
            result = line.split(" = ", 1)[1].split("custom-call(")[0].split("fusion(")[0]
            sizes += [int(n) for n in re.findall(r"u8\[(\d+)\]", result)]
    return sum(sizes) if sizes else None


def _workspace_bytes(case: JaxCase, direction: str) -> int | None:
    try:
        return case.workspace_bytes(direction)
    except Exception:  # noqa: BLE001 - a missing workspace figure must not discard a timing
        return None


def _single_forward(attention, q, k, v, index):
    return attention(q, k, v, *index)


def _single_forward_backward(attention, q, k, v, index, d_out):
    out, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, *index), q, k, v)
    return (out, *pullback(d_out))


def _time_plain(function, args, flops: float, settings: Settings):
    """(per-call seconds, calls per timed loop, the compiled executable) of the plain method."""
    jitted = jax.jit(function)  # called as users call it: jax.jit's C++ dispatch path, not Compiled.__call__
    compiled = jitted.lower(*args).compile()
    calls = steps_for(flops, settings)
    warm = min(_call_seconds(jitted, args) for _ in range(settings.warmup_calls))
    if warm > 3 * settings.target_call_s and calls > 1:
        calls = max(1, int(calls * settings.target_call_s / warm))
    times = plain_loop_seconds(lambda: jitted(*args), calls, settings.iterations)
    return times, calls, compiled


def _measure_direction(
    case: JaxCase,
    workload: Workload,
    system: str,
    direction: str,
    settings: Settings,
    on_compiled: Callable | None = None,
    method: str = "fori",
):
    flops = workload.flops(direction)
    if direction == "forward":
        loop, single, args = _forward_loop, _single_forward, (case.q, case.k, case.v, case.index)
    else:
        out = jax.eval_shape(case.attention, case.q, case.k, case.v, *case.index)
        d_out = jax.random.normal(jax.random.key(1), out.shape, out.dtype)
        loop, single = _forward_backward_loop, _single_forward_backward
        args = (case.q, case.k, case.v, case.index, d_out)
    if method == "plain":
        times, steps, compiled = _time_plain(functools.partial(single, case.attention), args, flops, settings)
        if on_compiled is not None:
            on_compiled(direction, compiled)
        return _row(case, workload, system, direction, method, times, steps, flops, compiled)
    if method != "fori":
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")

    def build(steps):
        compiled = jax.jit(functools.partial(loop, case.attention, steps)).lower(*args).compile()
        if on_compiled is not None:  # the last call of a direction sees the executable that is timed
            on_compiled(direction, compiled)
        return compiled

    steps = steps_for(flops, settings)
    compiled = build(steps)
    warm = min(_call_seconds(compiled, args) for _ in range(settings.warmup_calls))
    if warm > 3 * settings.target_call_s and steps > 1:  # far slower than assumed (the xla path): fewer steps
        steps = max(1, int(steps * settings.target_call_s / warm))
        compiled = build(steps)
        _call_seconds(compiled, args)
    times = [_call_seconds(compiled, args) / steps for _ in range(settings.iterations)]
    return _row(case, workload, system, direction, method, times, steps, flops, compiled)


def _row(case, workload, system, direction, method, times, steps, flops, compiled) -> Measurement:
    hlo = compiled.as_text() or ""
    workspace = _workspace_bytes(case, direction) if case.workspace_bytes else cudnn_scratch_bytes(hlo)
    return Measurement(
        workload.name,
        system,
        direction,
        median_s=statistics.median(times),
        min_s=min(times),
        max_s=max(times),
        iterations=len(times),
        steps=steps,
        flops=flops,
        workspace_bytes=workspace,
        peak_bytes=device_bytes(compiled),
        loop_copy_bytes=loop_copy_bytes(hlo) if method == "fori" else None,
        method=method,
    )


def measure_jax(
    case: JaxCase, workload: Workload, system: str, settings: Settings, on_compiled: Callable | None = None
) -> list[Measurement]:
    """Per method of settings.methods: forward and forward+backward measured, backward derived.

    A failing direction is reported, not raised. on_compiled(direction, compiled), if given, is called
    after each compilation of a timed executable.
    """
    return [
        row
        for method in settings.methods
        for row in _measure_method(case, workload, system, settings, on_compiled, method)
    ]


def _measure_method(case, workload, system, settings, on_compiled, method) -> list[Measurement]:
    rows = {}
    for direction in ("forward", "forward+backward"):
        try:
            rows[direction] = _measure_direction(case, workload, system, direction, settings, on_compiled, method)
        except Exception as error:  # noqa: BLE001 - one failing direction must not hide the other
            traceback.print_exc(file=sys.stderr)  # the row keeps the message; stderr keeps where it came from
            rows[direction] = Measurement(
                workload.name,
                system,
                direction,
                status=error_status(error),
                flops=workload.flops(direction),
                method=method,
            )
    backward_workspace = None
    if case.workspace_bytes:
        backward_workspace = _workspace_bytes(case, "backward")
    elif rows["forward"].workspace_bytes is not None and rows["forward+backward"].workspace_bytes is not None:
        backward_workspace = rows["forward+backward"].workspace_bytes - rows["forward"].workspace_bytes
    rows["backward"] = derive_backward(rows["forward"], rows["forward+backward"], backward_workspace)
    return [rows["forward"], rows["backward"], rows["forward+backward"]]


def host_overhead(
    workload: Workload, implementation: str, calls: int = 100, rounds: int = 7
) -> dict[str, tuple[float, float]]:
    """Host cost of a cached jitted ragged_attention call next to a jitted `q * 2` of the same shapes.

    On a workload this small the device finishes first, so back-to-back calls (no sync between them)
    measure what the host spends per call: JAX's dispatch, plus for the cuDNN path the FFI handler's
    graph-cache lookup and cuDNN's launch. The two functions are timed in alternating rounds (`calls`
    back-to-back calls, then `calls` calls each followed by a sync) and each figure is the median over the
    rounds: on a shared host the per-call baseline drifts by tens of microseconds over seconds, and timing
    one function fully before the other put that drift into their difference. Returns name -> (seconds
    per back-to-back call, seconds per call followed by a sync).
    """
    q, k, v, cu = workload.packed_inputs()
    attention = jax.jit(
        lambda q, k, v, cu: ragged_attention(
            q,
            k,
            v,
            cu,
            cu,
            max_seqlen_q=workload.max_seqlen,
            max_seqlen_kv=workload.max_seqlen,
            is_causal=workload.causal,
            implementation=implementation,
        )
    )
    trivial = jax.jit(lambda q, k, v, cu: q * 2)
    functions = {f"ragged_attention[{implementation}]": attention, "q * 2": trivial}
    for function in functions.values():
        for _ in range(3):
            jax.block_until_ready(function(q, k, v, cu))
    samples = {name: ([], []) for name in functions}
    for _ in range(rounds):
        for name, function in functions.items():

            def call():
                return function(q, k, v, cu)

            samples[name][0].extend(plain_loop_seconds(call, calls, 1))
            samples[name][1].append(statistics.median(plain_loop_seconds(call, 1, calls)))
    return {name: (statistics.median(a), statistics.median(b)) for name, (a, b) in samples.items()}


def matmul_rate(size: int, settings: Settings, method: str) -> float:
    """FLOP/s of a jitted [size, size] @ [size, size] bfloat16 matmul, timed by `method` like attention.

    The dense limit the "of limit" column divides by: what this device's matmul units reach in the same
    process and with the same harness, not a datasheet figure.
    """
    a, b = (jax.random.normal(key, (size, size), jnp.bfloat16) for key in jax.random.split(jax.random.key(2)))
    flops = 2.0 * size**3

    def matmul(a, b, _):
        return a @ b

    if method == "plain":
        times, _, _ = _time_plain(matmul, (a, b, b), flops, settings)
    elif method == "fori":
        steps = steps_for(flops, settings)
        compiled = jax.jit(functools.partial(_forward_loop, matmul, steps)).lower(a, b, b, ()).compile()
        for _ in range(settings.warmup_calls):
            _call_seconds(compiled, (a, b, b, ()))
        times = [_call_seconds(compiled, (a, b, b, ())) / steps for _ in range(settings.iterations)]
    else:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return flops / statistics.median(times)
