#!/usr/bin/env bash
# Packs one JAX release for the offline GPU host (../shared/gpu-host/README.md: Python 3.12, jax 0.11.2 with the
# CUDA 13 plugin, no network, at most 64 MiB a call), and installs it there beside the host's own JAX.
#
#   bash scripts/bring_jax.sh                  # here: the newest jax pip offers Python 3.12, and its CUDA 13 wheels
#   bash scripts/bring_jax.sh 0.12.0.1         # here: that release
#   bash scripts/bring_jax.sh --probe DIR      # on the host, once DIR's MANIFEST is there: does the host's numpy
#                                              # (scipy, ml_dtypes, ...) satisfy the new JAX, or must DIR-deps come
#   bash scripts/bring_jax.sh --install DIR [DIR-deps] [--target T]   # on the host: join, check, install into T
#
# Here it downloads jax, jaxlib (cp312 manylinux x86_64), jax-cuda13-plugin and jax-cuda13-pjrt at the versions
# jax's [cuda13] extra pins (`pip download --no-deps --only-binary=:all: --python-version 3.12`), puts the
# wheels as they are (already compressed) in one tar and splits it into parts p0, p1, ... of 56 MiB under
# .whl/jax-<version>/ (git-ignored), with the tar's sha256 in SHA256 and a MANIFEST (each wheel's size and sha256,
# the requirements the new wheels name outside the wheels themselves). A requirement whose bound moved since the
# host's JAX ($HOST_JAX, 0.11.2) gets a fallback wheel in .whl/jax-<version>-deps/ (same format; for a floor
# `>=X.Y`, the newest X.Y.z): it travels only when --probe says the host's own is too old, and --install installs
# it only then, so the host's packages stay as they are wherever they are new enough.
#
# On the host --install joins the parts, checks the sha256 and installs the wheels with `pip install --no-index
# --no-deps --target T` (default /tmp/jax-<version>; again only when the tar changed), which goes first on
# PYTHONPATH: the host's jax 0.11.2 in site-packages stays intact and is what every other command still gets.
# It ends by printing `import jax; jax.__version__, jax.devices()` from T, which must name the new version and,
# on the host, the GPU. scripts/check_release.sh --wheels DIR runs it and then the GPU suite.
#
# The extension needs no rebuild for the new jaxlib: it is built against an older jaxlib's XLA FFI headers
# (the release wheel against the oldest supported, 0.10's; a build on the host against the host's 0.11.2) and
# XLA runs handlers built against older FFI headers (docs/INSTALL.md, Building). check_release.sh builds it on
# the host with the host's own jaxlib, the new one kept off PYTHONPATH during the build.
set -euo pipefail
python=${PYTHON:-python3}
root=$(cd "$(dirname "$0")/.." && pwd)
say() { printf '==> %s\n' "$*"; }
fail() { printf 'bring_jax: %s\n' "$*" >&2; exit 1; }
part_mb=${PART_MB:-56}
# The host's glibc runs manylinux_2_34 wheels (this package's own), so every tag up to that one is taken.
platforms=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
download=(-m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}")

# join DIR OUT: the parts of DIR joined into OUT, checked against DIR/SHA256.
join_parts() {
  local dir=$1 tar=$2
  ls "$dir"/p? >/dev/null 2>&1 || fail "$dir has no parts (p0, p1, ...)"
  local want have expected
  expected=$(sed -n 's/^parts \([0-9]*\).*/\1/p' "$dir/MANIFEST")
  have=$(ls "$dir"/p? | wc -l)
  [ "$have" = "$expected" ] || fail "$dir has $have of its $expected parts: $(cd "$dir" && echo p?); bring the others"
  cat "$dir"/p? > "$tar"
  want=$(cat "$dir/SHA256")
  echo "$want  $tar" | sha256sum -c --quiet - || fail "the parts of $dir do not join into the tar of sha256 $want"
}

