"""A Flax NNX self-attention layer over packed sequences: fused projection, RoPE, ragged attention, output.

    from jax_ragged_attn.flax import RaggedSelfAttention
    attention = RaggedSelfAttention(512, num_heads=8, num_kv_heads=2, rngs=nnx.Rngs(0))
    y = attention(x, batch["cu_seqlens"], batch["positions"], max_seqlen=1024)   # x, y [T, 512]

x holds the tokens of many sequences back to back ([T, features], the THD layout, e.g. from
`jax_ragged_attn.inputs.data.pack_documents`); every sequence attends only to itself. The projection's output is laid
out as the packed attention ops read it, so on the cuDNN path q, k and v are never split out or copied:

  MHA (num_kv_heads == num_heads): one kernel [features, 3, H, D] gives qkv [T, 3, H, D], rotated in place
    (RoPE on parts 0 and 1, part 2 passed through, one elementwise pass) -> ragged_attention_qkvpacked.
  GQA / MQA: a q kernel [features, Hq, D] and one fused kv kernel [features, 2, Hkv, D] give q [T, Hq, D] and
    kv [T, 2, Hkv, D] -> ragged_attention_kvpacked. Two matmuls rather than one split afterwards, because a
    split of one [T, Hq*D + 2*Hkv*D] output would be copied into two buffers before the kernel reads them.

RoPE (rotate-half convention: a head's first D/2 features pair with its last D/2, frequencies
rope_base ** (-2i / D)) reads the packed positions, which restart at 0 in every sequence.

Learnable sinks (sinks=True, one logit per query head) go through the packed wrappers like everything else:
an elementwise epilogue of the op through its log-sum-exp (sinks.py), on cuDNN where it serves the call.

Parameters can be split over heads (head_axis="model"): the kernels carry partitioning metadata (Flax's
with_partitioning), so under `jax.set_mesh(mesh)` they are created sharded, and the attention call runs
inside `jax.shard_map` over that axis, each device attending with its own heads (the cuDNN call never sees
another device's heads and XLA never gathers them). The output projection sums over heads: one all-reduce.

Flax is an optional dependency: `pip install 'jax_ragged_attn[flax]'`.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp

try:
    from flax import nnx
except ImportError as error:  # the library itself needs no Flax; only this module does
    raise ImportError(
        "jax_ragged_attn.flax needs Flax (NNX): pip install 'jax_ragged_attn[flax]' "
        f"(installs flax and optax); importing flax failed with: {error}"
    ) from error

from jax_ragged_attn.config import STRATEGIES, AttentionOptions
from jax_ragged_attn.index import as_int32, count_at_or_before
from jax_ragged_attn.inputs.packed import ragged_attention_kvpacked, ragged_attention_qkvpacked

__all__ = ["RaggedSelfAttention", "apply_rope", "positions_from_cu_seqlens"]


class RaggedSelfAttention(nnx.Module):
    """Multi-head self-attention over packed sequences (THD), with RoPE from the packed positions.

    Args:
      features: width of the input and the output.
      num_heads: query heads Hq.
      num_kv_heads: key/value heads Hkv (a divisor of Hq); default Hq (MHA, the qkv-packed layout).
      head_dim: D, default features // num_heads; even when RoPE is on.
      is_causal: each token attends to itself and earlier tokens of its sequence only.
      local_window_size: None, w or (left, right): as in `ragged_attention`.
      sinks: add one learnable sink logit per query head (initialised to 0); see above.
      rope_base: RoPE's base; None turns RoPE off.
      scale: multiplies q.k; default 1 / sqrt(D).
      softcap: None or c > 0: cap the attention logits to c * tanh(s / c) (Gemma 2), as in `ragged_attention`.
      implementation: None, "cudnn", "fa3" or "xla", as in `ragged_attention` (None: the shipped policy
        of backends/policy.py, FA3 from 1,024 tokens a sequence where one of its wheels is installed, cuDNN
        below, xla where neither serves the call).
      strategy: "fastest" or "lean_memory", the cuDNN backward's workspace-for-speed trade, as in
        `ragged_attention`.
      head_axis: a mesh axis name to split heads over (see the module docstring), or None.
      dtype: the dtype of the projections and the attention (bfloat16 for cuDNN); default x's dtype.
      param_dtype: the parameters' dtype.
      kernel_init: initializer for the projection kernels, called (key, shape, dtype); default normal with
        standard deviation 1 / sqrt(fan_in).
      rngs: nnx.Rngs.
    """

    def __init__(
        self,
        features: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        is_causal: bool = True,
        local_window_size=None,
        sinks: bool = False,
        rope_base: float | None = 10_000.0,
        scale: float | None = None,
        implementation: str | None = None,
        strategy: str = "fastest",
        head_axis: str | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        kernel_init=None,
        softcap: float | None = None,
        rngs: nnx.Rngs,
    ):
        self.features = _positive_int(features, "features")
        self.num_heads = _positive_int(num_heads, "num_heads")
        self.num_kv_heads = self.num_heads if num_kv_heads is None else _positive_int(num_kv_heads, "num_kv_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if head_dim is None:
            if self.features % self.num_heads:
                raise ValueError(
                    f"features ({self.features}) must be a multiple of num_heads ({self.num_heads}), or pass head_dim"
                )
            head_dim = self.features // self.num_heads
        self.head_dim = _positive_int(head_dim, "head_dim")
        if rope_base is not None and (self.head_dim % 2 or not rope_base > 0):
            raise ValueError(
                f"RoPE needs an even head_dim and rope_base > 0, got head_dim {self.head_dim}, "
                f"rope_base {rope_base!r}; pass rope_base=None to turn RoPE off"
            )
        if not isinstance(is_causal, bool) or not isinstance(sinks, bool):
            raise ValueError(f"is_causal and sinks must be Python bools, got {is_causal!r} and {sinks!r}")
        self.is_causal, self.local_window_size, self.rope_base = is_causal, local_window_size, rope_base
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.scale, self.implementation, self.head_axis = scale, implementation, head_axis
        self.strategy = strategy
        # Validated here (ValueError naming softcap), not at the first call.
        self.softcap = AttentionOptions(softcap=softcap).softcap
        self.dtype, self.param_dtype = dtype, param_dtype

        h, hkv, d, f = self.num_heads, self.num_kv_heads, self.head_dim, self.features

        def param(shape, fan_in, spec, init=kernel_init):
            init = init or nnx.initializers.normal(stddev=fan_in**-0.5)
            if head_axis is not None:
                init = nnx.with_partitioning(init, spec)
            return nnx.Param(init(rngs.params(), shape, param_dtype))

        if self.packs_qkv:
            self.qkv_kernel = param((f, 3, h, d), f, (None, None, head_axis, None))
        else:
            self.q_kernel = param((f, h, d), f, (None, head_axis, None))
            self.kv_kernel = param((f, 2, hkv, d), f, (None, None, head_axis, None))
        self.out_kernel = param((h, d, f), h * d, (head_axis, None, None))
        self.sinks = param((h,), 1, (head_axis,), nnx.initializers.zeros_init()) if sinks else None

    @property
    def packs_qkv(self) -> bool:
        """True for MHA: one [T, 3, H, D] projection; False for GQA/MQA: q [T, Hq, D] and kv [T, 2, Hkv, D]."""
        return self.num_kv_heads == self.num_heads

    def __call__(
        self,
        x: jax.Array,
        cu_seqlens: jax.Array,
        positions: jax.Array | None = None,
        *,
        max_seqlen: int,
        return_stats: bool = False,
    ):
        """x [T, features] (sequence b owns rows cu_seqlens[b]:cu_seqlens[b+1]; rows past cu_seqlens[-1] are
        padding) -> y [T, features]; with return_stats also the attention's log-sum-exp [Hq, T] (float32).

        positions [T]: each token's index within its sequence (RoPE); default derived from cu_seqlens.
        max_seqlen: static bound on a sequence's length. Padding rows (past max(cu_seqlens)) read y = 0
        exactly (no bias anywhere) and get zero gradients; NaN in them never reaches a real row or a
        parameter's gradient.
        """
        if getattr(x, "ndim", None) != 2 or x.shape[1] != self.features:
            raise ValueError(f"x must be [T, features={self.features}], got shape {getattr(x, 'shape', None)}")
        # NumPy (what PackedDocuments.arrays() gives) or jax, any integer dtype. NumPy stays NumPy: the op checks
        # host values for free when traced.
        cu_seqlens = as_int32(cu_seqlens, "cu_seqlens")
        if positions is None:
            positions = positions_from_cu_seqlens(cu_seqlens, x.shape[0])
        elif getattr(positions, "shape", None) != (x.shape[0],):
            raise ValueError(f"positions must be [T={x.shape[0]}], got shape {getattr(positions, 'shape', None)}")
        else:
            positions = jnp.asarray(as_int32(positions, "positions"))
        # Padding rows are zeroed first: NaN there would otherwise reach the kernels' gradients (x.T @ d_qkv
        # multiplies it by the exact zeros the attention gives padding rows). One select, fused into the matmul.
        rows = jnp.arange(x.shape[0], dtype=jnp.int32)
        x = jnp.where((rows < jnp.max(cu_seqlens))[:, None], x, jnp.zeros((), x.dtype))
        qkv, q, kv = self.project(x, positions)
        result = self.attend(qkv, q, kv, cu_seqlens, max_seqlen=max_seqlen, return_stats=return_stats)
        out, stats = result if return_stats else (result, None)
        y = self.project_out(out)
        return (y, stats) if return_stats else y

    # The three steps, public so that a model can run the same parameters through another attention (the
    # main job times them with padded jax.nn.dot_product_attention).

    def project(self, x: jax.Array, positions: jax.Array):
        """(qkv [..., 3, H, D], None, None) for MHA, (None, q [..., Hq, D], kv [..., 2, Hkv, D]) for GQA, with
        RoPE applied; x [..., features], positions [...]."""
        dtype = self.dtype or x.dtype
        x = x.astype(dtype)
        if self.packs_qkv:
            qkv = jnp.einsum("...f,fphd->...phd", x, self.qkv_kernel[...].astype(dtype))
            return self._rope(qkv, positions, rotated_parts=2), None, None
        q = jnp.einsum("...f,fhd->...hd", x, self.q_kernel[...].astype(dtype))
        kv = jnp.einsum("...f,fphd->...phd", x, self.kv_kernel[...].astype(dtype))
        return None, self._rope(q, positions), self._rope(kv, positions, rotated_parts=1)

    def project_out(self, out: jax.Array) -> jax.Array:
        """[..., Hq, D] attention output -> [..., features]."""
        return jnp.einsum("...hd,hdf->...f", out, self.out_kernel[...].astype(out.dtype))

    def attend(self, qkv, q, kv, cu_seqlens, *, max_seqlen: int, return_stats: bool = False):
        """The ragged attention on `project`'s output: out [T, Hq, D] (and stats [Hq, T])."""
        options = dict(
            scale=self.scale,
            is_causal=self.is_causal,
            local_window_size=self.local_window_size,
            return_stats=return_stats,
            implementation=self.implementation,
            strategy=self.strategy,
            softcap=self.softcap,
        )
        bounds = dict(max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
        axis = self.head_axis
        packed, heads = jax.P(None, None, axis, None), jax.P(None, axis, None)  # [T, parts, H, D], [T, H, D]
        out_specs = (heads, jax.P(axis, None)) if return_stats else heads
        if self.sinks is not None:
            # The packed wrappers take sinks (the epilogue of sinks.py): the packed buffers stay in place.
            if self.packs_qkv:

                def call(qkv, sinks, cu):
                    return ragged_attention_qkvpacked(qkv, cu, max_seqlen=max_seqlen, sinks=sinks, **options)

                return self._on_heads(
                    call, (qkv, self.sinks[...], cu_seqlens), (packed, jax.P(axis), jax.P()), out_specs
                )

            def call(q, kv, sinks, cu):
                return ragged_attention_kvpacked(q, kv, cu, cu, sinks=sinks, **bounds, **options)

            return self._on_heads(
                call, (q, kv, self.sinks[...], cu_seqlens), (heads, packed, jax.P(axis), jax.P()), out_specs
            )
        if self.packs_qkv:
            return self._on_heads(
                lambda qkv, cu: ragged_attention_qkvpacked(qkv, cu, max_seqlen=max_seqlen, **options),
                (qkv, cu_seqlens),
                (packed, jax.P()),
                out_specs,
            )
        return self._on_heads(
            lambda q, kv, cu: ragged_attention_kvpacked(q, kv, cu, cu, **bounds, **options),
            (q, kv, cu_seqlens),
            (heads, packed, jax.P()),
            out_specs,
        )

    def _on_heads(self, fn, args, in_specs, out_specs):
        """fn(*args), inside shard_map over head_axis when the context mesh (jax.set_mesh) has that axis."""
        mesh = jax.sharding.get_abstract_mesh()
        if self.head_axis is None or mesh.empty or self.head_axis not in mesh.axis_names:
            return fn(*args)
        devices = mesh.shape[self.head_axis]
        if self.num_kv_heads % devices:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must be a multiple of the {devices} devices on "
                f"head_axis {self.head_axis!r}, so that each device holds whole GQA groups"
            )
        # check_vma=False: the cuDNN path's ffi_call has JAX's default rule for varying manual axes, which
        # refuses to mix head-sharded activations with the replicated cu_seqlens (as in sharding.py).
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)

    def _rope(self, x: jax.Array, positions: jax.Array, rotated_parts: int | None = None) -> jax.Array:
        if self.rope_base is None:
            return x
        extra = x.ndim - positions.ndim - 1  # axes between the tokens and D: heads, or parts and heads
        rotated = apply_rope(x, positions.reshape(positions.shape + (1,) * extra), self.rope_base)
        if rotated_parts is None:
            return rotated
        # A packed buffer [..., parts, H, D]: rotate q and k, pass v through, in one elementwise pass.
        part = jnp.arange(x.shape[-3], dtype=jnp.int32).reshape((1,) * (x.ndim - 3) + (-1, 1, 1))
        return jnp.where(part < rotated_parts, rotated, x)


