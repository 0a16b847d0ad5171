"""Tools built on the library: the demo (the main job), the self-check, the sweep, the autotune report and
the benchmarks. The library never imports from here."""
