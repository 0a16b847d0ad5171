"""Serving by continuous batching, side by side with the fixed-batch generation on the same requests.

A queue of requests (a prompt, how many bytes to generate, how many continuations to sample), a fixed number
of slots and a fixed pool of cache pages. Every step is one call of one jitted function, compiled once for
the run (every shape static): up to `budget` new tokens packed in one buffer, the decode rows (one byte of
each slot that is generating) and prefill chunks (the next piece of each prompt still being read, as much as
the budget leaves), through the model with `kvcache_append` and `ragged_attention_with_kvcache` over packed
queries (cu_seqlens_q, one row range per slot), then one byte sampled per slot. Between steps the host
schedules: a slot whose request has all its bytes returns its pages, and the next request that fits takes
the slot at once, instead of the whole batch waiting for its slowest request (generation.generate: prompts
prefilled as a phase of their own, then every prompt decoded for the longest one's length).

Shared prompts: the n continuations of one prompt read its cache pages in place. The first prefills the
prompt; each other one, once the first has written them, points its page table at the prompt's full pages
(reference-counted in the pool) and prefills only the rows past them (under a page), then samples with keys
of its own. The prompt's last row is always prefilled by each continuation itself: its logits are that
continuation's first draw.

    prompt of 21 bytes, pages of 8 rows, 3 continuations: the first prefills rows 0-20 (pages a, b, c); the
    others' tables start [a, b, own, ...] and they prefill rows 16-20 each; pages a and b are read by all
    three and return to the pool when the last of them finishes.

Sampling keys follow the request, the continuation and the byte's index (not the slot or the step), so a
request draws the same bytes however it is scheduled. Requests end after their number of bytes (no stop
byte), so the host knows the whole schedule without reading a drawn byte: it plans `steps_per_call` steps and
dispatches them as one call (a lax.scan over their schedules) without waiting for the device (a decode row's
byte is its slot's last draw, read on the device), waits only where a request finishes (its latency), and
reads every drawn byte back once at the end. One call a step costs more on the host than the step itself
(0.72x the fixed batches' bytes/s on the H200, whose decode loop runs on the device in one call).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_ragged_attn import backends
from jax_ragged_attn.config import AttentionOptions
from jax_ragged_attn.index import row_positions
from jax_ragged_attn.ops.kvcache import kvcache_append, kvcache_config, ragged_attention_with_kvcache
from jax_ragged_attn.tools.lm.generation import empty_caches, generate
from jax_ragged_attn.tools.lm.model import ByteLM, Setup, split_heads


@dataclasses.dataclass(frozen=True)
class Request:
    prompt: bytes
    max_new: int  # bytes to generate (no stop byte: a request is done after exactly these)
    samples: int = 1  # continuations of the prompt, sharing its cache pages


@dataclasses.dataclass
class Served:
    """The outcome of a run: texts[r][s] = request r's prompt + continuation s; seconds from the start (every
    request arrives then) until each request's last byte; the run's figures."""

    texts: list[list[bytes]]
    latency: np.ndarray  # [R] seconds
    seconds: float  # the whole run, compilation excluded
    generated: int  # bytes generated, every continuation counted
    steps: int = 0
    compilations: int = 0  # of the step function: 1, every shape static
    peak_pages: int = 0  # pages in use at the fullest
    shared_reads: int = 0  # page-table entries that pointed at another continuation's pages

    @property
    def bytes_per_s(self) -> float:
        return self.generated / max(self.seconds, 1e-9)

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latency, q))


class PagePool:
    """A fixed pool of cache pages: a free list and a reference count per page (a page several continuations'
    tables point at is free again once the last of them lets it go)."""

    def __init__(self, num_pages: int):
        self.free = list(range(num_pages - 1, -1, -1))
        self.refs = np.zeros(num_pages, np.int64)

    @property
    def in_use(self) -> int:
        return int((self.refs > 0).sum())

    def take(self, count: int) -> list[int]:
        if count > len(self.free):
            raise RuntimeError(f"the page pool has {len(self.free)} free pages, {count} asked for")
        pages = [self.free.pop() for _ in range(count)]
        self.refs[pages] = 1
        return pages

    def hold(self, pages) -> None:
        np.add.at(self.refs, np.asarray(pages, np.int64), 1)  # a page listed twice is held twice

    def release(self, pages) -> None:
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free.append(page)


@dataclasses.dataclass
class _Slot:
    request: int
    sample: int
    prompt: bytes
    max_new: int
    pages: list  # its page table's entries, shared ones first
    own: list  # the pages it took from the pool (shared ones are held through the first continuation)
    cached: int = 0  # rows of the cache written
    drawn: int = 0  # bytes drawn so far

    @property
    def rows(self) -> int:
        """Its sequence's length: the prompt and the bytes drawn (the last of which is not cached yet)."""
        return len(self.prompt) + self.drawn

    @property
    def done(self) -> bool:
        return self.drawn >= self.max_new


