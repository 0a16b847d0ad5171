"""Tools built on the library: the main job (lm/), the self-check and a bench of the user's own shapes. The
library never imports from here; the benchmark harnesses live outside the package, in the repository's
benchmarks/."""
