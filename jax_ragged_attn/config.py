"""The static description of one ragged attention call, validated once.

Every backend receives an `AttentionConfig`: a frozen, hashable dataclass that holds everything that is
known at trace time. It is the graph-cache key on the cuDNN side and a `nondiff_argnums` entry in the
`custom_vjp`, so it must hold plain Python values only.

The entry points' keyword options travel as one `AttentionOptions` (frozen, with the public defaults,
validated when built); `make_config` combines it with the arrays' shapes into the `AttentionConfig`.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Mapping
from typing import Any, ClassVar, cast

import jax.numpy as jnp
import numpy as np

DIAGONAL_ALIGNMENTS = ("top_left", "bottom_right")
STATS_LAYOUTS = ("head_major", "token_major")
# "fa3": FlashAttention-3's kernels from an optional wheel, one of FA3_PROVIDERS (backends/fa3/providers.py).
IMPLEMENTATIONS = (None, "cudnn", "xla", "fa3")
# The wheels that provide FlashAttention-3's kernels, named by fa3_provider (None: the first installed that serves).
FA3_PROVIDERS = ("dew-flash-attn", "flash-attn3-jax")
# How q, k, v lie in memory on the cuDNN path (ffi/attention_config.h's Packing, in this order).
PACKINGS = ("none", "kv", "qkv")
XLA_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# How the cuDNN backward lays out its fp32 intermediates (dQ accumulator, softmax sums); see
# backends/cudnn/strategy.py. "fastest": the faster layout when its workspace stays within the documented bound;
# "lean_memory": always the one sized by the token capacity.
STRATEGIES = ("fastest", "lean_memory")


class MaskedConfig:
    """What a static call configuration with heads, a causal flag and a window derives from them; shared by
    AttentionConfig and KVCacheConfig."""

    # Declared by each subclass, a frozen dataclass; named here for the properties and describe() below.
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
    num_heads_q: int
    num_heads_kv: int
    is_causal: bool
    window_left: int | None
    window_right: int | None

    @property
    def group_size(self) -> int:
        return self.num_heads_q // self.num_heads_kv

    @property
    def left_bound(self) -> int | None:
        """How far left of the diagonal a key may sit, or None for no limit."""
        return self.window_left

    @property
    def right_bound(self) -> int | None:
        """How far right of the diagonal a key may sit, or None for no limit (causal means 0)."""
        if self.is_causal:
            return 0 if self.window_right is None else min(self.window_right, 0)
        return self.window_right

    def describe(self) -> str:
        fields = dataclasses.asdict(self)
        return ", ".join(f"{k}={v}" for k, v in fields.items())


@dataclasses.dataclass(frozen=True)
class AttentionConfig(MaskedConfig):
    """Shapes and options of one call; see `ragged_attention` for the meaning of each field."""

    num_seqs: int  # B: cu_seqlens has B + 1 entries
    capacity_q: int  # Tq: rows of q, padding included
    capacity_kv: int  # Tkv
    num_heads_q: int
    num_heads_kv: int
    head_dim_qk: int
    head_dim_v: int
    max_seqlen_q: int
    max_seqlen_kv: int
    dtype: str  # numpy name: "bfloat16", "float16", "float32"
    scale: float
    is_causal: bool
    diagonal_alignment: str
    window_left: int | None  # keys at most this far left of the diagonal; None = unbounded
    window_right: int | None  # keys at most this far right of the diagonal; None = unbounded
    stats_layout: str
    deterministic: bool = False  # cuDNN backward: bit-identical dQ/dK/dV run to run (slower, more memory)
    guard_workspace: bool = False  # cuDNN: canary bands around the workspace and outputs, verified after each call
    autotune: bool = False  # cuDNN: run the fastest of cuDNN's candidate plans, measured once (autotune.py)
    packing: str = "none"  # cuDNN: "kv" / "qkv" read a fused projection in place (packed.py)
    has_sinks: bool = False  # sinks were passed; ops.ragged.attend runs the op without them and applies sinks.py after
    strategy: str = "fastest"  # cuDNN backward: speed or workspace first (backends/cudnn/strategy.py)
    softcap: float = 0.0  # scores become softcap * tanh(score / softcap) before the mask; 0: no cap
    # False: the caller drops the stats (ops.ragged.attend sets it), so the cuDNN path never computes their -inf
    # rows and jax.debug_infs stays quiet. Direct callers of the launch keep the documented stats.
    return_stats: bool = True
    # The tokens per sequence implementation=None chooses a kernel by (backends/policy.py), when not this
    # call's own capacity_q / num_seqs: AttentionOptions.policy_tokens_per_sequence.
    policy_tokens_per_sequence: int | None = None
    # The xla path's (block_q, block_kv) rows (AttentionOptions.xla_block_size); None: its default, 128 each on
    # a GPU and 64 on a CPU (backends/xla/memory.py). The other backends ignore it.
    xla_block_size: tuple[int, int] | None = None
    fa3_provider: str | None = None  # implementation="fa3"'s kernels: one of FA3_PROVIDERS, None: the first serving


@dataclasses.dataclass(frozen=True)
class KVCacheConfig(MaskedConfig):
    """Shapes and options of one ragged_attention_with_kvcache call (hashable: a nondiff argument); index/kvcache.py
    spells out how its rows map to memory."""

    batch: int  # B
    seqlen_q: int  # Sq: each sequence's newest queries
    num_heads_q: int
    num_heads_kv: int
    head_dim_qk: int
    head_dim_v: int
    dtype: str  # numpy name
    paged: bool
    page_size: int  # paged: rows per page; contiguous: L (one "page" per sequence)
    num_pages: int  # paged: pages in the cache; contiguous: B
    max_pages: int  # paged: page_table.shape[1]; contiguous: 1
    scale: float
    is_causal: bool
    window_left: int | None  # keys at most this far left of the query's position; None: no limit
    window_right: int | None  # at most this far right; None: no limit
    has_sinks: bool = False  # sinks are an epilogue of the op layer: backends never see them
    softcap: float = 0.0  # scores become softcap * tanh(score / softcap) before the softmax; 0: no cap
    total_q: int = 0  # packed queries: q [T, Hq, D] over cu_seqlens_q, seqlen_q being max_seqlen_q; 0: [B, Sq]

    @property
    def capacity(self) -> int:
        """Rows a sequence can hold: L, or max_pages * page_size."""
        return self.max_pages * self.page_size

    @property
    def packed(self) -> bool:
        """q is [T, Hq, D] with cu_seqlens_q (the module docstring), not [B, Sq, Hq, D]."""
        return self.total_q > 0


def check_implementation(implementation) -> None:
    """Checked first of all (AttentionOptions does it first), before any array is looked at."""
    if implementation == "dew":  # a wheel, not a kernel family: FA3's kernels as dew-flash-attn builds them
        raise ValueError(
            'implementation="dew" is spelled implementation="fa3", fa3_provider="dew-flash-attn": '
            "dew-flash-attn is one provider of FlashAttention-3's kernels"
        )
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """The keyword options every entry point takes, validated once; see `ragged_attention` for their meaning.

    The public functions keep their keywords, build one of these first thing and pass it on whole (to
    make_config, to the implementations); segments and sharding read theirs from **kwargs with `split`.
    Values are normalised: local_window_size becomes a (left, right) pair of ints (or None), scale a float
    (or None: 1/sqrt(Dqk), resolved by make_config), flags Python bools. Shapes (max_seqlen) and arrays
    (sinks) are arguments, not options.
    """

    scale: float | None = None
    is_causal: bool = False
    diagonal_alignment: str = "top_left"
    local_window_size: int | tuple[int, int] | None = None
    stats_layout: str = "head_major"
    return_stats: bool = False
    implementation: str | None = None
    deterministic: bool = False
    check: bool | None = None  # None reads JAX_RAGGED_ATTN_CHECK when the call is traced (checks.check_enabled)
    autotune: bool = False
    strategy: str = "fastest"
    softcap: float | None = None  # None or 0: no cap; make_config stores 0.0 then
    # Internal, set by sharded_ragged_attention: the shape class (tokens per sequence) implementation=None
    # chooses by, its whole batch's T / B. A context-parallel device's call holds 2B slots for its pieces, most
    # of them empty, so its own T / B would put long documents in the short-sequence class (policy.py).
    policy_tokens_per_sequence: int | None = None
    xla_block_size: int | tuple[int, int] | None = None  # None, or (block_q, block_kv) rows; an int b: (b, b)
    fa3_provider: str | None = None  # None, or one of FA3_PROVIDERS: whose FlashAttention-3 kernels "fa3" runs

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> AttentionOptions:
        """The options among an entry point's arguments (its `locals()` first thing): the entry points take
        the same keywords, and copying each one by name into the options is how one gets dropped."""
        return cls(**{f.name: arguments[f.name] for f in dataclasses.fields(cls) if f.name in arguments})

    def __post_init__(self):
        check_implementation(self.implementation)
        if self.fa3_provider not in (None, *FA3_PROVIDERS):
            raise ValueError(f"fa3_provider must be None or one of {FA3_PROVIDERS}, got {self.fa3_provider!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if not isinstance(self.return_stats, bool):
            raise ValueError(
                f"return_stats must be a Python bool, got {type(self.return_stats).__name__} {self.return_stats!r}"
            )
        if self.diagonal_alignment not in DIAGONAL_ALIGNMENTS:
            raise ValueError(
                f"diagonal_alignment must be one of {DIAGONAL_ALIGNMENTS}, got {self.diagonal_alignment!r}"
            )
        if self.stats_layout not in STATS_LAYOUTS:
            raise ValueError(f"stats_layout must be one of {STATS_LAYOUTS}, got {self.stats_layout!r}")
        for name in ("is_causal", "deterministic", "autotune"):
            flag = getattr(self, name)
            if not isinstance(flag, (bool, np.bool_)):
                raise ValueError(f"{name} must be a Python bool, got {type(flag).__name__}")
            object.__setattr__(self, name, bool(flag))
        if self.check is not None and not isinstance(self.check, (bool, np.bool_)):  # check="false" must not mean "on"
            raise ValueError(f"check must be True, False or None, got {self.check!r}")
        if self.scale is not None:
            object.__setattr__(self, "scale", _static_scale(self.scale))
        object.__setattr__(self, "local_window_size", _normalize_window(self.local_window_size))
        object.__setattr__(self, "softcap", _static_softcap(self.softcap))
        hint = self.policy_tokens_per_sequence
        if hint is not None and (isinstance(hint, bool) or not isinstance(hint, (int, np.integer)) or hint < 1):
            raise ValueError(f"policy_tokens_per_sequence must be a positive int or None, got {hint!r}")
        if hint is not None:
            object.__setattr__(self, "policy_tokens_per_sequence", int(hint))
        object.__setattr__(self, "xla_block_size", _xla_block_size(self.xla_block_size))

    @classmethod
    def split(cls, kwargs: dict) -> tuple[AttentionOptions, dict]:
        """(the options among `kwargs`, the other keywords): for entry points that forward **kwargs."""
        names = {f.name for f in dataclasses.fields(cls)}
        return (
            cls(**{k: v for k, v in kwargs.items() if k in names}),
            {k: v for k, v in kwargs.items() if k not in names},
        )


def _static_scale(scale) -> float:
    try:
        scale = float(scale)
    except (TypeError, ValueError):
        # Also catches a traced scale (jax's ConcretizationTypeError is a TypeError): it is baked into the graph.
        raise ValueError(f"scale must be a static Python float, got {type(scale).__name__} {scale!r}") from None
    if not math.isfinite(scale) or abs(scale) > float(np.finfo(np.float32).max):
        # The kernels take it as float32: a finite float64 beyond float32's range would become inf there.
        raise ValueError(f"scale must be finite in float32, got {scale}")
    return scale


def _static_softcap(softcap) -> float | None:
    """None for no cap (None or 0, FlashAttention's spelling), else a positive float."""
    if softcap is None:
        return None
    if isinstance(softcap, (bool, np.bool_, str, bytes)):  # float(True) == 1.0, float("50") == 50.0: mistakes
        raise ValueError(f"softcap must be None or a positive Python float, got {type(softcap).__name__} {softcap!r}")
    try:
        softcap = float(softcap)
    except (TypeError, ValueError):
        # A traced softcap too: like scale, it is baked into the cuDNN graph and the xla path's tiles.
        raise ValueError(
            f"softcap must be None or a static positive Python float, got {type(softcap).__name__} {softcap!r}"
        ) from None
    if not math.isfinite(softcap) or softcap < 0 or softcap > float(np.finfo(np.float32).max):
        raise ValueError(f"softcap must be None, 0 (no cap) or a positive finite float, got {softcap}")
    return softcap or None


def _static_int(value, name: str, minimum: int | None) -> int:
    if isinstance(value, (bool, np.bool_)):  # operator.index(True) == 1: almost certainly a mistake
        raise ValueError(f"{name} must be a static Python int, got the bool {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(
            f"{name} must be a static Python int (it fixes the graph's shape), got {type(value).__name__} "
            f"{value!r}; pass it outside jax.jit or mark it static"
        ) from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _xla_block_size(block) -> tuple[int, int] | None:
    """None, or (block_q, block_kv) of ints >= 1: 64 -> (64, 64), (8, 128) -> (8, 128)."""
    if block is None:
        return None
    if isinstance(block, (tuple, list)) and len(block) == 2:
        q, kv = block
    elif isinstance(block, (tuple, list)):
        raise ValueError(f"xla_block_size must be None, an int or a (block_q, block_kv) pair, got {block!r}")
    else:
        q = kv = block
    return (_static_int(q, "xla_block_size[0] (block_q)", 1), _static_int(kv, "xla_block_size[1] (block_kv)", 1))


def _normalize_window(local_window_size) -> tuple[int | None, int | None] | None:
    """(left, right) with None for a side without limit, or None for no window.

    jax.nn.dot_product_attention spells the window as an int or a (left, right) pair; FlashAttention spells
    "no limit on this side" as -1, and any negative side means that here too:
    (-1, 0) -> (None, 0) (causal, any distance back), (128, -1) -> (128, None), -1 and (-1, -1) -> None.
    """
    if local_window_size is None:
        return None
    if isinstance(local_window_size, (tuple, list)):
        if len(local_window_size) != 2:
            raise ValueError(f"local_window_size must be an int or a (left, right) pair, got {local_window_size!r}")
        left, right = local_window_size
    else:
        left = right = local_window_size
    left = _static_int(left, "local_window_size[0] (left)", None)
    right = _static_int(right, "local_window_size[1] (right)", None)
    window = (None if left < 0 else left, None if right < 0 else right)
    return None if window == (None, None) else window


def check_array(x, name: str, rank: int, layout: str):
    """x is an array (or a jax.ShapeDtypeStruct) of this rank; else a ValueError naming it and `layout`."""
    shape = getattr(x, "shape", None)
    if shape is None or getattr(x, "dtype", None) is None:
        raise ValueError(f"{name} must be an array {layout}, got {type(x).__name__}")
    if len(shape) != rank:
        raise ValueError(f"{name} must have rank {rank} {layout}, got shape {tuple(shape)}")


def check_heads(q, k, v, sinks=None, *, k_name: str = "k", v_name: str = "v") -> None:
    """What both ops (ragged_attention, ragged_attention_with_kvcache) check of their arrays, on the last two axes
    of each (heads, head dim) whatever the rank: one dtype of XLA_DTYPES, k's head dim equal to q's, every
    head count and head dim >= 1, Hq a multiple of Hkv, and sinks None or a floating [Hq]. ValueError naming
    the argument; the caller checks the ranks first (check_array) and its own other axes."""
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, {k_name} and {v_name} must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in [np.dtype(d) for d in XLA_DTYPES]:
        raise ValueError(f"q must be bfloat16, float16 or float32, got {q.dtype}")
    hq, dqk = q.shape[-2:]
    hkv, dk = k.shape[-2:]
    if dk != dqk:
        raise ValueError(f"{k_name}'s head dim must equal q's ({dqk}), got {k_name} shape {tuple(k.shape)}")
    for name, x, axis, label in (
        ("q", q, -2, "Hq"),
        (k_name, k, -2, "Hkv"),
        ("q", q, -1, "Dqk"),
        (v_name, v, -1, "Dv"),
    ):
        if x.shape[axis] < 1:
            raise ValueError(f"{name}.shape[{x.ndim + axis}] ({label}) must be >= 1, got {x.shape[axis]}")
    if hq % hkv:
        raise ValueError(f"q's heads ({hq}) must be a multiple of {k_name}'s heads ({hkv})")
    if sinks is not None:
        check_array(sinks, "sinks", 1, "[Hq]")
        if sinks.shape[0] != hq:
            raise ValueError(f"sinks must be [Hq={hq}], one logit per query head, got shape {tuple(sinks.shape)}")
        if not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise ValueError(f"sinks must be a floating array, got {sinks.dtype}")


def masked_fields(options: AttentionOptions, head_dim_qk: int) -> dict:
    """The fields every MaskedConfig (both ops' configs) takes from the validated options: scale (1/sqrt(Dqk)
    by default), is_causal, the window's sides (None: no limit) and softcap (0.0: no cap)."""
    # AttentionOptions.__post_init__ has normalised the window to a (left, right) pair or None.
    window = cast("tuple[int, int] | None", options.local_window_size)
    window_left, window_right = window or (None, None)
    return dict(
        scale=1.0 / math.sqrt(head_dim_qk) if options.scale is None else options.scale,
        is_causal=options.is_causal,
        window_left=window_left,
        window_right=window_right,
        softcap=options.softcap or 0.0,
    )


def make_config(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_kv,
    options: AttentionOptions = AttentionOptions(),
    *,
    max_seqlen_q,
    max_seqlen_kv,
    sinks=None,
    packing: str = "none",
) -> AttentionConfig:
    """Checks every static property of the arguments; raises ValueError naming the argument.

    q, k, v: arrays or shapes (jax.ShapeDtypeStruct) [T, H, D]; for a packed layout, the parts' shapes.
    """
    if not isinstance(options, AttentionOptions):
        raise ValueError(f"options must be an AttentionOptions, got {type(options).__name__}")
    if packing not in PACKINGS:
        raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
    check_array(q, "q", 3, "[Tq, Hq, Dqk]")
    check_array(k, "k", 3, "[Tkv, Hkv, Dqk]")
    check_array(v, "v", 3, "[Tkv, Hkv, Dv]")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_kv", cu_seqlens_kv)):
        check_array(cu, name, 1, "[B + 1]")
        if not jnp.issubdtype(cu.dtype, jnp.integer):  # any width: made int32 (index/__init__.py as_int32)
            raise ValueError(f"{name} must have an integer dtype, got {cu.dtype}")
        if cu.shape[0] < 2:
            raise ValueError(f"{name} must have B + 1 >= 2 entries, got shape {tuple(cu.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_kv.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_kv must both be [B + 1], got {tuple(cu_seqlens_q.shape)} "
            f"and {tuple(cu_seqlens_kv.shape)}"
        )

    check_heads(q, k, v, sinks)
    tq, hq, dqk = q.shape
    tkv, hkv, _ = k.shape
    if v.shape[0] != tkv or v.shape[1] != hkv:
        raise ValueError(f"v must be [Tkv={tkv}, Hkv={hkv}, Dv] like k, got {tuple(v.shape)}")
    for name, dim in (("q.shape[0] (Tq)", tq), ("k.shape[0] (Tkv)", tkv)):
        if dim < 1:
            raise ValueError(f"{name} must be >= 1, got {dim}")
    return AttentionConfig(
        num_seqs=int(cu_seqlens_q.shape[0]) - 1,
        capacity_q=int(tq),
        capacity_kv=int(tkv),
        num_heads_q=int(hq),
        num_heads_kv=int(hkv),
        head_dim_qk=int(dqk),
        head_dim_v=int(v.shape[2]),
        # Clamped to the capacities: no sequence can be longer than its buffer, so results are unchanged,
        # and a bound passed "to be safe" (10**9) sizes nothing on any path.
        max_seqlen_q=min(_static_int(max_seqlen_q, "max_seqlen_q", 1), int(tq)),
        max_seqlen_kv=min(_static_int(max_seqlen_kv, "max_seqlen_kv", 1), int(tkv)),
        dtype=np.dtype(q.dtype).name,
        diagonal_alignment=options.diagonal_alignment,
        stats_layout=options.stats_layout,
        deterministic=options.deterministic,
        autotune=options.autotune,
        strategy=options.strategy,
        packing=packing,
        has_sinks=sinks is not None,
        policy_tokens_per_sequence=options.policy_tokens_per_sequence,
        xla_block_size=cast("tuple[int, int] | None", options.xla_block_size),  # normalised by AttentionOptions
        fa3_provider=options.fa3_provider,
        **masked_fields(options, dqk),
    )
