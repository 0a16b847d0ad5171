"""jax.export of steps that call the ops (jax_ragged_attn/export.py): a training step (loss and jax.grad through
ragged_attention) and a decode step (kvcache_append, then ragged_attention_with_kvcache over a paged cache),
exported, serialized, deserialized in a fresh process that knows nothing but the bytes, run there, and
compared with the same step run here.

On a CPU the xla path round-trips, and the cuDNN path is lowered for CUDA (its trace-time graph queries
answered by a stand-in) to show what the exporter needs for our custom calls. On a GPU the cuDNN and FA3 paths
round-trip too (marked gpu; elsewhere they skip with the reason).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ragged_attn
from jax_ragged_attn.backends.cudnn import launch
from jax_ragged_attn.backends.cudnn import ragged as cudnn_ragged
from jax_ragged_attn.backends.fa3 import dew, providers
from jax_ragged_attn.backends.fa3 import ragged as fa3_ragged
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.testing import assert_close

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The fresh process: for every STEP.jax in the folder, the step deserialized and called on STEP.npz's
# arrays (cast to the step's input dtypes), its results saved as float32 in STEP.out.npz.
CHILD = r"""
import pathlib, sys
import jax, numpy as np
import jax_ragged_attn
for blob in sorted(pathlib.Path(sys.argv[1]).glob("*.jax")):
    step = jax_ragged_attn.export.deserialize(blob.read_bytes())
    saved = np.load(blob.with_suffix(".npz"))
    args = [np.asarray(saved[f"arg{i}"], aval.dtype) for i, aval in enumerate(step.in_avals)]
    results = jax.tree.leaves(step.call(*args))
    np.savez(blob.with_suffix(".out.npz"), *[np.asarray(r, np.float32) for r in results])
