"""The cuDNN path: `jax.ffi.ffi_call` into the C++ handlers, wrapped in one `jax.custom_vjp` for every packing.

At trace time the extension builds (or finds) the exact cuDNN graph and tells us its workspace size, which
becomes an extra uint8 output of the call: XLA allocates it like any buffer and the wrapper drops it.
There are two handlers, extension.FORWARD_TARGET and extension.BACKWARD_TARGET; the packing (packings.py)
is an attribute. The handler zeroes the rows the graph does not own itself, with its own small kernel, before
the graph runs (zero_outputs "unowned"); initial buffers aliased to the results may follow the index arrays
instead (check mode's guarded workspace and outputs, the split bottom-right backward's second call).

Zeroing only the unowned rows, in the handler, is the fastest way to make them 0: a memset of each whole output
costs more a call (docs/PERFORMANCE.md#what-the-measurements-found, "Row zeroing").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jax_ragged_attn.backends.cudnn import extents, graphs, options
from jax_ragged_attn.backends.cudnn.graphs import INT32_LIMIT, MAX_HEAD_DIM, ffi_kwargs, graph_info
from jax_ragged_attn.backends.shared import extension, known_issues, stats_grad
from jax_ragged_attn.backends.shared.forward_mode import forward_mode, portable
from jax_ragged_attn.backends.shared.remat_names import named_residuals
from jax_ragged_attn.config import AttentionConfig
from jax_ragged_attn.features import checks
from jax_ragged_attn.index import (
    RaggedIndex,
    query_rows_with_keys,
    row_positions,
    sanitize_both,
    sequence_lengths,
)
from jax_ragged_attn.index.packings import TABLE

# Per direction: the handler, and what the forward's results are called in errors (the backward's are the
# packing's gradients; the workspace comes last, unnamed).
_TARGETS = {"forward": extension.FORWARD_TARGET, "backward": extension.BACKWARD_TARGET}
FORWARD_RESULT_NAMES = ("out", "stats")


def _launch(direction: str, inputs, result_specs, names, cu_q, cu_kv, config: AttentionConfig, seqused=(None, None)):
    """Runs one handler; returns (its results but the workspace, a boolean scalar the caller must fold into
    its masks).

    inputs: (array, row axis) pairs in the handler's argument order, before the index arrays.
    result_specs(config): (shape, dtype, row axis) of each result but the workspace; names: theirs, in errors.

    Guard mode (check=True) makes every buffer the kernel writes larger than the call needs and verifies
    the slack on the host after the call: the workspace gets GUARD_BYTES more, each output GUARD_ROWS more
    rows before and after (inputs are padded to match with NaN rows; the ragged offsets skip the leading
    ones), all filled with a canary and passed in aliased to the results. A write outside the region a
    tensor owns stops the computation with an error naming the tensor. The scalar depends on those
    verifications, and the caller's row masks depend on the scalar, so they can be neither pruned nor
    overtaken. The guarded buffers follow the index arrays: the workspace, then one per result.
    """
    target = _TARGETS[direction]
    if not config.guard_workspace:
        info = graph_info(direction, config)
        types = tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype, _ in result_specs(config))
        types += (jax.ShapeDtypeStruct((info["workspace_bytes"],), jnp.uint8),)
        args = (*(x for x, _ in inputs), *_index_arrays(cu_q, cu_kv, config, seqused))
        # The handler zeroes, on the stream before the graph runs, the rows no sequence owns (its own small
        # kernel; whole outputs where that kernel cannot load). OPTIONS.poison_outputs (tests) fills every
        # output with NaN first, so a row cuDNN should write but skips reads NaN, not 0.
        call = jax.ffi.ffi_call(target, types, vmap_method="sequential")
        zero_outputs = "poisoned" if options.OPTIONS.poison_outputs else "unowned"
        *results, _ = call(*args, **ffi_kwargs(config, direction, zero_outputs=zero_outputs))
        return results, jnp.bool_(True)

    rows = checks.GUARD_ROWS
    padded = dataclasses.replace(
        config, capacity_q=config.capacity_q + 2 * rows, capacity_kv=config.capacity_kv + 2 * rows
    )
    # The backward layout the caller's buffers get unguarded: check mode checks the graph that runs.
    layout = graphs.backward_layout(config) if direction == "backward" else None
    size = graph_info(direction, padded, layout=layout)["workspace_bytes"]
    args = (
        *(checks.padded_rows(x, axis, rows) for x, axis in inputs),
        *_index_arrays(cu_q + rows, cu_kv + rows, padded, seqused),
    )
    specs = result_specs(padded)
    guarded = (
        *(checks.canary_array(shape, dtype) for shape, dtype, _ in specs),
        jnp.concatenate([jnp.zeros((size,), jnp.uint8), jnp.full((checks.GUARD_BYTES,), checks.CANARY, jnp.uint8)]),
    )
    types = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in guarded)
    workspace_at = len(specs)
    aliases = {len(args): workspace_at, **{len(args) + 1 + i: i for i in range(len(specs))}}
    call = jax.ffi.ffi_call(target, types, vmap_method="sequential", input_output_aliases=aliases)
    *results, workspace = call(*args, guarded[-1], *guarded[:-1], **ffi_kwargs(padded, direction, layout=layout))
    description = f"{target}: {config.describe()}"
    clobbered = checks.verified_guard_band(workspace[size:], description=description)
    for name, result, (_, _, axis) in zip(names, results, specs):
        clobbered = clobbered + checks.verified_output_band(result, axis, rows, name=name, description=description)
    inner = [
        jax.lax.slice_in_dim(result, rows, result.shape[axis] - rows, axis=axis)
        for result, (_, _, axis) in zip(results, specs)
    ]
    return inner, clobbered == 0


def _debugging_floats() -> bool:
    return bool(jax.config.jax_debug_nans or jax.config.jax_debug_infs)  # type: ignore[attr-defined]


def _zero_filled(config: AttentionConfig) -> bool:
    """Whether the results of a launch are already 0 in every row the kernel does not own: unguarded ones
    (the handler zeroed them); check mode's guarded launch leaves them to the caller's masks."""
    return not config.guard_workspace


def _run(fn, config_argnum: int, *args):
    """fn(*args). Under jax.debug_nans / debug_infs it runs inside jax.jit, so that an eager caller's checks
    see only what the wrapper returns: the kernel's raw results (the -inf stats cuDNN writes for a row whose
    band is empty, rows it does not own) are masked before they leave, and the caller's inputs are checked
    where they were made. Debugging only: each call traces again."""
    if _debugging_floats():
        return jax.jit(fn, static_argnums=config_argnum)(*args)
    return fn(*args)


def _index_arrays(cu_q, cu_kv, config: AttentionConfig, seqused=(None, None)):
    """Sequence lengths and the ragged offsets of each tensor, in elements (see ffi/layouts.h): a sequence
    starts at its first row times the tensor's token stride, which covers every part of a packed row. The
    offsets come from cu_seqlens and the lengths from seqused where given, so cuDNN reads (and the row-zeroing
    kernel treats as owned) only the first seqused[b] rows of each slot: the rest are never read or written
    by the graph, and zeroed like capacity padding."""
    hq, hkv = config.num_heads_q, config.num_heads_kv
    dqk, dv = config.head_dim_qk, config.head_dim_v
    packing = TABLE[config.packing]
    stats_offset = cu_q * hq if config.stats_layout == "token_major" else cu_q
    seq_len_q = sequence_lengths(cu_q, config.max_seqlen_q, seqused[0])
    seq_len_kv = sequence_lengths(cu_kv, config.max_seqlen_kv, seqused[1])
    # A sequence without keys has no softmax (cuDNN would write 0/0 into its rows): hand cuDNN no queries for
    # it. Its rows read out 0 and stats -inf through the wrapper's masks either way.
    seq_len_q = jnp.where(seq_len_kv > 0, seq_len_q, 0)
    return (
        seq_len_q,
        seq_len_kv,
        cu_q * (packing.parts("q") * hq * dqk),  # q, dq
        cu_kv * (packing.parts("k") * hkv * dqk),  # k, dk
        cu_kv * (packing.parts("v") * hkv * dv),  # v, dv
        cu_q * (hq * dv),  # o, do
        stats_offset,
    )


def _stats_shape(config: AttentionConfig) -> tuple[int, int]:
    if config.stats_layout == "token_major":
        return (config.capacity_q, config.num_heads_q)
    return (config.num_heads_q, config.capacity_q)


def _stats_axis(config: AttentionConfig) -> int:
    return 0 if config.stats_layout == "token_major" else 1


def _forward_results(config: AttentionConfig):
    out_shape = (config.capacity_q, config.num_heads_q, config.head_dim_v)
    return ((out_shape, jnp.dtype(config.dtype), 0), (_stats_shape(config), jnp.float32, _stats_axis(config)))


def _refuse_int32_overflow(config: AttentionConfig, *, backward: bool):
    """A loud stop, never a silent overflow: past 2**31 elements the int32 ragged offsets would wrap inside the
    kernel. Callers reach the launches through cudnn.attend, which splits such calls by head groups first."""
    sizes = extents.tensor_extents(config, backward=backward)
    name, extent = max(sizes.items(), key=lambda item: item[1])
    if extent > extents.INT32_LIMIT:
        raise NotImplementedError(
            f"this cuDNN {'backward' if backward else 'forward'} launch would index {name} with {extent:,} "
            "elements through int32 offsets; call it through backends.cudnn.attend, which splits by head groups"
        )


def _forward(buffers, cu_seqlens_q, cu_seqlens_kv, config: AttentionConfig, seqused=(None, None)):
    """Returns (out, stats for the caller, stats as cuDNN wrote them for the backward)."""
    packing = TABLE[config.packing]
    if len(buffers) != len(packing.buffers):
        raise ValueError(
            f"packing {packing.name!r} takes the buffers {[b.name for b in packing.buffers]}, got {len(buffers)} arrays"
        )
    _refuse_int32_overflow(config, backward=False)
    cu_q, cu_kv = sanitize_both(cu_seqlens_q, cu_seqlens_kv, config)
    inputs = tuple((x, 0) for x in packing.kernel_inputs(buffers))
    (out, raw_stats), intact = _launch(
        "forward", inputs, _forward_results, FORWARD_RESULT_NAMES, cu_q, cu_kv, config, seqused
    )
    # cuDNN writes only the rows of real tokens, and rows without any key have no defined softmax: give
    # both the documented values. The backward gets the raw stats, the values cuDNN itself expects.
    rows = query_rows_with_keys(cu_q, cu_kv, config, *seqused) & intact
    if not _zero_filled(config):
        out = jnp.where(rows[:, None, None], out, jnp.zeros((), out.dtype))
    stats_rows = rows[:, None] if config.stats_layout == "token_major" else rows[None, :]
    if _debugging_floats():
        # The backward's inputs must be finite too: a row without keys has P = 0 in the backward whatever its
        # stats say (every logit is masked), so 0 there is as good as cuDNN's -inf.
        raw_stats = jnp.where(stats_rows, raw_stats, 0.0)
    # Without return_stats the caller reads none (or, the sink epilogue, only rows with keys): no -inf is made.
    stats = jnp.where(stats_rows, raw_stats, -jnp.inf) if config.return_stats else raw_stats
    return out, stats, raw_stats


def _splits_bottom_right(config: AttentionConfig) -> bool:
    """A causal bottom-right mask without a left window: the backward can run as rectangle + square."""
    return config.diagonal_alignment == "bottom_right" and config.right_bound == 0 and config.left_bound is None


def _backward(
    buffers, cu_seqlens_q, cu_seqlens_kv, out, raw_stats, d_out, config: AttentionConfig, seqused=(None, None)
):
    """The gradients in the buffers' own layout, one per buffer: (dq, dk, dv), (dq, dkv) or (dqkv,).

    cuDNN's bottom-right causal backward does not skip masked tiles: it costs sq x skv per sequence, not the
    causal area (measured 1.2-1.7x the top-left backward on identical masks, cuDNN 9.19). Such a call's
    backward runs as two: with a = skv - sq, each sequence's queries against its first max(a, 0) keys
    unmasked (a rectangle) and its last min(sq, skv) queries against its last min(sq, skv) keys, top-left
    causal (a square: the same band). FlashAttention's backward is exact on any subset of a row's keys given
    the row's *final* out and stats (P_ij = exp(s_ij - stats_i), D_i = rowsum(dO_i * O_i)), so both calls get
    the forward's out and stats and their gradients add. The two key sets are disjoint, so a gradient buffer
    of key rows only (dk, dv, dkv) needs no sum: the square writes its rows into the rectangle's buffer
    (_writes_key_rows_in_place). dQ's rows are shared and summed.

    Whether the rectangle is empty (skv <= sq for every sequence) depends on the lengths, which are device
    values: the config bounds them from above only (a sequence may have 0 queries and max_seqlen_kv keys), so
    no configuration proves it at trace time, and branching on the lengths would copy them to the host. The
    one provable case, one array serving as both cu_seqlens with the same seqused and bounds, never gets here:
    features/bottom_right.py runs it as top-left. An empty rectangle costs a launch whose every sequence
    has 0 keys. The two calls take 0.64-0.74x the time of one bottom-right call, which does not skip masked tiles
    (docs/PERFORMANCE.md#what-the-measurements-found).
    """
    if not _splits_bottom_right(config):
        return _backward_call(buffers, cu_seqlens_q, cu_seqlens_kv, out, raw_stats, d_out, config, seqused)
    cu_q, cu_kv = sanitize_both(cu_seqlens_q, cu_seqlens_kv, config)
    sq = sequence_lengths(cu_q, config.max_seqlen_q, seqused[0])
    skv = sequence_lengths(cu_kv, config.max_seqlen_kv, seqused[1])
    before = jnp.maximum(skv - sq, 0)  # keys left of every query's band start: the rectangle
    band = jnp.minimum(sq, skv)  # the square's side
    rectangle = dataclasses.replace(
        config, is_causal=False, window_left=None, window_right=None, diagonal_alignment="top_left"
    )
    square = dataclasses.replace(config, diagonal_alignment="top_left")
    # Slots start where each part's rows start and end where the sequence's slot ends; seqused says how many
    # rows each part uses (the rest of a slot is never read, and its gradient rows are zero).
    shifted = lambda cu, by: jnp.concatenate([cu[:-1] + by, cu[-1:]])
    grads_rect = _backward_call(buffers, cu_q, cu_kv, out, raw_stats, d_out, rectangle, (sq, before))
    square_args = (
        buffers,
        shifted(cu_q, sq - band),
        shifted(cu_kv, before),
        out,
        raw_stats,
        d_out,
        square,
        (band, band),
    )
    holds_q = ["q" in b.holds for b in TABLE[config.packing].buffers]
    if not _writes_key_rows_in_place(config):
        return tuple(a + b for a, b in zip(grads_rect, _backward_call(*square_args)))
    # The rectangle's call zeroed every row it does not own (padding, rows past max_seqlen or seqused, and
    # the square's rows); the square's writes its own rows over those and leaves the rest as given. Its dQ
    # starts from zeros and is added: both calls own the rows of queries that see keys of both parts.
    initial = tuple(jnp.zeros_like(g) if q else g for g, q in zip(grads_rect, holds_q))
    grads_square = _backward_call(*square_args, initial=initial)
    return tuple(a + b if q else b for a, b, q in zip(grads_rect, grads_square, holds_q))


def _writes_key_rows_in_place(config: AttentionConfig) -> bool:
    """Whether a split bottom-right backward's square call writes its dK/dV rows into the rectangle's buffers
    (_backward) instead of both calls filling their own and the two being summed. It needs:
    - a gradient buffer that holds key rows only: dk and dv (packing "none"), dkv ("kv"). The qkv packing's
      one gradient holds dQ too, whose rows both calls write, so it is summed whole (as before).
    - an unguarded launch whose rectangle leaves the rows it does not own 0 and that trusts cuDNN to write no
      row the graph does not own. Check mode pads every buffer with guard rows and verifies each call's own
      canary bands, and OPTIONS.poison_outputs exists to show that each call writes every row it owns, which
      rows the rectangle already zeroed would hide: these two keep the sum of two separately masked calls.
    """
    if config.guard_workspace or options.OPTIONS.poison_outputs:
        return False
    return any("q" not in b.holds for b in TABLE[config.packing].buffers)


def _backward_call(
    buffers,
    cu_seqlens_q,
    cu_seqlens_kv,
    out,
    raw_stats,
    d_out,
    config: AttentionConfig,
    seqused=(None, None),
    initial=None,
):
    """One cuDNN backward call: the gradients in the buffers' own layout. `initial` (unguarded only): one
    array per gradient that the call writes into, see _backward_into."""
    _refuse_int32_overflow(config, backward=True)
    packing = TABLE[config.packing]
    cu_q, cu_kv = sanitize_both(cu_seqlens_q, cu_seqlens_kv, config)
    inputs = (
        *((x, 0) for x in packing.kernel_inputs(buffers)),
        (out, 0),
        (d_out.astype(config.dtype), 0),
        (raw_stats, _stats_axis(config)),
    )
    if initial is not None:
        return _backward_into(initial, inputs, cu_q, cu_kv, config, seqused)
    grads, intact = _launch("backward", inputs, packing.gradient_specs, packing.gradients, cu_q, cu_kv, config, seqused)
    unwritten = known_issues.worked_around(known_issues.NO_QUERY_SEQUENCES)
    if _zero_filled(config):
        if not unwritten:
            return tuple(grads)
        # The handler zeroed every row the graph does not own: only the key rows cuDNN left unwritten need a mask.
        valid_q = jnp.ones((config.capacity_q,), bool)
        valid_kv = _key_rows_of_sequences_with_queries(cu_q, cu_kv, config, seqused)
    else:
        valid_q = query_rows_with_keys(cu_q, cu_kv, config, *seqused) & intact
        valid_kv = row_positions(cu_kv, config.capacity_kv, config.max_seqlen_kv, seqused[1])[2] & intact
        if unwritten:
            valid_kv = valid_kv & _key_rows_of_sequences_with_queries(cu_q, cu_kv, config, seqused)
    # Rows cuDNN does not own are garbage: zero them. In a packed gradient each part has its own rows.
    zero = jnp.zeros((), config.dtype)
    return tuple(
        jnp.where(mask.reshape(mask.shape + (1,) * (g.ndim - mask.ndim)), g, zero)
        for g, mask in zip(grads, packing.gradient_masks(valid_q, valid_kv))
    )


def _key_rows_of_sequences_with_queries(cu_q, cu_kv, config: AttentionConfig, seqused) -> jax.Array:
    """[Tkv] boolean: the key row lies in a sequence with at least one query row. cuDNN before 9.19 leaves the
    dK and dV rows of a sequence with keys but no query rows unwritten (known_issues.NO_QUERY_SEQUENCES); their
    gradient is 0. Rows past the last sequence read False (they are zeroed anyway)."""
    sequence = row_positions(cu_kv, config.capacity_kv, config.max_seqlen_kv, seqused[1])[0]
    queries = sequence_lengths(cu_q, config.max_seqlen_q, seqused[0])
    return jnp.concatenate([queries, jnp.zeros((1,), queries.dtype)])[sequence] > 0


def _backward_into(initial, inputs, cu_q, cu_kv, config: AttentionConfig, seqused):
    """An unguarded backward call whose gradients start as `initial`, passed in aliased to the results the
    way row masking "zero_fill" passes zeros (ffi/handlers.cc): with zero_outputs "no" the handler zeroes
    nothing and cuDNN writes only the rows the graph owns, so every other row keeps the value it came in
    with. XLA writes in place when an initial array is not used after the call, and copies it otherwise."""
    info = graph_info("backward", config)
    types = (
        *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in initial),
        jax.ShapeDtypeStruct((info["workspace_bytes"],), jnp.uint8),
    )
    args = (*(x for x, _ in inputs), *_index_arrays(cu_q, cu_kv, config, seqused))
    aliases = {len(args) + i: i for i in range(len(initial))}
    call = jax.ffi.ffi_call(_TARGETS["backward"], types, vmap_method="sequential", input_output_aliases=aliases)
    *grads, _ = call(*args, *initial, **ffi_kwargs(config, "backward", zero_outputs="no"))
    return tuple(grads)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def attention(buffers: tuple, cu_seqlens_q, cu_seqlens_kv, config: AttentionConfig, seqused=(None, None)):
    """Returns (out [Tq, Hq, Dv], stats float32 in the configured layout) of the buffers laid out as
    packings.TABLE[config.packing] says: (q, k, v), (q, kv) or (qkv,). Differentiable in every buffer, the
    gradients in the buffers' own layout; the kernels read and write packed buffers in place.
    seqused: (seqused_q, seqused_kv), each None or int32 [B] (packing.sequence_lengths)."""
    return _run(_forward, 3, buffers, cu_seqlens_q, cu_seqlens_kv, config, seqused)[:2]


def attention_cudnn(q, k, v, cu_seqlens_q, cu_seqlens_kv, config: AttentionConfig):
    """`attention` of separate q [Tq, Hq, Dqk], k [Tkv, Hkv, Dqk], v [Tkv, Hkv, Dv] (config.packing "none")."""
    return attention((q, k, v), cu_seqlens_q, cu_seqlens_kv, config)


def _attention_fwd(buffers, cu_seqlens_q, cu_seqlens_kv, config, seqused=(None, None)):
    # symbolic_zeros=True wraps each primal input; unwrap them.
    buffers, cu_seqlens_q, cu_seqlens_kv, seqused = jax.tree.map(
        lambda x: x.value, (buffers, cu_seqlens_q, cu_seqlens_kv, seqused)
    )
    out, stats, raw_stats = _run(_forward, 3, buffers, cu_seqlens_q, cu_seqlens_kv, config, seqused)
    saved_out, raw_stats = named_residuals(out, raw_stats)
    return (out, stats), (buffers, cu_seqlens_q, cu_seqlens_kv, seqused, saved_out, raw_stats)


def stats_gradient_unsupported(config: AttentionConfig) -> str | None:
    """Why the backward cannot take a stats cotangent here (stats_grad.py widens Dv), or None."""
    widened = config.head_dim_v + stats_grad.EXTRA_COLUMNS
    if widened > MAX_HEAD_DIM:
        return (
            f"the cuDNN path cannot differentiate through stats (the log-sum-exp) with Dv={config.head_dim_v}: "
            f"it carries the stats term on {stats_grad.EXTRA_COLUMNS} extra value columns, and Dv + "
            f"{stats_grad.EXTRA_COLUMNS} = {widened} exceeds cuDNN's head dim limit of {MAX_HEAD_DIM} "
            f"(Dv <= {MAX_HEAD_DIM - stats_grad.EXTRA_COLUMNS} works)"
        )
    if max(config.capacity_q, config.capacity_kv) * config.num_heads_q * widened > INT32_LIMIT:
        return (
            f"the cuDNN path cannot differentiate through stats (the log-sum-exp) here: with Dv + "
            f"{stats_grad.EXTRA_COLUMNS} value columns the int32 ragged offsets would pass 2**31 elements"
        )
    # The backward that runs has the widened Dv: an upstream bug of that graph's head dims fences it here.
    return known_issues.fence("cudnn", "ragged", stats_grad.widened_config(config))


def _stats_cotangent_backward(
    buffers, cu_q, cu_kv, out, raw_stats, d_out, d_stats, config: AttentionConfig, seqused=(None, None)
):
    """The gradients with a stats cotangent, carried on widened value columns (stats_grad.py). A packed buffer
    cannot hold the wider v, so its parts are copied out and the gradients stacked back: the one place the
    packed path copies."""
    reason = stats_gradient_unsupported(config)
    if reason is not None:
        raise NotImplementedError(
            f"{reason}. Use implementation='xla' for this loss, or jax.lax.stop_gradient "
            "the stats, or return them as has_aux."
        )
    packing = TABLE[config.packing]
    q, k, v = packing.split(buffers)
    separate = dataclasses.replace(config, packing="none")
    widened, v_wide, out_wide, d_out_wide = stats_grad.widened_backward_inputs(
        v, out, d_out, d_stats, cu_q, cu_kv, separate, seqused
    )
    d_q, d_k, d_v_wide = _run(
        _backward, 6, (q, k, v_wide), cu_q, cu_kv, out_wide, raw_stats, d_out_wide, widened, seqused
    )
    return packing.join(d_q, d_k, d_v_wide[:, :, : config.head_dim_v])


def _attention_bwd(config, residuals, cotangents):
    buffers, cu_seqlens_q, cu_seqlens_kv, seqused, out, raw_stats = residuals
    d_out, d_stats = cotangents
    if not isinstance(d_stats, SymbolicZero):
        # Under jit an explicit zero array lands here too: correct, only a little slower than the plain pass.
        grads = _stats_cotangent_backward(
            buffers, cu_seqlens_q, cu_seqlens_kv, out, raw_stats, d_out, d_stats, config, seqused
        )
    elif isinstance(d_out, SymbolicZero):
        grads = tuple(jnp.zeros_like(x) for x in buffers)
    else:
        grads = _run(_backward, 6, buffers, cu_seqlens_q, cu_seqlens_kv, out, raw_stats, d_out, config, seqused)
    return grads, None, None, jax.tree.map(lambda _: None, seqused)


attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def portable_attention(buffers, cu_seqlens_q, cu_seqlens_kv, config: AttentionConfig, seqused=(None, None)):
    """`attention` on the portable path (the same buffers, index and config): the derivatives forward mode
    takes, since no cuDNN graph computes a tangent. Its stats carry 0, not -inf, on rows without keys (a
    constant either way, so the tangent is the same, and no -inf is made)."""
    index = RaggedIndex(cu_seqlens_q, cu_seqlens_kv, *seqused)
    return portable().attend(buffers, index, config, stats="raw")


# The residuals begin with the arguments themselves.
attention = forward_mode(attention, portable_attention, primals_from=lambda config, saved: saved[:4])
