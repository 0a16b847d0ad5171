"""implementation="fa3": FlashAttention-3's Hopper kernels from whichever provider is installed and serves the call.

    provider          module       its kernels
    dew-flash-attn    dew.py       head dims 64, 128, 192, 256 (Dqk = Dv); no softcap, no deterministic backward
    flash-attn3-jax   ragged.py    head dim 128

Both run through one wrapper (ragged.py: padding safety, masks and their alignment, both stats layouts, the
stats gradient's second backward call, row masking); a provider contributes its kernel calls and what they
cannot serve. fa3_provider names one (it runs, or the call is declined with its reason); None takes the first
in PROVIDERS' order that serves: dew-flash-attn's build runs faster than the flash-attn3-jax wheel's on every
row where both serve (docs/PERFORMANCE.md#against-every-peer).
"""

from __future__ import annotations

from jax_ragged_attn.backends import policy
from jax_ragged_attn.backends.fa3 import dew
from jax_ragged_attn.backends.fa3 import ragged as flash_attn3_jax
from jax_ragged_attn.config import AttentionConfig

NAME = "fa3"
READS_INDEX = True  # a provider proves a top-left mask from the lengths
PROVIDERS = {"dew-flash-attn": dew, "flash-attn3-jax": flash_attn3_jax}  # implementation=None's order


def _reason(provider: str, config: AttentionConfig, index) -> str | None:
    module = PROVIDERS[provider]  # looked up per call, so that tests can replace a provider's answers
    return module.unsupported_reason(config, index) if index is not None else module.unsupported_reason(config)


def provider(config: AttentionConfig, index=None) -> str | None:
    """The provider whose kernels run this call: config.fa3_provider where it serves, else the first of
    PROVIDERS that serves; None where none does."""
    names = [config.fa3_provider] if config.fa3_provider is not None else list(PROVIDERS)
    return next((name for name in names if _reason(name, config, index) is None), None)


def unavailable_reason() -> str | None:
    """None where some provider's kernels can run here, else why none can (each provider's reason)."""
    reasons = {name: module.unavailable_reason() for name, module in PROVIDERS.items()}
    if any(reason is None for reason in reasons.values()):
        return None
    return "; ".join(f"{name}: {reason}" for name, reason in reasons.items())


def unsupported_reason(config: AttentionConfig, index=None) -> str | None:
    """None when a provider can serve this call here (the named one, where fa3_provider names one), else why
    not: the named provider's reason, or those of the providers that can run here (of all where none can)."""
    if config.fa3_provider is not None:
        return _reason(config.fa3_provider, config, index)
    reasons = {}
    for name in PROVIDERS:
        reason = _reason(name, config, index)
        if reason is None:
            return None
        reasons[name] = reason
    # Those that can run here say why they decline; a wheel that is not installed says so only where none is.
    shown = [name for name in reasons if PROVIDERS[name].unavailable_reason() is None] or list(reasons)
    return reasons[shown[0]] if len(shown) == 1 else "; ".join(f"{name}: {reasons[name]}" for name in shown)


def auto_candidate(config: AttentionConfig) -> bool:
    """implementation=None considers FA3 where the shipped policy prefers it (policy.py), or measures it with
    autotune=True (tuning.py)."""
    return policy.prefers_fa3(config) or config.autotune


def attend(buffers, index, config: AttentionConfig, *, stats=True):
    """(out, stats) through the provider that serves this call (the caller has checked unsupported_reason)."""
    name = provider(config, index)
    assert name is not None  # unsupported_reason is None: some provider serves the call
    return PROVIDERS[name].attend(buffers, index, config, stats=stats)
