"""`python -m jax_ragged_attn.bench`: a short alias of `python -m jax_ragged_attn.tools.bench` (an entry point,
not part of the library: nothing imports this module)."""

if __name__ == "__main__":
    import sys

    from jax_ragged_attn.tools.bench import main

    sys.exit(main())
