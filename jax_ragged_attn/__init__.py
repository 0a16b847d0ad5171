"""cuDNN ragged attention for JAX."""
