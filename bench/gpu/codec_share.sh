#!/bin/bash
# The codec's share of D's step measured on ONE card (issue 26): D's decode step at 256
# streams x 1024 tokens (qwen3-4b-shape, bf16 KV, overlap on: `pdunit bench step`), then
# `pdunit bench codec` (Mimi's real shape, bf16, eager and CUDA graphs, 256 streams, 1 and 2
# frames a call, the top kernels of one eager call) judged against that step (--d-step-ms), so
# the share never mixes cards; first the codec's GPU tests (graph == eager, == one-shot). ~4 min.
#   bash bench/gpu/codec_share.sh [TAG]  (repo root, on the device machine; carry .out/transfer-whl
#   as bench/gpu/codec_h200.sh says). $OUT: report.txt (with the tests' tail), step-*.json/.md,
#   codec-*.json/.md; TAG (default share) goes in the file names.
set -uo pipefail
source tests/gpu/harness/setup.sh
tag=${1:-share}
gpu_env > "$OUT/report.txt"
rc=0
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_codec_graphs.py > "$OUT/pytest.txt" 2>&1
code=$?; echo "gpu-tests rc=$code" >> "$OUT/report.txt"; tail -8 "$OUT/pytest.txt" >> "$OUT/report.txt"
[ "$code" -eq 0 ] || { tail -60 "$OUT/pytest.txt" >> "$OUT/report.txt"; rc=1; }
rm -f "$OUT/pytest.txt"
timeout 100 python3 -m pdunit.bench.step --batches 256 --contexts 1024 --overlap on --iters 10 --warmup 2 \
  --compare= --machine-tag "$gpu-d256-$tag" --out "$OUT" > "$OUT/step.log" 2>&1
code=$?; echo "step rc=$code" >> "$OUT/report.txt"
[ "$code" -eq 0 ] || tail -20 "$OUT/step.log" >> "$OUT/report.txt"
d_ms=$(python3 - "$OUT" <<'PY'
import glob, json, sys
doc = json.load(open(sorted(glob.glob(f"{sys.argv[1]}/step-*.json"))[-1]))
rows = [r for r in doc["rows"] if r.get("batch") == 256 and r.get("step_ms")]
print(f"{min(r['step_ms'] for r in rows):.3f}")
PY
)
echo "D step at 256 x 1024 on this card: ${d_ms:-none} ms" | tee -a "$OUT/report.txt"
if [ -z "$d_ms" ]; then  # the codec is still timed, judged against the H100 step of record
  tail -40 "$OUT/step.log" >> "$OUT/report.txt"; rc=1; d_ms=17.622
  echo "no step: codec judged against 17.622 ms (step-20261206-h100-d256, another run)" >> "$OUT/report.txt"
fi
timeout 110 python3 -m pdunit.bench.codec --shape real --dtype bf16 --mode both --batches 256 --frames 1,2 \
  --iters 20 --warmup 3 --profile-batch 256 --d-step-ms "$d_ms" --machine-tag "$gpu-$tag-bf16" --out "$OUT" > "$OUT/codec.log" 2>&1
code=$?; echo "codec rc=$code" >> "$OUT/report.txt"
[ "$code" -eq 0 ] || { tail -40 "$OUT/codec.log" >> "$OUT/report.txt"; rc=1; }
grep -E "^\| bf16 " "$OUT"/codec-*.md >> "$OUT/report.txt" 2>/dev/null
rm -f "$OUT/step.log" "$OUT/codec.log"
exit $rc