# unpack DIR TAR OUT: the wheels of the joined TAR into OUT, each checked against DIR/MANIFEST's sha256.
unpack() {
  local dir=$1 tar=$2 out=$3
  mkdir -p "$out" && tar -xf "$tar" -C "$out" && rm "$tar"
  awk -v out="$out" '$1 == "wheel" {print $4 "  " out "/" $2}' "$dir/MANIFEST" | sha256sum -c --quiet - ||
    fail "a wheel of $dir differs from its MANIFEST"
  [ "$(ls "$out" | wc -l)" = "$(grep -c '^wheel ' "$dir/MANIFEST")" ] || fail "$dir's tar holds other files than its MANIFEST names"
}

# The requirements of the new wheels outside them, checked against what PYTHONPATH (then the host) gives: prints
# one line per requirement, "ok"/"unmet", and exits 1 when one is unmet.
check_requirements() {  # check_requirements MANIFEST
  "$python" - "$1" <<'EOF'
import importlib.metadata as md
import sys

try:
    from packaging.requirements import Requirement
except ImportError:  # the host has pip, which carries packaging
    from pip._vendor.packaging.requirements import Requirement
lines = [line.split(None, 2) for line in open(sys.argv[1]) if line.startswith("requires ")]
unmet = 0
for _, text, who in lines:
    req = Requirement(text)
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        have = None
    ok = have is not None and req.specifier.contains(have, prereleases=True)
    unmet += not ok
    who, _, moved = who.strip().partition(" (")
    where = f" in {md.distribution(req.name).locate_file('')}" if have is not None else ""
    note = f" ({moved}" if moved and not ok else ""
    print(f"    {'ok   ' if ok else 'UNMET'} {text:<18} {who:<18} installed: {have or 'none'}{where}{note}")
sys.exit(1 if unmet else 0)
EOF
}

if [ "${1:-}" = --probe ]; then
  dir=${2:?usage: bring_jax.sh --probe DIR}
  [ -f "$dir/MANIFEST" ] || fail "$dir/MANIFEST is not here"
  version=$(sed -n 's/^version //p' "$dir/MANIFEST")
  say "$("$python" --version) on $(hostname): jax $("$python" -c 'import jax; print(jax.__version__)' 2>/dev/null ||
       echo none) installed; what jax $version needs from outside its wheels:"
  if check_requirements "$dir/MANIFEST"; then
    say "all met by the host: ${dir%/}-deps need not come"
  else
    say "bring ${dir%/}-deps (its part p0, SHA256, MANIFEST) with the last call: --install takes the fallback wheels" \
        "for the unmet ones"
  fi
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  exit 0
fi

