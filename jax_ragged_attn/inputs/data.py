"""Documents packed into fixed-shape token buffers for ragged attention: NumPy, on the host, no JAX.

    from jax_ragged_attn.inputs.data import pack_documents
    batches = pack_documents(docs, capacity=4096, max_seqs=32, max_seqlen=1024)
    print(f"fill rate {batches.fill_rate:.1%}")   # known before the first batch when docs is a list
    for epoch in range(3):
        for batch in batches:   # the same batches every epoch; each has the same shapes: tokens [4096], ...
            loss = train_step(batch.arrays())

The result is re-iterable: each pass packs the stored input again, lazily (a large input is never held),
from the same rng state, so every pass yields the same batches. A generator (or any iterator) can be read only
once: its packer gives one pass, and a second raises RuntimeError instead of yielding nothing.

A batch lays its sequences back to back from row 0 (the THD layout); rows past cu_seqlens[-1] are padding.
Three documents a = [7, 8, 9], b = [5], c = [4, 6] in capacity 8, max_seqs 4:

    tokens      = [7, 8, 9, 5, 4, 6, 0, 0]     (pad_id 0 past the documents)
    cu_seqlens  = [0, 3, 4, 6, 6]              (the unused fourth slot repeats the last offset)
    positions   = [0, 1, 2, 0, 0, 1, 0, 0]     (restart at 0 in every sequence: RoPE / position tables)
    segment_ids = [1, 1, 1, 2, 3, 3, 0, 0]     (sequences 1..B in row order, 0 = padding)
    targets     = [8, 9, 0, 0, 6, 0, 0, 0]     (targets[t] = tokens[t + 1] within the same sequence)
    loss_mask   = [T, T, F, F, T, F, F, F]     (row t predicts targets[t]; never across a boundary)

The mask is for next-token targets: loss_mask[t] is True exactly when row t + 1 holds the next token of the
same sequence, so the last token of every sequence, and every padding row, predicts nothing. Train with
`cross_entropy(logits[t], targets[t])` weighted by loss_mask: no shift to get wrong at a boundary.

Documents longer than max_seqlen are split into consecutive pieces of max_seqlen tokens (the last piece holds
the remainder; a document of 2.5 * max_seqlen tokens gives pieces of max_seqlen, max_seqlen, max_seqlen / 2).
Each piece is a sequence of its own: positions restart at 0, attention does not reach back into the previous
piece, and the last token of a piece predicts nothing (the first token of the next piece is lost as a target:
one label per piece). Pieces of one document may land in different batches, in any order;
`document_index` and `document_offset` say where every sequence came from. Empty documents are skipped.

Packing is greedy first-fit-decreasing over a buffer of `buffer_size` pieces: the buffer's pieces are sorted
longest first and each goes into the first open batch with room for its tokens and a free sequence slot.
While more input follows, the least-filled batch of a buffer is not emitted; its pieces join the next buffer,
where they can fill gaps. Within a batch the sequences are ordered by (document, offset), so segment ids
follow the input order. With rng, equal-length pieces are placed and batches emitted in a random order.

Context parallelism (`context_parallel_devices=n`): batches come out ready for
`sharded_ragged_attention(..., token_axis=..., load_balance=True)` on n devices, with no reorder in the
training step. The per-token arrays (tokens, targets, loss_mask, positions, segment_ids) are in the
dual-chunk order - exactly `reorder_for_load_balance(x, n)` of the natural batch: the 2n chunks of T/(2n)
rows, device r's shard holding chunks r and 2n-1-r - while cu_seqlens (and document_index/document_offset)
keep describing the natural packed order, as the op expects. The example above with n = 2 (chunks of 2
rows; the same with balance_causal_work=False):

    tokens      = [7, 8, 0, 0, 9, 5, 4, 6]     (natural chunks 0, 3 | 1, 2)
    cu_seqlens  = [0, 3, 4, 6, 6]              (unchanged: the natural order)

By default (balance_causal_work=True) the packer also chooses the order of each batch's sequences so that
every device gets close to 1/n of the batch's causal work (a sequence of L tokens costs L (L + 1) / 2
query-key pairs; see jax_ragged_attn.parallel.load_balance.balanced_document_order), rather than the input order:
sequences stay contiguous in the natural order and may straddle device boundaries. `batch.natural_order()`
gives the batch back in the natural row order.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections.abc import Iterable, Iterator

import numpy as np

from jax_ragged_attn.parallel.load_balance import _int, _positive_int, balanced_document_order, dual_chunk_rows

_INT32 = np.iinfo(np.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class PackedDocuments:
    """One packed batch. Every array has a fixed shape: T = capacity, B = max_seqs. Read fields as
    attributes (batch.tokens) or keys (batch["tokens"]); `arrays()` gives the ones a model consumes."""

    tokens: np.ndarray  # [T] int32, pad_id past cu_seqlens[-1]
    targets: np.ndarray  # [T] int32: tokens[t + 1] where loss_mask[t], else pad_id
    loss_mask: np.ndarray  # [T] bool: row t predicts targets[t], the next token of its own sequence
    positions: np.ndarray  # [T] int32, 0 at every sequence's first token; 0 on padding rows
    segment_ids: np.ndarray  # [T] int32, 1..num_seqs in row order, 0 on padding rows
    cu_seqlens: np.ndarray  # [B + 1] int32; unused slots repeat the last offset (zero-length sequences)
    document_index: np.ndarray  # [B] int64: the input document each sequence comes from (-1: unused slot)
    document_offset: np.ndarray  # [B] int64: where in that document the sequence starts (-1: unused slot)
    # n when the per-token arrays are in the dual-chunk order for n context-parallel devices (cu_seqlens,
    # document_index and document_offset always describe the natural order); None: natural order.
    context_parallel_devices: int | None = None

    @property
    def num_seqs(self) -> int:
        """Sequences (document pieces) in this batch."""
        return int(np.sum(self.document_index >= 0))

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens in this batch."""
        return int(self.cu_seqlens[-1])

    @property
    def fill_rate(self) -> float:
        """Real tokens / capacity."""
        return self.num_tokens / self.tokens.shape[0]

    def __getitem__(self, key: str) -> np.ndarray:
        if key not in _FIELDS:
            raise KeyError(f"{key!r}: a packed batch has {', '.join(_FIELDS)}")
        return getattr(self, key)

    def keys(self):
        return _FIELDS

    def arrays(self) -> dict[str, np.ndarray]:
        """The per-token arrays and cu_seqlens, as a dict ready for jax.device_put / a jitted step."""
        return {key: getattr(self, key) for key in (*_TOKEN_FIELDS, "cu_seqlens")}

    def natural_order(self) -> PackedDocuments:
        """This batch with its per-token arrays in the natural packed order (itself if they already are):
        what restore_order(x, n) gives for each of them."""
        n = self.context_parallel_devices
        if n is None:
            return self
        rows = dual_chunk_rows(self.tokens.shape[0], n, inverse=True)
        return dataclasses.replace(
            self, context_parallel_devices=None, **{key: getattr(self, key)[rows] for key in _TOKEN_FIELDS}
        )


