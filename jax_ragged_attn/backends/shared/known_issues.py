"""Upstream bugs that reach a path this package runs: one table keyed by library, version range, GPU and feature.

A backend's unsupported_reason asks `fence(backend, op, config)`. Where the loaded library is in an entry's
range, the GPU is one it names and the call has the feature, the call is declined with a reason naming the
report, so implementation=None routes it to a backend that serves it correctly and implementation="cudnn"
raises NotImplementedError saying why:

    cuDNN 9.14.0, ragged_attention(..., local_window_size=(64, 0), max_seqlen_kv=1500, implementation="cudnn")
      -> NotImplementedError: ... a left window over more than 1024 keys is declined on cuDNN 9.14.0, which has a
         known bug there: ... (TransformerEngine#2344, https://github.com/NVIDIA/TransformerEngine/pull/2344)

An entry with `workaround` set is handled another way already (the reason is in the entry); it is listed, by the
self-check too, and declines nothing. A workaround that costs something runs only where `worked_around(key)`
says the loaded versions need it. Each entry names the GPU test that reproduces it with its fence or workaround
lifted (tests/test_known_issues.py; `lifted(key)` is the test-only switch), or, where the bug did not show in
this package's forms on an affected release, the test of its fence or workaround; and says whether an affected
release installs from pip. docs/CUDNN_VERSIONS.md says how to run them against a given cuDNN.

Considered and left out, because no path of this package reaches them:
- TransformerEngine#3249 (THD backward with a sink token: the sink's gradient read the stats as dense, cuDNN
  before 9.26): cuDNN never gets a sink token here; sinks are an epilogue or folded into O and dO
  (backends/cudnn/sinks.py).
- cudnn-frontend#737 (THD ragged offsets ignored by the frontend's open-source FROST engines): those engines
  run from the frontend's Python package (cudnn.pygraph); this package's C++ graphs run the backend's engines.
  The seqused rows of the deep self-check would show a mis-addressed slot.
- cudnn-frontend#304 (Ampere backward read non-ragged stats as packed BHSD before 9.26): the stats here always
  carry ragged offsets, and frontends from 1.26 refuse the affected graphs.
- cudnn-frontend#628 / #1072 (Hopper backward NaN for rows with a very negative log-sum-exp, s_kv = 64 mod 128,
  fixed in 9.26; #1072: again with s_q = 1 and no padding mask): every graph here carries the padding mask (the
  reports' workaround) and at least 2 query rows; tests/test_known_issues.py probes it on every version.
- cudnn-frontend#1071 (9.26 backward plan creation crashes for B = H = s_q = 1): backward graphs have s_q >= 2.
- TransformerEngine#2344's other half (an illegal memory access under CUDA-graph capture, 9.13-9.14, keys past
  1024): a crash, not a silent error.
- pytorch#193893 (B200, fewer than 8 KV heads, cuDNN 9.19-9.20, open, cause unknown): no trigger confirmed.
- cuDNN 9.18.1 release notes, known issues (no public report to cite; the stored text is cut off after "the
  result"): decode-phase SDPA "run with causal masking turned on" with Q head count != K/V head count. The
  paged graphs here never carry a causal right bound: the head / tail split hands them `right + TAIL` (256
  rows past the diagonal, shared/head_tail.py head_bounds), which for one query row removes no key; the
  ragged route's graphs have at least 2 query rows (graphs.MIN_GRAPH_SEQLEN), not the decode phase. The GPU
  suite's GQA decode cases (stats against the float64 reference) passed on 9.19.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import warnings
from collections.abc import Callable
from typing import Any

from jax_ragged_attn.features.stacklevel import users_stacklevel

Version = tuple[int, ...]
LIBRARIES = ("cudnn", "cudnn_frontend", "flash-attn3-jax")
OPS = ("ragged", "kvcache")


@dataclasses.dataclass(frozen=True)
class Versions:
    """What an entry is matched against: the loaded libraries and the GPU."""

    cudnn: Version | None = None  # the loaded libcudnn, e.g. (9, 27, 0); None: not loaded
    cudnn_frontend: Version | None = None  # the headers the extension was built with
    fa3: Version | None = None  # the flash-attn3-jax wheel
    arch: int | None = None  # compute capability as major * 10 + minor: 90 on the H200

    def of(self, library: str) -> Version | None:
        return {"cudnn": self.cudnn, "cudnn_frontend": self.cudnn_frontend, "flash-attn3-jax": self.fa3}[library]


@dataclasses.dataclass(frozen=True)
class KnownIssue:
    key: str  # the report as repository#number, e.g. "cudnn-frontend#1083"; jax_ragged_attn#name: found here
    library: str  # one of LIBRARIES
    first_affected: Version | None  # None: every release before first_fixed
    first_fixed: Version | None  # None: no release has the fix yet
    archs: frozenset[int] | None  # compute capabilities (90: sm_90) it shows on; None: every GPU
    backend: str  # the backend whose calls reach it
    ops: tuple[str, ...]  # the ops whose configs `applies` reads
    feature: str  # what the user asked for, as a reason names it
    applies: Callable[[str, Any], bool]  # (op, config) -> whether this call has the feature
    description: str
    report: str  # the public report's URL; for a bug found here, its section of docs/CUDNN_VERSIONS.md
    # The GPU test that shows the bug with the fence (or workaround) lifted; for a worked-around entry whose bug
    # this package's graphs did not show on an affected release, the GPU test that checks the workaround on every
    # release; for a fence whose bug did not show in this package's forms (TransformerEngine#2344), its fence test.
    reproducer: str
    installable: str  # whether an affected release installs from pip next to jax[cuda13], and its size
    workaround: str | None = None  # how the bug is already kept away; set: fence() declines nothing

    def affects(self, versions: Versions) -> bool:
        """The loaded library is in [first_affected, first_fixed) and the GPU is one the entry names."""
        version = versions.of(self.library)
        if version is None:
            return False
        if self.first_affected is not None and version < self.first_affected:
            return False
        if self.first_fixed is not None and version >= self.first_fixed:
            return False
        return self.archs is None or versions.arch in self.archs

    def remedy(self) -> str:
        """Which release lifts the fence."""
        if self.first_fixed is None:
            return "no release has the fix yet"
        return f"fixed in {_name(self.library)} {format_version(self.first_fixed)}: upgrade to lift it"

    def reason(self, versions: Versions) -> str:
        version = format_version(versions.of(self.library))
        return (
            f"{self.feature} is declined on {_name(self.library)} {version}, which has a known bug there: "
            f"{self.description} ({self.key}, {self.report}); {self.remedy()}"
        )


def _name(library: str) -> str:
    return {"cudnn": "cuDNN", "cudnn_frontend": "cudnn-frontend"}.get(library, library)


def format_version(version: Version | None) -> str:
    return "unknown" if version is None else ".".join(map(str, version))


def cudnn_version_tuple(encoded: int) -> Version | None:
    """cuDNN 9's major * 10000 + minor * 100 + patch as a tuple: 92701 -> (9, 27, 1); 0 (not loaded) -> None."""
    if encoded <= 0:
        return None
    return encoded // 10000, encoded % 10000 // 100, encoded % 100