# Steps one jitted call runs (a lax.scan over their schedules): the host's cost of a call (flattening the model's
# state, the transfers, the dispatch) is paid once per this many steps instead of every step.
STEPS_PER_CALL = 8


@dataclasses.dataclass(frozen=True)
class ServingConfig:
    slots: int  # sequences a step carries
    budget: int  # new tokens a step carries (decode rows + prefill chunks), >= slots
    page_size: int
    max_pages: int  # a slot's page-table entries: ceil(max_seqlen / page_size)
    num_pages: int  # the pool
    steps_per_call: int = STEPS_PER_CALL

    @classmethod
    def for_setup(
        cls,
        setup: Setup,
        slots: int,
        budget: int,
        page_size: int,
        num_pages: int | None = None,
        steps_per_call: int = STEPS_PER_CALL,
    ) -> ServingConfig:
        if budget < slots:
            raise ValueError(
                f"the token budget ({budget}) must be at least the slots ({slots}): every slot that "
                "is generating takes one row of each step"
            )
        if steps_per_call < 1:
            raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
        max_pages = math.ceil(setup.max_seqlen / page_size)
        return cls(slots, budget, page_size, max_pages, num_pages or slots * max_pages, steps_per_call)


def make_step(graphdef, config: ServingConfig, temperature: float, implementation=None):
    """The jitted call of config.steps_per_call steps (caches donated): (state, caches, last [S], key, schedule)
    -> (bytes [steps_per_call, S] int32, last [S], caches), where schedule stacks each step's (tokens [budget],
    from_last [budget], cu_seqlens [S + 1], cached [S], page_table [S, max_pages], ids [S], draws [S]). In a
    step, slot b feeds rows cu[b] .. cu[b + 1] - 1, the rows cached[b] .. of its sequence: a row's byte is
    tokens[row], or, where from_last[row] = b' >= 0, last[b'] (the byte slot b' drew the step before, still on
    the device: decode rows need no round trip to the host). Slot b's byte is drawn from its last row's
    logits with the key fold_in(fold_in(key, ids[b]), draws[b])."""
    budget = config.budget

    def step(state, caches, last, tokens, from_last, cu, cached, table, key, ids, draws):
        model = nnx.merge(graphdef, state)
        tokens = jnp.where(from_last >= 0, last[jnp.maximum(from_last, 0)], tokens)
        sequence, offset, _ = row_positions(cu, budget, budget)
        positions = cached[jnp.minimum(sequence, config.slots - 1)] + offset  # padding rows: any position
        layers = iter(caches)
        written = []

        def attend(attention, x):  # x [budget, d]: every slot's new rows, packed
            q, k, v = split_heads(*attention.project(x, positions))
            k_cache, v_cache, after = kvcache_append(*next(layers), k, v, cached, cu_seqlens_k_new=cu, page_table=table)
            written.append((k_cache, v_cache))
            out = ragged_attention_with_kvcache(
                q,
                k_cache,
                v_cache,
                after,
                cu_seqlens_q=cu,
                max_seqlen_q=budget,
                page_table=table,
                scale=attention.scale,
                implementation=implementation,
            )
            return attention.project_out(out)

        x = model.embed_tokens(tokens)
        for block in model.blocks:
            x = block(x, attend)
        logits = model.logits(x[jnp.maximum(cu[1:] - 1, 0)])  # [S, 256]: each slot's last row
        if temperature == 0:
            drawn = jnp.argmax(logits, axis=-1)
        else:
            keys = jax.vmap(lambda i, j: jax.random.fold_in(jax.random.fold_in(key, i), j))(ids, draws)
            drawn = jax.vmap(jax.random.categorical)(keys, logits / temperature)
        return drawn.astype(jnp.int32), tuple(written)

    def steps(state, caches, last, key, schedule):
        """schedule: step's per-step arguments stacked on a leading axis of steps_per_call -> (bytes
        [steps_per_call, S], the last step's bytes [S], caches)."""

        def body(carry, arguments):
            last, caches = carry
            tokens, from_last, cu, cached, table, ids, draws = arguments
            drawn, caches = step(state, caches, last, tokens, from_last, cu, cached, table, key, ids, draws)
            return (drawn, caches), drawn

        (last, caches), drawn = jax.lax.scan(body, (last, caches), schedule)
        return drawn, last, caches

    return jax.jit(steps, donate_argnums=(1,))