# The arrays (read as batch[key]); context_parallel_devices describes them and is an attribute only.
_FIELDS = tuple(field.name for field in dataclasses.fields(PackedDocuments) if field.name != "context_parallel_devices")
# The [T] arrays, the ones the dual-chunk order permutes.
_TOKEN_FIELDS = ("tokens", "targets", "loss_mask", "positions", "segment_ids")

# A piece of a document: (document index, offset in the document, its tokens).
_Piece = tuple[int, int, np.ndarray]


class DocumentPacker(Iterable[PackedDocuments]):
    """What `pack_documents` returns: the packing of `docs`, iterated as often as wanted, the same batches on
    every pass (each pass packs the stored input again, reading it lazily, from the same rng state).

    A one-shot input (an iterator or generator, which one read consumes) gives one pass; a second raises
    RuntimeError rather than yield no batch. Pass a list, or an iterable whose iter() starts over, to iterate
    again (or call pack_documents again with a fresh generator).

    Attributes over one whole pass: batches, tokens (real tokens), documents (non-empty documents), pieces
    (sequences) and fill_rate = tokens / (batches * capacity). Re-readable input: known before iterating (the
    first read packs the input once without building batches, unless a pass has run to its end). One-shot
    input: the counts of its one pass so far (the whole pass once it has ended), and fill_rate raises before
    its first batch. The arguments as given: capacity, max_seqs, max_seqlen, buffer_size, pad_id, rng,
    context_parallel_devices, balance_causal_work. `iter(packer)` is a `PackingPass`, which counts what it
    has emitted.
    """

    def __init__(
        self,
        docs: Iterable,
        capacity: int,
        *,
        max_seqs: int,
        max_seqlen: int | None = None,
        buffer_size: int = 1024,
        pad_id: int = 0,
        rng: np.random.Generator | None = None,
        context_parallel_devices: int | None = None,
        balance_causal_work: bool = True,
    ):
        self.capacity = _positive_int(capacity, "capacity")
        self.max_seqs = _positive_int(max_seqs, "max_seqs")
        self.max_seqlen = self.capacity if max_seqlen is None else _positive_int(max_seqlen, "max_seqlen")
        if self.max_seqlen > self.capacity:
            raise ValueError(
                f"max_seqlen ({self.max_seqlen}) must be <= capacity ({self.capacity}): a sequence "
                "must fit in one batch"
            )
        if self.capacity > _INT32.max:
            raise ValueError(f"capacity must fit int32 offsets (<= {_INT32.max}), got {self.capacity}")
        self.buffer_size = _positive_int(buffer_size, "buffer_size")
        self.pad_id = _int(pad_id, "pad_id")
        if not _INT32.min <= self.pad_id <= _INT32.max:
            raise ValueError(f"pad_id must fit int32, got {self.pad_id}")
        if rng is not None and not isinstance(rng, np.random.Generator):
            raise ValueError(f"rng must be a numpy.random.Generator or None, got {type(rng).__name__}")
        # One draw from the caller's generator seeds this packer's own: every pass of this packer starts from
        # the same state (the same batches each time), while a caller who builds a packer per epoch from one
        # generator still gets a new order each epoch, as when the packer drew from it directly.
        self._rng = None if rng is None else np.random.default_rng(int(rng.integers(0, 2**63 - 1)))
        self.rng = rng
        self.context_parallel_devices = (
            None
            if context_parallel_devices is None
            else _positive_int(context_parallel_devices, "context_parallel_devices")
        )
        if self.context_parallel_devices is not None and self.capacity % (2 * self.context_parallel_devices):
            raise ValueError(
                f"capacity ({self.capacity}) must be a multiple of 2 * context_parallel_devices = "
                f"{2 * self.context_parallel_devices}: the dual-chunk order cuts it into 2 chunks per "
                "device"
            )
        if not isinstance(balance_causal_work, (bool, np.bool_)):
            raise ValueError(
                f"balance_causal_work must be a bool, got {type(balance_causal_work).__name__} {balance_causal_work!r}"
            )
        self.balance_causal_work = bool(balance_causal_work)
        if isinstance(docs, (str, bytes)) or not isinstance(docs, Iterable):
            raise ValueError(f"docs must be an iterable of 1-D integer token arrays, got {type(docs).__name__}")
        self._docs = docs
        self._one_shot = isinstance(docs, Iterator)  # a generator, a file, iter(list): one read consumes it
        self._only_pass: PackingPass | None = None  # a one-shot input's pass
        self._totals: PackingPass | None = None  # a finished pass: the counts of every pass

    def __iter__(self) -> PackingPass:
        if not self._one_shot:
            return PackingPass(self, self._docs)
        if self._only_pass is not None:
            raise RuntimeError(
                "pack_documents was given a one-shot iterator (a generator or iterator, which one read consumes) "
                "and its pass has already started: a second pass would yield no batch. To iterate again, pass a "
                "list, or an iterable whose iter() starts over (a class with an __iter__ generator method), or "
                "call pack_documents again with a fresh generator"
            )
        self._only_pass = PackingPass(self, self._docs)
        return self._only_pass

    def _counts(self) -> PackingPass | None:
        """A pass whose counts are those of a whole pass (a one-shot input's: so far), or None before any."""
        if self._one_shot:
            return self._only_pass
        if self._totals is None:  # count a pass: pack the pieces' lengths, build no batch
            counting = PackingPass(self, self._docs)
            while counting._next_bin() is not None:
                pass
        return self._totals

    @property
    def batches(self) -> int:
        counts = self._counts()
        return 0 if counts is None else counts.batches

    @property
    def tokens(self) -> int:
        counts = self._counts()
        return 0 if counts is None else counts.tokens

    @property
    def documents(self) -> int:
        counts = self._counts()
        return 0 if counts is None else counts.documents

    @property
    def pieces(self) -> int:
        counts = self._counts()
        return 0 if counts is None else counts.pieces

    @property
    def fill_rate(self) -> float:
        """Real tokens / (batches * capacity) over a whole pass (0.0 when there is no batch); for a one-shot
        input over the batches emitted so far, RuntimeError before the first."""
        counts = self._counts()
        if counts is None or not (counts.batches or counts.finished):
            raise RuntimeError(
                "fill_rate is not known before the first batch: docs is a one-shot iterator, which "
                "the packer cannot read ahead; read fill_rate after iterating, or pass a list (or "
                "an iterable whose iter() starts over) to know it up front"
            )
        return counts.fill_rate

    def _batch(self, pieces: list[_Piece]) -> PackedDocuments:
        n = self.context_parallel_devices
        if n is not None and self.balance_causal_work:
            order = balanced_document_order([len(p[2]) for p in pieces], n, self.capacity)
            pieces = [pieces[i] for i in order]
        batch = self._natural_batch(pieces)
        if n is None:
            return batch
        rows = dual_chunk_rows(self.capacity, n)
        return dataclasses.replace(
            batch, context_parallel_devices=n, **{key: getattr(batch, key)[rows] for key in _TOKEN_FIELDS}
        )

    def _natural_batch(self, pieces: list[_Piece]) -> PackedDocuments:
        """The batch of these pieces, in this order, in the natural packed order."""
        t, b = self.capacity, self.max_seqs
        tokens = np.full(t, self.pad_id, np.int32)
        targets = np.full(t, self.pad_id, np.int32)
        loss_mask = np.zeros(t, bool)
        positions = np.zeros(t, np.int32)
        segment_ids = np.zeros(t, np.int32)
        document_index = np.full(b, -1, np.int64)
        document_offset = np.full(b, -1, np.int64)
        lengths = np.zeros(b, np.int64)
        start = 0
        for s, (index, offset, piece) in enumerate(pieces):
            n = len(piece)
            rows = slice(start, start + n)
            tokens[rows] = piece
            targets[start : start + n - 1] = piece[1:]
            loss_mask[start : start + n - 1] = True
            positions[rows] = np.arange(n)
            segment_ids[rows] = s + 1
            document_index[s], document_offset[s], lengths[s] = index, offset, n
            start += n
        cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        return PackedDocuments(
            tokens=tokens,
            targets=targets,
            loss_mask=loss_mask,
            positions=positions,
            segment_ids=segment_ids,
            cu_seqlens=cu_seqlens,
            document_index=document_index,
            document_offset=document_offset,
        )


