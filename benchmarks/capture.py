"""Are this package's FFI custom calls captured into XLA's command buffers (CUDA graphs)? Read from XLA's output.

What XLA does (read from openxla/xla; file paths below are in that repository):

- `--xla_gpu_enable_command_buffer` is a comma-separated list of command types (FUSION, CUBLAS, CUBLASLT,
  CUSTOM_CALL, CUDNN, COLLECTIVES, CONDITIONAL, WHILE, DYNAMIC_SLICE_FUSION, ...). A plain list replaces the
  set, "+X,-Y" edits the default set, and an empty value (`--xla_gpu_enable_command_buffer=`) clears it:
  command buffers off (xla/debug_options_flags.cc). The default set is FUSION, CUBLAS, CUBLASLT,
  CUSTOM_CALL, CUDNN, so custom calls are eligible without any flag. `--xla_gpu_graph_min_graph_size`
  (default 5) is the fewest consecutive convertible operations that become a command buffer; shorter runs
  stay ordinary launches.
- CUSTOM_CALL covers an XLA FFI custom call only when its handler was registered with
  `ffi::Traits::kCmdBufferCompatible` (`ffi::IsCommandBufferCompatible` on the registration, in
  command_buffer_scheduling.cc and command_buffer_conversion_pass.cc); legacy (non-FFI) custom calls are
  never captured. A captured custom call is recorded by stream capture, which needs CUDA driver and runtime
  12.3 or newer: below that XLA silently drops CUSTOM_CALL (with CUBLAS, CUDNN, ...) from the set.
- A while loop is captured whole only if WHILE is enabled (it is not by default) and everything in its body
  and condition is convertible; otherwise runs of convertible operations inside the body become command
  buffers of their own, launched once per iteration.
- Where capture shows up depends on the XLA version:
  * Older XLA wraps the captured operations in the optimized HLO (pass CommandBufferScheduling,
    xla/service/gpu/transforms/command_buffer_scheduling.cc): a computation built under the name
    "command_buffer" (made unique as command_buffer.N) and called as `call(...), to_apply=%command_buffer`.
    Computations it calls (a captured loop's body) are captured too.
  * Newer XLA forms command buffers after the HLO, on the thunk sequence (CommandBufferConversionPass,
    xla/backends/gpu/runtime/command_buffer_conversion_pass.cc; jaxlib 0.10.2 lists the old switch
    `xla_gpu_experimental_enable_command_buffer_on_thunks` as a reserved, removed field). The optimized HLO
    (`compiled.as_text()`) then shows nothing. With `--xla_dump_to=DIR` XLA writes
    `module_NNNN.<module>.thunk_sequence_after_thunk_passes.txt` when a thunk pass changed the sequence
    (else only `...thunk_sequence.txt`): one line per thunk, `<indent><thunk id>: <kind>`, the thunks of a
    command buffer indented under its `kCommandBuffer` line, and `...thunk_metadata.txt`, which maps each
    thunk id to its `profile_annotation`, the name of the HLO instruction it came from
    (xla/backends/gpu/runtime/gpu_executable.cc, sequential_thunk.cc, thunk.cc).

`classify_hlo` reads the HLO; `classify_thunks` reads the thunk dump; `classify` tries the HLO, then the
dump. Each occurrence of one of our targets comes back "captured", "not captured" or "unknown" with the
reason. These text formats are not a stable interface: where the signature is missing the answer is
"unknown", never a guess.

Caveats: a captured custom call is traced on the first execution and replayed after that; XLA calls the
handler again only to trace anew when the addresses of its buffers change (TracedCommandBuffer in
xla/backends/gpu/runtime/command_buffer_cmd.cc, a cache of `--xla_cmd_buffer_trace_cache_size` = 16 traces),
so the handler's host-side work (its graph cache lookup, its checks) runs when traced, not on every replay.
With a profiler attached XLA runs op by op unless `--xla_enable_command_buffers_during_profiling` is set.
"""

from __future__ import annotations

import dataclasses
import os
import re

from jax_ragged_attn.backends.shared.extension import BACKWARD_TARGET, FORWARD_TARGET

TARGETS = (FORWARD_TARGET, BACKWARD_TARGET)  # check mode calls the same two handlers
CAPTURED, NOT_CAPTURED, UNKNOWN = "captured", "not captured", "unknown"

