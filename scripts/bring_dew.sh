#!/usr/bin/env bash
# Brings dew-flash-attn-cu13 (FlashAttention-3 for JAX, a peer of benchmarks/peers.py) to the offline GPU host,
# which takes at most 64 MiB a call: here, downloads the wheel (77.8 MB) and splits it into parts p0, p1 of at
# most 55 MiB under .whl/dew/ (git-ignored), with the wheel's sha256 in SHA256 and its file name in NAME (pip
# reads the tags from the name); on the host, joins them back into .whl/dew/<wheel> and installs it. Also puts
# the nvidia-cudnn-frontend wheel (raw cuDNN's column) in .whl/fe if that holds none.
#
#   bash scripts/bring_dew.sh                 # here: download, split, print the host calls
#   bash scripts/bring_dew.sh --join          # on the host: the parts -> .whl/dew/<wheel>, sha256 and zip checked
#   bash scripts/bring_dew.sh --install       # on the host: --join, then pip install it into $SITE (/tmp/site)
#
# The wheel's needs (its METADATA; benchmarks/peers.py's docstring has the rest): Python >= 3.11, jax >= 0.11.2,
# a CUDA 13 jax (its libraries need libcudart.so.13 and ship none). The host has Python 3.12, jax 0.11.2 with
# jax-cuda13-plugin: nothing else to bring. No unzip there: `python3 -m zipfile -t` checks the joined wheel.
# benchmarks/gpu_wave.sh installs every .whl under .whl/ into /tmp/site, the joined one included.
set -euo pipefail
version=${VERSION:-0.3.6}
dist=dew-flash-attn-cu13
root=$(git rev-parse --show-toplevel 2>/dev/null || pwd)
dir="$root/.whl/dew"
rel=${dir#"$root/"}

join() {
  local name
  name=$(cat "$dir/NAME")
  if [ -f "$dir/$name" ] && echo "$(cat "$dir/SHA256")  $dir/$name" | sha256sum -c --status; then
    echo "$rel/$name: already joined"
    return
  fi
  ls "$dir"/p? >/dev/null || { echo "no parts in $rel (carry $rel/p0, $rel/p1 first)"; exit 1; }
  cat "$dir"/p? > "$dir/$name.part"
  echo "$(cat "$dir/SHA256")  $dir/$name.part" | sha256sum -c --status \
    || { echo "the joined parts' sha256 differs from SHA256: a part is missing or stale ($(cd "$dir" && echo p?))"
         rm -f "$dir/$name.part"; exit 1; }
  python3 -m zipfile -t "$dir/$name.part" > /dev/null
  mv "$dir/$name.part" "$dir/$name"
  echo "$rel/$name: joined, sha256 $(cat "$dir/SHA256")"
}

case ${1:-} in
  --join) join; exit 0 ;;
  --install)
    join
    site=${SITE:-/tmp/site}
    python3 -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --upgrade --target "$site" \
      "$dir/$(cat "$dir/NAME")"
    # Its libraries' RUNPATH ($ORIGIN/../nvidia/cu13/lib) misses under --target: JAX's CUDA plugin maps
    # libcudart.so.13 first (benchmarks/peers.py does the same, and preloads it from sys.path otherwise).
    PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} python3 -c "import jax; print(jax.__version__, jax.devices()); \
import dew_flash_attn as d; print('dew_flash_attn', d.__file__, d.ARCHITECTURES, 'FA3 here:', d._hopper())"
    exit 0 ;;
  "") ;;
  *) echo "usage: bring_dew.sh [--join|--install]"; exit 2 ;;
esac

grep -qx '/.whl/' "$root/.git/info/exclude" 2>/dev/null || grep -qx '/.whl/' "$root/.gitignore" \
  || echo '/.whl/' >> "$root/.git/info/exclude"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 "$dist==$version" -d "$work"
wheel=$(ls "$work"/*.whl)
echo "downloaded $(basename "$wheel"): $(du -h "$wheel" | cut -f1)"
rm -rf "$dir" && mkdir -p "$dir"
split -b 55m -d -a 1 "$wheel" "$dir/p"
sha256sum "$wheel" | cut -d' ' -f1 > "$dir/SHA256"
basename "$wheel" > "$dir/NAME"
ls -l "$dir"
if ! ls "$root"/.whl/fe/*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$root/.whl/fe" 'nvidia-cudnn-frontend==1.32.0'
fi
echo ".whl/fe: $(ls "$root"/.whl/fe | tr '\n' ' ')($(du -sh "$root/.whl/fe" | cut -f1))"
echo
echo "On the host, back to back (it keeps ignored files between calls while warm; name each part, never .whl or .gpu):"
echo "  mkdir -p .gpu && git archive HEAD | gzip > .gpu/tree.tgz         # here: the committed tree it runs"
echo "  run(carry=[\"$rel/p0\", \"$rel/SHA256\", \"$rel/NAME\"], command=\"ls -l $rel\")"
parts=$(ls "$dir"/p? | sed '1d')
carry=""
for part in $parts; do carry="$carry\"$rel/$(basename "$part")\", "; done
echo "  run(carry=[${carry}\"$rel/SHA256\", \"$rel/NAME\", \".gpu/tree.tgz\", \".whl/fa3\", \".whl/fe\"],"
echo "      command=\"bash scripts/bring_dew.sh --join && STEP_S=540 bash benchmarks/gpu_wave.sh \\"
echo "        'peers=python3 -m benchmarks.peers --workloads W1,W2 --time-budget 360 --out \$OUT/peers-a'\")"
echo "  then, with the same carry less the parts (the joined wheel stays in $rel):"
echo "    ... 'peers=python3 -m benchmarks.peers --workloads W5,W6 --time-budget 480 --out \$OUT/peers-b'"
echo "    ... 'peers=python3 -m benchmarks.peers --workloads W4-d64,W4-d256,MLA --time-budget 480 --out \$OUT/peers-c'"
echo "  here: python -m benchmarks.peers --merge <files_at>/peers-a/peers.json .../peers-b/... .../peers-c/..."