class PackingPass(Iterator[PackedDocuments]):
    """One pass of a DocumentPacker over its input: the batches, and counts of what it has emitted so far
    (batches, tokens, documents, pieces, fill_rate; finished once the input has run out)."""

    def __init__(self, packer: DocumentPacker, docs: Iterable):
        self._packer = packer
        self._rng = copy.deepcopy(packer._rng)
        self._docs = iter(enumerate(docs))
        self._current: collections.deque[_Piece] = collections.deque()  # pieces of the document being read
        self._carried: list[_Piece] = []
        self._ready: collections.deque[list[_Piece]] = collections.deque()
        self._exhausted = False
        self.finished = False
        self.batches = self.tokens = self.documents = self.pieces = 0

    @property
    def fill_rate(self) -> float:
        """Real tokens / (batches * capacity) over every batch emitted so far (0.0 before the first)."""
        return self.tokens / (self.batches * self._packer.capacity) if self.batches else 0.0

    def __iter__(self) -> PackingPass:
        return self

    def __next__(self) -> PackedDocuments:
        pieces = self._next_bin()
        if pieces is None:
            raise StopIteration
        return self._packer._batch(pieces)

    def _next_bin(self) -> list[_Piece] | None:
        """The pieces of the next batch, counted; None at the end of the input."""
        while not self._ready:
            pieces = self._carried + self._read(self._packer.buffer_size - len(self._carried))
            self._carried = []
            if not pieces:
                if not self.finished:
                    self.finished = True
                    if self._packer._totals is None:
                        self._packer._totals = self
                return None
            bins = self._first_fit_decreasing(pieces)
            if not self._exhausted and len(bins) > 1:
                # The least-filled batch waits for the next buffer (the last such batch: the smallest pieces).
                fills = [sum(len(p[2]) for p in b) for b in bins]
                self._carried = bins.pop(len(fills) - 1 - int(np.argmin(fills[::-1])))
            if self._rng is not None:
                bins = [bins[i] for i in self._rng.permutation(len(bins))]
            self._ready.extend(bins)
        pieces = self._ready.popleft()
        self.batches += 1
        self.tokens += sum(len(p[2]) for p in pieces)
        self.pieces += len(pieces)
        return pieces

    def _read(self, wanted: int) -> list[_Piece]:
        """Up to `wanted` (at least one, while input lasts) pieces, splitting documents as they are read."""
        pieces = []
        while len(pieces) < max(wanted, 1):
            if not self._current:
                if self._exhausted or not self._next_document():
                    break
                continue
            pieces.append(self._current.popleft())
        return pieces

    def _next_document(self) -> bool:
        """Queues the pieces of the next non-empty document; False at the end of the input."""
        for index, doc in self._docs:
            tokens = _tokens(doc, index)
            if tokens.size == 0:
                continue
            self.documents += 1
            self._current.extend(
                (index, start, tokens[start : start + self._packer.max_seqlen])
                for start in range(0, tokens.size, self._packer.max_seqlen)
            )
            return True
        self._exhausted = True
        return False

    def _first_fit_decreasing(self, pieces: list[_Piece]) -> list[list[_Piece]]:
        # Longest first; ties keep input order (so equal pieces of one document fill batches in order), or a
        # random order with rng (so the many equal pieces of long documents mix across batches).
        order = range(len(pieces)) if self._rng is None else self._rng.permutation(len(pieces)).tolist()
        order = sorted(order, key=lambda i: -len(pieces[i][2]))
        room = np.empty(0, np.int64)  # free tokens per open batch
        slots = np.empty(0, np.int64)  # free sequence slots per open batch
        bins: list[list[_Piece]] = []
        for i in order:
            length = len(pieces[i][2])
            fits = np.flatnonzero((room >= length) & (slots > 0))
            if fits.size:
                b = int(fits[0])
            else:
                b = len(bins)
                bins.append([])
                room = np.append(room, self._packer.capacity)
                slots = np.append(slots, self._packer.max_seqs)
            bins[b].append(pieces[i])
            room[b] -= length
            slots[b] -= 1
        return [sorted(b, key=lambda p: (p[0], p[1])) for b in bins]