# ---- the features, over each op's config ------------------------------------------------------------------


def _packed_with_grouped_heads(op: str, config) -> bool:
    # Packed queries carry ragged stats, the report's form; their decode rows are sequences with one query
    # (seq_len_q = 1) whatever the graph's rows. The fixed form's decode (dense stats) is outside the entry: it
    # is right on 9.27.0 (test_one_query_paged_decode_stats_are_right_on_every_cudnn).
    return op == "kvcache" and config.packed and config.num_heads_q > config.num_heads_kv


def _ragged_single_query_grouped_heads(op: str, config) -> bool:
    return op == "ragged" and config.max_seqlen_q == 1 and config.num_heads_q > config.num_heads_kv


def _left_window_past_1024_keys(op: str, config) -> bool:
    keys = config.max_seqlen_kv if op == "ragged" else config.capacity
    return config.left_bound is not None and keys > 1024


def _every_call(op: str, config) -> bool:
    return True


def _head_major_stats(op: str, config) -> bool:
    return op == "ragged" and config.stats_layout == "head_major"


def _hopper_backward_head_dims(op: str, config) -> bool:
    # TransformerEngine's condition (both head dims at least 128, unequal, not DeepSeek's 192 / 128), and the one
    # seen here: Dv between 128 and 256 above a smaller Dqk (64 / 144 failed on 9.14; 32 / 48, 64 / 80 and equal
    # dims passed). A stats cotangent's backward widens Dv by 16 columns (launch.stats_gradient_unsupported asks
    # with that Dv).
    dqk, dv = config.head_dim_qk, config.head_dim_v
    unequal_wide = dqk >= 128 and dv >= 128 and dqk != dv and (dqk, dv) != (192, 128)
    return op == "ragged" and (unequal_wide or (dqk < dv and 128 < dv < 256))