_COMMAND_BUFFER_COMPUTATION = re.compile(r"^command_buffer(?:[._]\d+)?$")
_CALLED = re.compile(r"\b(?:to_apply|calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_CALLED_LISTS = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_CUSTOM_CALL = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?\scustom-call\(.*?custom_call_target=\"([^\"]+)\"")
_MODULE_NAME = re.compile(r"^\s*HloModule\s+([^\s,]+)", re.MULTILINE)
# "<indent>012: kCustomCall ..." (recent XLA) or "<indent>kCustomCall: ..." / "<indent>kCustomCall\t..." (older)
_THUNK_LINE = re.compile(r"^(?P<indent>[ \t]*)(?:(?P<id>\d+):[ \t]*)?(?P<kind>k[A-Z][A-Za-z0-9]*)(?=[\s:]|$)")
_DUMP_MODULE = re.compile(r"(?:^|\.)module_(\d+)\.")
_DUMP_KIND = re.compile(r"(thunk_sequence_after_thunk_passes|thunk_sequence|thunk_metadata)\.txt$")


@dataclasses.dataclass(frozen=True)
class Occurrence:
    """One custom call to one of our targets in a compiled module, and whether it runs in a command buffer."""

    target: str
    instruction: str  # the HLO instruction's name, e.g. custom-call.12
    computation: str  # the HLO computation holding it
    status: str  # CAPTURED, NOT_CAPTURED or UNKNOWN
    reason: str  # what the status was read from, or why it could not be


# ---- HLO ------------------------------------------------------------------------------------------------


def computations(hlo: str) -> dict[str, list[str]]:
    """HLO text split into its computations: name -> instruction lines (ENTRY included, under its name)."""
    found: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        if line.rstrip().endswith("{") and line[:1] not in (" ", "\t", "") and not line.startswith("HloModule"):
            words = line.split()
            name = words[1] if words[0] == "ENTRY" and len(words) > 1 else words[0]
            current = found.setdefault(name.lstrip("%"), [])
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return found


def _callees(lines: list[str]) -> set[str]:
    names = set()
    for line in lines:
        names.update(_CALLED.findall(line))
        for group in _CALLED_LISTS.findall(line):
            names.update(part.strip().lstrip("%") for part in group.split(",") if part.strip())
    return names


def custom_calls(hlo: str, targets=TARGETS) -> list[tuple[str, str, str]]:
    """(target, instruction name, computation) of every custom call to one of `targets`, in text order."""
    wanted = set(targets)
    found = []
    for computation, lines in computations(hlo).items():
        for line in lines:
            match = _CUSTOM_CALL.match(line)
            if match and match.group(2) in wanted:
                found.append((match.group(2), match.group(1), computation))
    return found


def module_name(hlo: str) -> str | None:
    match = _MODULE_NAME.search(hlo)
    return match.group(1) if match else None


def classify_hlo(hlo: str, targets=TARGETS) -> list[Occurrence]:
    """Each custom call to `targets`: captured if its computation is, or is reached from, a command_buffer one.

    Without any command_buffer computation the HLO cannot tell (nothing was captured, or this XLA forms its
    command buffers after the HLO, on thunks): every occurrence is then UNKNOWN.
    """
    comps = computations(hlo)
    callees = {name: _callees(lines) for name, lines in comps.items()}
    roots = sorted(name for name in comps if _COMMAND_BUFFER_COMPUTATION.match(name))
    inside, stack = set(), list(roots)
    while stack:
        name = stack.pop()
        if name not in inside:
            inside.add(name)
            stack.extend(callees.get(name, ()))
    occurrences = []
    for target, instruction, computation in custom_calls(hlo, targets):
        if not roots:
            status, reason = (
                UNKNOWN,
                (
                    "the optimized HLO has no command_buffer computation: either nothing was "
                    "captured, or this XLA forms command buffers on thunks after the HLO "
                    "(read the thunk dump)"
                ),
            )
        elif computation in inside:
            via = computation if computation in roots else f"{computation}, reached from {', '.join(roots)}"
            status, reason = CAPTURED, f"HLO: in command-buffer computation {via}"
        else:
            status, reason = (
                NOT_CAPTURED,
                (f"HLO: in {computation}, outside the module's command-buffer computations ({', '.join(roots)})"),
            )
        occurrences.append(Occurrence(target, instruction, computation, status, reason))
    return occurrences


# ---- thunk dumps ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ThunkLine:
    line_number: int
    thunk_id: int | None
    kind: str
    depth: int  # indentation in characters
    in_command_buffer: bool  # some enclosing (less indented, earlier) thunk is a kCommandBuffer
    rest: str = ""  # the line after the kind (older XLA printed the profile annotation there)