def pack_documents(
    docs: Iterable,
    capacity: int,
    *,
    max_seqs: int,
    max_seqlen: int | None = None,
    buffer_size: int = 1024,
    pad_id: int = 0,
    rng: np.random.Generator | None = None,
    context_parallel_devices: int | None = None,
    balance_causal_work: bool = True,
) -> DocumentPacker:
    """Packs token documents into fixed-shape batches for `ragged_attention` (see the module docstring).

    Args:
      docs: a list or any iterable (read lazily) of 1-D integer token arrays (or lists); empty ones are skipped.
      capacity: T, rows of every batch's token buffer.
      max_seqs: B, sequence slots of every batch (cu_seqlens has B + 1 entries). A batch closes when its
        slots run out even if it has room for tokens, so B bounds how many short documents share a batch.
        Neither implementation's memory depends on B or max_seqlen beyond the [B + 1] offsets (the xla
        path's working set is O(T * H * block_kv), README "The xla path's memory").
      max_seqlen: the longest sequence; longer documents are split into pieces of this length. Default
        capacity; at most capacity. Pass the same value as the attention's max_seqlen.
      buffer_size: pieces read ahead and packed together (first-fit-decreasing); larger packs tighter.
      pad_id: the token (and target) written to padding rows.
      rng: None packs deterministically, in input order. A numpy Generator shuffles each buffer's pieces
        before the (stable) longest-first sort and the order its batches are emitted in: a long document
        splits into many pieces of equal length, which would otherwise fill whole batches one after another.
        Its state is copied here and every pass starts from the copy: passes give the same batches (call
        pack_documents with another Generator for another order).
      context_parallel_devices: None (default) emits the natural packed order. n emits every batch ready for
        context parallelism over n devices with load_balance=True: the per-token arrays in the dual-chunk
        order (reorder_for_load_balance(x, n) of the natural batch), cu_seqlens in the natural order.
        capacity must be a multiple of 2n. Put the arrays on the mesh split along tokens; no reorder needed.
      balance_causal_work: with context_parallel_devices, order each batch's sequences so that the n
        devices' causal work comes out even (within 1 % where the lengths allow; the module docstring),
        instead of by (document, offset). Costs the host milliseconds per batch on 2-4 devices, up to
        ~0.2 s for a few dozen long documents on 8. Ignored without context_parallel_devices.

    Returns:
      A `DocumentPacker`: an iterable of `PackedDocuments` batches, the same batches on every pass (a one-shot
      iterator input: one pass, a second raises RuntimeError), whose fill_rate, batches, tokens, documents
      and pieces describe a whole pass (a one-shot input's: the pass so far). Arguments are checked here,
      documents as they are read; a malformed one raises ValueError naming its index. next() needs an
      iterator: `next(iter(batches))`, or keep `passes = iter(batches)`, whose counts are its own.
    """
    return DocumentPacker(
        docs,
        capacity,
        max_seqs=max_seqs,
        max_seqlen=max_seqlen,
        buffer_size=buffer_size,
        pad_id=pad_id,
        rng=rng,
        context_parallel_devices=context_parallel_devices,
        balance_causal_work=balance_causal_work,
    )


def _tokens(doc, index: int) -> np.ndarray:
    array = np.asarray(doc)
    if array.ndim != 1:
        raise ValueError(f"docs[{index}] must be a 1-D array of token ids, got shape {array.shape}")
    if array.size == 0:
        return array.astype(np.int32)
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"docs[{index}] must hold integer token ids, got dtype {array.dtype}")
    if array.min() < _INT32.min or array.max() > _INT32.max:
        raise ValueError(f"docs[{index}] holds token ids outside int32: min {array.min()}, max {array.max()}")
    return array.astype(np.int32)
