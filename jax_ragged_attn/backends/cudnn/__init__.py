"""The cudnn family: cuDNN's fused SDPA graphs, built and launched by this package's C++ FFI extension.

    ragged.py     ragged_attention's backend (the surface the registry calls)
    kvcache.py    ragged_attention_with_kvcache's backend: the paged SDPA graph, or the ragged kernel
    launch.py     the differentiable launch (custom_vjp) of the forward and backward handlers
    graphs.py     what the extension is asked at trace time: support, workspace, graph attributes
    paged.py      the paged decode graph's launch
    extents.py    head groups sized so every tensor stays below the int32 offsets' 2**31 elements
    strategy.py   the backward's intermediate layout; autotune.py the plan timing and its on-disk store
    sinks.py      sinks folded into the plain backward
    options.py    its test hooks (NaN-poisoned outputs, a KV-cache route), set through testing.backend_options

Imports run one way: the registry (backends/__init__.py) imports these modules; they import the shared
helpers (backends/shared/) and the lower layers (config, index, features), never another family.
"""
