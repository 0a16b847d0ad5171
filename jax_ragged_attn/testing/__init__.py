"""Test support shipped with the package: the float64 reference, dtype-derived tolerances, packed random
batches and the CPU stand-in kernels' helpers. Used by the tests, the sweep, the self-check and users'
own tests of code built on the op."""

from jax_ragged_attn.testing.helpers import (
    PackedBatch,
    assert_close,
    implementation_options,
    packed_batch,
    random_lengths,
    stand_in_handler_args,
    tolerance,
)
from jax_ragged_attn.testing.private_config import backend_options, config_overrides
from jax_ragged_attn.testing.reference import reference_attention

__all__ = [
    "PackedBatch",
    "assert_close",
    "backend_options",
    "config_overrides",
    "implementation_options",
    "packed_batch",
    "random_lengths",
    "reference_attention",
    "stand_in_handler_args",
    "tolerance",
]
