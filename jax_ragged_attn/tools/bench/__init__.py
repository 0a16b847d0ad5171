"""Benchmarks against raw cuDNN and JAX's own attention paths: `python -m jax_ragged_attn.bench`."""
