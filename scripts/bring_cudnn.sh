#!/usr/bin/env bash
# Packs one cuDNN release for the offline GPU host, which takes at most 64 MiB a call: downloads the
# nvidia-cudnn wheel, keeps only the libraries the SDPA path loads, packs them as one tar.xz of nvidia/cudnn/lib
# and splits it into parts p0, p1, ... of 56 MiB under .whl/cudnn-<version>/ (git-ignored), with the tar.xz's
# sha256 in SHA256 beside them. benchmarks/gpu_wave.sh joins the parts on the host, checks the sha256 and puts
# the libraries before the installed cuDNN (docs/CUDNN_VERSIONS.md has the whole procedure).
#
#   bash scripts/bring_cudnn.sh 9.27.0.42          # nvidia-cudnn-cu13 (jax[cuda13], what the H200 host runs)
#   bash scripts/bring_cudnn.sh 9.27.0.42 cu12     # nvidia-cudnn-cu12, for a jax[cuda12] host
#
# Which libraries: libcudnn.so.9 is a shim that opens graph, ops, cnn, adv and ext by name; graph opens the
# engine libraries (precompiled, runtime_compiled, tensor_ir) and heuristic (the names in each library's
# strings). The SDPA graphs go through graph, heuristic and the engines; XLA's own start-up asks for graph and
# ops (its PreloadCudnnSubLibs; adv only for RNNs). So every library of the wheel but libcudnn_adv (about 100 MB:
# RNNs and the legacy multi-head attention API) comes along (older releases have no tensor_ir or ext);
# LIBS="graph heuristic ..." (the stems after libcudnn_) names the list instead.
set -euo pipefail
version=${1:?usage: bring_cudnn.sh VERSION [cu13|cu12], e.g. 9.27.0.42}
cuda=${2:-cu13}
libs=${LIBS:-}
root=$(git rev-parse --show-toplevel)
out="$root/.whl/cudnn-$version"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
grep -qx '/.whl/' "$root/.git/info/exclude" 2>/dev/null || grep -qx '/.whl/' "$root/.gitignore" \
  || echo '/.whl/' >> "$root/.git/info/exclude"

python3 -m pip download -q --no-deps --platform manylinux_2_27_x86_64 --python-version 3.12 \
  --only-binary=:all: "nvidia-cudnn-$cuda==$version" -d "$work/wheel"
wheel=$(ls "$work"/wheel/*.whl)
echo "downloaded $(basename "$wheel"): $(du -h "$wheel" | cut -f1)"
python3 - "$wheel" "$work/stage" $libs <<'EOF'
import os, sys, zipfile
wheel, stage, stems = sys.argv[1], sys.argv[2], sys.argv[3:]
with zipfile.ZipFile(wheel) as z:
    members = {os.path.basename(n): n for n in z.namelist() if n.startswith("nvidia/cudnn/lib/")}
    wanted = ({"libcudnn.so.9"} | {f"libcudnn_{stem}.so.9" for stem in stems} if stems
              else {name for name in members if name.endswith(".so.9") and name != "libcudnn_adv.so.9"})
    missing = sorted(wanted - set(members))
    if missing:
        sys.exit(f"{os.path.basename(wheel)} has no {missing}; it has {sorted(members)}")
    for name in sorted(wanted):
        z.extract(members[name], stage)
        print(f"  {name}: {z.getinfo(members[name]).file_size / 2**20:.0f} MiB")
    print(f"  left out: {', '.join(sorted(set(members) - wanted))}")
EOF
echo "packing (xz -6 on every core; minutes on two)"
tar -C "$work/stage" -cf - nvidia | xz -T0 -6 > "$work/cudnn.tar.xz"
rm -rf "$out" && mkdir -p "$out"
split -b 56m -d -a 1 "$work/cudnn.tar.xz" "$out/p"
sha256sum "$work/cudnn.tar.xz" | cut -d' ' -f1 > "$out/SHA256"
parts=$(ls "$out"/p? | wc -l)
echo "$out: $parts parts, $(du -h "$work/cudnn.tar.xz" | cut -f1) in all, sha256 $(cat "$out/SHA256")"
ls -l "$out"
rel=${out#"$root/"}
echo "On the host, one call a part, each within the 30 s the machine stays warm (docs/CUDNN_VERSIONS.md):"
for part in "$out"/p?; do echo "  carry [\"$rel/$(basename "$part")\", \"$rel/SHA256\"]  command: ls $rel"; done
echo "then (git archive HEAD | gzip > .gpu/tree.tgz), carry [\".gpu\", \".whl/fe\"]:"
echo "  CUDNN_PARTS=$rel bash benchmarks/gpu_wave.sh suite \\"
echo "    'known=python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_known_issues.py' \\"
echo "    'deep=python3 -m jax_ragged_attn.selfcheck --deep'"