"""


def _child_env() -> dict:
    env = dict(os.environ)
    # The package is found where this process found it (the checkout), not through an install.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _round_trip(steps: dict, folder: pathlib.Path) -> dict:
    """{name: (here, there, exported)}: each jitted step's results run in this process and, exported with
    jax_ragged_attn.export, serialized and deserialized, in a fresh one (all steps in one process)."""
    here, exported = {}, {}
    for name, (step, args) in steps.items():
        exported[name] = jax_ragged_attn.export.export(step)(*args)
        (folder / f"{name}.jax").write_bytes(exported[name].serialize())
        np.savez(folder / f"{name}.npz", **{f"arg{i}": np.asarray(a, np.float32) for i, a in enumerate(args)})
        here[name] = [np.asarray(r, np.float32) for r in jax.tree.leaves(step(*args))]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(folder)],
        env=_child_env(),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, f"the fresh process failed:\n{done.stdout}\n{done.stderr[-6000:]}"
    there = {}
    for name in steps:
        saved = np.load(folder / f"{name}.out.npz")
        there[name] = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    return {name: (here[name], there[name], exported[name]) for name in steps}


def training_step(implementation: str, dtype, head_dim: int):
    """jit(value_and_grad) of a loss through ragged_attention (GQA, causal, padding rows), and its arguments."""
    rng = np.random.default_rng(65)
    rows, heads_q, heads_kv = 96, 4, 2
    q = jnp.asarray(rng.standard_normal((rows, heads_q, head_dim)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((rows, heads_kv, head_dim)), dtype) for _ in range(2))
    cu = jnp.array([0, 30, 31, 70, 88], jnp.int32)  # 8 padding rows
    weights = jnp.asarray(rng.standard_normal((rows, heads_q, head_dim)), jnp.float32)

    def loss(q, k, v, cu):
        out = jax_ragged_attn.ragged_attention(
            q, k, v, cu, cu, max_seqlen_q=40, max_seqlen_kv=40, is_causal=True, implementation=implementation
        )
        return jnp.sum(out.astype(jnp.float32) * weights)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), (q, k, v, cu)


def decode_step(implementation: str, dtype, head_dim: int):
    """jit of one decode step over a paged cache: the new token's key and value appended, then attention; and
    its arguments."""
    rng = np.random.default_rng(66)
    batch, heads_q, heads_kv, page_size, num_pages = 3, 8, 2, 16, 16
    k_cache, v_cache = (
        jnp.asarray(rng.standard_normal((num_pages, page_size, heads_kv, head_dim)), dtype) for _ in range(2)
    )
    page_table = jnp.asarray(rng.permutation(num_pages)[: batch * 4].reshape(batch, 4), jnp.int32)
    lengths = jnp.array([5, 40, 0], jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, 1, heads_q, head_dim)), dtype)
    k_new, v_new = (jnp.asarray(rng.standard_normal((batch, 1, heads_kv, head_dim)), dtype) for _ in range(2))

    def step(q, k_cache, v_cache, k_new, v_new, lengths, page_table):
        k_cache, v_cache, lengths = jax_ragged_attn.kvcache_append(
            k_cache, v_cache, k_new, v_new, lengths, page_table=page_table
        )
        out = jax_ragged_attn.ragged_attention_with_kvcache(
            q, k_cache, v_cache, lengths, page_table=page_table, implementation=implementation
        )
        return out, k_cache, v_cache, lengths

    return jax.jit(step), (q, k_cache, v_cache, k_new, v_new, lengths, page_table)


def _called(exported) -> set[str]:
    return set(re.findall(r"stablehlo\.custom_call @([\w.$-]+)\(", exported.mlir_module()))


# ---- the xla path, on any machine -------------------------------------------------------------------------


def test_the_xla_path_round_trips_through_a_fresh_process(tmp_path):
    steps = {
        "training": training_step("xla", jnp.float32, 16),
        "decode": decode_step("xla", jnp.float32, 16),
    }
    for name, (here, there, exported) in _round_trip(steps, tmp_path).items():
        assert not _called(exported) & set(jax_ragged_attn.export.target_names()), f"{name}: the xla path calls none"
        assert len(here) == len(there) == 4, name  # loss, dq, dk, dv; out, k_cache, v_cache, lengths
        for i, (a, b) in enumerate(zip(here, there)):
            np.testing.assert_array_equal(b, a, err_msg=f"{name} result {i}")


# ---- the cuDNN path lowered for CUDA on this machine ----------------------------------------------------------


@pytest.fixture
def cudnn_lowers_here(monkeypatch):
    """implementation="cudnn" traces without a GPU: the backend serves, and the graphs' workspace (a trace-time
    question to the extension, which needs a device) is a stand-in's size."""
    monkeypatch.setattr(cudnn_ragged, "unsupported_reason", lambda config: None)
    monkeypatch.setattr(launch, "graph_info", lambda direction, config, layout=None: {"workspace_bytes": 256})


def test_the_cudnn_path_exports_for_cuda_with_its_targets_allowed(cudnn_lowers_here, tmp_path):
    step, args = training_step("cudnn", jnp.bfloat16, 64)
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    exported = jax_ragged_attn.export.export(step, platforms=("cuda",))(*avals)
    assert exported.platforms == ("cuda",)
    assert {extension.FORWARD_TARGET, extension.BACKWARD_TARGET} <= _called(exported)
    assert _called(exported) & set(jax_ragged_attn.export.target_names()) <= set(extension.targets().values())
    # Deserializing where it cannot run (no GPU here) works: the step can be inspected, and calling it is JAX's
    # platform error.
    again = jax_ragged_attn.export.deserialize(exported.serialize())
    assert again.in_avals == exported.in_avals and _called(again) == _called(exported)
    with pytest.raises(ValueError, match="cuda"):
        again.call(*args)


