"""`python -m jax_ragged_attn.selfcheck`: a short alias of `python -m jax_ragged_attn.tools.selfcheck` (an entry
point, not part of the library: nothing imports this module)."""

if __name__ == "__main__":
    import sys

    from jax_ragged_attn.tools.selfcheck import main

    sys.exit(main())
