"""Check mode (check=True or JAX_RAGGED_ATTN_CHECK=1): input data the op would drop or clamp is an error.

Without it, cu_seqlens are clamped monotone into the buffers (index.sanitize_cu_seqlens) and segments past
max_segments are treated as padding: no kernel addresses outside its buffers, the query rows of a sequence
whose index data is invalid read NaN (index.invalid_sequences, ops/common.loud), and
`return_overflow=True` counts what was dropped (overflow.py). With check mode, such data stops the
computation with a `RaggedAttentionInputError` (a ValueError) naming the argument, the index and the values.
The problem finders here test on the host the conditions index/ and overflow.py test on the device.

Concrete values (an eager call) are checked on the host here and raise as they are; traced ones are checked by
a `jax.pure_callback` whose result is the checked array, so the kernels wait for it. Under jit the error reaches
the caller wrapped in jaxlib's runtime error, whose type depends on jax's dispatch path and whose first line
jaxlib fixes; the last line is the check's message (the comment above `check_callback` says why and how;
`input_errors()` re-raises it as RaggedAttentionInputError).

Host-resident inputs (NumPy arrays) cost nothing to read, so they are checked when the call is traced
whatever the mode: check mode raises, otherwise a `RaggedAttentionInputWarning` says what will be dropped.
"""

from __future__ import annotations

import _thread
import contextlib
import dataclasses
import functools
import logging
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jax_ragged_attn.features.stacklevel import users_stacklevel
from jax_ragged_attn.index import host_slots

ENV_VAR = "JAX_RAGGED_ATTN_CHECK"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


class RaggedAttentionInputError(ValueError):
    """Input data that the op would drop, cut or clamp, found in check mode (see the module docstring)."""


class RaggedAttentionInputWarning(UserWarning):
    """Host-resident (NumPy) input data that the op will drop, cut or clamp, found outside check mode."""


