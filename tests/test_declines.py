"""jax_ragged_attn/testing/declines.py: a decline is a skip only where the list of expected declines names it.

On a CPU every GPU backend declines with "no CUDA device" (an environment skip), so the list's entries are
checked here against the backends' own checks: each entry has an example configuration its backend declines
with the entry's reason, and a decline the list does not name, planted by patching a backend's
unsupported_reason, fails instead of skipping.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_configs import decode_config  # tests/ is on sys.path under pytest

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.backends.cudnn import graphs
from jax_ragged_attn.backends.cudnn import kvcache as cudnn_kvcache
from jax_ragged_attn.backends.cudnn import ragged as cudnn
from jax_ragged_attn.backends.fa3 import dew
from jax_ragged_attn.backends.fa3 import kvcache as fa3_kvcache
from jax_ragged_attn.backends.fa3 import ragged as fa3
from jax_ragged_attn.backends.shared import extension, known_issues
from jax_ragged_attn.backends.xla import ragged as xla
from jax_ragged_attn.config import AttentionOptions, make_config
from jax_ragged_attn.testing import declines


class Skipped(Exception):
    pass


def _skip(message):
    raise Skipped(message)


def _ragged(dtype="bfloat16", dqk=128, dv=128, tokens=64, heads=4, **options):
    shape = lambda d: jax.ShapeDtypeStruct((tokens, heads, d), np.dtype(dtype))
    cu = jax.ShapeDtypeStruct((3,), jnp.int32)
    return make_config(
        shape(dqk),
        shape(dqk),
        shape(dv),
        cu,
        cu,
        AttentionOptions(**options),
        max_seqlen_q=tokens,
        max_seqlen_kv=tokens,
    )


# (entry's backend, op, fragment) -> (the backend's check, a configuration it declines that way)
EXAMPLES = {
    ("cudnn", "ragged", "takes bfloat16 or float16 inputs"): (graphs.unsupported_reason, _ragged("float32")),
    ("cudnn", "ragged", "head dims that are multiples of 8 up to"): (graphs.unsupported_reason, _ragged(dqk=100)),
    ("cudnn", "ragged", "ragged offsets are int32"): (graphs.unsupported_reason, _ragged(tokens=2**25, heads=1)),
    ("cudnn", "ragged", "which has a known bug there"): (graphs.unsupported_reason, _ragged()),
    ("cudnn", "ragged", "cannot differentiate through stats"): (cudnn.stats_gradient_unsupported, _ragged(dv=248)),
    ("cudnn", "kvcache", "takes bfloat16 or float16 inputs"): (
        cudnn_kvcache.unsupported_reason,
        decode_config(dtype="float32"),
    ),
    ("cudnn", "kvcache", "head dims that are multiples of 8 up to"): (
        cudnn_kvcache.unsupported_reason,
        decode_config(head_dim_v=100),
    ),
    ("cudnn", "kvcache", "page sizes that are powers of 2"): (
        cudnn_kvcache.unsupported_reason,
        decode_config(page_size=48),
    ),
    ("cudnn", "kvcache", "of at most 2**31 - 1 rows"): (
        cudnn_kvcache.unsupported_reason,
        decode_config(page_size=2**16, max_pages=2**15),
    ),
    ("cudnn", "kvcache", "which has a known bug there"): (cudnn_kvcache.unsupported_reason, decode_config()),
    ("cudnn", "kvcache", "packed queries (cu_seqlens_q) over a paged cache take cuDNN"): (
        cudnn_kvcache.unsupported_reason,
        decode_config(total_q=20, seqlen_q=4, num_heads_q=2),
    ),
    ("cudnn", "kvcache", "reaches into the rows cuDNN's paged graph reads"): (
        cudnn_kvcache.unsupported_reason,
        decode_config(seqlen_q=10, window_left=cudnn_kvcache.TAIL - 5),
    ),
    ("fa3", "ragged", "kernels are built without softcap"): (dew.unsupported_reason, _ragged(softcap=1.0)),
    ("fa3", "ragged", "kernels take equal head dims of"): (dew.unsupported_reason, _ragged(dqk=128, dv=64)),
    ("fa3", "ragged", "backward has no deterministic mode"): (dew.unsupported_reason, _ragged(deterministic=True)),
    ("fa3", "ragged", "called with softcap 0"): (fa3.unsupported_reason, _ragged(softcap=1.0)),
    ("fa3", "ragged", "FlashAttention-3 takes bfloat16 or float16 inputs"): (
        fa3.unsupported_reason,
        _ragged("float32"),
    ),
    ("fa3", "ragged", "kernels are built for head dim"): (fa3.unsupported_reason, _ragged(dqk=64, dv=64)),
    ("fa3", "ragged", "aligns its causal mask and windows bottom-right"): (
        fa3.unsupported_reason,
        _ragged(is_causal=True),
    ),
    ("fa3", "kvcache", "called with softcap 0"): (fa3_kvcache.unsupported_reason, decode_config(softcap=1.0)),
    ("fa3", "kvcache", "FlashAttention-3 takes bfloat16 or float16 inputs"): (
        fa3_kvcache.unsupported_reason,
        decode_config(dtype="float32"),
    ),
    ("fa3", "kvcache", "kernels are built for head dim"): (
        fa3_kvcache.unsupported_reason,
        decode_config(head_dim_qk=64),
    ),
    ("fa3", "kvcache", "reaches into the rows FA3 reads"): (
        fa3_kvcache.unsupported_reason,
        decode_config(seqlen_q=40, window_left=fa3_kvcache.TAIL - 5),
    ),
    # packed queries (cu_seqlens_q: total_q rows, seqlen_q their max_seqlen_q)
    ("fa3", "kvcache", "FA3 serves packed queries in tiles of at most"): (
        fa3_kvcache.unsupported_reason,
        decode_config(total_q=20, seqlen_q=4, num_heads_q=2 * 129),
    ),
    ("fa3", "kvcache", "packed queries with keys right of the diagonal"): (
        fa3_kvcache.unsupported_reason,
        decode_config(total_q=100, seqlen_q=64, is_causal=False),
    ),
}


def test_every_entry_is_what_its_backend_says_for_a_configuration_it_covers(monkeypatch):
    monkeypatch.setattr(extension, "cudnn_unavailable_reason", lambda: None)  # the checks before any graph
    for provider in (fa3, dew):  # FA3's checks of a configuration, which a machine without its wheel never reaches
        monkeypatch.setattr(provider, "unavailable_reason", lambda: None)
    assert set(EXAMPLES) == {(e.backend, e.op, e.says) for e in declines.EXPECTED}
    for (backend, op, says), (check, config) in EXAMPLES.items():
        # The fence's examples on cuDNN 9.10.0, which known_issues.py fences off for every call
        # (TransformerEngine#1937); the packed-queries floor on 9.7.1; the others with no cuDNN loaded, so that
        # no fence comes first.
        loaded = (9, 10, 0) if "known bug" in says else (9, 7, 1) if "take cuDNN" in says else None
        versions = known_issues.Versions(cudnn=loaded)
        monkeypatch.setattr(known_issues, "loaded_versions", lambda: versions)
        reason = check(config)
        assert reason is not None and says in reason, (backend, op, says, reason)
        entry = declines.expected(backend, op, config, reason)
        assert entry is not None and entry.says == says, (backend, op, says, reason, entry)


def _call(implementation="xla", dtype=jnp.bfloat16):
    q = jnp.ones((8, 2, 128), dtype)
    cu = jnp.array([0, 5, 8], jnp.int32)
    return declines.call(
        implementation,
        ragged_attention,
        q,
        q,
        q,
        cu,
        cu,
        max_seqlen_q=5,
        max_seqlen_kv=5,
        implementation=implementation,
        skip=_skip,
    )


def test_a_decline_the_list_does_not_name_fails(monkeypatch):
    monkeypatch.setattr(xla, "unsupported_reason", lambda config: "the xla path now declines everything")
    with pytest.raises(AssertionError, match="does not list as declined by design.*now declines everything"):
        _call("xla")


def test_a_listed_reason_on_a_configuration_its_entry_does_not_cover_fails(monkeypatch):
    """cuDNN declining bfloat16 with its float32 sentence is a regression, not the float32 decline."""
    monkeypatch.setattr(extension, "cudnn_unavailable_reason", lambda: None)
    monkeypatch.setattr(
        cudnn,
        "unsupported_reason",
        lambda config: f"the cuDNN path takes bfloat16 or float16 inputs, got {config.dtype}",
    )
    with pytest.raises(AssertionError, match="does not list"):
        _call("cudnn", jnp.bfloat16)
    with pytest.raises(Skipped, match=r"by design \(backends/cudnn/graphs.py unsupported_reason\).*float32"):
        _call("cudnn", jnp.float32)


def test_a_backend_that_cannot_run_here_is_an_environment_skip(monkeypatch):
    monkeypatch.setattr(extension, "cudnn_unavailable_reason", lambda: "no CUDA device: JAX's backend is 'cpu'")
    monkeypatch.setattr(cudnn, "unsupported_reason", lambda config: extension.cudnn_unavailable_reason())
    with pytest.raises(Skipped, match="cudnn cannot run here: no CUDA device"):
        _call("cudnn")


def test_a_backend_is_recorded_under_its_registry_name_not_its_module_path():
    """fa3/dew.py is a provider of implementation="fa3" (fa3/providers.py): its softcap decline is dew's listed
    one, a skip, recorded under the registry's name "fa3"."""
    from jax_ragged_attn.testing import fa3_emulator

    q = jnp.ones((8, 2, 128), jnp.bfloat16)
    cu = jnp.array([0, 5, 8], jnp.int32)
    with fa3_emulator.patched_dew(), declines.recorded() as seen, pytest.raises(NotImplementedError) as error:
        ragged_attention(
            q,
            q,
            q,
            cu,
            cu,
            max_seqlen_q=5,
            max_seqlen_kv=5,
            softcap=2.0,
            implementation="fa3",
            fa3_provider="dew-flash-attn",
        )
    assert [(d.backend, d.op) for d in seen] == [("fa3", "ragged")]
    assert "by design (backends/fa3/dew.py" in declines.verdict("fa3", error.value, seen)


