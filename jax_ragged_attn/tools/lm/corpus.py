"""The main job's data: the standard library's .py files, random windows of them, and the batches built from
those windows, packed (pack_documents) or padded to [rows, max_seqlen] (the side-by-side's pipeline)."""

from __future__ import annotations

import os
import sysconfig
import zlib
from collections.abc import Iterator

import jax
import numpy as np

from jax_ragged_attn.inputs.data import pack_documents
from jax_ragged_attn.tools.lm.model import Setup


def stdlib_files(root: str | None = None) -> tuple[list[bytes], list[bytes], str]:
    """(training files, held-out files, root): every non-empty .py file under the standard library (site- and
    dist-packages excluded), split by a hash of the path relative to root, one in ten held out."""
    root = root or sysconfig.get_paths()["stdlib"]
    train, held_out = [], []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            if data:
                relative = os.path.relpath(path, root).replace(os.sep, "/")
                (held_out if zlib.crc32(relative.encode()) % 10 == 0 else train).append(data)
    if not train or not held_out:
        raise SystemExit(f"found too few .py files under {root} ({len(train)} training, {len(held_out)} held out)")
    return train, held_out, root


def windows(
    files: list[bytes], rng: np.random.Generator, window: int, epochs: int | None = None, lengths: list | None = None
) -> Iterator:
    """Each epoch, the files in a random order, each as one random window of at most `window` bytes (whose
    lengths are appended to `lengths` when given)."""
    epoch = 0
    while epochs is None or epoch < epochs:
        for i in rng.permutation(len(files)):
            data = files[i]
            start = int(rng.integers(0, len(data) - window + 1)) if len(data) > window else 0
            if lengths is not None:
                lengths.append(min(window, len(data)))
            yield np.frombuffer(data, np.uint8, count=min(window, len(data)), offset=start)
        epoch += 1


def device_batch(arrays: dict) -> dict:
    """Host arrays -> device arrays (asynchronous), with the keys the losses read."""
    return {key: jax.device_put(value) for key, value in arrays.items() if key != "segment_ids"}


def packed_batches(files, setup: Setup, seed: int, lengths: list | None = None):
    """The packer's one pass over endless training windows (document lengths appended to `lengths`): an iterator
    of batches that counts what it has emitted (batches, tokens, pieces)."""
    documents = windows(files, np.random.default_rng([seed, 0]), setup.window_bytes, lengths=lengths)
    return iter(
        pack_documents(
            documents,
            setup.capacity,
            max_seqs=setup.max_seqs,
            max_seqlen=setup.max_seqlen,
            rng=np.random.default_rng([seed, 1]),
        )
    )


def padded_rows(setup: Setup) -> int:
    return max(1, setup.capacity // setup.max_seqlen)


def padded_pieces(pieces: list, setup: Setup) -> tuple[dict, int]:
    """Pieces (1-D token arrays of at most max_seqlen) as rows of [rows, max_seqlen], one per row, the first
    `rows` of them; (batch, the rows' real tokens). An empty row gets length 1 (a masked pad byte): a row with
    no key at all is undefined for some backends."""
    rows, s = padded_rows(setup), setup.max_seqlen
    arrays = {
        key: np.zeros((rows, s), dtype)
        for key, dtype in (("tokens", np.int32), ("targets", np.int32), ("loss_mask", bool))
    }
    lengths = np.zeros(rows, np.int32)
    for r, piece in enumerate(pieces[:rows]):
        n = len(piece)
        arrays["tokens"][r, :n] = piece
        arrays["targets"][r, : n - 1] = piece[1:]
        arrays["loss_mask"][r, : n - 1] = True
        lengths[r] = n
    return dict(arrays, lengths=np.maximum(lengths, 1)), int(lengths.sum())


def padded_batch(batch, setup: Setup) -> tuple[dict, int]:
    """The first rows = capacity // max_seqlen sequences of a packed batch as rows of [rows, max_seqlen] (the
    same token buffer), one per row; (batch, rows' real tokens). The rest of the batch is dropped."""
    cu = batch.cu_seqlens
    return padded_pieces([batch.tokens[int(cu[r]) : int(cu[r + 1])] for r in range(batch.num_seqs)], setup)


def padded_batches(files, setup: Setup, seed: int) -> Iterator[tuple[dict, int]]:
    """The padded pipeline over the same windows as `packed_batches(files, setup, seed)`: each window split
    at max_seqlen as the packer splits it, the pieces in stream order, `rows` of them per [rows, max_seqlen]
    batch; yields (batch, real tokens)."""
    s, rows = setup.max_seqlen, padded_rows(setup)
    pieces = (
        doc[start : start + s].astype(np.int32)
        for doc in windows(files, np.random.default_rng([seed, 0]), setup.window_bytes)
        for start in range(0, len(doc), s)
    )
    while True:
        yield padded_pieces([next(pieces) for _ in range(rows)], setup)