def _ragged_backward(op: str, config) -> bool:
    # Whether a sequence has query rows is a device value: every ragged call's backward may have one without.
    return op == "ragged"


_INSTALL_9_26_27 = (
    "yes: nvidia-cudnn-cu13 9.26.0.51, 9.26.1.1 and 9.27.0.42 (the 9.27 wheel 537 MB; the "
    "libraries SDPA loads, xz-compressed, in parts: docs/CUDNN_VERSIONS.md)"
)

# Found by this package (no public report): the key is a name here, the report a section of docs/CUDNN_VERSIONS.md.
NO_QUERY_SEQUENCES = "jax_ragged_attn#no-query-sequences"

TABLE: tuple[KnownIssue, ...] = (
    KnownIssue(
        key="cudnn-frontend#1083",
        library="cudnn",
        first_affected=(9, 26, 0),
        # The report is open; the range is the report's (9.26-9.27) up to 9.28.1, the first release on which this
        # package's packed and decode cases are known right (9.28.0 untested). In this package's graph forms the
        # bug does not reproduce on an affected release: on cuDNN 9.27.0.42 from pip (H200; H100 with the
        # extension built against 9.28.1's headers) one-row packed graphs and one-row ragged graphs give every
        # head's stats within 6e-7 of the reference with the floors lowered to 1, and with the fence lifted the
        # packed decode and every cuDNN case of tests/test_kvcache_varlen.py pass. The pattern does show on
        # cuDNN 9.19 (H200: one-row packed graphs with grouped heads write the first head's stats only), so the
        # floor below stays on every release and nothing is declined.
        first_fixed=(9, 28, 1),
        archs=None,  # reported on sm_80, sm_90 and sm_100
        backend="cudnn",
        ops=("kvcache",),
        feature="packed queries with grouped-query heads through cuDNN's paged graph",
        applies=_packed_with_grouped_heads,
        description=(
            "with s_q = 1, ragged stats and more query heads than KV heads the forward writes the softmax "
            "stats of the first query head of each KV group only; a packed step's decode rows are such "
            "sequences, and the paged route merges its head and tail by those stats"
        ),
        report="https://github.com/NVIDIA/cudnn-frontend/issues/1083",
        reproducer="tests/test_known_issues.py::test_cudnn_frontend_1083_packed_decode_workaround",
        installable=_INSTALL_9_26_27 + "; not reproduced in this package's graphs on 9.27.0 (see the comment)",
        workaround=(
            "the KV-cache op's packed paged graphs are built for at least paged.PACKED_MIN_SEQLEN_Q = 2 "
            "query rows on every cuDNN (one-row packed graphs with grouped heads came back wrong on 9.19; "
            "on 9.27.0 they did not)"
        ),
    ),
    KnownIssue(
        key="cudnn-frontend#1083",
        library="cudnn",
        first_affected=(9, 26, 0),
        first_fixed=(9, 28, 1),  # as above: 9.28.1 is the first release seen right
        archs=None,
        backend="cudnn",
        ops=("ragged",),
        feature="ragged attention with one query row per sequence and grouped-query heads",
        applies=_ragged_single_query_grouped_heads,
        description="the ragged forward with s_q = 1 and grouped-query heads writes the first head's stats only",
        report="https://github.com/NVIDIA/cudnn-frontend/issues/1083",
        reproducer="tests/test_known_issues.py::test_cudnn_frontend_1083_ragged_workaround",
        installable=_INSTALL_9_26_27 + "; not reproduced in this package's graphs on 9.27.0 (see the comment above)",
        workaround=(
            "ragged graphs are built for at least graphs.MIN_GRAPH_SEQLEN = 2 query rows on every cuDNN "
            "(s_q = 1 graphs wrote wrong or NaN stats on 9.19 too)"
        ),
    ),
    KnownIssue(
        key=NO_QUERY_SEQUENCES,
        library="cudnn",
        # Seen on 9.14.0 (H100, benchmarks/cudnn_bug_probe.py): a sequence with keys but no query rows (cross
        # attention, a context-parallel chunk, seqused_q = 0) gets its dK and dV rows unwritten, every row of it
        # (700 of 700), in MHA and GQA, with or without a mask, so they hold whatever the buffer held (NaN, or
        # old values: the deep self-check fails). Every other row is right, keys outside every window included.
        # Right on 9.19.0, 9.27.0 and 9.28.1; 9.12-9.13 and 9.15-9.18 untested, so the range is every release
        # before 9.19.0 (NVIDIA wrote of a Hopper THD backward workspace-initialisation
        # bug "fixed in 9.18" in TransformerEngine#2186, maybe this one; TransformerEngine zero-fills dQ, dK and
        # dV of every THD backward, which hides it).
        first_affected=None,
        first_fixed=(9, 19, 0),
        archs=None,  # seen on sm_90; the workaround is one masked pass over dK and dV, kept on every GPU
        backend="cudnn",
        ops=("ragged",),
        feature="the ragged backward of a sequence with keys but no query rows",
        applies=_ragged_backward,
        description=(
            "the backward leaves the dK and dV rows of a sequence that has keys but no query rows "
            "unwritten (garbage or NaN where they must be 0); no public report: found by this "
            "package's deep self-check"
        ),
        report="docs/CUDNN_VERSIONS.md#no-query-sequences",
        reproducer="tests/test_known_issues.py::test_reproduces_no_query_sequences",
        installable="yes: nvidia-cudnn-cu13 9.14.0.64 (215 MiB of parts: docs/CUDNN_VERSIONS.md)",
        workaround=(
            "on the releases in range the backward masks dK and dV to 0 in the rows of sequences without "
            "query rows (backends/cudnn/launch.py), one elementwise pass over each"
        ),
    ),
    KnownIssue(
        key="TransformerEngine#2185",
        library="cudnn",
        first_affected=(9, 11, 0),
        # TransformerEngine declines 128 <= Dqk != Dv (not 192 / 128) on Hopper from 9.11 on every later release
        # ("until fixed"). On an H100 cuDNN 9.14.0 fails 14 tests of the GPU suite, every one a backward with a
        # stats cotangent, whose Dv is widened by 16 columns: Dqk 128 / Dv 144 and 64 / 144 give wrong dQ, dK,
        # dV (NaN too) past the first 128-row tile, with and without a mask, grouped heads or not
        # (benchmarks/cudnn_bug_probe.py). Right there: the plain backwards of 64 / 128, 128 / 64, 192 / 128,
        # 160 / 128 and equal dims, and the widened ones of 32 / 48 and 64 / 80. So the fence takes
        # TransformerEngine's condition and, seen here, Dv in (128, 256) above a smaller Dqk. 9.19.0, 9.27.0 and
        # 9.28.1 pass the same tests: the range ends at 9.19.0; 9.15-9.18 untested.
        first_fixed=(9, 19, 0),
        archs=frozenset({90}),
        backend="cudnn",
        ops=("ragged",),
        feature=(
            "the Hopper backward with 128 <= Dqk != Dv or 128 < Dv < 256 above a smaller Dqk (a stats "
            "cotangent's Dv + 16 included)"
        ),
        applies=_hopper_backward_head_dims,
        description=(
            "the Hopper backward gives wrong or NaN dQ, dK and dV past the first tile for 128 <= Dqk != Dv "
            "(but 192 / 128; TransformerEngine declines it from 9.11) and, seen by this package on 9.14.0, "
            "for 128 < Dv < 256 above a smaller Dqk (Dv 144 with Dqk 64 and 128)"
        ),
        report="https://github.com/NVIDIA/TransformerEngine/pull/2185",
        reproducer="tests/test_known_issues.py::test_reproduces_transformer_engine_2185_unequal_head_dims",
        installable="yes: nvidia-cudnn-cu13 9.14.0.64 (reproduced on it)",
    ),
    KnownIssue(
        key="TransformerEngine#2344",
        library="cudnn",
        first_affected=(9, 14, 0),
        first_fixed=(9, 15, 0),
        archs=None,
        backend="cudnn",
        ops=("ragged", "kvcache"),
        feature="a left window over more than 1024 keys",
        applies=_left_window_past_1024_keys,
        description=(
            "cuDNN 9.14.0 gives NaN outputs for a left window with max_seqlen_kv > 1024 under any mask "
            "but plain causal (padding masks included: every ragged call); TransformerEngine declines it "
            "(NVIDIA's own report is internal)"
        ),
        report="https://github.com/NVIDIA/TransformerEngine/pull/2344",
        # Not reproduced in this package's forms on cuDNN 9.14.0.64 (H100, the fence lifted, forward
        # and backward against the float64 reference: windows (64, 64) over 1500 keys, (128, 0) without causal
        # over 2048 keys with 16 heads, (256, 256) over 2048 + 1100 keys with grouped heads, (1000, 0)
        # bottom-right over 3000 keys, and the deep self-check's (32, 0) over 1100 keys; all right). Kept: the
        # report is NVIDIA's own, its trigger is not public, and the fence costs one old release's long windows
        # a route to another backend. The test checks the fence; benchmarks/cudnn_bug_probe.py runs the forms.
        reproducer="tests/test_known_issues.py::test_transformer_engine_2344_fence",
        installable="yes: nvidia-cudnn-cu13 9.14.0.64; not reproduced in this package's forms on it (above)",
    ),
    KnownIssue(
        key="TransformerEngine#1937",
        library="cudnn",
        first_affected=(9, 10, 0),
        first_fixed=(9, 10, 2),
        archs=None,
        backend="cudnn",
        ops=("ragged", "kvcache"),
        feature="every cuDNN attention call",
        applies=_every_call,
        description=(
            "TransformerEngine skips cuDNN 9.10.0 and 9.10.1 for every FP16/BF16 attention graph for "
            "known bugs (not itemised publicly; JAX itself refuses 9.10.0 against other builds)"
        ),
        report="https://github.com/NVIDIA/TransformerEngine/pull/1937",
        reproducer="tests/test_known_issues.py::test_reproduces_transformer_engine_1937_deep_check",
        installable=(
            "no, not next to jax[cuda13]: nvidia-cudnn-cu13 starts at 9.12; nvidia-cudnn-cu12 9.10.0.56 "
            "and 9.10.1.4 need jax[cuda12]"
        ),
    ),
    KnownIssue(
        key="cudnn-frontend#462",
        library="cudnn_frontend",
        first_affected=None,
        first_fixed=(1, 28, 0),
        archs=None,
        backend="cudnn",
        ops=("ragged",),
        feature="the ragged backward with head-major stats",
        applies=_head_major_stats,
        description=(
            "with max_total_seq_len set the frontend sized the head-major stats' intermediates H times "
            "too small and dQ, dK, dV came back all zero"
        ),
        report="https://github.com/NVIDIA/cudnn-frontend/pull/462",
        reproducer="tests/test_known_issues.py::test_reproduces_cudnn_frontend_462",
        installable="yes: nvidia-cudnn-frontend 1.27.0 (headers; scripts/build_old_frontend.sh builds against it)",
        workaround=(
            "the build refuses frontends before 1.28; a test build against one checks the reserved region "
            "when it builds each backward graph and falls back to the dense layout (ffi/graph_build.cc)"
        ),
    ),
)