def parse_thunk_sequence(text: str) -> list[ThunkLine]:
    """The thunks of a `thunk_sequence*.txt` dump, each with whether a kCommandBuffer thunk encloses it.

    Nesting is read from indentation: a thunk belongs to the nearest earlier thunk line indented less.
    Lines that are not thunks ("body:", "condition:", "No thunks.", descriptions) are skipped.
    """
    thunks, stack = [], []  # stack: (depth, kind) of the enclosing thunks
    for number, line in enumerate(text.splitlines(), start=1):
        match = _THUNK_LINE.match(line)
        if not match:
            continue
        depth = len(match.group("indent").expandtabs(8))
        while stack and stack[-1][0] >= depth:
            stack.pop()
        inside = any(kind == "kCommandBuffer" for _, kind in stack)
        thunk_id = int(match.group("id")) if match.group("id") is not None else None
        thunks.append(
            ThunkLine(number, thunk_id, match.group("kind"), depth, inside, line[match.end() :].strip(" \t:"))
        )
        stack.append((depth, match.group("kind")))
    return thunks


def parse_thunk_metadata(text: str) -> list[tuple[int, str, str]]:
    """(thunk id, profile_annotation, thunk_kind) of each entry of a `thunk_metadata.txt` dump.

    The dump is a ThunkMetadataListProto in text form: `thunk_metadata { thunk_info { profile_annotation: "..."
    thunk_id: N } thunk_kind: "kCustomCall" }` per thunk. Text format leaves out fields at their default, so an
    entry without a thunk_id has id 0.
    """
    entries = []
    for block in text.split("thunk_metadata {")[1:]:
        thunk_id = re.search(r"\bthunk_id:\s*(\d+)", block)
        annotation = re.search(r"\bprofile_annotation:\s*\"((?:[^\"\\]|\\.)*)\"", block)
        kind = re.search(r"\bthunk_kind:\s*\"([^\"]*)\"", block)
        entries.append(
            (
                int(thunk_id.group(1)) if thunk_id else 0,
                annotation.group(1) if annotation else "",
                kind.group(1) if kind else "",
            )
        )
    return entries


def classify_thunks(
    hlo: str, thunk_sequence: str, metadata: str | None = None, *, passes_changed: bool = True, targets=TARGETS
) -> list[Occurrence]:
    """Each custom call to `targets` in `hlo`, placed by the thunk dump of the same compiled module.

    thunk_sequence: the text of `thunk_sequence_after_thunk_passes.txt`, or, with passes_changed=False, of
    `thunk_sequence.txt` when XLA wrote no after-passes dump (its thunk passes changed nothing, so no command
    buffer was formed). metadata: `thunk_metadata.txt`, which names the HLO instruction of each thunk id.
    Without it (or without usable ids) the answer is read by elimination, and only when every custom-call
    thunk of the module has the same status.
    """
    found = custom_calls(hlo, targets)
    if not found:
        return []
    thunks = parse_thunk_sequence(thunk_sequence)
    if not thunks:
        return [
            Occurrence(t, i, c, UNKNOWN, "the thunk dump has no line of the form '<id>: <kind>'") for t, i, c in found
        ]
    calls = [t for t in thunks if t.kind == "kCustomCall"]
    source = "thunk_sequence_after_thunk_passes" if passes_changed else "thunk_sequence (thunk passes changed nothing)"

    def placed(thunk: ThunkLine) -> tuple[str, str]:
        where = f"line {thunk.line_number}" + (f", thunk {thunk.thunk_id:03d}" if thunk.thunk_id is not None else "")
        if thunk.in_command_buffer:
            return CAPTURED, f"thunks: {where} is nested in a kCommandBuffer ({source})"
        return NOT_CAPTURED, f"thunks: {where} is outside every kCommandBuffer ({source})"

    # Name each custom-call thunk after its HLO instruction: through thunk_metadata's id -> annotation map when
    # the custom-call thunks' ids are distinct, else from the annotation older XLA printed first after the kind.
    by_name: dict[str, ThunkLine] = {}
    ids = [t.thunk_id for t in calls]
    if metadata and None not in ids and len(set(ids)) == len(ids):
        line_of = {t.thunk_id: t for t in calls}
        for thunk_id, annotation, kind in parse_thunk_metadata(metadata):
            if thunk_id in line_of and kind in ("kCustomCall", "") and annotation:
                by_name.setdefault(annotation, line_of[thunk_id])
    for _, instruction, _ in found:
        if instruction not in by_name:
            named = [t for t in calls if t.rest.split()[:1] == [instruction]]
            if len(named) == 1:
                by_name[instruction] = named[0]
    statuses = {placed(t)[0] for t in calls}
    occurrences = []
    for target, instruction, computation in found:
        if instruction in by_name:
            status, reason = placed(by_name[instruction])
        elif not calls:
            status, reason = UNKNOWN, "the thunk dump has no kCustomCall thunk for this custom call"
        elif len(statuses) == 1:
            status = next(iter(statuses))
            reason = (
                f"thunks, by elimination: all {len(calls)} kCustomCall thunks of the module are "
                f"{'inside' if status == CAPTURED else 'outside'} command buffers ({source}; "
                f"{'no thunk_metadata to name them' if not metadata else 'metadata did not name this one'})"
            )
        else:
            status, reason = (
                UNKNOWN,
                (
                    f"thunks: {sum(t.in_command_buffer for t in calls)} of {len(calls)} "
                    "kCustomCall thunks are in command buffers and the metadata does not say "
                    "which one this is"
                ),
            )
        occurrences.append(Occurrence(target, instruction, computation, status, reason))
    return occurrences