def test_an_error_that_is_no_backend_decline_is_raised():
    def refuses():
        raise NotImplementedError("seqused_q / seqused_kv with token_axis")

    with pytest.raises(NotImplementedError, match="token_axis"):
        declines.call("cudnn", refuses, skip=_skip)


def test_a_served_call_returns_its_result():
    assert _call("xla").shape == (8, 2, 128)


def test_the_recording_is_undone():
    from jax_ragged_attn import backends

    original = backends.unsupported_reason
    with declines.recorded() as seen:
        assert backends.unsupported_reason is not original
    assert backends.unsupported_reason is original and seen == []


def test_a_stats_gradient_fence_asked_by_the_backward_is_recorded_and_listed(monkeypatch):
    """cuDNN's backward asks stats_gradient_unsupported itself when a stats cotangent arrives (launch.py): the
    recording sees it, and the widened backward's fence (Dv + 16 columns, TransformerEngine#2185 on 9.14 Hopper)
    is a listed decline, not the plain call's fence."""
    from jax_ragged_attn.backends.cudnn import launch

    monkeypatch.setattr(known_issues, "loaded_versions", lambda: known_issues.Versions(cudnn=(9, 14, 0), arch=90))
    config = _ragged()
    assert known_issues.fence("cudnn", "ragged", config) is None  # the plain call (Dqk = Dv = 128) is served
    original = launch.stats_gradient_unsupported
    with declines.recorded() as seen:
        reason = launch.stats_gradient_unsupported(config)
    assert launch.stats_gradient_unsupported is original
    assert "TransformerEngine#2185" in reason and [d.reason for d in seen] == [reason]
    entry = declines.expected("cudnn", "ragged", config, reason)
    assert entry is not None and "widened" in entry.source, entry