_lifted: set[str] = set()


@contextlib.contextmanager
def lifted(*keys: str):
    """Within the block, fence() declines nothing for these reports and worked_around() applies none of their
    workarounds: for the reproducers, which run the affected feature to show the bug. Read when a call is
    traced, so run the op outside any jit traced before."""
    unknown = sorted(set(keys) - {issue.key for issue in TABLE})
    if unknown:
        raise ValueError(f"lifted() takes keys of known_issues.TABLE, got {unknown}")
    added = set(keys) - _lifted
    _lifted.update(added)
    try:
        yield
    finally:
        _lifted.difference_update(added)


def fence(backend: str, op: str, config, versions: Versions | None = None) -> str | None:
    """The reason `backend` must not serve this `op` call with the loaded versions, naming the bug, or None."""
    versions = loaded_versions() if versions is None else versions
    for issue in TABLE:
        if (
            issue.backend != backend
            or op not in issue.ops
            or issue.workaround
            or issue.key in _lifted
            or not issue.affects(versions)
        ):
            continue
        if issue.applies(op, config):
            return issue.reason(versions)
    return None


def worked_around(key: str, versions: Versions | None = None) -> bool:
    """Whether the loaded versions need entry `key`'s workaround: in its range and not lifted (a reproducer
    lifts it to show the bug). Read when a call is traced, as fence() is."""
    versions = loaded_versions() if versions is None else versions
    issues = [issue for issue in TABLE if issue.key == key]
    if not issues or not all(issue.workaround for issue in issues):
        raise ValueError(f"worked_around() takes the key of a worked-around entry of known_issues.TABLE, got {key!r}")
    return key not in _lifted and any(issue.affects(versions) for issue in issues)