class _OneLineForInputErrors(logging.Filter):
    """JAX logs a failed callback's whole traceback before raising its own exception; for our input errors
    that record becomes one line with the message, so it is not a second traceback in front of the error."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, RaggedAttentionInputError):
            record.msg, record.args = f"{type(error).__name__}: {error}", ()
            record.exc_info = record.exc_text = None
        return True


logging.getLogger("jax._src.callback").addFilter(_OneLineForInputErrors())


@contextlib.contextmanager
def input_errors():
    """Re-raises a check-mode failure that XLA delivered wrapped (see the module docstring) as
    `RaggedAttentionInputError` carrying only its message; every other exception passes unchanged.

        with input_errors():
            loss = jax.block_until_ready(train_step(params, batch))   # read the result inside

    Also a decorator (`@input_errors()`). Results are computed asynchronously: read them inside the block.
    """
    try:
        yield
    except RaggedAttentionInputError:
        raise
    except (ValueError, RuntimeError) as error:
        message = input_error_message(error)
        if message is None:
            raise
        raise RaggedAttentionInputError(message) from None


# How a check raises. Where the values are concrete (an eager call), they are checked on the host right here
# and the error is raised from this module, as a plain Python exception. Under a trace (jit, vmap, grad), the
# check is a `jax.pure_callback` whose result *is* the checked array, copied back unchanged by a NumPy function
# that raises on bad values. Why this one (jax 0.10.2, CPU):
#
# - The attention consumes the callback's result, so it cannot start before the check has passed, and a
#   raising callback aborts the XLA program (a later op that depends on it never runs). `jax.debug.callback`
#   returns nothing to depend on: the kernels could run on the bad values while the check is still pending.
# - It composes with jit, vmap (the check receives the batched [..., B + 1] array once), grad, custom_vjp,
#   lax.scan and jax.checkpoint. `io_callback` carries an effect, which `jax.checkpoint` rejects ("Effects
#   not supported in partial-eval of `checkpoint`/`remat`"); `jax.experimental.buffer_callback` wraps an
#   error exactly as pure_callback does.
# - `jax.experimental.checkify` (and jax's error_check, not public in jax 0.10) make the caller wrap the
#   function and raise the error themselves; forgetting that would silently drop the check, the failure we
#   are here to prevent.
#
# What the user sees under a trace: XLA carries the callback's exception as text, so the exception raised
# where the jitted call runs (or, with asynchronous dispatch, where a result is read) is jaxlib's:
# `JaxRuntimeError` on a jitted function's first call (and where a result is read), `ValueError` on its later
# calls (jit's C++ fast path). Its text is jaxlib's "INTERNAL: CpuCallback error calling callback: " and then
# the Python exception as nanobind renders it: "Traceback (most recent call last):", one line per frame from
# the outermost caller down, and "RaggedAttentionInputError: <the message>" last. Neither the first line nor
# the type can be changed from Python (jaxlib formats them in C++, and a raised Python exception always has a
# traceback), so the callback keeps the rest short: it raises the error with a traceback of one frame, made by
# raising it once in a thread of its own (`_with_one_frame`), and the text is three lines, the third naming
# the argument, the index and the values:
#
#     INTERNAL: CpuCallback error calling callback: Traceback (most recent call last):
#       File ".../jax_ragged_attn/features/checks.py", line 123, in check_mode_input_error
#     RaggedAttentionInputError: cu_seqlens_q is invalid: it decreases at index 2: cu_seqlens_q[1] = 3 > ...
#
# (the same last line is the last one Python prints for an uncaught error). JAX also logs the callback's
# traceback at ERROR level before raising; a filter on JAX's callback logger (_OneLineForInputErrors) turns
# that record into one line with the message, so the first line on stderr says what is wrong. Where the
# callback runs inside our own call (a transformation outside jit: jax.vmap, jax.grad of an eager function),
# the error is re-raised as `RaggedAttentionInputError` there. Code that wants the dedicated type under jit
# wraps the call (and the read of its result) in `input_errors()`, which re-raises such a failure as
# `RaggedAttentionInputError` with only the message. A pure_callback whose result is unused is dead code and
# is removed with it, so only values that reach a kernel are checked. On a GPU each check is one small
# device-to-host round trip and a stream sync.
def check_callback(check, result_shape_dtypes, *args, vmap_method: str):
    """`jax.pure_callback(check, ...)` for a check that raises RaggedAttentionInputError: the error leaves the
    callback with a one-frame traceback (so XLA's text of it is three lines, see above), and
    where the callback runs inside this call (a transformation outside jit) it arrives unwrapped."""

    def run(*values):
        try:
            return check(*values)
        except RaggedAttentionInputError as error:
            raise _with_one_frame(error) from None

    with input_errors():
        return jax.pure_callback(run, result_shape_dtypes, *args, vmap_method=vmap_method)


def _with_one_frame(error: BaseException) -> BaseException:
    """`error`, raised once in a thread of its own, so that its traceback holds that one frame and no caller.
    Raised again from the callback, its deepest frame stays this one, and nanobind (which XLA's message
    comes from) walks callers from the deepest frame: the text shows one frame instead of every frame from the
    user's script through jax's dispatch and callback machinery to the check."""
    error.__traceback__ = None
    done = _thread.allocate_lock()
    done.acquire()

    def check_mode_input_error():
        try:
            raise error
        except BaseException:  # noqa: BLE001 - raised only to give it this frame's traceback
            pass
        finally:
            done.release()

    _thread.start_new_thread(check_mode_input_error, ())
    done.acquire()  # released by the thread once the error holds its traceback
    return error


def input_error_message(error: BaseException) -> str | None:
    """The message of a RaggedAttentionInputError carried inside `error` (as XLA's text), or None."""
    if isinstance(error, RaggedAttentionInputError):
        return str(error)
    marker = f"{RaggedAttentionInputError.__name__}: "
    text = str(error)
    at = text.rfind(marker)
    return None if at < 0 else text[at + len(marker) :].strip()


def check_enabled(check: bool | None) -> bool:
    """An explicit check=True/False wins; None reads JAX_RAGGED_ATTN_CHECK (read at trace time).

    An unrecognised value raises rather than meaning "off": a typo must not silently disable the checks.
    """
    if check is not None:
        if not isinstance(check, (bool, np.bool_)):  # check="false" must not mean "on"
            raise ValueError(f"check must be True, False or None, got {check!r}")
        return bool(check)
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{ENV_VAR} must be one of {_TRUE + _FALSE[1:]} (or unset), got {os.environ[ENV_VAR]!r}")


def cu_seqlens_problems(cu: np.ndarray, name: str, capacity: int, max_seqlen: int, bound: str) -> list[str]:
    """What is wrong with one [B + 1] cu_seqlens, first offending index of each kind."""
    cu = cu.astype(np.int64)
    problems = []
    if cu[0] != 0:
        problems.append(f"{name}[0] = {cu[0]}, must be 0")
    lengths = np.diff(cu)
    if (lengths < 0).any():
        i = int(np.argmax(lengths < 0))
        problems.append(f"it decreases at index {i + 1}: {name}[{i}] = {cu[i]} > {name}[{i + 1}] = {cu[i + 1]}")
    if (cu > capacity).any():
        i = int(np.argmax(cu > capacity))
        problems.append(f"{name}[{i}] = {cu[i]} is past the capacity {capacity} (rows of the packed buffer)")
    if (lengths > max_seqlen).any():
        i = int(np.argmax(lengths > max_seqlen))
        problems.append(
            f"sequence {i} has {lengths[i]} tokens ({name}[{i + 1}] - {name}[{i}] = {cu[i + 1]} - "
            f"{cu[i]}), more than {bound} = {max_seqlen}"
        )
    return problems


def segment_problems(ids: np.ndarray, max_segments: int, max_seqlen: int) -> list[str]:
    """What segments.ragged_attention_segments would drop or cut from one [R, S] segment_ids."""
    seq = ids.shape[1]
    real = ids > 0
    previous = np.concatenate([ids[:, :1], ids[:, :-1]], axis=1)
    starts = (real & ((np.arange(seq) == 0) | (ids != previous))).reshape(-1)
    first = np.flatnonzero(starts)  # flat index of each segment's first token, row-major
    segment = np.cumsum(starts) - 1
    lengths = np.bincount(segment[real.reshape(-1)], minlength=first.size)
    problems = []
    if first.size > max_segments:
        r, t = divmod(int(first[max_segments]), seq)
        problems.append(
            f"segment_ids hold {first.size} segments, more than max_segments = {max_segments}: segments "
            f"{max_segments} to {first.size - 1} (row-major) would be dropped, the first of them "
            f"at segment_ids[{r}, {t}] = {ids[r, t]}"
        )
    if (lengths > max_seqlen).any():
        i = int(np.argmax(lengths > max_seqlen))
        r, t = divmod(int(first[i]), seq)
        problems.append(
            f"segment {i} (segment_ids[{r}, {t}:{t + lengths[i]}] = {ids[r, t]}) has {lengths[i]} "
            f"tokens, more than max_seqlen = {max_seqlen}"
        )
    return problems


def _first_invalid(values: tuple, element_ranks: tuple, message_of) -> str | None:
    """What message_of(*element, where=...) says of the first element of `values` (NumPy arrays, one call's
    arguments) it finds invalid, or None. Under vmap the arrays carry the same leading mapped axes, and
    `where` names the mapped element."""
    for index in np.ndindex(values[0].shape[: values[0].ndim - element_ranks[0]]):
        message = message_of(*(v[index] for v in values), where=f" (vmapped element {index})" if index else "")
        if message:
            return message
    return None


def _named(name: str, problems_of):
    """message_of for one array: "<name> is invalid: <problems>. Got <values>", or None without problems."""

    def message_of(values, *, where):
        problems = problems_of(values)
        if not problems:
            return None
        got = np.array2string(values, threshold=32, max_line_width=10**6).replace("\n", "")
        return f"{name} is invalid{where}: " + "; ".join(problems) + f". Got {got}"

    return message_of


def _warn(values: np.ndarray, element_rank: int, name: str, problems_of, *, counted: bool = True) -> None:
    """A RaggedAttentionInputWarning naming `name` if `problems_of` finds anything in host-resident `values`."""
    _warn_first((values,), (element_rank,), _named(name, problems_of), counted=counted)


def _warn_first(values: tuple, element_ranks: tuple, message_of, *, counted: bool = True) -> None:
    """A RaggedAttentionInputWarning with what message_of says of the first invalid element of host-resident
    `values` (_first_invalid); `counted`: the op's return_overflow counts such data."""
    message = _first_invalid(values, element_ranks, message_of)
    if message:
        # The attention ops (counted) make the rows of a sequence with invalid index data NaN (ops/common.loud).
        warnings.warn(
            message
            + (
                ". The op clamps this data and the query rows it concerns read NaN (check=True raises instead"
                if counted
                else ". The op drops or clamps this data (check=True raises instead"
            )
            + ("; return_overflow=True counts it)" if counted else ")"),
            RaggedAttentionInputWarning,
            stacklevel=users_stacklevel(),
        )


def _checked(arrays: tuple, element_ranks: tuple, message_of) -> tuple:
    """`arrays`, unchanged, once the host found them valid together (message_of(*element, where=...) says
    nothing); otherwise the computation stops with a RaggedAttentionInputError (see the module docstring).
    Concrete values are checked here and now, traced ones by one pure_callback over all of them. Every check
    of check mode, of both ops, is this: its caller brings the problem finder."""

    def check_on_host(*values):
        values = tuple(np.asarray(v) for v in values)
        message = _first_invalid(values, element_ranks, message_of)
        if message:
            raise RaggedAttentionInputError(message)
        return values

    if not any(isinstance(x, jax.core.Tracer) for x in arrays):
        check_on_host(*arrays)
        return tuple(arrays)
    result = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays)
    # broadcast_all: under vmap some may be unbatched (one set of slots, batched seqused); the check needs all
    # with the same leading axes, and must return full-size results.
    return tuple(check_callback(check_on_host, result, *arrays, vmap_method="broadcast_all"))


def _bound_name(name: str) -> str:
    return name.replace("cu_seqlens", "max_seqlen") if "cu_seqlens" in name else "max_seqlen"


def checked_cu_seqlens(cu_seqlens: jax.Array, *, name: str, capacity: int, max_seqlen: int) -> jax.Array:
    """cu_seqlens, unchanged, once a host check has found it valid; otherwise the computation stops with a
    RaggedAttentionInputError.

    Valid means: starts at 0, never decreases, never exceeds `capacity` (the packed buffer's rows) and no
    sequence is longer than `max_seqlen`. Works eagerly and under jit, vmap, grad and checkpoint.
    """
    problems_of = functools.partial(
        cu_seqlens_problems, name=name, capacity=int(capacity), max_seqlen=int(max_seqlen), bound=_bound_name(name)
    )
    return _checked((cu_seqlens,), (1,), _named(name, problems_of))[0]


def seqused_problems(
    cu: np.ndarray, seqused: np.ndarray, name: str, seqused_name: str, capacity: int, max_seqlen: int, bound: str
) -> list[str]:
    """What is wrong with one [B + 1] cu_seqlens (the slots' offsets) and its [B] seqused: the offsets as for
    cu_seqlens but a slot may exceed max_seqlen; seqused within [0, slot length] and at most max_seqlen."""
    problems = cu_seqlens_problems(cu, name, capacity, np.iinfo(np.int64).max, bound)
    seqused = seqused.astype(np.int64)
    slots = np.diff(cu.astype(np.int64))
    if (seqused < 0).any():
        i = int(np.argmax(seqused < 0))
        problems.append(f"{seqused_name}[{i}] = {seqused[i]} is negative")
    if (seqused > slots).any():
        i = int(np.argmax(seqused > slots))
        problems.append(
            f"{seqused_name}[{i}] = {seqused[i]} is more than the slot's {slots[i]} rows ({name}[{i + 1}] - "
            f"{name}[{i}] = {cu[i + 1]} - {cu[i]})"
        )
    if (seqused > max_seqlen).any():
        i = int(np.argmax(seqused > max_seqlen))
        problems.append(f"{seqused_name}[{i}] = {seqused[i]} is more than {bound} = {max_seqlen}")
    return problems


def checked_seqused(
    cu_seqlens: jax.Array, seqused: jax.Array, *, name: str, seqused_name: str, capacity: int, max_seqlen: int
):
    """(cu_seqlens, seqused), unchanged, once a host check has found them valid together (seqused_problems);
    otherwise the computation stops with a RaggedAttentionInputError naming the argument."""

    def message_of(cu, used, *, where):
        problems = seqused_problems(cu, used, name, seqused_name, int(capacity), int(max_seqlen), _bound_name(name))
        if not problems:
            return None
        return (
            f"{name} / {seqused_name} are invalid{where}: "
            + "; ".join(problems)
            + f". Got {name} = {cu.tolist()}, {seqused_name} = {used.tolist()}"
        )

    return _checked((cu_seqlens, seqused), (1, 1), message_of)


def checked_segment_ids(segment_ids: jax.Array, *, max_segments: int, max_seqlen: int) -> jax.Array:
    """segment_ids [R, S], unchanged, once a host check has found no more than `max_segments` segments and
    none longer than `max_seqlen`; otherwise the computation stops with a RaggedAttentionInputError."""
    problems_of = functools.partial(segment_problems, max_segments=int(max_segments), max_seqlen=int(max_seqlen))
    return _checked((segment_ids,), (2,), _named("segment_ids", problems_of))[0]


def _lengths_outside(lengths: np.ndarray, capacity: int, what: str) -> list[str]:
    """The first cache_seqlens entry outside [0, capacity], as a problem sentence (none: [])."""
    return [
        f"cache_seqlens[{b}] = {lengths[b]} is outside [0, {capacity}] ({what})"
        for b in np.flatnonzero((lengths < 0) | (lengths > capacity))[:1]
    ]


def _first_bad_entry(page_table: np.ndarray, touched: np.ndarray, num_pages: int) -> tuple[int, int] | None:
    """(b, p) of the first page-table entry outside [0, num_pages) among those `touched` marks, or None."""
    bad = touched & ((page_table < 0) | (page_table >= num_pages))
    if not bad.any():
        return None
    b, p = np.argwhere(bad)[0]
    return int(b), int(p)


def cache_index_problems(lengths: np.ndarray, page_table: np.ndarray | None, config) -> list[str]:
    """What is wrong with one ragged_attention_with_kvcache call's cache_seqlens [B] and page_table
    [B, max_pages] (None: contiguous); config its KVCacheConfig (index/kvcache.py)."""
    problems = []
    lengths = lengths.astype(np.int64)
    where = (
        "k_cache.shape[1]"
        if not config.paged
        else f"page_table.shape[1] * page_size = {config.max_pages} * {config.page_size}"
    )
    problems += _lengths_outside(lengths, config.capacity, f"the capacity, {where}")
    if page_table is not None:
        used = (np.clip(lengths, 0, config.capacity) + config.page_size - 1) // config.page_size  # [B]
        needed = np.arange(config.max_pages)[None, :] < used[:, None]
        bad = _first_bad_entry(page_table, needed, config.num_pages)
        if bad is not None:
            b, p = bad
            problems.append(
                f"page_table[{b}, {p}] = {page_table[b, p]} is outside [0, num_pages = "
                f"{config.num_pages}) (k_cache.shape[0]) and holds rows {p * config.page_size}.."
                f"{(p + 1) * config.page_size - 1} that sequence {b} uses (cache_seqlens[{b}] = "
                f"{lengths[b]})"
            )
    return problems


def _cache_index_message(config):
    def message_of(lengths, table=None, *, where):
        problems = cache_index_problems(lengths, table, config)
        return "KV cache index invalid" + where + ": " + "; ".join(problems) if problems else None

    return message_of


def checked_cache_index(cache_seqlens: jax.Array, page_table: jax.Array | None, config):
    """(cache_seqlens, page_table), unchanged, once a host check has found them valid together
    (cache_index_problems); otherwise the computation stops with a RaggedAttentionInputError."""
    message_of = _cache_index_message(config)
    arrays = (cache_seqlens,) if page_table is None else (cache_seqlens, page_table)
    checked = _checked(arrays, (1, 2)[: len(arrays)], message_of)
    return checked[0], (None if page_table is None else checked[1])


def warn_cu_seqlens_on_host(cu_seqlens, *, name: str, capacity: int, max_seqlen: int) -> None:
    """Outside check mode: a RaggedAttentionInputWarning if host-resident (NumPy) cu_seqlens will be clamped
    or cut. Device arrays and traced values are left alone: reading them would cost a round trip."""
    if isinstance(cu_seqlens, np.ndarray):
        _warn(
            cu_seqlens,
            1,
            name,
            functools.partial(
                cu_seqlens_problems,
                name=name,
                capacity=int(capacity),
                max_seqlen=int(max_seqlen),
                bound=_bound_name(name),
            ),
        )


def _on_host(*arrays) -> bool:
    """Every one of `arrays` (None: absent) is a NumPy array, read at trace time for free."""
    return all(x is None or isinstance(x, np.ndarray) for x in arrays)


def warn_segment_ids_on_host(segment_ids, *, max_segments: int, max_seqlen: int) -> None:
    """Outside check mode: a RaggedAttentionInputWarning if host-resident (NumPy) segment_ids will lose
    segments or tokens."""
    if isinstance(segment_ids, np.ndarray):
        _warn(
            segment_ids,
            2,
            "segment_ids",
            functools.partial(segment_problems, max_segments=int(max_segments), max_seqlen=int(max_seqlen)),
        )


# Guard mode of the cuDNN path (on with check=True): GUARD_BYTES past the end of the workspace the graph
# reported, and GUARD_ROWS rows before and after every output, filled with CANARY bytes before the call
# and verified after it.
GUARD_BYTES = 4096
GUARD_ROWS = 8
CANARY = 0xA5
_UINTS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _count_clobbered(band, *, description: str) -> np.ndarray:
    band = np.asarray(band)
    clobbered = int(np.count_nonzero(band != CANARY))
    if clobbered:
        raise RuntimeError(
            f"cuDNN wrote past the workspace it reported: {clobbered} of the {band.shape[-1]} guard bytes after "
            f"it were overwritten [{description}]"
        )
    return np.zeros(band.shape[:-1], np.int32)


def verified_guard_band(band: jax.Array, *, description: str) -> jax.Array:
    """A zero int32 once a host check found every byte of `band` still CANARY; otherwise the computation stops."""
    check = functools.partial(_count_clobbered, description=description)
    result = jax.ShapeDtypeStruct(band.shape[:-1], np.int32)
    return jax.pure_callback(check, result, band, vmap_method="expand_dims")


def padded_rows(x: jax.Array, axis: int, rows: int) -> jax.Array:
    """`x` with `rows` NaN rows before and after along `axis`: the input side of an output's guard band,
    so the kernel's buffers agree in shape; a kernel reading one of them would spread NaN."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (rows, rows)
    # Under jax.debug_nans the NaN itself would stop the program: pad with zeros there.
    # jax.config's options are properties it adds at import time, which a type checker cannot see.
    debug = jax.config.jax_debug_nans or jax.config.jax_debug_infs  # type: ignore[attr-defined]
    poison = 0 if debug else jnp.nan
    return jnp.pad(x, widths, constant_values=poison)


def canary_array(shape, dtype) -> jax.Array:
    """An array of `dtype` whose every byte is CANARY (for a float, a finite value nothing computes)."""
    dtype = jnp.dtype(dtype)
    word = int.from_bytes(bytes([CANARY]) * dtype.itemsize, "little")
    return jax.lax.bitcast_convert_type(jnp.full(shape, word, _UINTS[dtype.itemsize]), dtype)


def _count_changed(band, *, name: str, rows: int, description: str) -> np.ndarray:
    band = np.asarray(band)
    changed = int(np.count_nonzero(band != int.from_bytes(bytes([CANARY]) * band.dtype.itemsize, "little")))
    if changed:
        raise RuntimeError(
            f"cuDNN wrote outside the rows of {name}: {changed} of the {band.size} elements in the {rows} guard "
            f"rows before and after it were overwritten [{description}]"
        )
    return np.zeros((), np.int32)


def verified_output_band(result: jax.Array, axis: int, rows: int, *, name: str, description: str) -> jax.Array:
    """A zero int32 once a host check found the `rows` guard rows at both ends of `result` along `axis`
    still canary; otherwise the computation stops with an error naming `name`."""
    size = result.shape[axis]
    before = jax.lax.slice_in_dim(result, 0, rows, axis=axis)
    after = jax.lax.slice_in_dim(result, size - rows, size, axis=axis)
    band = jnp.concatenate([before, after], axis=axis)
    band = jax.lax.bitcast_convert_type(band, _UINTS[jnp.dtype(result.dtype).itemsize])
    check = functools.partial(_count_changed, name=name, rows=rows, description=description)
    return jax.pure_callback(check, jax.ShapeDtypeStruct((), np.int32), band, vmap_method="sequential")


# ---- the check feature of one call (ops.ragged.attend, ops/kvcache.py) -----------------------------------------


def apply_check(check: bool | None, config, index):
    """With check on: guard mode in the config, and an index whose cu_seqlens (and seqused) are validated on
    the host at run time. Off: NumPy cu_seqlens, free to read, warn if they will be clamped or cut.
    Returns (config, index)."""
    # One array for q and kv (qkv-packed, segments): checked once, under the name the caller passed.
    same = index.same and (config.capacity_q, config.max_seqlen_q) == (config.capacity_kv, config.max_seqlen_kv)
    name_q = "cu_seqlens" if same and config.packing == "qkv" else "cu_seqlens_q"
    sides = [(0, name_q, index.cu_seqlens_q, config.capacity_q, config.max_seqlen_q)]
    if not same:
        sides.append((1, "cu_seqlens_kv", index.cu_seqlens_kv, config.capacity_kv, config.max_seqlen_kv))
    seqused = index.seqused
    if not check_enabled(check):
        for side, name, cu, capacity, max_seqlen in sides:
            if seqused[side] is None:  # with seqused the slot may be longer than max_seqlen: only used rows count
                warn_cu_seqlens_on_host(cu, name=name, capacity=capacity, max_seqlen=max_seqlen)
        return config, index
    config = dataclasses.replace(config, guard_workspace=True)
    checked, used = [], list(seqused)
    for side, name, cu, capacity, max_seqlen in sides:
        if seqused[side] is None:
            checked.append(checked_cu_seqlens(cu, name=name, capacity=capacity, max_seqlen=max_seqlen))
        else:
            cu, used[side] = checked_seqused(
                cu,
                seqused[side],
                name=name,
                capacity=capacity,
                max_seqlen=max_seqlen,
                seqused_name=("seqused_q", "seqused_kv")[side],
            )
            checked.append(cu)
    if same and seqused[1] is not None and used[1] is seqused[1]:  # one cu for both sides: check kv's seqused too
        _, used[1] = checked_seqused(
            checked[0],
            seqused[1],
            name="cu_seqlens" if config.packing == "qkv" else "cu_seqlens_kv",
            seqused_name="seqused_kv",
            capacity=config.capacity_kv,
            max_seqlen=config.max_seqlen_kv,
        )
    # The checked arrays are new values: `same` stays true only where one array still serves both sides.
    return config, index.replace(
        cu_seqlens_q=checked[0],
        cu_seqlens_kv=checked[-1],
        seqused_q=used[0],
        seqused_kv=used[1],
        same=index.same and checked[0] is checked[-1],
    )


def apply_cache_check(check: bool | None, config, cache_seqlens, page_table, cu_seqlens_q=None):
    """The check feature of one ragged_attention_with_kvcache call (config its KVCacheConfig): with check on,
    (cache_seqlens, page_table) validated on the host at run time (checked_cache_index), and packed queries'
    cu_seqlens_q as ragged_attention's (checked_cu_seqlens: from 0, never decreasing, within q's T rows, no
    sequence over max_seqlen_q); off, as they are (NumPy cu_seqlens_q warn if they will be clamped or cut, as
    ragged_attention's do, and NumPy cache_seqlens, with a NumPy page_table, if an entry is out of range).
    The kernels read no guard bands here. Returns (cache_seqlens, page_table,
    cu_seqlens_q)."""
    packed = cu_seqlens_q is not None
    if not check_enabled(check):
        if packed:
            warn_cu_seqlens_on_host(
                cu_seqlens_q, name="cu_seqlens_q", capacity=config.total_q, max_seqlen=config.seqlen_q
            )
        # The pages a sequence uses follow from its length: the table is read only beside host lengths.
        if _on_host(cache_seqlens):
            arrays = (cache_seqlens,) + ((page_table,) if page_table is not None and _on_host(page_table) else ())
            _warn_first(arrays, (1, 2)[: len(arrays)], _cache_index_message(config))
        return cache_seqlens, page_table, cu_seqlens_q
    cache_seqlens, page_table = checked_cache_index(cache_seqlens, page_table, config)
    if packed:
        cu_seqlens_q = checked_cu_seqlens(
            cu_seqlens_q, name="cu_seqlens_q", capacity=config.total_q, max_seqlen=config.seqlen_q
        )
    return cache_seqlens, page_table, cu_seqlens_q


def append_index_problems(
    lengths: np.ndarray,
    page_table: np.ndarray | None,
    cu: np.ndarray | None,
    *,
    new_rows: int,
    capacity: int,
    num_pages: int,
    page_size: int,
) -> list[str]:
    """What kvcache_append would not write, for one call: cache_seqlens [B] outside [0, capacity], a sequence
    whose new rows run past its capacity, a page-table entry outside [0, num_pages) that would receive rows;
    cu (packed: [B + 1] cu_seqlens_k_new over new_rows rows, None: new_rows each) as it would be clamped."""
    lengths = lengths.astype(np.int64)
    counts = np.full(lengths.shape, new_rows, np.int64) if cu is None else host_slots(cu, new_rows)
    assert counts is not None  # cu is a host array here, never a tracer
    problems = _lengths_outside(lengths, capacity, "the capacity")
    start = np.clip(lengths, 0, capacity)
    end = start + counts  # rows start .. end - 1 are written
    for b in np.flatnonzero(end > capacity)[:1]:
        problems.append(
            f"sequence {b}: cache_seqlens[{b}] = {lengths[b]} and its {counts[b]} new rows reach row "
            f"{end[b] - 1}, past its capacity {capacity}: rows {capacity}..{end[b] - 1} would not be "
            "written"
        )
    if page_table is not None:
        pages = np.arange(page_table.shape[1])[None, :]
        written = (pages * page_size < np.minimum(end, capacity)[:, None]) & ((pages + 1) * page_size > start[:, None])
        bad = _first_bad_entry(page_table, written, num_pages)
        if bad is not None:
            b, p = bad
            problems.append(
                f"page_table[{b}, {p}] = {page_table[b, p]} is outside [0, num_pages = {num_pages}) "
                f"(k_cache.shape[0]) and would receive rows {max(start[b], p * page_size)}.."
                f"{min(end[b], (p + 1) * page_size) - 1} of sequence {b} (cache_seqlens[{b}] = "
                f"{lengths[b]}, {counts[b]} new rows): they would not be written"
            )
    return problems


def apply_append_check(
    check: bool | None,
    cache_seqlens,
    page_table,
    cu_seqlens_k_new,
    *,
    new_rows: int,
    capacity: int,
    num_pages: int,
    page_size: int,
):
    """The check feature of one kvcache_append call: with check on, (cache_seqlens, page_table,
    cu_seqlens_k_new) validated together on the host at run time (cu_seqlens_problems for cu_seqlens_k_new,
    append_index_problems for the rows that would not be written); off, as they are (NumPy ones warn of the
    rows that will not be written). Returns the three."""
    arrays = [("cache_seqlens", cache_seqlens, 1), ("page_table", page_table, 2), ("cu", cu_seqlens_k_new, 1)]
    present = [(name, x, rank) for name, x, rank in arrays if x is not None]

    def message_of(*values, where):
        given = dict(zip((name for name, _, _ in present), values))
        problems = []
        if "cu" in given:
            problems += cu_seqlens_problems(given["cu"], "cu_seqlens_k_new", new_rows, new_rows, "its rows")
        problems += append_index_problems(
            given["cache_seqlens"],
            given.get("page_table"),
            given.get("cu"),
            new_rows=new_rows,
            capacity=capacity,
            num_pages=num_pages,
            page_size=page_size,
        )
        return "KV cache append invalid" + where + ": " + "; ".join(problems) if problems else None

    if not check_enabled(check):
        if _on_host(*(x for _, x, _ in present)):  # free to read: say what will not be written
            _warn_first(tuple(x for _, x, _ in present), tuple(r for _, _, r in present), message_of, counted=False)
        elif _on_host(cache_seqlens):  # the rest on the device: the lengths alone
            _warn(
                cache_seqlens,
                1,
                "cache_seqlens",
                lambda lengths: _lengths_outside(lengths.astype(np.int64), capacity, "the capacity"),
                counted=False,
            )
        return cache_seqlens, page_table, cu_seqlens_k_new
    checked = dict(
        zip(
            (name for name, _, _ in present),
            _checked(tuple(x for _, x, _ in present), tuple(r for _, _, r in present), message_of),
        )
    )
    return checked["cache_seqlens"], checked.get("page_table"), checked.get("cu")
