"""Generation after training: batched prompts through a paged KV cache, timed against a full forward per byte.

The cache path: the prompts, of different lengths, are packed into one buffer and run once through the model
(ragged attention over cu_seqlens, as in training), each layer's keys and values appended to a paged cache
([num_pages, PAGE_SIZE, Hkv, D] and a page table) with `kvcache_append`; then one byte per prompt per step,
its attention `ragged_attention_with_kvcache` over the cache. The comparison: the packed model over every
prompt's whole [max_seqlen] buffer for every byte. Both loops run on the device (lax.fori_loop) and sample
with the same keys, so they produce the same bytes unless rounding tips a draw.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_ragged_attn.ops.kvcache import kvcache_append, ragged_attention_with_kvcache
from jax_ragged_attn.tools.lm.model import ByteLM, Setup, split_heads

PAGE_SIZE = 64  # cache rows per page


def page_table_for(capacities, page_size: int = PAGE_SIZE) -> np.ndarray:
    """int32 [B, max_pages] for sequences needing `capacities` rows: pages handed out as the sequences grow
    (page j of every sequence before page j + 1 of any), so a sequence's pages are not adjacent; -1 past a
    sequence's last page. capacities [100, 40, 130], page_size 64 -> [[0, 3, -1], [1, -1, -1], [2, 4, 5]]."""
    pages = [-(-int(c) // page_size) for c in capacities]
    table = np.full((len(pages), max(pages)), -1, np.int32)
    next_page = 0
    for j in range(max(pages)):
        for b, n in enumerate(pages):
            if j < n:
                table[b, j], next_page = next_page, next_page + 1
    return table


def empty_caches(model: ByteLM, num_pages: int, page_size: int = PAGE_SIZE) -> tuple:
    """((k, v) per layer), each [num_pages, page_size, Hkv, D] of zeros in the model's dtype."""
    caches = []
    for block in model.blocks:
        shape = (num_pages, page_size, block.attention.num_kv_heads, block.attention.head_dim)
        caches.append((jnp.zeros(shape, model.dtype), jnp.zeros(shape, model.dtype)))
    return tuple(caches)


def prefill(model: ByteLM, tokens, cu_seqlens, max_seqlen: int, caches: tuple, page_table):
    """The prompts packed in tokens [T] (prompt b = tokens[cu_seqlens[b]:cu_seqlens[b + 1]]) -> (logits [B, 256]
    of each prompt's last byte, the caches with rows 0 .. len_b - 1 of sequence b written). One forward of the
    packed prompts, attention by the module's own ragged op; every layer's rotated keys and values go to the
    cache by kvcache_append, from [B, max_seqlen] gathered rows (rows past a prompt repeat its last one: they
    lie past cache_seqlens, are never read, and the sample overwrites them)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    batch = lengths.shape[0]
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32) - jnp.repeat(
        cu_seqlens[:-1], lengths, total_repeat_length=tokens.shape[0]
    )
    rows = cu_seqlens[:-1, None] + jnp.minimum(
        jnp.arange(max_seqlen, dtype=jnp.int32)[None, :], lengths[:, None] - 1
    )  # [B, S]
    layers = iter(caches)
    written = []

    def attend(attention, x):
        qkv, q, kv = attention.project(x, positions)
        _, k, v = split_heads(qkv, q, kv)
        written.append(
            kvcache_append(*next(layers), k[rows], v[rows], jnp.zeros(batch, jnp.int32), page_table=page_table)
        )
        return attention.project_out(attention.attend(qkv, q, kv, cu_seqlens, max_seqlen=max_seqlen))

    logits = model.forward(tokens, attend)
    return logits[cu_seqlens[1:] - 1], tuple(written)


def decode(model: ByteLM, tokens, lengths, caches: tuple, page_table, implementation=None):
    """One byte per sequence, tokens [B] at positions lengths [B] (the rows each sequence's cache holds) ->
    (logits [B, 256] of the byte after each, the caches with that row appended). Attention: the one query of
    each sequence against its cache, ragged_attention_with_kvcache(cache_seqlens=lengths + 1)."""
    layers = iter(caches)
    written = []

    def attend(attention, x):  # x [B, 1, d]
        q, k, v = split_heads(*attention.project(x, lengths[:, None]))
        k_cache, v_cache = kvcache_append(*next(layers), k, v, lengths, page_table=page_table)
        written.append((k_cache, v_cache))
        out = ragged_attention_with_kvcache(
            q,
            k_cache,
            v_cache,
            lengths + 1,
            page_table=page_table,
            scale=attention.scale,
            implementation=implementation,
        )
        return attention.project_out(out)

    logits = model.forward(tokens[:, None], attend)
    return logits[:, 0], tuple(written)


def _sample(logits, key, i, temperature):
    """[B, 256] -> [B] bytes: a draw at `temperature`, the same keys for both paths; 0 takes the argmax."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(jax.random.fold_in(key, i), logits / temperature).astype(jnp.int32)


def _generate_cached(graphdef, state, buffer, key, *, prompts, length, temperature, implementation, page_size):
    model = nnx.merge(graphdef, state)
    n0 = jnp.asarray([len(p) for p in prompts], jnp.int32)
    tokens = jnp.asarray(np.concatenate([np.frombuffer(p, np.uint8) for p in prompts]).astype(np.int32))
    cu = jnp.asarray(np.cumsum([0] + [len(p) for p in prompts]), jnp.int32)
    table = page_table_for([len(p) + length for p in prompts], page_size)
    caches = empty_caches(model, int(table.max()) + 1, page_size)
    page_table = jnp.asarray(table)
    logits, caches = prefill(model, tokens, cu, max(map(len, prompts)), caches, page_table)
    rows = jnp.arange(buffer.shape[0])

    def body(i, carry):
        buffer, logits, caches = carry
        token = _sample(logits, key, i, temperature)
        buffer = buffer.at[rows, n0 + i].set(token)
        logits, caches = decode(model, token, n0 + i, caches, page_table, implementation)
        return buffer, logits, caches

    return jax.lax.fori_loop(0, length, body, (buffer, logits, caches))[0]


def _generate_full(graphdef, state, buffer, key, *, prompts, length, temperature, implementation, page_size):
    del implementation, page_size
    model = nnx.merge(graphdef, state)
    batch, s = buffer.shape
    n0 = jnp.asarray([len(p) for p in prompts], jnp.int32)
    cu = jnp.arange(batch + 1, dtype=jnp.int32) * s  # each prompt's whole row one sequence: causal, so the
    positions = jnp.tile(jnp.arange(s, dtype=jnp.int32), batch)  # bytes after n never reach row n - 1
    rows = jnp.arange(batch)

    def body(i, buffer):
        n = n0 + i
        logits = model(buffer.reshape(-1), cu, positions).reshape(batch, s, -1)[rows, n - 1]
        return buffer.at[rows, n].set(_sample(logits, key, i, temperature))

    return jax.lax.fori_loop(0, length, body, buffer)


def sample_prompts(first: bytes, files: list[bytes], count: int) -> list[bytes]:
    """`first`, then the opening 8, 16, .., 48 bytes of files in turn (held out: text the model never saw):
    `count` prompts of different lengths."""
    return [first] + [files[i % len(files)][: 8 * (1 + i % 6)] for i in range(count - 1)]


def fit_prompts(prompts, length: int, max_seqlen: int) -> tuple[list[bytes], int]:
    """(prompts, length) cut to fit [max_seqlen] rows: each prompt keeps its last max_seqlen - 1 bytes (an empty
    one becomes b"\\n"), length drops to what the longest prompt leaves."""
    prompts = [p[-(max_seqlen - 1) :] or b"\n" for p in prompts]
    return prompts, max(0, min(length, max_seqlen - max(map(len, prompts))))


def generate(
    model: ByteLM,
    setup: Setup,
    prompts: list[bytes],
    length: int,
    seed: int,
    temperature: float = 0.7,
    cached: bool = True,
    implementation: str | None = None,
    page_size: int = PAGE_SIZE,
) -> tuple[list[bytes], float]:
    """([prompt + up to `length` sampled bytes] per prompt, seconds the generation took once compiled).
    cached=True: the packed prompts prefilled once into a paged cache, then one `decode` per byte for every
    prompt at once; cached=False: the packed model over every [max_seqlen] row for every byte. temperature 0
    is greedy. The prompts and the bytes fit in max_seqlen (see fit_prompts)."""
    prompts, length = fit_prompts(prompts, length, setup.max_seqlen)
    buffer = np.zeros((len(prompts), setup.max_seqlen), np.int32)
    for b, p in enumerate(prompts):
        buffer[b, : len(p)] = np.frombuffer(p, np.uint8)
    graphdef, state = nnx.split(model)
    fn = _generate_cached if cached else _generate_full
    run = jax.jit(
        functools.partial(
            fn,
            graphdef,
            prompts=tuple(prompts),
            length=length,
            temperature=temperature,
            implementation=implementation,
            page_size=page_size,
        )
    )
    key = jax.random.key(seed)
    compiled = run.lower(state, buffer, key).compile()
    start = time.perf_counter()
    out = np.asarray(jax.block_until_ready(compiled(state, buffer, key)))
    seconds = time.perf_counter() - start
    return [bytes(row[: len(p) + length].astype(np.uint8)) for row, p in zip(out, prompts)], seconds


def sample_and_time(model: ByteLM, setup: Setup, prompts: list[bytes], length: int, seed: int) -> None:
    """Prints the first prompt's cached sample and bytes/s over every prompt, the paged cache against a full
    forward per byte (a failure is printed, not raised: the reports after it still run)."""

    def attempt(**options):
        try:
            return generate(model, setup, prompts, length, seed, **options), None
        except Exception as error:  # noqa: BLE001
            return (None, None), f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"

    (texts, cached_s), error = attempt()
    note = ""
    if error:  # the cache's attention call refused where it runs: say so, run the xla path
        note = f" (the default implementation failed: {error}; xla instead)"
        (texts, cached_s), error = attempt(implementation="xla")
    (full_texts, full_s), full_error = attempt(cached=False)
    rule = "-" * 60
    if texts is not None:
        print(
            f"sample (temperature 0.7, paged KV cache):\n{rule}\n{texts[0].decode('utf-8', errors='replace')}\n{rule}"
        )
    fitted, n = fit_prompts(prompts, length, setup.max_seqlen)
    total = n * len(fitted)
    cached = f"{total / max(cached_s, 1e-9):,.0f} bytes/s" if texts is not None else f"failed ({error})"
    full = f"{total / max(full_s, 1e-9):,.0f} bytes/s" if full_texts is not None else f"failed ({full_error})"
    tail = ""
    if texts is not None and full_texts is not None:
        same = "the same bytes" if full_texts == texts else "different bytes (rounding tipped a draw)"
        tail = f" ({full_s / max(cached_s, 1e-9):.1f}x slower); {same}"
    print(
        f"generation, {len(fitted)} prompts x {n} bytes: paged KV cache (ragged_attention_with_kvcache, pages of "
        f"{PAGE_SIZE} rows){note} {cached}; full forward over [{len(fitted)}, {setup.max_seqlen}] per byte "
        f"{full}{tail}"
    )