def active(versions: Versions | None = None) -> list[KnownIssue]:
    """The entries the loaded versions and GPU are in the range of (fenced or worked around)."""
    versions = loaded_versions() if versions is None else versions
    return [issue for issue in TABLE if issue.affects(versions)]


def summary_lines(versions: Versions | None = None) -> list[str]:
    """What the self-check and the one-time warning say about the loaded versions: one line per entry in range."""
    versions = loaded_versions() if versions is None else versions
    lines = []
    for issue in active(versions):
        what = f"worked around ({issue.workaround})" if issue.workaround else f"declined on {issue.backend}"
        lines.append(f"{issue.feature}: {what}; {issue.key} {issue.report}; {issue.remedy()}")
    return lines


class KnownIssueWarning(UserWarning):
    """The loaded cuDNN (or frontend, or FA3 wheel) has bugs this package fences: some features go elsewhere."""


_warned = False


def warn_once() -> None:
    """Once a process, where a GPU library is loaded: which features are fenced and which release lifts them.
    (Once even under -W error: the flag is set before the warning is raised.)"""
    global _warned
    if _warned:
        return
    _warned = True
    versions = loaded_versions()
    fenced = [line for issue, line in zip(active(versions), summary_lines(versions)) if not issue.workaround]
    if fenced:
        loaded = ", ".join(f"{_name(lib)} {format_version(versions.of(lib))}" for lib in LIBRARIES if versions.of(lib))
        warnings.warn(
            f"jax_ragged_attn: {loaded} has known bugs in features this package fences: " + "; ".join(fenced),
            KnownIssueWarning,
            stacklevel=users_stacklevel(),
        )


# ---- what is loaded ---------------------------------------------------------------------------------------


def loaded_versions() -> Versions:
    """The versions of the loaded libraries and the GPU's compute capability (None where there is none)."""
    # The compiled module itself, not extension.py: extension.py warns through this module (warn_once), so
    # reading the versions through it would make the two import each other.
    try:
        import jax_ragged_attn._ext as ext
    except ImportError:  # no extension: no cuDNN path to fence
        ext = None
    return Versions(
        cudnn=cudnn_version_tuple(ext.cudnn_version()) if ext else None,
        cudnn_frontend=tuple(ext.frontend_version) if ext else None,
        fa3=fa3_version(),
        arch=_arch(),
    )


@functools.cache
def fa3_version() -> Version | None:
    """The installed flash-attn3-jax wheel's version, e.g. (0, 2, 3); None where it is not installed."""
    try:
        text = importlib.metadata.version("flash-attn3-jax")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in text.split(".")[:3] if part.isdigit())


@functools.cache
def _arch() -> int | None:
    import jax

    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return None
    capability = getattr(devices[0], "compute_capability", None) if devices else None
    if capability is None:
        return None
    major, _, minor = str(capability).partition(".")
    return int(major) * 10 + int(minor or 0)