def shared_rows(prompt_len: int, page_size: int) -> int:
    """Rows of a prompt whose pages its continuations share: its full pages, its last row excluded."""
    return (prompt_len - 1) // page_size * page_size


def serve(
    model: ByteLM,
    setup: Setup,
    requests: list[Request],
    config: ServingConfig,
    seed: int,
    temperature: float = 0.7,
    implementation=None,
) -> Served:
    """Runs `requests` by continuous batching (the module docstring). Every prompt + max_new must fit
    max_seqlen rows.

    Requests have no stop byte, so the whole schedule (which rows each step carries, when each request ends)
    follows from the lengths: the host plans config.steps_per_call steps at a time and dispatches them as one
    call without waiting for the device, the bytes drawn stay there (a decode row reads its slot's last draw on
    the device) and come back once, at the end. The host waits only for a call in which a request finishes,
    to take its latency: a request's latency is the end of the call that carries its last step."""
    for r, request in enumerate(requests):
        if not request.prompt or len(request.prompt) + request.max_new > setup.max_seqlen or request.samples < 1:
            raise ValueError(
                f"request {r}: a prompt of 1 .. max_seqlen - max_new bytes and samples >= 1, got "
                f"{len(request.prompt)} + {request.max_new} bytes (max_seqlen {setup.max_seqlen}), "
                f"{request.samples} samples"
            )
    graphdef, state = nnx.split(model)
    step = make_step(graphdef, config, temperature, implementation)
    caches = empty_caches(model, config.num_pages, config.page_size)
    key = jax.random.key(seed)
    slots_n, budget, per_call = config.slots, config.budget, config.steps_per_call
    last = jnp.zeros(slots_n, jnp.int32)
    # A step no slot has rows in: nothing is written, nothing read. It fills the last call's schedule.
    idle = (
        np.zeros(budget, np.int32),
        np.full(budget, -1, np.int32),
        np.zeros(slots_n + 1, np.int32),
        np.zeros(slots_n, np.int32),
        np.full((slots_n, config.max_pages), -1, np.int32),
        np.zeros(slots_n, np.int32),
        np.zeros(slots_n, np.int32),
    )
    stacked = lambda schedule: tuple(np.stack(column) for column in zip(*schedule))
    _, last, caches = step(state, caches, last, key, stacked([idle] * per_call))  # compiles
    jax.block_until_ready(caches)

    pool = PagePool(config.num_pages)
    queue = [(r, s) for r, request in enumerate(requests) for s in range(request.samples)]
    first_pages: dict[int, list] = {}  # request -> the first continuation's pages (its prompt's, shared)
    prefilled: dict[int, int] = {}  # request -> rows its first continuation has written
    slots: list[_Slot | None] = [None] * slots_n
    drawn_log = []  # per call: (its bytes [steps_per_call, S] on the device, per step [(slot, request, sample)])
    left = [request.samples for request in requests]
    latency = np.zeros(len(requests))
    served = Served(texts=[], latency=latency, seconds=0.0, generated=0)
    start = time.perf_counter()

    def admit(r: int, s: int) -> _Slot | None:
        request = requests[r]
        pages_needed = math.ceil((len(request.prompt) + request.max_new) / config.page_size)
        shared = shared_rows(len(request.prompt), config.page_size) // config.page_size if request.samples > 1 else 0
        if s > 0 and prefilled.get(r, 0) < shared * config.page_size:
            return None  # the first continuation has not written the shared pages yet
        own_count = pages_needed - (shared if s > 0 else 0)
        if own_count > len(pool.free):
            return None
        own = pool.take(own_count)
        if s == 0:
            pages = own
            first_pages[r] = pages
            pool.hold(pages[:shared] * (request.samples - 1))  # kept for the other continuations
            return _Slot(r, s, request.prompt, request.max_new, pages, own)
        served.shared_reads += shared
        return _Slot(
            r, s, request.prompt, request.max_new, first_pages[r][:shared] + own, own, cached=shared * config.page_size
        )

    def plan() -> tuple[tuple, list, list]:
        """The next step's arguments, the slots that draw a byte in it and the requests it finishes; the
        host's bookkeeping advanced as if it had run (nothing in it waits for the device)."""
        for b in range(slots_n):  # a free slot takes the first request in the queue that fits
            if slots[b] is None:
                for i, (r, s) in enumerate(queue):
                    slot = admit(r, s)
                    if slot is not None:
                        slots[b] = slot
                        del queue[i]
                        break
        counts = np.zeros(slots_n, np.int32)
        decoding = [slot is not None and slot.cached >= len(slot.prompt) for slot in slots]
        room = budget - sum(decoding)
        for b, slot in enumerate(slots):  # decode rows one each, then prompts' chunks in slot order
            if slot is not None:
                counts[b] = 1 if decoding[b] else min(slot.rows - slot.cached, room)
                room -= 0 if decoding[b] else counts[b]
        if not counts.any():
            raise RuntimeError("no slot can take a row: the page pool is too small for the next request")
        cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        tokens = np.zeros(budget, np.int32)
        from_last = np.full(budget, -1, np.int32)
        cached = np.zeros(slots_n, np.int32)
        table = np.full((slots_n, config.max_pages), -1, np.int32)
        ids = np.zeros(slots_n, np.int32)
        draws = np.zeros(slots_n, np.int32)
        for b, slot in enumerate(slots):
            if slot is None:
                continue
            if decoding[b]:
                from_last[cu[b]] = b  # its byte: the one it drew the step before, on the device
            else:
                tokens[cu[b] : cu[b + 1]] = np.frombuffer(slot.prompt[slot.cached : slot.cached + counts[b]], np.uint8)
            cached[b] = slot.cached
            table[b, : len(slot.pages)] = slot.pages
            ids[b] = slot.request * 1024 + slot.sample
            draws[b] = slot.drawn
        served.steps += 1
        served.peak_pages = max(served.peak_pages, pool.in_use)
        drew, finished = [], []
        for b, slot in enumerate(slots):
            if slot is None or not counts[b]:
                continue
            slot.cached += int(counts[b])
            if slot.sample == 0:
                prefilled[slot.request] = slot.cached
            if slot.cached == slot.rows:  # its last row was fed: the byte drawn is its next
                drew.append((b, slot.request, slot.sample))
                slot.drawn += 1
                served.generated += 1
            if slot.done:
                pool.release(slot.own)
                if slot.sample > 0:
                    pool.release(slot.pages[: len(slot.pages) - len(slot.own)])
                left[slot.request] -= 1
                if not left[slot.request]:
                    finished.append(slot.request)
                slots[b] = None
        return (tokens, from_last, cu, cached, table, ids, draws), drew, finished

    while queue or any(slots):
        schedule, drew, finished = [], [], []
        while len(schedule) < per_call and (queue or any(slots)):
            arguments, step_drew, step_finished = plan()
            schedule.append(arguments)
            drew.append(step_drew)
            finished += step_finished
        schedule += [idle] * (per_call - len(schedule))  # the run's last call: idle steps after the work
        drawn, last, caches = step(state, caches, last, key, stacked(schedule))
        drawn_log.append((drawn, drew))
        if finished:  # the one wait of the host: when the call with a request's last byte is done
            jax.block_until_ready(drawn)
            latency[finished] = time.perf_counter() - start
    jax.block_until_ready(caches)
    served.seconds = time.perf_counter() - start
    served.compilations = step._cache_size()
    texts = [[bytearray(request.prompt) for _ in range(request.samples)] for request in requests]
    for values, (_, drew) in zip(jax.device_get([d for d, _ in drawn_log]), drawn_log):
        for step_values, step_drew in zip(values, drew):
            for b, r, s in step_drew:
                texts[r][s].append(int(step_values[b]))
    served.texts = [[bytes(t) for t in row] for row in texts]
    return served