def test_exporting_the_cudnn_path_without_the_allowance_names_the_target(cudnn_lowers_here):
    step, args = training_step("cudnn", jnp.bfloat16, 64)
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    with pytest.raises(ValueError, match="compatibility guarantees") as error:
        jax.export.export(step, platforms=("cuda",))(*avals)
    assert extension.FORWARD_TARGET in str(error.value)
    # jax.export.export takes the same allowance directly.
    allowed = jax.export.export(step, platforms=("cuda",), disabled_checks=jax_ragged_attn.export.disabled_checks())
    assert extension.BACKWARD_TARGET in _called(allowed(*avals))


def test_deserializing_on_a_gpu_where_a_handler_cannot_run_says_why(cudnn_lowers_here, monkeypatch):
    step, args = training_step("cudnn", jnp.bfloat16, 64)
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    blob = jax_ragged_attn.export.export(step, platforms=("cuda",))(*avals).serialize()
    if extension.cudnn_unavailable_reason() is None:
        pytest.skip("the extension's handlers run here")
    jax_ragged_attn.export.register()  # every availability answer cached as this machine gives it
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(NotImplementedError, match=extension.FORWARD_TARGET) as error:
        jax_ragged_attn.export.deserialize(blob)
    assert extension.cudnn_unavailable_reason() in str(error.value)


def test_every_target_the_fa3_family_calls_is_allowed():
    """The FA3 providers' handlers are called by name in the fa3 modules: each name is in the allowance."""
    family = ROOT / "jax_ragged_attn" / "backends" / "fa3"
    names = {n for path in family.glob("*.py") for n in re.findall(r'TARGET_PREFIX \+ "(\w+)"', path.read_text())}
    called = {fa3_ragged.TARGET_PREFIX + n for n in names} | {dew.TARGET_PREFIX + n for n in dew.TARGETS}
    assert names, "the fa3 modules call no handler by name: this test reads them wrong"
    assert called <= set(jax_ragged_attn.export.target_names()), sorted(called)


def test_check_mode_does_not_serialize():
    """check=True reports through host callbacks, which JAX cannot serialize: export a step with check off."""
    step, args = training_step("xla", jnp.float32, 16)
    checked = jax.jit(
        lambda q, k, v, cu: jax_ragged_attn.ragged_attention(
            q, k, v, cu, cu, max_seqlen_q=40, max_seqlen_kv=40, implementation="xla", check=True
        )
    )
    with pytest.raises(NotImplementedError, match="host_callbacks"):
        jax_ragged_attn.export.export(checked)(*args).serialize()


# ---- the GPU paths, round trips -----------------------------------------------------------------------------

_CUDNN_REASON = extension.cudnn_unavailable_reason()
_FA3_REASON = providers.unavailable_reason()
GPU_PATHS = [
    pytest.param(
        "cudnn",
        marks=[pytest.mark.gpu, pytest.mark.skipif(_CUDNN_REASON is not None, reason=f"cuDNN: {_CUDNN_REASON}")],
    ),
    pytest.param(
        "fa3", marks=[pytest.mark.gpu, pytest.mark.skipif(_FA3_REASON is not None, reason=f"FA3: {_FA3_REASON}")]
    ),
]


@pytest.mark.parametrize("implementation", GPU_PATHS)
@pytest.mark.parametrize("kind", ["training", "decode"])
def test_the_gpu_paths_round_trip_through_a_fresh_process(implementation, kind, tmp_path):
    make = training_step if kind == "training" else decode_step
    step, args = make(implementation, jnp.bfloat16, 128)  # 128: the head dim every FA3 provider serves
    try:
        jax.block_until_ready(step(*args))
    except NotImplementedError as declined:
        pytest.skip(f"{implementation} declines this {kind} step here: {declined}")
    ((here, there, exported),) = _round_trip({kind: (step, args)}, tmp_path).values()
    assert _called(exported) & set(jax_ragged_attn.export.target_names()), "the step calls none of our handlers"
    assert len(here) == len(there)
    for i, (a, b) in enumerate(zip(here, there)):
        # The same executable: only the order of a backward's atomic adds may differ between the runs.
        assert_close(b, a, "bfloat16", f"{implementation} {kind} result {i}")
