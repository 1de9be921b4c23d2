#!/bin/bash
# Issue 31 item 1: D's decode attention on an fp8 (e4m3) pool, its variants side by side on ONE
# card, ~3-4 min: `pdunit bench attention` (one layer of qwen3-4b-shape) at 64/128/256/512 streams
# x 1k/2k/4k context, every variant of kernels/decode_settings.py's fp8 knobs (kv_words, block_g,
# lazy_softmax, alone and together, with num_stages 2 and block_n 128) beside the current
# default and torch's SDPA (K/V gathered and widened in the call; contiguous bf16 K/V); one
# bf16-pool point for the unchanged bf16 path; then the decode kernel's fp8 GPU tests (every
# fp8 setting against the default kernel and the reference, every --tune candidate) and the
# bench's decode sweep.
#   bash bench/gpu/attention_fp8.sh [TAG]  (repo root, on the device machine; carry .out/transfer-whl,
#   tests/gpu/harness/wheels.sh). $OUT: report.txt (env, each step's status, the summaries, the
#   tests' tail) and attention.tgz (attention-<date>-<gpu>-fp8-<TAG>.json/.md, -bf16-<TAG>.json/.md,
#   pytest.txt, the log of a failed step: the tool brings back at most 8 files).
set -uo pipefail
source tests/gpu/harness/setup.sh
tag=${1:-i31}
stamp=$(date +%Y%m%d)
gpu_env > "$OUT/report.txt"
rc=0
variants="default;kv_words=1;block_g=8;lazy_softmax=1;kv_words=1,block_g=8;kv_words=1,block_g=8,lazy_softmax=1"
variants+=";kv_words=1,block_g=8,lazy_softmax=1,num_stages=2;kv_words=1,block_g=8,lazy_softmax=1,block_n=128"
variants+=";kv_words=1,block_g=8,lazy_softmax=1,block_n=128,num_stages=2;kv_words=1,block_g=8,lazy_softmax=1,fp8_dots=0"
run_bench() {  # name, timeout, args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pdunit.bench.attention --points= --out "$OUT/attention-$stamp-$gpu-$name-$tag.json" "$@" \
    > "$OUT/bench-$name.log" 2>&1
  local code=$?; echo "bench $name rc=$code" >> "$OUT/report.txt"
  grep -E "^copy bandwidth|^summary:" "$OUT/bench-$name.log" >> "$OUT/report.txt"
  if [ "$code" -eq 0 ]; then rm -f "$OUT/bench-$name.log"; else tail -30 "$OUT/bench-$name.log" >> "$OUT/report.txt"; rc=1; fi
}
run_bench fp8 140 --kv-cache-dtype fp8_e4m3 --decode-kernels "$variants" \
  --decode-points 64x1024,64x2048,64x4096,128x1024,128x2048,128x4096,256x1024,256x2048,256x4096,512x1024,512x2048,512x4096
run_bench bf16 30 --kv-cache-dtype auto --decode-kernels default --decode-points 128x2048
# the fp8 tests only: with the new settings off the kernel compiles to the same code as before
timeout 110 python3 -m pytest -q -p no:cacheprovider -m gpu -k "fp8_pool or tunable or decode_sweep" \
  tests/kernels/test_paged_attention.py tests/bench/test_attention_decode_bench.py > "$OUT/pytest.txt" 2>&1
code=$?; echo "gpu-tests rc=$code" >> "$OUT/report.txt"; tail -8 "$OUT/pytest.txt" >> "$OUT/report.txt"
[ "$code" -eq 0 ] || rc=1
# the device tool brings back at most 8 files: the results travel as one archive
(cd "$OUT" && tar czf attention.tgz attention-* pytest.txt bench-*.log 2>/dev/null; rm -f attention-* pytest.txt bench-*.log)
exit $rc
