#!/bin/bash
# The monolith's mixed step on ONE card (issue 25): eager against the replay of its captured
# (decode rows, prompt rows) pair, `pdunit bench mixed` at qwen3-4b-shape with the monolith's
# settings of docs/performance.md's mixed-graphs A/B (fp8 KV, fp8 prefill GEMMs, the default
# pairs: 16..512 prompt rows, so the 1024- and 2048-row points report no pair and time eager
# only), 32-256 streams x 256-2048 prompt rows at context 1024, one chunk and four; first the
# gpu tests of the mixed-step runner and of the bench (replay == eager). ~4 min.
#   bash bench/gpu/mixed_step.sh [TAG]  (repo root, on the device machine; carry .out/transfer-whl,
#   tests/gpu/harness/setup.sh). $OUT: report.txt (env, a status line per step, the tests' tail,
#   the bench's table), mixed-<date>-<gpu>-<TAG>.json/.md, the log of a failed step.
set -uo pipefail
source tests/gpu/harness/setup.sh
tag=${1:-mixed}
gpu_env > "$OUT/report.txt"
rc=0
t0=$SECONDS
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_mixed_graphs.py \
  tests/bench/test_mixed_bench.py > "$OUT/pytest.txt" 2>&1
code=$?; echo "gpu-tests rc=$code $((SECONDS - t0))s" >> "$OUT/report.txt"; tail -8 "$OUT/pytest.txt" >> "$OUT/report.txt"
[ "$code" -eq 0 ] || { tail -60 "$OUT/pytest.txt" >> "$OUT/report.txt"; rc=1; }
rm -f "$OUT/pytest.txt"
t0=$SECONDS
timeout 180 python3 -m pdunit.bench.mixed --model random:qwen3-4b-shape:0 --batches 32,64,128,256 --contexts 1024 \
  --prompt-rows 256,512,1024,2048 --chunks 1,4 --kv-cache-dtype fp8_e4m3 --prefill-gemm fp8 --iters 10 --warmup 2 \
  --machine-tag "$gpu-$tag" --out "$OUT" > "$OUT/mixed.log" 2>&1
code=$?; echo "bench-mixed rc=$code $((SECONDS - t0))s" >> "$OUT/report.txt"
if [ "$code" -eq 0 ]; then
  sed -n '/^ *streams /,/^summary:/p' "$OUT/mixed.log" >> "$OUT/report.txt"; rm -f "$OUT/mixed.log"
else
  tail -40 "$OUT/mixed.log" >> "$OUT/report.txt"; rc=1
fi
exit $rc
