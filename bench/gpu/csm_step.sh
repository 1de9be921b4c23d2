#!/bin/bash
# Issue 23's step benchmark of the real-model shapes on ONE card, ~5-8 min: first the csm
# GPU tests (the Triton path == the reference, decode and frame graph replays == eager, the
# fused depth decoder == the torch one, D on CUDA, and the bench's own csm GPU test), then
# `pdunit bench step` for random:csm-1b-shape:0 (twice: --depth-kernels torch, then fused,
# tagged TAG-fused) and random:dualar-4b-shape:0: D's whole step (backbone graph +
# frame graph: codebook 0, the K-1 depth passes, sampling) at 64/128/256/512 streams x
# 1024/2048 tokens with overlap, its device time split (backbone, frames) and its roofline
# (max of bytes / measured bandwidth, FLOPs / measured GEMM rate). Points whose KV does not
# fit the card are written as skipped rows, named (dualar-4b: 144 KiB a token).
#   bash bench/gpu/csm_step.sh [TAG]  (repo root, on the device machine; carry .out/transfer-whl,
#   tests/gpu/harness/wheels.sh; worst case ~9.3 min (200 s of GPU tests, 3 x 120 s of steps), under the tool's 10). $OUT: report.txt (env, a
#   status line a step, the tests' tail) and steps.tgz (step-<date>-<gpu>-<shape>-<TAG>.json/.md/
#   .fit.json and the log of a failed step: the tool brings back at most 8 files).
set -uo pipefail
source tests/gpu/harness/setup.sh
tag=${1:-i23}
gpu_env > "$OUT/report.txt"
rc=0
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_csm_gpu_path.py \
  tests/kernels/test_csm_depth_fused.py tests/kernels/test_sampling_fused.py \
  "tests/engine/test_sampling.py::test_static_sampler_on_cuda_is_one_launch_with_the_host_samplers_frames" \
  tests/engine/test_csm_serving.py "tests/bench/test_step.py::test_gpu_run_of_csm_replays_both_graphs_and_times_them_apart" \
  > "$OUT/pytest.txt" 2>&1
code=$?; echo "gpu-tests rc=$code" >> "$OUT/report.txt"; tail -8 "$OUT/pytest.txt" >> "$OUT/report.txt"
[ "$code" -eq 0 ] || { tail -80 "$OUT/pytest.txt" >> "$OUT/report.txt"; rc=1; }
rm -f "$OUT/pytest.txt"
for run in csm-1b-shape:torch csm-1b-shape:fused dualar-4b-shape:torch; do
  shape=${run%%:*} kernels=${run##*:}
  name=$shape-$tag; [ "$kernels" = torch ] || name=$shape-$tag-$kernels
  timeout 120 python3 -m pdunit.bench.step --model "random:$shape:0" --batches 64,128,256,512 \
    --contexts 1024,2048 --overlap on --iters 10 --warmup 2 --compare= --depth-kernels "$kernels" \
    --machine-tag "$gpu-$name" --out "$OUT" > "$OUT/step-$name.log" 2>&1
  code=$?; echo "step $shape depth-kernels $kernels rc=$code" >> "$OUT/report.txt"
  grep -E "^memory bandwidth|^pool:|^step forward ready|WARNING" "$OUT/step-$name.log" >> "$OUT/report.txt"
  if [ "$code" -eq 0 ]; then rm -f "$OUT/step-$name.log"; else tail -40 "$OUT/step-$name.log" >> "$OUT/report.txt"; rc=1; fi
done
# the device tool brings back at most 8 files: the step results travel as one archive
(cd "$OUT" && tar czf steps.tgz step-* && rm -f step-*)
exit $rc
