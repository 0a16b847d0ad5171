"""Generation after training: ragged attention over a KV cache, timed against a full forward per byte."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.tools.lm.model import ByteLM, Setup, split_heads

def prefill(model: ByteLM, tokens, n):
    """tokens [S] with the first n real -> (logits [256] of row n - 1, k, v [layers, S, Hkv, D]): the prompt's
    forward, keeping every layer's rotated keys and values as the cache (rows >= n are never read)."""
    s = tokens.shape[0]
    cu = jnp.stack([jnp.zeros((), jnp.int32), jnp.asarray(n, jnp.int32)])
    positions = jnp.arange(s, dtype=jnp.int32)
    keys, values = [], []

    def attend(attention, x):
        qkv, q, kv = attention.project(x, positions)
        _, k, v = split_heads(qkv, q, kv)
        keys.append(k)
        values.append(v)
        return attention.project_out(attention.attend(qkv, q, kv, cu, max_seqlen=s))
    logits = model.forward(tokens, attend)
    return logits[n - 1], jnp.stack(keys), jnp.stack(values)


def decode(model: ByteLM, token, n, keys, values, implementation=None):
    """The byte at position n (its predecessors cached in keys/values [layers, S, Hkv, D]) -> (logits [256]
    of the byte after it, the caches with row n written). Attention: one query row against the cache slot,
    ragged_attention(is_causal=True, diagonal_alignment='bottom_right', seqused_kv=[n + 1])."""
    s = keys.shape[1]
    position = jnp.reshape(jnp.asarray(n, jnp.int32), (1,))
    cu_q = jnp.array([0, 1], jnp.int32)
    cu_kv = jnp.array([0, s], jnp.int32)
    layer = iter(range(keys.shape[0]))
    new_keys, new_values = [], []

    def attend(attention, x):
        i = next(layer)
        q, k, v = split_heads(*attention.project(x, position))
        k_cache = jax.lax.dynamic_update_slice(keys[i], k.astype(keys.dtype), (position[0], 0, 0))
        v_cache = jax.lax.dynamic_update_slice(values[i], v.astype(values.dtype), (position[0], 0, 0))
        new_keys.append(k_cache)
        new_values.append(v_cache)
        out = ragged_attention(q, k_cache, v_cache, cu_q, cu_kv, max_seqlen_q=1, max_seqlen_kv=s, is_causal=True,
                               diagonal_alignment="bottom_right", seqused_kv=position + 1, scale=attention.scale,
                               implementation=implementation or attention.implementation)
        return attention.project_out(out)
    logits = model.forward(jnp.reshape(token, (1,)), attend)
    return logits[0], jnp.stack(new_keys), jnp.stack(new_values)


def _sample(logits, key, i, temperature):
    return jax.random.categorical(jax.random.fold_in(key, i), logits / temperature).astype(jnp.int32)


def _generate_cached(graphdef, state, buffer, key, *, n0, length, temperature, implementation):
    model = nnx.merge(graphdef, state)
    logits, keys, values = prefill(model, buffer, n0)

    def body(i, carry):
        buffer, logits, keys, values = carry
        token = _sample(logits, key, i, temperature)
        buffer = buffer.at[n0 + i].set(token)
        logits, keys, values = decode(model, token, n0 + i, keys, values, implementation)
        return buffer, logits, keys, values
    return jax.lax.fori_loop(0, length, body, (buffer, logits, keys, values))[0]


def _generate_full(graphdef, state, buffer, key, *, n0, length, temperature, implementation):
    del implementation
    model = nnx.merge(graphdef, state)
    positions = jnp.arange(buffer.shape[0], dtype=jnp.int32)

    def body(i, buffer):
        n = n0 + i
        logits = model(buffer, jnp.stack([jnp.zeros((), jnp.int32), n]), positions)[n - 1]
        return buffer.at[n].set(_sample(logits, key, i, temperature))
    return jax.lax.fori_loop(0, length, body, buffer)


def generate(model: ByteLM, setup: Setup, prompt: bytes, length: int, seed: int, temperature: float = 0.7,
             cached: bool = True, implementation: str | None = None) -> tuple[bytes, float]:
    """(prompt + up to `length` sampled bytes, seconds the generation took once compiled). The whole loop
    runs on the device (lax.fori_loop, jax.random sampling with the same keys either way): cached=True
    prefills the prompt once, then one `decode` per byte; cached=False runs the packed model over the whole
    [max_seqlen] buffer for every byte. The prompt and the bytes fit in max_seqlen (length is cut to fit)."""
    s = setup.max_seqlen
    prompt = prompt[-(s - 1):] or b"\n"
    length = max(0, min(length, s - len(prompt)))
    buffer = np.zeros(s, np.int32)
    buffer[:len(prompt)] = np.frombuffer(prompt, np.uint8)
    graphdef, state = nnx.split(model)
    fn = _generate_cached if cached else _generate_full
    run = jax.jit(functools.partial(fn, graphdef, n0=len(prompt), length=length, temperature=temperature,
                                    implementation=implementation))
    key = jax.random.key(seed)
    compiled = run.lower(state, buffer, key).compile()
    start = time.perf_counter()
    out = np.asarray(jax.block_until_ready(compiled(state, buffer, key)))
    return bytes(out[:len(prompt) + length].astype(np.uint8)), time.perf_counter() - start


def sample_and_time(model: ByteLM, setup: Setup, prompt: bytes, length: int, seed: int) -> None:
    """Prints the cached sample and bytes/s cached vs a full forward per byte (a failure is printed, not
    raised: the reports after it still run)."""
    def attempt(**options):
        try:
            return generate(model, setup, prompt, length, seed, **options), None
        except Exception as error:  # noqa: BLE001
            return (None, None), f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    (text, cached_s), error = attempt()
    note = ""
    if error:  # the cache's attention call refused where it runs (e.g. cuDNN): say so, run the xla path
        note = f" (the default implementation failed: {error}; xla instead)"
        (text, cached_s), error = attempt(implementation="xla")
    (full_text, full_s), full_error = attempt(cached=False)
    rule = "-" * 60
    if text is not None:
        print(f"sample (temperature 0.7, KV cache):\n{rule}\n{text.decode('utf-8', errors='replace')}\n{rule}")
    n = len(text or full_text or b"") - len(prompt[-(setup.max_seqlen - 1):] or b"\n")
    cached = f"{n / max(cached_s, 1e-9):,.0f} bytes/s" if text is not None else f"failed ({error})"
    full = f"{n / max(full_s, 1e-9):,.0f} bytes/s" if full_text is not None else f"failed ({full_error})"
    tail = ""
    if text is not None and full_text is not None:
        same = "the same bytes" if full_text == text else "different bytes (rounding tipped a draw)"
        tail = f" ({full_s / max(cached_s, 1e-9):.1f}x slower); {same}"
    print(f"generation, {n} bytes: KV cache (ragged attention, bottom-right, seqused_kv){note} {cached}; full "
          f"forward over [{setup.max_seqlen}] per byte {full}{tail}")
