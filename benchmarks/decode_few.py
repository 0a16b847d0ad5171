"""Few-sequence decode, issue 48's two decode targets measured the way they are stated, in one run:
8 x 32k at >= 70 % of the H200's 4.8 TB/s, and 8 x 2k paged at <= 1.10x FlashAttention-3's own kvcache call.

    python -m benchmarks.decode_few            # on the GPU: fa3 rows, raw FA3, key splits, pieces
    python -m benchmarks.decode_few --quick    # small shapes on the xla path: the harness itself, on a CPU
    python -m benchmarks.decode_few --in-step  # each call inside a decode step, as a model makes q and lengths
    python -m benchmarks.decode_few --host     # the host's events of a paged 8 x 2k call, ours against raw FA3

Why another decode table: benchmarks/decode.py times each system in its own loops, one after the other, and
its small rows swing 20-40 % run to run (docs/PERFORMANCE.md, 8 x 2k raw FA3 0.048 to 0.119 ms the same day),
which is the size of the gap the 1.10x target asks about. Here every row of a shape is timed in the same
rounds (tools/bench.py interleaved_loop_seconds: one plain loop of each row per round, median over rounds), so
a load that drifts moves every row alike, and each row also prints the kernels its compiled call launches
(fusions and custom calls in the optimised HLO's entry computation): at 8 x 2k a decode is tens of
microseconds, and every extra launch is a few of them.

Rows per shape (GQA 32/8, d 128, pages of 256, bf16, lengths in [L/2, L], the same draws as decode.py):
    ours              implementation=None, what a user gets
    ours splits=N     the FA3 route with its key splits pinned (fa3 options.num_splits), N in SPLITS
    ours pieces=P     each sequence's keys as P sequences through the page table, merged by log-sum-exps
                      (benchmarks/decode_pieces.py pieces_call), FA3's own splits
    raw FA3           flash-attn3-jax's flash_mha_with_kvcache at its default (num_splits=1), then pinned to
                      ours' split count (the kernel alone, no wrapper)
Every row's output is checked against ours (max |diff|), so a fast wrong row cannot pass.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from jax_ragged_attn.backends.fa3 import kvcache as fa3_kvcache
from jax_ragged_attn.config import AttentionOptions
from jax_ragged_attn.ops.kvcache import kvcache_config, ragged_attention_with_kvcache
from jax_ragged_attn.testing.private_config import backend_options
from jax_ragged_attn.tools.bench import interleaved_loop_seconds

from benchmarks import decode
from benchmarks.capture import entry_launches
from benchmarks.decode_pieces import pieces_call

FULL = dict(decode.FULL, batches=(8,), contexts=(2048, 32768), splits=(1, 2, 4, 8, 16, 32), pieces=(2, 4, 8),
            implementation="fa3")
QUICK = dict(decode.QUICK, batches=(2,), contexts=(256,), splits=(), pieces=(2,), implementation="xla")


def _rows(args, shape: dict, splits_of_ours: int):
    """{label: function of (q, k, v, lengths, table)} for one shape."""
    implementation = shape["implementation"]
    rows = {"ours": lambda q, k, v, n, t: ragged_attention_with_kvcache(q, k, v, n, page_table=t)}
    for splits in shape["splits"]:
        def pinned(q, k, v, n, t, splits=splits):
            with backend_options(num_splits=splits):
                return ragged_attention_with_kvcache(q, k, v, n, page_table=t, implementation=implementation)
        rows[f"ours splits={splits}"] = pinned
    if args[4] is not None:  # pieces go through the page table
        for pieces in shape["pieces"]:
            rows[f"ours pieces={pieces}"] = (lambda q, k, v, n, t, p=pieces:
                                             pieces_call(q, k, v, n, t, p, implementation=implementation))
    raw, reason = decode._raw_fa3()
    if raw is not None:
        rows["raw FA3"] = lambda q, k, v, n, t: raw(q, k, v, cache_seqlens=n, page_table=t, is_causal=True)
        rows[f"raw FA3 splits={splits_of_ours}"] = (lambda q, k, v, n, t: raw(
            q, k, v, cache_seqlens=n, page_table=t, is_causal=True, num_splits=splits_of_ours))
    return rows, reason


def _cases(shape: dict, layouts=("contiguous", "paged")):
    """(label, (q, k, v, lengths, page_table or None), bytes read, FA3's split count for ours) of each shape
    and layout: decode.py's draws, its contiguous cache and the same buffer seen as pages."""
    rng = np.random.default_rng(0)
    for batch in shape["batches"]:
        for context in shape["contexts"]:
            q, k, v, lengths, table, bytes_read = decode._inputs(batch, context, shape, rng)
            paged_k = k.reshape(-1, shape["page_size"], *k.shape[2:])
            paged_v = v.reshape(-1, shape["page_size"], *v.shape[2:])
            size = f"{context // 1024}k" if context >= 1024 else f"{context}"
            for layout, args in (("contiguous", (q, k, v, lengths, None)),
                                 ("paged", (q, paged_k, paged_v, lengths, table))):
                if layout in layouts:
                    config = kvcache_config(*args[:4], args[4], AttentionOptions(is_causal=True))
                    yield f"{batch} x {size} {layout}", args, bytes_read, fa3_kvcache.num_splits(config)


def in_step(function):
    """`function` inside a decode step as a model runs it: q made in the step (times a traced 1), the lengths
    made in the step (the previous lengths plus a traced 0), the output consumed in the step (times the same
    1). XLA may then fuse the op's small index and mask kernels into those neighbours, as it would in a model;
    the page table stays an argument, as a server passes it."""
    def step(q, k, v, n, t, one):
        out = function(q * one.astype(q.dtype), k, v, n + (one != 1).astype(n.dtype), t)
        return out * one.astype(out.dtype)
    return step


def _launch_names(launch_lines: list[str]) -> str:
    """The entry computation's launches (capture.entry_launches' lines), each as `name shape`."""
    names = []
    for line in launch_lines:
        name, rest = line.strip().removeprefix("ROOT ").split(" = ", 1)
        names.append(f"{name} {rest.split(' ')[0].split('{')[0]}")
    return "; ".join(names)


def run(shape: dict, calls: int, rounds: int, step: bool = False, show_launches: bool = False) -> list[str]:
    where = "inside a decode step (in_step)" if step else "alone"
    lines = [f"# {jax.devices()[0].device_kind}; {calls} calls a loop, median of {rounds} interleaved rounds; "
             f"each call {where}",
             "| shape | row | ms | GB/s | % of 4.8 TB/s | x ours | kernels | max diff to ours |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, args, bytes_read, splits_of_ours in _cases(shape):
        rows, reason = _rows(args, shape, splits_of_ours)
        if reason:
            lines.append(f"# raw FA3 left out: {reason}")
        if step:
            rows = {name: in_step(function) for name, function in rows.items()}
            args = args + (jnp.float32(1.0),)
        entries, launches, outputs = {}, {}, {}
        for name, function in rows.items():
            try:
                compiled = jax.jit(function).lower(*args).compile()
                outputs[name] = np.asarray(jax.block_until_ready(compiled(*args)), np.float32)
            except Exception as error:  # noqa: BLE001 - a declined or failing row must not end the table
                lines.append(f"| {label} | {name} | {type(error).__name__}: {str(error)[:100]} | | | | | |")
                continue
            launch_lines = entry_launches(compiled.as_text())
            launches[name] = len(launch_lines)  # about the kernels a call launches
            if show_launches and name in ("ours", "raw FA3"):
                lines.append(f"# {label} {name} launches: {_launch_names(launch_lines)}")
                print(lines[-1], flush=True)
            entries[name] = ((lambda c=compiled: c(*args)), calls)
        times = interleaved_loop_seconds(entries, rounds)
        base = statistics.median(times["ours"]) if "ours" in times else float("nan")
        for name, samples in times.items():
            seconds = statistics.median(samples)
            rate = bytes_read / seconds
            diff = float(np.abs(outputs[name] - outputs["ours"]).max()) if "ours" in outputs else float("nan")
            lines.append(f"| {label} | {name} | {seconds * 1e3:.4f} | {rate / 1e9:.0f} | "
                         f"{100 * rate / decode.PEAK_BYTES_PER_S:.1f} | {seconds / base:.3f} | "
                         f"{launches[name]} | {diff:.2g} |")
        print("\n".join(lines[-len(times):]), flush=True)
    return lines


def profile(shape: dict, steps: int) -> list[str]:
    """GPU kernel time per call (jax.profiler, cp_device_profile.kernel_ms) of ours and raw FA3: what the device
    spends, beside the plain loop's time, which at a few tens of microseconds a call is the host's dispatch."""
    from benchmarks.cp_device_profile import kernel_ms

    lines = ["| shape | row | kernels' ms a call | first to last kernel, ms a call | kernels by name |",
             "| --- | --- | --- | --- | --- |"]
    for label, args, _, splits_of_ours in _cases(shape, layouts=("paged",)):
        rows, _ = _rows(args, dict(shape, splits=(), pieces=()), splits_of_ours)
        for name, function in rows.items():
            totals, span = kernel_ms(jax.jit(function), args, steps)
            names = ", ".join(f"{n[:40]} {ms * 1e3:.1f} us" for n, ms in sorted(totals.items(), key=lambda x: -x[1]))
            lines.append(f"| {label} | {name} | {sum(totals.values()):.4f} | {span:.4f} | {names} |")
            print(lines[-1], flush=True)
    return lines


def host_profile(shape: dict, calls: int) -> list[str]:
    """The host's side of each paged 8 x 2k call (launch_cost.host_events): at that size a plain loop waits on the
    host's dispatch, so the events where ours spends more than raw FA3 are where its extra time goes."""
    from benchmarks.launch_cost import host_events

    lines = ["| shape | host event | ours: us a call (count) | raw FA3: us a call (count) | ours - raw, us |",
             "| --- | --- | --- | --- | --- |"]
    for label, args, _, splits_of_ours in _cases(dict(shape, contexts=(2048,)), layouts=("paged",)):
        rows, reason = _rows(args, dict(shape, splits=(), pieces=()), splits_of_ours)
        if reason:
            return [f"# raw FA3 left out: {reason}"]
        ours, raw = (host_events(jax.jit(rows[name]), args, calls) for name in ("ours", "raw FA3"))
        for event in sorted(set(ours) | set(raw), key=lambda e: -abs(ours.get(e, (0, 0))[0] - raw.get(e, (0, 0))[0])):
            (a, na), (b, nb) = ours.get(event, (0.0, 0.0)), raw.get(event, (0.0, 0.0))
            if max(na, nb) >= 0.5:  # once-a-trace events (the profiler's own) left out
                lines.append(f"| {label} | {event} | {a:.2f} ({na:.1f}) | {b:.2f} ({nb:.1f}) | {a - b:+.2f} |")
    return lines[:40]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes on the xla path (a CPU)")
    parser.add_argument("--calls", type=int, default=None, help="jitted calls a timed loop (default 200; quick 3)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds, median reported (default 15)")
    parser.add_argument("--in-step", action="store_true",
                        help="each call inside a decode step: q and the lengths made in it, the output consumed")
    parser.add_argument("--profile", action="store_true",
                        help="instead: each paged row's GPU kernels per call (jax.profiler), ours against raw FA3")
    parser.add_argument("--launches", action="store_true",
                        help="also print the launches (name and shape) of ours' and raw FA3's compiled calls")
    parser.add_argument("--host", action="store_true",
                        help="instead: the host-side events of a paged 8 x 2k call (jax.profiler), ours against raw FA3")
    args = parser.parse_args(argv)
    shape = QUICK if args.quick else FULL
    if args.host:
        print("\n".join(host_profile(shape, args.calls or 50)))
        return 0
    if args.profile:
        print("\n".join(profile(shape, args.calls or 50)))
        return 0
    lines = run(shape, args.calls or (3 if args.quick else 200), args.rounds or (2 if args.quick else 15),
                step=args.in_step, show_launches=args.launches)
    print("\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
