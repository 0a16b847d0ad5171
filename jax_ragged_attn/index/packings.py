"""How q, k and v lie in the buffers a caller passes: one table entry per packing.

A packing is the list of its input buffers, and each buffer says which tensors one token row of it holds,
side by side. Everything the launch needs follows from that list, so no code branches on the packing:

    packing  buffers (token row holds)        parts per row q, k, v   gradients (row masks per part)
    "none"   q (q), k (k), v (v)              1, 1, 1                 dq (q), dk (kv), dv (kv)
    "kv"     q (q), kv (k, v)                 1, 2, 2                 dq (q), dkv [T, 2, ...] (kv, kv)
    "qkv"    qkv (q, k, v)                    3, 3, 3                 dqkv [T, 3, ...] (q, kv, kv)

- parts: a tensor's token stride is its buffer's row (parts x H x D elements), which scales its ragged
  offsets (launch._index_arrays); the extension learns the packing from the `packing` attribute and finds
  each part at its offset within the row (ffi/layouts.h).
- gradients: the backward writes one gradient per buffer, in the buffer's shape ("d" + its name); a part's
  rows are valid where its side's rows are (queries with keys on the q side, real tokens on the kv side).

A new packing is one entry in TABLE (its name also in config.PACKINGS and the C++ enum) plus its public
wrapper in packed.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax_ragged_attn.config import PACKINGS, AttentionConfig

TENSORS = ("q", "k", "v")


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One input buffer: an unpacked [T, H, D] when it holds one tensor, else [T, parts, H, D]."""

    name: str  # the argument's name, in messages; its gradient is "d" + name
    layout: str  # its shape, in messages
    holds: tuple[str, ...]  # the tensors a token row holds, in order

    @property
    def packed(self) -> bool:
        return len(self.holds) > 1


@dataclasses.dataclass(frozen=True)
class Packing:
    name: str  # config.packing and the extension's `packing` attribute (in config.PACKINGS order)
    buffers: tuple[Buffer, ...]  # the primal inputs, in order

    def _where(self, tensor: str) -> tuple[int, Buffer]:
        return next((i, b) for i, b in enumerate(self.buffers) if tensor in b.holds)

    def parts(self, tensor: str) -> int:
        """How many parts a token row of `tensor`'s buffer holds."""
        return len(self._where(tensor)[1].holds)

    @property
    def max_parts(self) -> int:
        return max(len(b.holds) for b in self.buffers)

    @property
    def gradients(self) -> tuple[str, ...]:
        """The backward's result names, one per buffer (the workspace follows, unnamed)."""
        return tuple("d" + b.name for b in self.buffers)

    def views(self, buffers) -> tuple:
        """(q, k, v) for make_config's shared validation: unpacked buffers as they are, the parts of a packed
        buffer as [T, H, D] shapes. A packed buffer of the wrong shape raises ValueError naming it."""
        views = {}
        for x, buffer in zip(buffers, self.buffers):
            if not buffer.packed:
                views[buffer.holds[0]] = x
                continue
            shape = getattr(x, "shape", None)
            if shape is None or getattr(x, "dtype", None) is None:
                raise ValueError(f"{buffer.name} must be an array {buffer.layout}, got {type(x).__name__}")
            if len(shape) != 4 or shape[1] != len(buffer.holds):
                raise ValueError(f"{buffer.name} must be {buffer.layout}, got shape {tuple(shape)}")
            for tensor in buffer.holds:
                views[tensor] = jax.ShapeDtypeStruct((shape[0], shape[2], shape[3]), x.dtype)
        return tuple(views[t] for t in TENSORS)

    def kernel_inputs(self, buffers) -> tuple:
        """The q, k and v arguments of the handlers: the buffer holding each, itself (no slice, no copy)."""
        return tuple(buffers[self._where(t)[0]] for t in TENSORS)

    def split(self, buffers) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(q, k, v) as separate [T, H, D] arrays: slices, i.e. copies, of packed buffers."""
        parts = []
        for tensor in TENSORS:
            index, buffer = self._where(tensor)
            x = buffers[index]
            parts.append(x[:, buffer.holds.index(tensor)] if buffer.packed else x)
        q, k, v = parts
        return q, k, v

    def join(self, d_q, d_k, d_v) -> tuple:
        """Separate gradients assembled into the buffers' layout (the inverse of `split`)."""
        grads = dict(zip(TENSORS, (d_q, d_k, d_v)))
        return tuple(
            jnp.stack([grads[t] for t in b.holds], axis=1) if b.packed else grads[b.holds[0]] for b in self.buffers
        )

    def gradient_specs(self, config: AttentionConfig):
        """(shape, dtype, row axis) of each gradient the backward handler writes: each buffer's shape."""
        dtype = jnp.dtype(config.dtype)
        shapes = {
            "q": (config.capacity_q, config.num_heads_q, config.head_dim_qk),
            "k": (config.capacity_kv, config.num_heads_kv, config.head_dim_qk),
            "v": (config.capacity_kv, config.num_heads_kv, config.head_dim_v),
        }
        specs = []
        for b in self.buffers:
            rows, heads, dim = shapes[b.holds[0]]
            specs.append(((rows, len(b.holds), heads, dim) if b.packed else (rows, heads, dim), dtype, 0))
        return tuple(specs)

    def gradient_masks(self, valid_q: jax.Array, valid_kv: jax.Array) -> tuple:
        """Per gradient, which rows (and, packed, which parts of a row) hold a gradient: [T] or [T, parts]."""
        side = {"q": valid_q, "k": valid_kv, "v": valid_kv}
        return tuple(
            jnp.stack([side[t] for t in b.holds], axis=1) if b.packed else side[b.holds[0]] for b in self.buffers
        )


TABLE = {
    p.name: p
    for p in (
        Packing(
            "none",
            (
                Buffer("q", "[Tq, Hq, Dqk]", ("q",)),
                Buffer("k", "[Tkv, Hkv, Dqk]", ("k",)),
                Buffer("v", "[Tkv, Hkv, Dv]", ("v",)),
            ),
        ),
        Packing("kv", (Buffer("q", "[Tq, Hq, D]", ("q",)), Buffer("kv", "[Tkv, 2, Hkv, D]", ("k", "v")))),
        Packing("qkv", (Buffer("qkv", "[T, 3, H, D]", ("q", "k", "v")),)),
    )
}
assert tuple(TABLE) == PACKINGS, "the table and config.PACKINGS (the C++ enum's order) must name the same packings"
