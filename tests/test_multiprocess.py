"""Context parallelism the way multi-host jobs run it: 2 processes under `jax.distributed.initialize`, 2 CPU
devices each (gloo collectives), one 4-device mesh over both, against the unsharded op in each process.

Each process builds the same global arrays from a shared seed (`jax.make_array_from_callback`: a process
holds only its own devices' rows), runs the sharded op and its gradient, gathers the results with
`multihost_utils.process_allgather` and compares them with the op on the whole arrays. Reproduce by hand:
    python tests/test_multiprocess.py 0 PORT & python tests/test_multiprocess.py 1 PORT
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # 2 processes under jax.distributed

CASES = {  # name: (context_strategy, load_balance, causal)
    "all_gather_natural_causal": ("all_gather", False, True),
    "all_gather_balanced_causal": ("all_gather", True, True),
    "ring_natural_causal": ("ring", False, True),
    "ring_balanced_no_mask": ("ring", True, False),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_context_parallelism_over_two_processes():
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    children = [
        subprocess.Popen(
            [sys.executable, __file__, str(i), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    for child in children:
        try:
            outputs.append(child.communicate(timeout=420)[0])
        except subprocess.TimeoutExpired:
            for c in children:
                c.kill()
            raise
    for i, (child, output) in enumerate(zip(children, outputs)):
        assert child.returncode == 0, f"process {i} exited {child.returncode}:\n{output[-4000:]}"
        passed = {line.split()[1] for line in output.splitlines() if line.startswith("ok ")}
        assert passed == set(CASES), f"process {i} passed {sorted(passed)}:\n{output[-4000:]}"


def _child(process_id: int, port: int) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=process_id)
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    from jax_ragged_attn import ragged_attention
    from jax_ragged_attn.parallel.sharding import reorder_for_load_balance, restore_order, sharded_ragged_attention
    from jax_ragged_attn.testing import assert_close

    assert jax.process_count() == 2 and len(jax.devices()) == 4 and len(jax.local_devices()) == 2
    mesh = jax.make_mesh((4,), ("cp",))
    rng = np.random.default_rng(0)  # the same arrays in both processes
    total = 48  # 2n = 8 chunks of 6 rows: documents cross chunks and processes
    lengths = [17, 0, 9, 13, 5]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v = (rng.standard_normal((total, h, 8)).astype(np.float32) for h in (4, 2, 2))
    d_out = rng.standard_normal((total, 4, 8)).astype(np.float32)
    d_out[cu[-1] :] = 0
    tokens = jax.NamedSharding(mesh, jax.P("cp", None, None))

    def global_array(x):
        return jax.make_array_from_callback(x.shape, tokens, lambda index: x[index])

    for name, (strategy, balanced, causal) in CASES.items():
        options = dict(max_seqlen_q=17, max_seqlen_kv=17, is_causal=causal, implementation="xla")

        def sharded(q, k, v):
            order = (lambda x: reorder_for_load_balance(x, 4)) if balanced else (lambda x: x)
            out = sharded_ragged_attention(
                order(q),
                order(k),
                order(v),
                cu,
                cu,
                mesh=mesh,
                token_axis="cp",
                load_balance=balanced,
                context_strategy=strategy,
                **options,
            )
            return restore_order(out, 4) if balanced else out

        args = tuple(global_array(x) for x in (q, k, v))
        out, pullback = jax.vjp(jax.jit(sharded), *args)
        grads = pullback(global_array(d_out))
        got = [multihost_utils.process_allgather(x, tiled=True) for x in (out, *grads)]
        want_out, want_pullback = jax.vjp(
            lambda q, k, v: ragged_attention(q, k, v, cu, cu, **options), jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
        )
        want = [want_out, *want_pullback(jnp.asarray(d_out))]
        for what, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            assert_close(np.asarray(g), np.asarray(w), "float32", f"{name}: {what}")
        print(f"ok {name}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    _child(int(sys.argv[1]), int(sys.argv[2]))
