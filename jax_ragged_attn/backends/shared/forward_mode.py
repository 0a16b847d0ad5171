"""Forward-mode differentiation (jax.jvp, linearize, jacfwd, Hessian-vector products) of a backend's custom_vjp.

A `jax.custom_vjp` refuses forward mode, and none of the kernels has a forward-mode rule. `forward_mode(op,
reference)` turns the custom_vjp `op` into a `jax.custom_jvp` of the same signature whose jvp rule runs op's
own forward rule and returns

    outputs, tangents = op.fwd(...),  tangents_p.bind(primals, residuals, input tangents)

`tangents_p` is a primitive linear in its tangent operands:

    evaluated   jax.jvp(reference, primals, tangents): the portable path's derivative for the same config
    transposed  op.bwd(residuals, cotangents): reverse mode runs the same backward kernel on the same
                residuals as the custom_vjp would, symbolic zeros included (a cotangent JAX knows to be zero
                reaches op.bwd as a SymbolicZero where op asked for them)
    batched     the same primitive with one more vmapped level; evaluation and transposition nest jax.vmap
    jvp         jax.jvp of its evaluation (a second forward derivative)

jax.grad therefore linearizes through the jvp rule and transposes back into op.bwd: the calls and residuals
of reverse mode are the custom_vjp's. For forward-over-reverse (jax.jvp(jax.grad(f)), jax.hessian), op.bwd
runs inside a custom_jvp whose tangent is the reference's second derivative (jax.jvp of its vjp), unless the
backward is plain jnp and differentiates as it is (second_order=False: the portable path's own op).

The reference takes op's arguments (the nondiff ones in their places) and returns op's outputs, in pure JAX
that forward mode differentiates: the portable path with the same configuration (`portable`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = ["forward_mode", "portable"]


def portable(op: str = "ragged"):
    """The registry's fallback backend module for `op` ("ragged" or "kvcache"): the reference a GPU family's
    forward mode differentiates, reached through the registry (families never import each other)."""
    from jax_ragged_attn import backends

    return importlib.import_module(backends.REGISTRIES[op][backends.FALLBACK])


class _Rule:
    """One custom_vjp with its reference: a static parameter of tangents_p (hashed by identity)."""

    def __init__(self, op, reference: Callable, second_order: bool, primals_from: Callable | None):
        self.op = op
        self.reference = reference
        self.second_order = second_order
        self.primals_from = primals_from
        self.nondiff = tuple(op.nondiff_argnums)
        self.name = getattr(op.fun, "__qualname__", "op")

    def __repr__(self):
        return f"forward_mode({self.name})"


def forward_mode(op, reference: Callable, *, second_order: bool = True, primals_from: Callable | None = None):
    """A custom_jvp with op's signature and outputs: forward mode through tangents_p (the module docstring),
    reverse mode through op's own rules. second_order=False: op.bwd is plain jnp, differentiated as it is.

    primals_from(nondiff args, residuals) -> op's differentiable arguments (their tree), or arrays the
    reference gives the same derivatives at (the backend's cleared copies): the tangent then reads the
    residuals alone, so reverse mode keeps no array alive that op's backward does not keep."""
    rule = _Rule(op, reference, second_order, primals_from)

    @functools.wraps(op.fun)
    def primal(*args):
        return op(*args)

    wrapped = jax.custom_jvp(primal, nondiff_argnums=rule.nondiff)
    wrapped.defjvp(functools.partial(_jvp, rule), symbolic_zeros=True)
    return wrapped


def _inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _jvp(rule: _Rule, *args):
    *static, primals, tangents = args
    prim_leaves, prim_tree = jax.tree.flatten(primals)
    tan_leaves = jax.tree.leaves(tangents, is_leaf=lambda x: isinstance(x, SymbolicZero))
    present = tuple(
        _inexact(p) and not isinstance(t, SymbolicZero) for p, t in zip(prim_leaves, tan_leaves, strict=True)
    )
    run_fwd = functools.partial(_run_fwd, rule, tuple(static), prim_tree, present)
    if rule.second_order:  # op.fwd calls kernels: an outer derivative of it must come from the reference
        run_fwd = _differentiable_fwd(rule, tuple(static), prim_tree, run_fwd)
    outs, residuals = run_fwd(prim_leaves)
    out_leaves, out_tree = jax.tree.flatten(outs)
    if not any(present):
        return outs, jax.tree.map(jnp.zeros_like, outs)
    res_leaves, res_tree = jax.tree.flatten(residuals)
    params = dict(
        rule=rule,
        static=tuple(static),
        prim_tree=prim_tree,
        res_tree=res_tree,
        out_tree=out_tree,
        present=present,
        out_avals=tuple(jax.core.ShapedArray(x.shape, x.dtype) for x in out_leaves),
        levels=(),
    )
    tangent_ops = [t for t, p in zip(tan_leaves, present) if p]
    carried = [] if rule.primals_from else prim_leaves
    tangents_out = tangents_p.bind(*carried, *res_leaves, *tangent_ops, **params)
    return outs, jax.tree.unflatten(out_tree, tangents_out)


def _run_fwd(rule, static, prim_tree, present, prim_leaves):
    """op.fwd of the primal leaves: (outputs, residuals)."""
    dynamic = jax.tree.unflatten(prim_tree, prim_leaves)
    if rule.op.symbolic_zeros:
        dynamic = jax.tree.map(CustomVJPPrimal, dynamic, jax.tree.unflatten(prim_tree, present))
    return rule.op.fwd(*_merge(rule.nondiff, static, dynamic))


def _differentiable_fwd(rule, static, prim_tree, run_fwd):
    """run_fwd as a custom_jvp, for a derivative of the forward rule itself (forward over reverse, jvp of jvp):
    the outputs' tangents are the reference's; each residual that primals_from reads an argument from gets
    that argument's tangent (the residual tangents the second-order backward reads), the others 0."""
    fwd = jax.custom_jvp(run_fwd)

    @fwd.defjvp
    def _(primals, tangents):
        (leaves,), (d_leaves,) = primals, tangents
        outs, residuals = run_fwd(leaves)
        where = [i for i, x in enumerate(leaves) if _inexact(x)]

        def along(*values):
            inner = list(leaves)
            for i, x in zip(where, values):
                inner[i] = x
            return _reference_outputs(rule, static, prim_tree, inner)

        d_outs = jax.jvp(along, [leaves[i] for i in where], [d_leaves[i] for i in where])[1]
        d_outs = jax.tree.map(lambda t, o: t.astype(o.dtype), d_outs, outs)
        res_leaves, res_tree = jax.tree.flatten(residuals)
        d_res = [_zero_tangent(x) for x in res_leaves]
        if rule.primals_from:
            floats = [i for i, x in enumerate(res_leaves) if _inexact(x)]

            def selected(*values):
                inner = list(res_leaves)
                for i, x in zip(floats, values):
                    inner[i] = x
                derived = prim_tree.flatten_up_to(tuple(rule.primals_from(*static, res_tree.unflatten(inner))))
                return [derived[i] for i in where]

            scatter = jax.linear_transpose(selected, *[res_leaves[i] for i in floats])
            for i, t in zip(floats, scatter([d_leaves[i].astype(leaves[i].dtype) for i in where])):
                d_res[i] = t
        return (outs, residuals), (d_outs, res_tree.unflatten(d_res))

    return fwd


def _zero_tangent(x):
    if _inexact(x):
        return jnp.zeros(jnp.shape(x), jnp.result_type(x))
    return np.zeros(jnp.shape(x), jax.dtypes.float0)


def _merge(nondiff, static, dynamic) -> list:
    """The full argument list of a function with `nondiff` argument positions."""
    static, dynamic = list(static), list(dynamic)
    return [static.pop(0) if i in nondiff else dynamic.pop(0) for i in range(len(static) + len(dynamic))]


# ---- tangents_p ----------------------------------------------------------------------------------------------

tangents_p = Primitive("ragged_attention_tangents")
tangents_p.multiple_results = True


def _fixed(rule, prim_tree, res_tree) -> int:
    """How many operands precede the tangents: the primal leaves (unless derived) and the residuals."""
    return (0 if rule.primals_from else prim_tree.num_leaves) + res_tree.num_leaves


def _split(rule, static, operands, prim_tree, res_tree):
    """(primal leaves, residual leaves, the operands after them) of tangents_p's operands."""
    fixed = _fixed(rule, prim_tree, res_tree)
    residuals = list(operands[fixed - res_tree.num_leaves : fixed])
    if rule.primals_from:
        derived = rule.primals_from(*static, jax.tree.unflatten(res_tree, residuals))
        prims = prim_tree.flatten_up_to(tuple(derived))
    else:
        prims = list(operands[: prim_tree.num_leaves])
    return prims, residuals, list(operands[fixed:])


def _reference_outputs(rule, static, prim_tree, leaves):
    return rule.reference(*_merge(rule.nondiff, static, jax.tree.unflatten(prim_tree, leaves)))


def _base_tangents(rule, static, prim_tree, res_tree, out_tree, present, out_avals, *operands):
    """One (unbatched) evaluation: the reference's output tangents for the present input tangents."""
    prims, _, tangents = _split(rule, static, operands, prim_tree, res_tree)
    where = [i for i, p in enumerate(present) if p]

    def along(*values):
        leaves = list(prims)
        for i, x in zip(where, values):
            leaves[i] = x
        return jax.tree.leaves(_reference_outputs(rule, static, prim_tree, leaves))

    _, out = jax.jvp(along, [prims[i] for i in where], list(tangents))
    return [t.astype(a.dtype) for t, a in zip(out, out_avals, strict=True)]


def _nested(fn, levels, leading=None, extra_axes=()):
    """fn vmapped over every level (outermost first in `levels`: each batching moved its axis to 0), over the
    first `leading` operands' axes of each level (all by default) and then `extra_axes`."""
    for _, axes in reversed(levels):
        fn = jax.vmap(fn, in_axes=tuple(axes[:leading]) + tuple(extra_axes))
    return fn


def _impl(*operands, rule, static, prim_tree, res_tree, out_tree, present, out_avals, levels):
    base = functools.partial(_base_tangents, rule, static, prim_tree, res_tree, out_tree, present, out_avals)
    return _nested(base, levels)(*operands)


_impl_jit = jax.jit(
    _impl, static_argnames=("rule", "static", "prim_tree", "res_tree", "out_tree", "present", "out_avals", "levels")
)


def _abstract_eval(*avals, out_avals, levels, **_):
    sizes = tuple(size for size, _ in levels)
    # Inside shard_map the outputs vary over the manual axes the operands vary over.
    typed = [a for a in avals if hasattr(a, "manual_axis_type")]
    widest = max(typed, key=lambda a: len(a.manual_axis_type.varying), default=None)
    extra = {} if widest is None else {"manual_axis_type": widest.manual_axis_type}
    return [jax.core.ShapedArray(sizes + tuple(a.shape), a.dtype, **extra) for a in out_avals]


tangents_p.def_impl(lambda *operands, **params: _impl_jit(*operands, **params))
tangents_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(tangents_p, mlir.lower_fun(_impl, multiple_results=True))


def _jvp_rule(primals, tangents, **params):
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    return jax.jvp(lambda *ops: _impl(*ops, **params), list(primals), tangents)


ad.primitive_jvps[tangents_p] = _jvp_rule


def _batch(operands, dims, *, rule, prim_tree, res_tree, levels, **params):
    size = next(x.shape[d] for x, d in zip(operands, dims) if d is not None)
    fixed = _fixed(rule, prim_tree, res_tree)
    moved, axes = [], []
    for i, (x, d) in enumerate(zip(operands, dims)):
        if d is not None:
            moved.append(jnp.moveaxis(x, d, 0))
            axes.append(0)
        elif i >= fixed:  # tangents are always batched, so their transposes come back batched along 0
            moved.append(jnp.broadcast_to(x, (size, *jnp.shape(x))))
            axes.append(0)
        else:
            moved.append(x)
            axes.append(None)
    levels = ((size, tuple(axes)),) + tuple(levels)
    outs = tangents_p.bind(*moved, rule=rule, prim_tree=prim_tree, res_tree=res_tree, levels=levels, **params)
    return outs, [0] * len(outs)


batching.primitive_batchers[tangents_p] = _batch


def _transpose(cts, *operands, rule, static, prim_tree, res_tree, out_tree, present, out_avals, levels):
    fixed = _fixed(rule, prim_tree, res_tree)
    known = list(operands[:fixed])
    if any(ad.is_undefined_primal(x) for x in known):
        raise NotImplementedError(f"{rule!r}: the primal inputs and residuals of a tangent must be known")
    zero = tuple(type(c) is ad.Zero for c in cts)
    nothing = [None] * len(operands)
    if all(zero):
        return nothing
    live = [c for c, z in zip(cts, zero) if not z]
    base = functools.partial(_base_backward, rule, static, prim_tree, res_tree, out_tree, present, out_avals, zero)
    grads = _nested(base, levels, fixed, (0,) * len(live))(*known, *live)
    return [None] * fixed + list(grads)


def _base_backward(rule, static, prim_tree, res_tree, out_tree, present, out_avals, zero, *operands):
    """One (unbatched) transposition: op.bwd's cotangents of the present tangent inputs."""
    prims, residuals, live = _split(rule, static, operands, prim_tree, res_tree)

    def backward(prims, residuals, live):
        cts, rest = [], iter(live)
        for aval, z in zip(out_avals, zero):
            if not z:
                cts.append(next(rest))
            elif rule.op.symbolic_zeros:
                cts.append(SymbolicZero(aval))
            else:
                cts.append(jnp.zeros(aval.shape, aval.dtype))
        grads = rule.op.bwd(*static, jax.tree.unflatten(res_tree, residuals), jax.tree.unflatten(out_tree, cts))
        flat = _flatten_cotangents(grads, prim_tree)
        return [_instantiate(g, p) for g, p, keep in zip(flat, prims, present) if keep]

    if not rule.second_order:
        return backward(prims, residuals, live)

    where = [i for i, p in enumerate(present) if p]
    inexact = [i for i, p in enumerate(prims) if _inexact(p)]
    second = jax.custom_jvp(backward)

    @second.defjvp
    def _(primals, tangents):
        prims_, residuals_, live_ = primals
        d_prims, _, d_live = tangents

        def reference_vjp(float_prims, live_):
            leaves = list(prims_)
            for i, x in zip(inexact, float_prims):
                leaves[i] = x

            def along(*values):
                inner = list(leaves)
                for i, x in zip(where, values):
                    inner[i] = x
                return jax.tree.leaves(_reference_outputs(rule, static, prim_tree, inner))

            outs, pullback = jax.vjp(along, *[leaves[i] for i in where])
            rest = iter(live_)
            cts = [jnp.zeros_like(o) if z else next(rest).astype(o.dtype) for o, z in zip(outs, zero)]
            return list(pullback(cts))

        out = backward(prims_, residuals_, live_)
        _, d_out = jax.jvp(
            reference_vjp, ([prims_[i] for i in inexact], list(live_)), ([d_prims[i] for i in inexact], list(d_live))
        )
        return out, [t.astype(o.dtype) for t, o in zip(d_out, out)]

    return second(prims, residuals, live)


def _flatten_cotangents(grads, prim_tree) -> list:
    """op.bwd's result as one cotangent per primal leaf (None where op returned None for a whole subtree)."""
    dummy = jax.tree.unflatten(prim_tree, [object()] * prim_tree.num_leaves)
    expanded = jax.tree.map(
        lambda g, d: [g] * len(jax.tree.leaves(d)), tuple(grads), dummy, is_leaf=lambda x: x is None
    )
    return [g for group in jax.tree.leaves(expanded, is_leaf=lambda x: isinstance(x, list)) for g in group]


def _instantiate(g, primal):
    if g is None or isinstance(g, SymbolicZero):
        return jnp.zeros(jnp.shape(primal), jnp.result_type(primal))
    return g


ad.primitive_transposes[tangents_p] = _transpose