def serve_fixed(
    model: ByteLM,
    setup: Setup,
    requests: list[Request],
    slots: int,
    seed: int,
    temperature: float = 0.7,
    implementation=None,
    page_size: int | None = None,
) -> Served:
    """The same requests through today's generation (generation.generate): batches of `slots` continuations in
    queue order, each prefilled as a phase of its own and decoded for its longest request's length; a batch
    starts when the one before has finished. Each batch compiles apart (its prompts are static), timed apart."""
    flat = [(r, s) for r, request in enumerate(requests) for s in range(request.samples)]
    texts = [[b""] * request.samples for request in requests]
    latency = np.zeros(len(requests))
    options = {} if page_size is None else {"page_size": page_size}
    clock = 0.0
    for start in range(0, len(flat), slots):
        batch = flat[start : start + slots]
        prompts = [requests[r].prompt for r, _ in batch]
        length = max(requests[r].max_new for r, _ in batch)
        out, seconds = generate(
            model, setup, prompts, length, seed, temperature=temperature, implementation=implementation, **options
        )
        clock += seconds
        for (r, s), text in zip(batch, out):
            texts[r][s] = text[: len(requests[r].prompt) + requests[r].max_new]
            latency[r] = clock
    generated = sum(len(text) - len(request.prompt) for request, row in zip(requests, texts) for text in row)
    return Served(texts=texts, latency=latency, seconds=clock, generated=generated)


