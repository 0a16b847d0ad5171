"""The model of the main job: a pre-norm byte-level decoder, with its attention passed in as a callback.

One definition of the decoder, shared with the training-step benchmark (benchmarks/model_step.py): Block
takes its attention as a callback attend(attention_module, x), so that the same parameters run packed
(RaggedSelfAttention), padded (jax.nn.dot_product_attention), or over a KV cache (generation).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jax_ragged_attn.flax import RaggedSelfAttention

VOCAB = 256  # bytes


@dataclasses.dataclass(frozen=True)
class Setup:
    """One run's model, batches and schedule (the CLI's flags; tools/lm/cli.py's PRESETS give the defaults)."""

    width: int
    heads: int
    kv_heads: int
    layers: int
    capacity: int  # tokens (bytes) per packed batch
    max_seqlen: int
    max_seqs: int
    steps: int
    lr: float
    window_bytes: int
    eval_bytes: int
    dtype: str
    max_bits_per_byte: float


class Block(nnx.Module):
    """Pre-norm decoder block: x + attention(norm(x)), then x + MLP(norm(x)) (GELU, hidden `hidden`)."""

    def __init__(
        self,
        width: int,
        heads: int,
        kv_heads: int,
        *,
        dtype,
        implementation=None,
        hidden: int | None = None,
        head_dim: int | None = None,
        rngs: nnx.Rngs,
    ):
        dtype = jnp.dtype(dtype)
        hidden = hidden or 4 * width
        self.attention_norm = nnx.RMSNorm(width, dtype=dtype, rngs=rngs)
        self.attention = RaggedSelfAttention(
            width,
            heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            is_causal=True,
            dtype=dtype,
            implementation=implementation,
            rngs=rngs,
        )
        self.mlp_norm = nnx.RMSNorm(width, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(width, hidden, use_bias=False, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(hidden, width, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x, attend):
        x = x + attend(self.attention, self.attention_norm(x))
        return x + self.mlp(x)

    def mlp(self, x):
        return self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


def split_heads(qkv, q, kv):
    """`RaggedSelfAttention.project`'s output as (q [..., Hq, D], k [..., Hkv, D], v [..., Hkv, D])."""
    if qkv is not None:
        return qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
    return q, kv[..., 0, :, :], kv[..., 1, :, :]


def packed_attend(cu_seqlens, positions, max_seqlen: int):
    """attend for packed tokens [T, d]: the module's own ragged attention (cuDNN where it serves)."""

    def attend(attention, x):
        return attention(x, cu_seqlens, positions, max_seqlen=max_seqlen)

    return attend


def padded_attend(lengths, positions, implementation):
    """attend for padded rows [R, S, d]: the same projections around jax.nn.dot_product_attention."""

    def attend(attention, x):
        q, k, v = split_heads(*attention.project(x, positions))
        out = jax.nn.dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            query_seq_lengths=lengths,
            key_value_seq_lengths=lengths,
            implementation=implementation,
        )
        return attention.project_out(out)

    return attend


class ByteLM(nnx.Module):
    """Bytes -> next-byte logits (float32). `__call__` takes a packed batch; `padded` the same model on
    [rows, S] padded rows through jax.nn.dot_product_attention (the side-by-side); `forward` any attend."""

    def __init__(self, setup: Setup, implementation=None, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(setup.dtype)
        self.embed = nnx.Embed(VOCAB, setup.width, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List(
            [
                Block(setup.width, setup.heads, setup.kv_heads, dtype=dtype, implementation=implementation, rngs=rngs)
                for _ in range(setup.layers)
            ]
        )
        self.norm = nnx.RMSNorm(setup.width, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(setup.width, VOCAB, use_bias=False, dtype=dtype, rngs=rngs)
        self.max_seqlen = setup.max_seqlen
        self.dtype = dtype

    def __call__(self, tokens, cu_seqlens, positions):
        return self.forward(tokens, packed_attend(cu_seqlens, positions, self.max_seqlen))

    def padded(self, tokens, lengths, implementation=None):
        """tokens [R, S], lengths [R] -> logits [R, S, 256], attention by jax.nn.dot_product_attention."""
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        return self.forward(tokens, padded_attend(lengths, positions, implementation))

    def forward(self, tokens, attend):
        x = self.embed_tokens(tokens)
        for block in self.blocks:
            x = block(x, attend)
        return self.logits(x)

    def embed_tokens(self, tokens):
        """A one-hot matmul: exact, and its backward is a [256, T] @ [T, d] matmul, not a scatter-add."""
        table = self.embed.embedding[...].astype(self.dtype)
        return jnp.dot(jax.nn.one_hot(tokens, VOCAB, dtype=self.dtype), table)

    def logits(self, x):
        return self.head(self.norm(x)).astype(jnp.float32)


def _nll(logits, targets, mask):
    """(summed negative log-likelihood in nats over masked positions, their count). The target's logit is
    read through a one-hot product, whose backward is elementwise (a gather's would be a scatter)."""
    picked = jnp.sum(logits * jax.nn.one_hot(targets, VOCAB, dtype=logits.dtype), axis=-1)
    nll = jax.nn.logsumexp(logits, axis=-1) - picked
    # `where`, not a product: padded rows past a sequence's end may hold anything, and NaN * 0 is NaN.
    return jnp.sum(jnp.where(mask, nll, 0.0)), jnp.sum(mask)


def packed_loss(model, batch):
    total, count = _nll(
        model(batch["tokens"], batch["cu_seqlens"], batch["positions"]), batch["targets"], batch["loss_mask"]
    )
    return total / jnp.maximum(count, 1)


def padded_loss(model, batch, implementation):
    total, count = _nll(
        model.padded(batch["tokens"], batch["lengths"], implementation), batch["targets"], batch["loss_mask"]
    )
    return total / jnp.maximum(count, 1)


@nnx.jit
def eval_nll(model, batch):
    return _nll(model(batch["tokens"], batch["cu_seqlens"], batch["positions"]), batch["targets"], batch["loss_mask"])
