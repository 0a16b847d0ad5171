"""The named packed-batch workloads, defined once for the benchmark, the tests and the self-check.

Every length draw is `numpy.random.default_rng(seed).integers(low, high, size, endpoint=True)`; when a total
is given, the batch is trimmed from the last sequence backwards (each keeps at least one token) until it
holds exactly that many tokens. That is the rule the self-check's reference batch was drawn with, so W1 is
the batch behind the figures in README.md: 16 sequences of 193..3980 tokens, 32,768 in all.

    W1            bf16, causal, 16 sequences of 128..4096 trimmed to 32,768 tokens, 16 heads, head dim 128
    W2            4 sequences of 8k..16k, GQA 32 query / 8 kv heads, head dim 128, causal
    W3            512 sequences of 16..256, 8 heads, head dim 64, causal
    W4-d64/-d256  W1 with head dim 64 / 256
    W4-noncausal  W1 without the causal mask
    W5            119 sequences of 64..1022 trimmed to 65,536 tokens, 16 heads, head dim 128, causal
    tiny          a few short sequences: CPU smoke tests and the host-overhead measurement
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_ragged_attn.index import cu_seqlens_from_lengths

DIRECTIONS = ("forward", "backward", "forward+backward")
# A backward pass does five matmuls of the forward's size (recomputing S = q.k, then dV, dP, dQ, dK) against
# the forward's two; the usual convention (FlashAttention's, cuDNN's samples) counts it as 2.5 forwards.
_DIRECTION_FACTOR = {"forward": 1.0, "backward": 2.5, "forward+backward": 3.5}


def seeded_lengths(num_seqs: int, low: int, high: int, *, total: int | None = None, seed: int = 0) -> tuple[int, ...]:
    """num_seqs lengths uniform in [low, high], optionally trimmed from the end to sum to exactly `total`.

    With total=32768: [3504, ..., 3980, 3023] (33,269 tokens) -> [3504, ..., 3980, 1722].
    """
    lengths = np.random.default_rng(seed).integers(low, high, size=num_seqs, endpoint=True)
    if total is not None:
        if total < num_seqs:
            raise ValueError(f"total must leave every one of the {num_seqs} sequences a token, got {total}")
        excess = int(lengths.sum()) - total
        for i in range(num_seqs - 1, -1, -1):
            cut = max(min(excess, int(lengths[i]) - 1), 0)
            lengths[i] -= cut
            excess -= cut
        if excess > 0:
            raise ValueError(f"cannot trim {num_seqs} sequences of {low}..{high} to {total} tokens")
    return tuple(int(n) for n in lengths)


def attention_flops(seqlens, num_heads_q: int, head_dim: int, causal: bool) -> float:
    """Useful forward FLOPs over real tokens: 4 * s^2 * h * d per sequence (q.k and p.v), halved when causal.

    Padding never counts: a padded system that computes on it gets no credit for it.
    """
    flops = sum(4.0 * s * s * num_heads_q * head_dim for s in seqlens)
    return flops / 2 if causal else flops


def direction_flops(forward_flops: float, direction: str) -> float:
    """FLOPs of one direction given the forward's: backward 2.5x, forward+backward 3.5x."""
    if direction not in _DIRECTION_FACTOR:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    return forward_flops * _DIRECTION_FACTOR[direction]


@dataclasses.dataclass(frozen=True)
class Workload:
    """One packed self-attention batch: the same lengths for queries and keys."""

    name: str
    description: str
    seqlens: tuple[int, ...]
    num_heads_q: int
    num_heads_kv: int
    head_dim: int  # Dqk = Dv
    dtype: str = "bfloat16"
    causal: bool = True

    @property
    def num_seqs(self) -> int:
        return len(self.seqlens)

    @property
    def total_tokens(self) -> int:
        return sum(self.seqlens)

    @property
    def max_seqlen(self) -> int:
        return max(self.seqlens)

    def cu_seqlens(self) -> np.ndarray:
        return cu_seqlens_from_lengths(self.seqlens)

    def flops(self, direction: str = "forward") -> float:
        return direction_flops(attention_flops(self.seqlens, self.num_heads_q, self.head_dim, self.causal), direction)

    def summary(self) -> str:
        heads = (
            f"{self.num_heads_q} heads"
            if self.num_heads_q == self.num_heads_kv
            else f"{self.num_heads_q}/{self.num_heads_kv} heads (GQA)"
        )
        return (
            f"{self.name}: {self.num_seqs} sequences of {min(self.seqlens)}..{self.max_seqlen} "
            f"({self.total_tokens:,} tokens), {heads}, head dim {self.head_dim}, {self.dtype}, "
            f"{'causal' if self.causal else 'non-causal'}"
        )

    def packed_inputs(self, seed: int = 0):
        """(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], cu_seqlens int32 [B + 1]) on the default device.

        Standard normal values drawn by jax.random on the device: a host draw of W2's 200M-element q would
        take seconds and gigabytes of float64.
        """
        dtype = jnp.dtype(self.dtype)
        t, d = self.total_tokens, self.head_dim
        kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
        q = jax.random.normal(kq, (t, self.num_heads_q, d), dtype)
        k = jax.random.normal(kk, (t, self.num_heads_kv, d), dtype)
        v = jax.random.normal(kv, (t, self.num_heads_kv, d), dtype)
        return q, k, v, jnp.asarray(self.cu_seqlens())


def _w1_lengths() -> tuple[int, ...]:
    return seeded_lengths(16, 128, 4096, total=32768)


def _build() -> dict[str, Workload]:
    w1 = Workload("W1", "16 sequences, 32,768 tokens: the README's reference batch", _w1_lengths(), 16, 16, 128)
    workloads = [
        w1,
        Workload("W2", "4 long sequences, GQA", seeded_lengths(4, 8192, 16384), 32, 8, 128),
        Workload("W3", "512 short sequences", seeded_lengths(512, 16, 256), 8, 8, 64),
        dataclasses.replace(w1, name="W4-d64", description="W1 with head dim 64", head_dim=64),
        dataclasses.replace(w1, name="W4-d256", description="W1 with head dim 256", head_dim=256),
        dataclasses.replace(w1, name="W4-noncausal", description="W1 without the causal mask", causal=False),
        Workload("W5", "119 medium sequences", seeded_lengths(119, 64, 1022, total=65536), 16, 16, 128),
        Workload("W6", "16 sequences of 128..8192, GQA", seeded_lengths(16, 128, 8192), 32, 8, 128),
        Workload("tiny", "a smoke test that runs anywhere", seeded_lengths(4, 8, 64), 4, 2, 32),
    ]
    return {w.name: w for w in workloads}


WORKLOADS: dict[str, Workload] = _build()
# What `--workloads all` (the default) runs; "tiny" is for smoke tests.
DEFAULT_WORKLOADS = ("W1", "W2", "W3", "W4-d64", "W4-d256", "W4-noncausal", "W5")


def select(spec: str) -> list[Workload]:
    """Workloads named by a comma-separated list; "W4" means every W4-* and "all" the default set."""
    chosen: list[Workload] = []
    for token in (t.strip() for t in spec.split(",")):
        if not token:
            continue
        names = (
            list(DEFAULT_WORKLOADS)
            if token == "all"
            else [token]
            if token in WORKLOADS
            else [n for n in WORKLOADS if n.startswith(token + "-")]
        )
        if not names:
            raise ValueError(f"unknown workload {token!r}; choose from {', '.join(WORKLOADS)} or 'all'")
        chosen += [WORKLOADS[n] for n in names if WORKLOADS[n] not in chosen]
    if not chosen:
        raise ValueError("no workload selected")
    return chosen