def make_requests(
    prompt: bytes,
    files: list[bytes],
    count: int,
    setup: Setup,
    max_new: tuple[int, int],
    samples: int = 3,
    seed: int = 0,
) -> list[Request]:
    """`count` requests: openings of held-out `files` of mixed lengths (up to a quarter of max_seqlen), each
    generating a length drawn from max_new (low, high; at most 3/4 of max_seqlen, so that any prompt fits beside
    any length and a fixed batch cuts none), the first `prompt` with `samples` continuations."""
    rng = np.random.default_rng(seed)
    low, high = (min(n, setup.max_seqlen - setup.max_seqlen // 4) for n in max_new)
    requests = []
    for i in range(count):
        new = int(rng.integers(low, high + 1))
        if i == 0:
            text = prompt
        else:
            text = files[i % len(files)][: int(rng.integers(8, max(9, setup.max_seqlen // 4)))] or b"\n"
        text = text[-(setup.max_seqlen // 4) :]
        requests.append(Request(text, new, samples if i == 0 else 1))
    return requests


def packed_implementation(model: ByteLM, config: ServingConfig) -> str:
    """The backend implementation=None gives a serving step's packed attention call (FA3 on Hopper for head
    dim 128, else cuDNN on a GPU, else the xla path), or why none is known. The call is the step's: causal (the
    op's default) with the attention's scale."""
    attention = model.blocks[0].attention
    dtype = model.dtype
    struct = jax.ShapeDtypeStruct
    cache = struct((config.num_pages, config.page_size, attention.num_kv_heads, attention.head_dim), dtype)
    try:
        call = kvcache_config(
            struct((config.budget, attention.num_heads, attention.head_dim), dtype),
            cache,
            cache,
            struct((config.slots,), jnp.int32),
            struct((config.slots, config.max_pages), jnp.int32),
            AttentionOptions(scale=attention.scale, is_causal=True),
            cu_seqlens_q=struct((config.slots + 1,), jnp.int32),
            max_seqlen_q=config.budget,
        )
        return backends.choose(None, call, None, op="kvcache").NAME
    except Exception as error:  # noqa: BLE001 - a report line, not a failure
        return f"unknown ({type(error).__name__}: {error})"


def serve_and_compare(
    model: ByteLM,
    setup: Setup,
    requests: list[Request],
    config: ServingConfig,
    seed: int,
    temperature: float = 0.7,
    implementation: str | None = None,
) -> tuple[Served, Served | None]:
    """Prints continuous batching beside the fixed-batch generation on the same requests (a failure of either
    is printed, not raised). implementation: the packed attention's (None: the op's choice)."""

    def attempt(run, **options):
        try:
            return run(**options), None
        except Exception as error:  # noqa: BLE001 - the report goes on
            return None, f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"

    served, error = attempt(
        functools.partial(serve, model, setup, requests, config, seed, temperature, implementation=implementation)
    )
    note = ""
    if error:
        note = f" (implementation {implementation or 'None'} failed: {error}; xla instead)"
        served, error = attempt(
            functools.partial(serve, model, setup, requests, config, seed, temperature, implementation="xla")
        )
    fixed, fixed_error = attempt(
        functools.partial(serve_fixed, model, setup, requests, config.slots, seed, temperature)
    )
    total = sum(r.samples for r in requests)
    print(
        f"serving {len(requests)} requests ({total} continuations, prompts of {min(len(r.prompt) for r in requests)}"
        f"-{max(len(r.prompt) for r in requests)} bytes, {min(r.max_new for r in requests)}-"
        f"{max(r.max_new for r in requests)} new bytes each), {config.slots} slots, packed attention by "
        f"{implementation or packed_implementation(model, config)}:"
    )

    def line(name, result, failure):
        if result is None:
            return f"  {name}: failed ({failure})"
        return (
            f"  {name}: {result.bytes_per_s:,.0f} bytes/s, latency p50 {result.percentile(50):.3f} s / p99 "
            f"{result.percentile(99):.3f} s"
        )

    if served is not None:
        first = requests[0]
        print(
            line("continuous batching", served, error) + f" ({served.steps} steps of <= {config.budget} tokens, "
            f"{config.steps_per_call} a call, "
            f"{served.compilations} compilation{'s' if served.compilations != 1 else ''}; pages of "
            f"{config.page_size} rows, at most {served.peak_pages} of {config.num_pages} in use; "
            f"{first.samples} continuations of one {len(first.prompt)}-byte prompt read its "
            f"{shared_rows(len(first.prompt), config.page_size) // config.page_size} full pages in place){note}"
        )
    else:
        print(line("continuous batching", None, error))
    print(
        line(f"fixed batches of {config.slots} (generation.generate)", fixed, fixed_error)
        + (" (each batch compiled apart, not timed)" if fixed is not None else "")
    )
    if served is not None and fixed is not None:
        print(
            f"  continuous / fixed: {served.bytes_per_s / max(fixed.bytes_per_s, 1e-9):.2f}x the throughput, p99 "
            f"latency {served.percentile(99) / max(fixed.percentile(99), 1e-9):.2f}x"
        )
    return served, fixed