if [ "${1:-}" = --install ]; then
  shift
  dirs=() target=""
  while (($#)); do
    case $1 in
      --target) target=$2; shift 2 ;;
      *) dirs+=("${1%/}"); shift ;;
    esac
  done
  ((${#dirs[@]})) || fail "usage: bring_jax.sh --install DIR [DIR-deps] [--target T]"
  main=${dirs[0]}
  [ -f "$main/MANIFEST" ] || fail "$main/MANIFEST is not here"
  version=$(sed -n 's/^version //p' "$main/MANIFEST")
  target=${target:-/tmp/jax-$version}
  scratch=$(mktemp -d)
  trap 'rm -rf "$scratch"' EXIT
  if [ "$(cut -d' ' -f1 "$target/.bring_jax" 2>/dev/null)" = "$(cat "$main/SHA256")" ]; then
    say "jax $version already installed in $target (from the same parts)"
  else
    t=$SECONDS
    join_parts "$main" "$scratch/jax.tar"
    unpack "$main" "$scratch/jax.tar" "$scratch/wheels"
    rm -rf "$target" && mkdir -p "$target"
    say "installing $(cd "$scratch/wheels" && echo *.whl) into $target"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$target" "$scratch"/wheels/*.whl
    cat "$main/SHA256" > "$target/.bring_jax"
    say "joined, checked (the tar's sha256, each wheel's) and installed in $((SECONDS - t)) s"
  fi
  export PYTHONPATH=$target${PYTHONPATH:+:$PYTHONPATH}
  say "what jax $version needs from outside its wheels, as PYTHONPATH=$target sees it:"
  if ! check_requirements "$main/MANIFEST"; then
    deps=${dirs[1]:-$main-deps}
    [ -f "$deps/MANIFEST" ] || fail "an unmet requirement and no fallback wheels: bring $deps (bring_jax.sh made it)"
    join_parts "$deps" "$scratch/deps.tar"
    unpack "$deps" "$scratch/deps.tar" "$scratch/deps"
    # Only the fallbacks of the unmet requirements: the host's own packages stay wherever they are new enough.
    unmet=$(check_requirements "$main/MANIFEST" | awk '$1 == "UNMET" {print $2}' || true)
    picked=$("$python" - "$scratch/deps" $unmet <<'EOF'
import os, re, sys
norm = lambda name: re.sub(r"[-_.]+", "_", name).lower()
wanted = {norm(re.split(r"[<>=!~;\[ ]", text)[0]) for text in sys.argv[2:]}
for wheel in sorted(os.listdir(sys.argv[1])):
    if norm(wheel.split("-")[0]) in wanted:
        print(os.path.join(sys.argv[1], wheel))
EOF
)
    [ -n "$picked" ] || fail "no fallback wheel in $deps for: $unmet"
    say "installing the fallback $(for w in $picked; do basename "$w"; done | xargs) into $target"
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$target" $picked
    check_requirements "$main/MANIFEST" || fail "still unmet after the fallback wheels"
    echo "$(cat "$main/SHA256") $(cat "$deps/SHA256")" > "$target/.bring_jax"
  fi
  say "PYTHONPATH=$target python3 -c 'import jax; print(jax.__version__, jax.devices())':"
  "$python" -c 'import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.__file__.rsplit("/", 2)[0]);
print(jax.devices())' > "$scratch/import.out" 2> "$scratch/import.err" || { cat "$scratch/import.err"; fail "jax does not import"; }
  read -r got got_lib from < "$scratch/import.out"
  echo "    jax $got, jaxlib $got_lib from $from: $(tail -n 1 "$scratch/import.out")"
  # No GPU: the CUDA plugin says why (here: no cuDNN, no GPU) and JAX falls back to the CPU.
  grep -q "Cuda\|cuda" "$scratch/import.out" || echo "    no CUDA device: $(grep -v '^ ' "$scratch/import.err" | tail -n 1)"
  [ "$got" = "$version" ] || fail "python imports jax $got, not $version, with PYTHONPATH=$PYTHONPATH"
  say "ready: export PYTHONPATH=$target\${PYTHONPATH:+:\$PYTHONPATH}"
  exit 0
fi

# Here: download, pick fallbacks, pack.
[[ ${1:-} == -* ]] && { sed -n '5,9p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
version=${1:-}
cuda=${CUDA:-cuda13}
host_jax=${HOST_JAX:-0.11.2}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
grep -qx '/.whl/' "$root/.git/info/exclude" 2>/dev/null || grep -qx '/.whl/' "$root/.gitignore" \
  || echo '/.whl/' >> "$root/.git/info/exclude"
t0=$SECONDS
mkdir -p "$work/wheels"
"$python" "${download[@]}" -d "$work/wheels" "jax${version:+==$version}" 2>&1 | grep -v "is ignored" || true
jax_wheel=$(ls "$work"/wheels/jax-*.whl 2>/dev/null) || fail "pip found no jax${version:+ $version} for Python 3.12"
version=$(basename "$jax_wheel" | cut -d- -f2)
# The versions jax's [cuda13] extra pins, and the pjrt the plugin pins, read from their METADATA.
read_pins() {  # read_pins WHEEL PATTERN: the first requirement of that wheel matching PATTERN, as name==version
  "$python" - "$@" <<'EOF'
import re, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
for line in meta.splitlines():
    if line.startswith("Requires-Dist:") and re.search(sys.argv[2], line):
        name = re.match(r"Requires-Dist: *([A-Za-z0-9_.-]+)", line).group(1)
        pins = re.findall(r"(?:==|<=|>=)\s*([0-9][0-9a-z.]*)", line.split(";")[0])
        print(f"{name}=={max(pins, key=pins.count)}")  # "<=V,>=V" or "==V"
        break
EOF
}
jaxlib_pin=$(read_pins "$jax_wheel" "^Requires-Dist: *jaxlib.*extra == \"$cuda\"")
plugin_pin=$(read_pins "$jax_wheel" "^Requires-Dist: *jax-$cuda-plugin.*extra == \"$cuda\"")
[ -n "$jaxlib_pin" ] && [ -n "$plugin_pin" ] || fail "jax $version's METADATA pins no jaxlib or jax-$cuda-plugin for [$cuda]"
"$python" "${download[@]}" -d "$work/wheels" "$jaxlib_pin" "$plugin_pin" 2>&1 | grep -v "is ignored" || true
pjrt_pin=$(read_pins "$(ls "$work"/wheels/jax_"${cuda}"_plugin-*.whl)" "^Requires-Dist: *jax-$cuda-pjrt")
"$python" "${download[@]}" -d "$work/wheels" "$pjrt_pin" 2>&1 | grep -v "is ignored" || true
say "jax $version for CPython 3.12, $cuda: $jaxlib_pin, $plugin_pin, $pjrt_pin"

# Requirements outside the four wheels (no extras), and how they compare with the host's JAX's.
"$python" -m pip install -q --dry-run --no-deps --ignore-installed --ignore-requires-python --report "$work/host.json" \
  --target "$work/dry" --python-version 3.12 --implementation cp "${platforms[@]}" --only-binary=:all: \
  "jax==$host_jax" "jaxlib==$host_jax" "jax-$cuda-plugin==$host_jax" "jax-$cuda-pjrt==$host_jax" 2>&1 |
  grep -v "is ignored" || true
"$python" - "$work/wheels" "$work/host.json" "$version" "$host_jax" > "$work/requirements" <<'EOF'
import json, os, re, sys, zipfile
wheels, host_report, version, host_jax = sys.argv[1:]
ours = {"jax", "jaxlib"} | {n for n in os.listdir(wheels) for n in [re.sub(r"_", "-", n.split("-")[0])]}
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
def outside(name, lines):  # requirement lines without an extra, on packages not among the wheels brought
    for line in lines:
        text = line.split(";")[0].strip()
        if "extra ==" in line or norm(re.split(r"[<>=!~ (]", text)[0]) in {norm(o) for o in ours}:
            continue
        yield norm(re.split(r"[<>=!~ (]", text)[0]), text.replace(" ", "")
host = {}
for item in json.load(open(host_report)).get("install", []):
    for name, text in outside(item["metadata"]["name"], item["metadata"].get("requires_dist", [])):
        host.setdefault(name, set()).add(text)
for wheel in sorted(os.listdir(wheels)):
    z = zipfile.ZipFile(os.path.join(wheels, wheel))
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    who = wheel.split("-")[0] + " " + wheel.split("-")[1]
    lines = [l.split(":", 1)[1].strip() for l in meta.splitlines() if l.startswith("Requires-Dist:")]
    for name, text in outside(who, lines):
        moved = "" if text in host.get(name, ()) else f" moved: jax {host_jax}'s wheels ask {sorted(host.get(name, ())) or 'nothing'}"
        print(f"{text}\t{who}\t{moved}")
EOF
sort -u "$work/requirements" -o "$work/requirements"
mkdir -p "$work/deps"
while IFS=$'\t' read -r text who moved; do
  [ -n "$moved" ] || continue
  # A floor ">=X.Y" gets the newest X.Y.z: the smallest step up from an older host's package.
  if [[ $text =~ ^([A-Za-z0-9_.-]+)\>=([0-9]+\.[0-9]+)(\.[0-9]+)?$ ]]; then
    spec="${BASH_REMATCH[1]}~=${BASH_REMATCH[2]}.0"
    [ -n "${BASH_REMATCH[3]}" ] && spec="${BASH_REMATCH[1]}>=${BASH_REMATCH[2]}${BASH_REMATCH[3]},<$(echo "${BASH_REMATCH[2]}" |
      awk -F. '{print $1 "." $2 + 1}')"
  else
    spec=$text
  fi
  say "$text ($who):$moved; fallback: $spec"
  "$python" "${download[@]}" -d "$work/deps" "$spec" 2>&1 | grep -v "is ignored" || true
done < "$work/requirements"

# pack DIR KIND WHEELDIR: the wheels of WHEELDIR as one tar in parts of $part_mb MiB, SHA256, MANIFEST.
pack() {
  local out=$1 kind=$2 wheels=$3 tar=$work/$2.tar
  (cd "$wheels" && tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf "$tar" *.whl)  # the same bytes each run
  rm -rf "$out" && mkdir -p "$out"
  split -b "${part_mb}m" -d -a 1 "$tar" "$out/p"
  sha256sum "$tar" | cut -d' ' -f1 > "$out/SHA256"
  {
    echo "# jax $version for CPython 3.12 manylinux x86_64 ($cuda), made by scripts/bring_jax.sh on $(date +%F)"
    echo "# $kind: the wheels below, as one tar split into parts; the host joins them (bring_jax.sh --install)"
    echo "version $version"
    echo "kind $kind"
    echo "parts $(ls "$out"/p? | wc -l) of $part_mb MiB, tar $(stat -c %s "$tar") bytes, sha256 $(cat "$out/SHA256")"
    for w in "$wheels"/*.whl; do echo "wheel $(basename "$w") $(stat -c %s "$w") $(sha256sum "$w" | cut -d' ' -f1)"; done
    # "requires TEXT WHO": the requirement --probe and --install check against the host.
    if [ "$kind" = jax ]; then
      awk -F'\t' '{print "requires " $1 " " $2 ($3 ? " (" substr($3, 2) ")" : "")}' "$work/requirements"
    fi
  } > "$out/MANIFEST"
}
out=$root/.whl/jax-$version
pack "$out" jax "$work/wheels"
rm -rf "$out-deps"
ls "$work"/deps/*.whl >/dev/null 2>&1 && pack "$out-deps" fallback "$work/deps"
rel=${out#"$root/"}
for dir in "$out" "$out-deps"; do
  [ -d "$dir" ] || continue
  say "${dir#"$root/"}: parts $(sed -n 's/^parts //p' "$dir/MANIFEST")"
  awk '$1 == "wheel" {printf "    %-70s %6.1f MiB\n", $2, $3 / 1048576}' "$dir/MANIFEST"
done
grep '^requires ' "$out/MANIFEST" | sed 's/^/    /'
say "packed in $((SECONDS - t0)) s. On the host, one call a part (docs/INSTALL.md, JAX 0.12 on the offline GPU host):"
first=1
for part in "$out"/p?; do
  if ((first)); then
    echo "  carry [\"$rel/$(basename "$part")\", \"$rel/SHA256\", \"$rel/MANIFEST\"]  command: bash scripts/bring_jax.sh --probe $rel"
    first=0
  else
    echo "  carry [\"$rel/$(basename "$part")\"]  command: ls -l $rel"
  fi
done
deps_note=""
[ -d "$out-deps" ] && deps_note=" (and $rel-deps if the probe printed UNMET: --install finds it beside $rel)"
echo "  then, carry [\".gpu/tree.tgz\", \".whl/flax\", \".whl/fa3\"]$deps_note, timeout_s 600:"
echo "  src=\$PWD; rm -rf /tmp/tree && mkdir /tmp/tree && tar -xzf .gpu/tree.tgz -C /tmp/tree && cd /tmp/tree &&"
echo "    SUITE_S=420 bash scripts/check_release.sh --python \"\$(command -v python3)\" --jax $version \\"
echo "      --wheels \$src/$rel --wheels \$src/.whl/flax --wheels \$src/.whl/fa3 --no-main-job --logs \$OUT"
echo "  and the main job: the same call with --tests \"\" in place of --no-main-job"