def module_dump_files(names, module: str | None) -> dict[str, str | None]:
    """The thunk dump files of one compiled module among `names` (file names in an --xla_dump_to directory).

    Picks the files of `module` (the HloModule name) with the highest module number, or, when no file name
    carries that name, the highest-numbered module that has thunk dumps. Returns the chosen names under the
    keys "after" (thunk_sequence_after_thunk_passes), "before" (thunk_sequence), "metadata"; None if absent.
    """
    parsed = []
    for name in names:
        base = os.path.basename(name)
        number, kind = _DUMP_MODULE.search(base), _DUMP_KIND.search(base)
        if number and kind:
            parsed.append((int(number.group(1)), module is not None and f".{module}." in base, kind.group(1), name))
    chosen = [p for p in parsed if p[1]] or parsed
    files: dict[str, str | None] = {"after": None, "before": None, "metadata": None}
    if not chosen:
        return files
    newest = max(p[0] for p in chosen)
    keys = {"thunk_sequence_after_thunk_passes": "after", "thunk_sequence": "before", "thunk_metadata": "metadata"}
    for number, _, kind, name in chosen:
        if number == newest:
            files[keys[kind]] = name
    return files


def classify(
    hlo: str,
    *,
    thunk_after: str | None = None,
    thunk_before: str | None = None,
    metadata: str | None = None,
    targets=TARGETS,
) -> list[Occurrence]:
    """The HLO's answer where it has one; else the thunk dump's (texts, not paths); else UNKNOWN with both reasons."""
    from_hlo = classify_hlo(hlo, targets)
    if all(o.status != UNKNOWN for o in from_hlo):
        return from_hlo
    if thunk_after is not None:
        from_thunks = classify_thunks(hlo, thunk_after, metadata, passes_changed=True, targets=targets)
    elif thunk_before is not None:
        from_thunks = classify_thunks(hlo, thunk_before, metadata, passes_changed=False, targets=targets)
    else:
        return [
            dataclasses.replace(o, reason=o.reason + "; and no thunk dump was found (run with --xla_dump_to)")
            if o.status == UNKNOWN
            else o
            for o in from_hlo
        ]
    merged = []
    for hlo_says, thunks_say in zip(from_hlo, from_thunks):
        if hlo_says.status != UNKNOWN:
            merged.append(hlo_says)
        elif thunks_say.status != UNKNOWN:
            merged.append(thunks_say)
        else:
            merged.append(dataclasses.replace(thunks_say, reason=f"{hlo_says.reason}; {thunks_say.reason}"))
    return merged


def summary(occurrences: list[Occurrence], short: dict[str, str] | None = None) -> str:
    """One phrase per target, e.g. "forward captured, backward not captured"; "none of our calls" if empty."""
    if not occurrences:
        return "none of our calls"
    short = short or {}
    parts = []
    for target in dict.fromkeys(o.target for o in occurrences):
        statuses = [o.status for o in occurrences if o.target == target]
        name = short.get(target, target)
        if len(set(statuses)) == 1:
            parts.append(f"{name} {statuses[0]}" + (f" (x{len(statuses)})" if len(statuses) > 1 else ""))
        else:
            parts.append(
                f"{name} {statuses.count(CAPTURED)}/{len(statuses)} captured"
                + (f", {statuses.count(UNKNOWN)} unknown" if UNKNOWN in statuses else "")
            )
    return ", ".join(parts)
