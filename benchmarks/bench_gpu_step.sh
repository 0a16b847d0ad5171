#!/bin/bash
# Issue 13's measurements on the H200 host in one command from the repo root, about 4 minutes (plus the
# extension build when .prebuilt/ is not carried):
#
#   bash benchmarks/bench_gpu_step.sh
#
# 1. the attention bench on W1 and W3 timed by both methods (fori: a device-side loop in one jitted call;
#    plain: N jitted calls then block_until_ready), with the dense-matmul "of limit" column;
# 2. the training-step benchmark (one GQA decoder block, forward+backward+AdamW) on W1 and the short
#    lengths: padded, pad-unpad, ours-cudnn, ours-xla.
# Both run as steps of benchmarks/gpu_run.sh (logs and CSVs in $OUT); the two tables are printed last.
set -o pipefail
out=${OUT:-/tmp/jax_ragged_attn_gpu}
STEPS="bench model" OUT="$out" TAIL=${TAIL:-8} BENCH_S=${BENCH_S:-100} MODEL_S=${MODEL_S:-120} \
  BENCH_ARGS=${BENCH_ARGS:-"--workloads W1,W3 --systems raw-cudnn,ours-hm,jax-padded --method fori,plain --iterations 10 --time-budget 65"} \
  MODEL_ARGS=${MODEL_ARGS:-"--lengths W1,short --time-budget 80"} \
  bash benchmarks/gpu_run.sh
status=$?
echo
echo "=== attention, both timing methods ($out/table.txt, $out/bench.csv)"
grep -h "dense limit" "$out/table.txt" 2>/dev/null
sed -n '/^workload  system/,$p' "$out/table.txt" 2>/dev/null | grep -v "^$"
echo
echo "=== training step ($out/model_step.txt, $out/model_step.csv)"
grep -h -E "^(block|dense limit|lengths [A-Za-z0-9]+:)" "$out/model_step.txt" 2>/dev/null
sed -n '/^lengths  system/,$p' "$out/model_step.txt" 2>/dev/null
exit $status
