"""What a backend of each op provides: the surface the registry and the op layer call.

A backend is a module; `typing.Protocol` describes a module's attributes as well as a class's, so
`isinstance(module, RaggedBackend)` (runtime_checkable) checks that a registered module has every required
name, and a type checker checks the signatures. tests/test_layout.py holds every registered backend to its
op's protocol. Optional members are listed in each docstring: the registry looks them up with getattr.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class RaggedBackend(Protocol):
    """A `ragged_attention` backend (registry "ragged").

    Optional members:
        READS_INDEX: bool                     # True: unsupported_reason(config, cu_seqlens_q, cu_seqlens_kv,
                                              # seqused) also reads the index (FA3 proves a top-left mask)
        stats_gradient_unsupported(config) -> str | None   # why the stats cannot be differentiated here
        attend_with_sinks(buffers, index, sinks, config) -> out   # sinks folded into the kernel's backward
        auto_candidate(config) -> bool        # implementation=None may pick it for this call
    """

    NAME: str

    def unsupported_reason(self, config, *index) -> str | None:
        """None when it can serve the call here, else one sentence naming the cause."""

    def attend(self, buffers: tuple, index, config, *, stats: Any = True) -> tuple:
        """(out, stats or None) of the buffers laid out as config.packing says (index/packings.py); index an
        index.RaggedIndex; stats False (not needed), "raw" (an epilogue masks them) or True (the documented
        stats). Differentiable in the buffers and the stats."""


@runtime_checkable
class KVCacheBackend(Protocol):
    """A `ragged_attention_with_kvcache` backend (registry "kvcache"). Optional: auto_candidate(config);
    zeroes_rows_without_keys(config) -> bool, True where attend's out is already exactly 0 on every query
    without keys (the op layer then leaves out its own mask of them); READS_TABLE_UNCHECKED = True, where its
    kernel reads the page table without bounds (the op layer then passes every entry in range, made so with
    the lengths' clamp in one launch: shared/cache_index.py)."""

    NAME: str

    def unsupported_reason(self, config) -> str | None:
        """config a config.KVCacheConfig; None when it can serve the call here."""

    def attend(self, q, k_cache, v_cache, lengths, page_table, config) -> tuple:
        """(out [B, Sq, Hq, Dv], lse [B, Hq, Sq] float32), forward only. lengths: cache_seqlens clamped into
        [0, capacity]; page_table None (contiguous) or int32 as passed (entries outside [0, num_pages) are the
        backend's to keep from being read; with READS_TABLE_UNCHECKED, page 0 instead). Rows with no keys may
        hold anything: the op layer masks them (unless zeroes_rows_without_keys says they are 0)."""

    def attend_packed(self, q, k_cache, v_cache, lengths, cu_seqlens_q, page_table, config) -> tuple:
        """Packed queries (config.packed; unsupported_reason declines those it cannot serve): (out [T, Hq, Dv],
        lse [Hq, T] float32) of q [T, Hq, D], sequence b's queries the rows index.kvcache.packed_query_rows
        gives it. cu_seqlens_q int32 [B + 1] as passed (sanitising is the backend's); the rest as attend."""


PROTOCOLS = {"ragged": RaggedBackend, "kvcache": KVCacheBackend}
