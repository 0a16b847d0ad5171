"""autotune=True: run the fastest of the plans cuDNN offers for a graph, measured once and kept on disk.

cuDNN's heuristics rank candidate execution plans (engine configurations) for a graph and we normally run
the first that builds. With autotune the extension builds every candidate, times each on scratch buffers
(equal-length sequences filling the capacities, median of 9 runs after 2 warm-ups; ffi/autotune.cc) and
we keep the heuristic's choice unless another plan is faster by more than MARGIN, so tuning never picks
a plan slower than the default by more than timing noise. The choice is stored per (GPU model, cuDNN
version, cudnn-frontend version, direction, every graph attribute) in a JSON file, so a later process
reuses it without measuring; the candidate list is a function of exactly those, so its indices stay valid
(the extension still rejects an index out of range).

Tune the benchmark workloads and print the gains with `python -m benchmarks.autotune`.

The file is $JAX_RAGGED_ATTN_AUTOTUNE_CACHE, else $XDG_CACHE_HOME/jax_ragged_attn/autotune.json (default
~/.cache). Delete it to measure again. Tuning happens at trace time, where it synchronises the device.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import warnings
from pathlib import Path

from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.features.stacklevel import users_stacklevel

CACHE_ENV = "JAX_RAGGED_ATTN_AUTOTUNE_CACHE"
# Another plan replaces the heuristic's choice only if its median is this much lower: run-to-run noise of
# a median of 9 is about 1 % on the H200, so 3 % is a real difference.
MARGIN = 0.03

_lock = threading.Lock()
_chosen: dict[str, dict] = {}  # key -> entry, this process


def cache_path() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "jax_ragged_attn" / "autotune.json"


def choose(plans: list[dict]) -> dict:
    """The plan to run, from tune_plans' measurements: the heuristic's choice (the first plan that built
    and ran) unless another one's median is more than MARGIN lower. Raises if no plan ran."""
    ran = [p for p in plans if p["ok"]]
    if not ran:
        reasons = "; ".join(f"plan {p['index']}: {p['message']}" for p in plans) or "cuDNN offered no plan"
        raise RuntimeError(f"autotuning found no plan that runs: {reasons}")
    heuristic = min(ran, key=lambda p: p["index"])
    fastest = min(ran, key=lambda p: (p["median_ms"], p["index"]))
    return fastest if fastest["median_ms"] < heuristic["median_ms"] * (1 - MARGIN) else heuristic


def _key(direction: str, attributes: dict, device: int) -> str:
    import jax  # the device's model name; imported here so the CLI's --help needs no backend

    ext = extension.module()
    gpu = jax.devices("gpu")[device].device_kind if jax.default_backend() == "gpu" else "none"
    graph = {k: v for k, v in sorted(attributes.items()) if k != "plan_index"}
    return json.dumps([gpu, ext.cudnn_version(), list(ext.frontend_version), direction, graph])


def load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return {}  # unreadable or half-written by someone else: measure again rather than fail


def store(path: Path, key: str, entry: dict) -> None:
    # Merge with what other processes wrote, then replace atomically: a reader never sees half a file.
    entries = load(path)
    entries[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(entries, f, indent=1)
    os.replace(f.name, path)


def tune(direction: str, attributes: dict, device: int) -> dict:
    """Measures every candidate plan now (no cache) and returns the entry autotune would store."""
    result = extension.module().tune_plans(direction, device, {**attributes, "plan_index": -1})
    if result["status"] == "unsupported":
        raise NotImplementedError(f"cuDNN cannot run this {direction} configuration: {result['message']}")
    if result["status"] != "ok":
        raise RuntimeError(f"autotuning the cuDNN {direction} graph failed: {result['message']}")
    plans = [dict(p) for p in result["plans"]]
    chosen = choose(plans)
    heuristic = min((p for p in plans if p["ok"]), key=lambda p: p["index"])
    return dict(
        plan_index=chosen["index"],
        plan_name=chosen["name"],
        chosen_ms=chosen["median_ms"],
        heuristic_index=heuristic["index"],
        heuristic_ms=heuristic["median_ms"],
        plans=plans,
    )


def plan_index(direction: str, attributes: dict, device: int) -> int:
    """The plan index to run for this graph: from this process, else the disk cache, else measured now."""
    return int(entry(direction, attributes, device)["plan_index"])


def chosen_ms(direction: str, attributes: dict, device: int) -> float:
    """The measured median of the plan autotune runs for this graph; inf where none could be measured."""
    return float(entry(direction, attributes, device).get("chosen_ms", float("inf")))


def entry(direction: str, attributes: dict, device: int) -> dict:
    """The stored choice for this graph: from this process, else the disk cache, else measured now."""

    def measure():
        try:
            return tune(direction, attributes, device), True
        except NotImplementedError:  # the graph itself is unsupported: graph_info says so itself
            return dict(plan_index=-1, unsupported=True), False
        except RuntimeError as error:  # e.g. no memory for the scratch buffers: keep the heuristic's
            warnings.warn(
                f"autotuning the cuDNN {direction} graph failed, using cuDNN's heuristic choice: {error}",
                RuntimeWarning,
                stacklevel=users_stacklevel(),
            )
            return dict(plan_index=-1, failed=str(error)), False

    return remembered(_key(direction, attributes, device), _chosen, _lock, measure)


def remembered(key: str, chosen: dict, lock, measure) -> dict:
    """The entry stored under `key`: from `chosen` (this process's entries), else the disk cache, else
    measure() -> (entry, keep), whose entry this process remembers and, when `keep`, the disk cache too (a
    failed measurement is not kept, so another process measures again). `lock` guards `chosen`; a caller
    whose measurement itself tunes (backends/tuning.py's, through cuDNN's plans) passes a lock of its own."""
    with lock:
        found = chosen.get(key)
        if found is None:
            path = cache_path()
            found = load(path).get(key)
            if found is None:
                found, keep = measure()
                if keep:
                    store(path, key, found)
            chosen[key] = found
    return found
