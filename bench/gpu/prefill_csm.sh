#!/bin/bash
# Issue 23: P's first frames on the fused depth kernels and frame graphs, on ONE card,
# ~3-4 min: first the GPU tests (P's first frames with frame graphs == without for
# csm-tiny, bench prefill's csm run replaying them, D's and the fused path's frame graphs
# at one capture a bucket), then `pdunit bench prefill` with P's new defaults (auto:
# fused depth kernels, frame graphs up to the largest point's prompts) for
# random:csm-1b-shape:0 and random:dualar-4b-shape:0 at 1x1500,4x1500,8x1000,16x512 in
# bf16, and csm-1b-shape's old path (--depth-kernels torch --no-frame-graphs) at 1x1500
# and 16x512 in the same call, the baseline on this card (tagged TAG-before).
#   bash bench/gpu/prefill_csm.sh [TAG]  (repo root, on the device machine; carry .out/transfer-whl,
#   tests/gpu/harness/wheels.sh; worst case ~9.3 min: 200 s of GPU tests, 3 x 120 s of bench). $OUT:
#   report.txt (env, a status line a run, its depth kernels and frame graphs, the tests' tail) and
#   prefill-<date>-<gpu>-<shape>-<TAG>.json/.md of each run (7 files: the tool brings back at most 8).
set -uo pipefail
source tests/gpu/harness/setup.sh
tag=${1:-i23p}
day=$(date +%Y%m%d)
gpu_env > "$OUT/report.txt"
rc=0
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_prefill_first_frames.py \
  "tests/bench/test_prefill_bench.py::test_cuda_run_of_csm_replays_the_first_frames_where_a_bucket_holds_the_prompts" \
  "tests/kernels/test_csm_gpu_path.py::test_csm_frame_graph_replay_makes_the_eager_steps_frames_bf16" \
  "tests/kernels/test_csm_depth_fused.py::test_frame_graphs_on_the_fused_path_replay_their_eager_frames_bit_for_bit" \
  > "$OUT/pytest.txt" 2>&1
code=$?; echo "gpu-tests rc=$code" >> "$OUT/report.txt"; tail -8 "$OUT/pytest.txt" >> "$OUT/report.txt"
[ "$code" -eq 0 ] || { tail -80 "$OUT/pytest.txt" >> "$OUT/report.txt"; rc=1; }
rm -f "$OUT/pytest.txt"
for run in csm-1b-shape:new dualar-4b-shape:new csm-1b-shape:before; do
  shape=${run%%:*} kind=${run##*:}
  name=$shape-$tag; flags=(--points 1x1500,4x1500,8x1000,16x512)
  if [ "$kind" = before ]; then
    name=$shape-$tag-before; flags=(--points 1x1500,16x512 --depth-kernels torch --no-frame-graphs)
  fi
  timeout 120 python3 -m pdunit.bench.prefill --model "$shape" --gemm bf16 --iters 10 --warmup 3 "${flags[@]}" \
    --out "$OUT/prefill-$day-$gpu-$name.json" > "$OUT/prefill-$name.log" 2>&1
  code=$?; echo "prefill $shape ($kind) rc=$code" >> "$OUT/report.txt"
  grep -E "^depth kernels|^bf16 |WARNING|Error" "$OUT/prefill-$name.log" >> "$OUT/report.txt"
  if [ "$code" -eq 0 ]; then rm -f "$OUT/prefill-$name.log"; else tail -40 "$OUT/prefill-$name.log" >> "$OUT/report.txt"; rc=1; fi
done
exit $rc