def test_every_backend_that_declines_a_stats_gradient_folds_sinks():
    """ops/ragged.py asks for a stats gradient with sinks only when stats are returned, because every backend that can
    decline one folds the sinks into its plain backward otherwise."""
    from jax_ragged_attn import backends

    for name in backends.REGISTRY:
        backend = backends.get(name)
        if hasattr(backend, "stats_gradient_unsupported"):
            assert hasattr(backend, "attend_with_sinks"), name


def test_without_the_wheel_a_decline_says_so_before_what_fa3_would_decline():
    """A top-left causal mask over unequal lengths is a decline FA3 would give with its wheel; without one the
    reason is the missing wheel."""
    from jax_ragged_attn import ragged_attention_with_kvcache
    from jax_ragged_attn.backends.fa3 import providers

    unavailable = providers.unavailable_reason()
    if unavailable is None:
        pytest.skip("an FA3 provider runs here")
    q, kv = jnp.ones((8, 2, 128), jnp.bfloat16), jnp.ones((12, 2, 128), jnp.bfloat16)
    with pytest.raises(NotImplementedError) as error:
        ragged_attention(
            q,
            kv,
            kv,
            jnp.array([0, 5, 8], jnp.int32),
            jnp.array([0, 9, 12], jnp.int32),
            max_seqlen_q=5,
            max_seqlen_kv=9,
            implementation="fa3",
        )
    assert str(error.value) == f"implementation='fa3' cannot serve this call: {unavailable}"
    assert "not installed" in str(error.value) or "needs a CUDA GPU" in str(error.value)
    cache = jnp.ones((2, 16, 2, 64), jnp.float32)  # float32, head dim 64: FA3 would decline both
    with pytest.raises(NotImplementedError) as error:
        ragged_attention_with_kvcache(
            jnp.ones((2, 1, 4, 64), jnp.float32), cache, cache, jnp.array([3, 16]), implementation="fa3"
        )
    assert str(error.value).endswith(fa3.unavailable_reason()), error.value
