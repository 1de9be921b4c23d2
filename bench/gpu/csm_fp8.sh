#!/bin/bash
# Issue 23: csm's depth decoder GEMMs in e4m3 (`--decode-gemm fp8` now covers the depth
# layers' q|k|v, o, gate|up and down, both forms) on ONE card, ~3.5-4 min: first the GPU
# tests (the fused pass == the torch form under fp8, the frame graphs captured with fp8
# depth GEMMs == their eager frames_static, the e4m3 GEMM against its reference), then
# `pdunit bench step --model random:csm-1b-shape:0 --depth-kernels fused --decode-gemm fp8`
# at 64/128/256/512 streams x 1024 tokens with overlap (the roofline times the e4m3 GEMMs'
# FLOPs at a measured e4m3 GEMM's rate, reported beside the bf16 one), then the same points
# with bf16 GEMMs on the same card as the baseline (tagged TAG-bf16).
#   bash bench/gpu/csm_fp8.sh [TAG]  (repo root, on the device machine; carry .out/transfer-whl,
#   tests/gpu/harness/wheels.sh; worst case ~6.2 min: 150 s of GPU tests, 2 x 110 s of steps).
#   $OUT: report.txt (env, a status line a step, the tests' tail) and steps.tgz
#   (step-<date>-<gpu>-csm-1b-shape-<TAG>-fp8.json/.md/.fit.json, the -bf16 ones, and the log
#   of a failed step: the tool brings back at most 8 files).
set -uo pipefail
source tests/gpu/harness/setup.sh
tag=${1:-i23}
gpu_env > "$OUT/report.txt"
rc=0
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_csm_depth_fp8.py \
  tests/kernels/test_fp8_gemm.py > "$OUT/pytest.txt" 2>&1
code=$?; echo "gpu-tests rc=$code" >> "$OUT/report.txt"; tail -8 "$OUT/pytest.txt" >> "$OUT/report.txt"
[ "$code" -eq 0 ] || { tail -80 "$OUT/pytest.txt" >> "$OUT/report.txt"; rc=1; }
rm -f "$OUT/pytest.txt"
for gemm in fp8 bf16; do
  name=csm-1b-shape-$tag-$gemm
  timeout 110 python3 -m pdunit.bench.step --model random:csm-1b-shape:0 --batches 64,128,256,512 \
    --contexts 1024 --overlap on --iters 10 --warmup 2 --compare= --depth-kernels fused --decode-gemm "$gemm" \
    --machine-tag "$gpu-$name" --out "$OUT" > "$OUT/step-$name.log" 2>&1
  code=$?; echo "step csm-1b-shape decode-gemm $gemm rc=$code" >> "$OUT/report.txt"
  grep -E "^memory bandwidth|^pool:|^step forward ready|WARNING" "$OUT/step-$name.log" >> "$OUT/report.txt"
  if [ "$code" -eq 0 ]; then rm -f "$OUT/step-$name.log"; else tail -40 "$OUT/step-$name.log" >> "$OUT/report.txt"; rc=1; fi
done
# the device tool brings back at most 8 files: the step results travel as one archive
(cd "$OUT" && tar czf steps.tgz step-* && rm -f step-*)
exit $rc
