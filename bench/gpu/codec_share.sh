#!/bin/bash
# The codec's share of D's step measured on ONE card (issue 26): D's decode step at 256
# streams x 1024 tokens (qwen3-4b-shape, bf16 KV, overlap on: `pdunit bench step`), then
# `pdunit bench codec` (Mimi's real shape, bf16, CUDA graphs, 256 streams, 1 and 2 frames a
# call) judged against that step (--d-step-ms), so the share never mixes cards. ~3 min.
#   bash bench/gpu/codec_share.sh     (repo root, on the device machine; carry .out/transfer-whl
#   as bench/gpu/codec_h200.sh says). $OUT: report.txt, step-*.json/.md, codec-*.json/.md.
set -uo pipefail
source tests/gpu/harness/setup.sh
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]\+' | head -1 | tr 'A-Z' 'a-z')
gpu=${gpu:-gpu}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/report.txt" 2>&1
rc=0
timeout 200 python3 -m pdunit.bench.step --batches 256 --contexts 1024 --overlap on --iters 10 --warmup 2 \
  --compare= --machine-tag "$gpu-d256" --out "$OUT" > "$OUT/step.log" 2>&1
echo "step rc=$?" >> "$OUT/report.txt"
d_ms=$(python3 - "$OUT" <<'PY'
import glob, json, sys
doc = json.load(open(sorted(glob.glob(f"{sys.argv[1]}/step-*.json"))[-1]))
rows = [r for r in doc["rows"] if r.get("batch") == 256 and r.get("step_ms")]
print(f"{min(r['step_ms'] for r in rows):.3f}")
PY
)
echo "D step at 256 x 1024 on this card: ${d_ms:-none} ms" | tee -a "$OUT/report.txt"
if [ -z "$d_ms" ]; then tail -40 "$OUT/step.log" >> "$OUT/report.txt"; exit 1; fi
timeout 150 python3 -m pdunit.bench.codec --shape real --dtype bf16 --mode graphs --batches 256 --frames 1,2 \
  --iters 20 --warmup 3 --d-step-ms "$d_ms" --machine-tag "$gpu-share-bf16" --out "$OUT" > "$OUT/codec.log" 2>&1
code=$?; echo "codec rc=$code" >> "$OUT/report.txt"
[ "$code" -eq 0 ] || { tail -40 "$OUT/codec.log" >> "$OUT/report.txt"; rc=1; }
rm -f "$OUT/step.log" "$OUT/codec.log"
exit $rc