def apply_rope(x: jax.Array, positions: jax.Array, base: float = 10_000.0) -> jax.Array:
    """Rotary embedding, rotate-half convention: x [..., D], positions broadcastable to x[..., 0].

    Features i and i + D/2 form the pair rotated by the angle position * base ** (-2i / D). Computed in
    float32, returned in x's dtype.
    """
    half = x.shape[-1] // 2
    positions = jnp.asarray(positions)
    if positions.ndim > x.ndim - 1:
        raise ValueError(
            f"positions must broadcast to x's shape without its last axis {x.shape[:-1]}, got shape {positions.shape}"
        )
    # Leading axes made explicit, so that nothing relies on rank promotion (jax_numpy_rank_promotion="raise").
    positions = positions.reshape((1,) * (x.ndim - 1 - positions.ndim) + positions.shape)
    frequencies = base ** (-jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1])
    angles = positions.astype(jnp.float32)[..., None] * frequencies.reshape((1,) * positions.ndim + (half,))
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def positions_from_cu_seqlens(cu_seqlens: jax.Array, capacity: int) -> jax.Array:
    """[capacity] int32: each row's index within its sequence, 0 past the last sequence.

    cu_seqlens [0, 2, 2, 5], capacity 7 -> [0, 1, 0, 1, 2, 0, 0]. A row's sequence is the number of sequence
    ends at or before it (index.count_at_or_before: no binary-search loop, which costs a host round trip per
    step on a GPU).
    """
    cu_seqlens = jnp.asarray(as_int32(cu_seqlens, "cu_seqlens"))  # NumPy cannot be indexed by a tracer below
    num_seqs = cu_seqlens.shape[0] - 1
    ends = jnp.clip(cu_seqlens[1:], 0, capacity)
    sequence = count_at_or_before(ends, capacity)
    rows = jnp.arange(capacity, dtype=jnp.int32)
    positions = rows - cu_seqlens[jnp.minimum(sequence, num_seqs - 1)]
    return jnp.where(sequence < num_seqs, positions, 0).astype(jnp.int32)


def _positive_int(value, name: str) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value
