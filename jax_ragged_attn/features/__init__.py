"""What composes around a backend call, each in one place (ops.ragged.attend applies them in order): input checks
(checks.py), the bottom-right mask rewritten as top-left where they agree (bottom_right.py), learnable sinks
(sinks.py) and the overflow counts (overflow.py). Features import the index layer, never a backend."""
