#!/bin/bash
# The codec's share of D's step measured on ONE card (issue 26), the fused kernels on tuned conv
# tiles beside the torch ones in one run: first `pdunit bench codec --tune-conv` (Mimi's real
# shape, bf16, 256 streams, 1 and 2 frames a call: every tile candidate of the decoder's conv
# shapes compiled in threads, checked against the torch form and timed in CUDA graphs; the
# fastest written as codec-conv-*.json, the engines' --codec-conv-table), then in the same run
# --kernels fused,torch, eager and CUDA graphs, each graph's replay alone, the kernels of one
# eager call (how many, the top ones) on those tiles, judged against D's step at 256 streams x
# 1024 tokens (qwen3-4b-shape, bf16 KV, overlap on): on an H100 the 18.078 ms of record
# (bench/results/step-20261207-h100-d256-share2), elsewhere or with STEP=1 measured first
# (`pdunit bench step`, ~100 s more). Then the fused path on the hand tiles (graphs, the same
# points: the tuning's gain on the same card) and the codec's GPU tests (graph == eager, fused ==
# torch per conv, per PCM sample and per decoder on the hand and the tuned tiles, == one-shot,
# the launch count; the tuning's kernels are in Triton's cache by then). Expected ~4-4.5 min on
# an H100 (tuning ~1 min of it, most of it compiling; the tests ~1.5 min, fp32 compiles cold).
#   bash bench/gpu/codec_share.sh [TAG]  (repo root, on the device machine; carry .out/transfer-whl
#   as bench/gpu/codec_h200.sh says). $OUT: report.txt (the tuning per shape, a line a run and a
#   row, the tests' tail), codec-*.json/.md, codec-conv-*.json (step-*.json/.md when measured);
#   TAG (default share) goes in the file names.
set -uo pipefail
source tests/gpu/harness/setup.sh
tag=${1:-share}
gpu_env > "$OUT/report.txt"
rc=0
d_ms=""
if [ "$gpu" = h100 ] && [ "${STEP:-0}" != 1 ]; then
  d_ms=18.078; echo "D step at 256 x 1024: 18.078 ms of record (H100, 2026-12-07; STEP=1 measures it)" >> "$OUT/report.txt"
else
  timeout 100 python3 -m pdunit.bench.step --batches 256 --contexts 1024 --overlap on --iters 10 --warmup 2 \
    --compare= --machine-tag "$gpu-d256-$tag" --out "$OUT" > "$OUT/step.log" 2>&1
  code=$?; echo "step rc=$code" >> "$OUT/report.txt"
  [ "$code" -eq 0 ] || { tail -40 "$OUT/step.log" >> "$OUT/report.txt"; rc=1; }
  d_ms=$(python3 - "$OUT" <<'PY'
import glob, json, sys
files = sorted(glob.glob(f"{sys.argv[1]}/step-*.json"))
rows = [r for r in json.load(open(files[-1]))["rows"] if r.get("batch") == 256 and r.get("step_ms")] if files else []
print(f"{min(r['step_ms'] for r in rows):.3f}" if rows else "")
PY
)
  echo "D step at 256 x 1024 on this card: ${d_ms:-none} ms" >> "$OUT/report.txt"
  [ -n "$d_ms" ] || { d_ms=18.078; echo "no step: judged against the H100's 18.078 ms of record" >> "$OUT/report.txt"; }
  rm -f "$OUT/step.log"
fi
timeout 210 python3 -m pdunit.bench.codec --shape real --dtype bf16 --kernels fused,torch --mode both --batches 256 \
  --frames 1,2 --iters 20 --warmup 3 --profile-batch 256 --d-step-ms "$d_ms" --tune-conv \
  --machine-tag "$gpu-$tag-bf16" --out "$OUT" > "$OUT/codec.log" 2>&1
code=$?; echo "codec rc=$code" >> "$OUT/report.txt"
grep -E "^tune-conv" "$OUT/codec.log" >> "$OUT/report.txt"
[ "$code" -eq 0 ] || { tail -40 "$OUT/codec.log" >> "$OUT/report.txt"; rc=1; }
timeout 60 python3 -m pdunit.bench.codec --shape real --dtype bf16 --kernels fused --mode graphs --batches 256 \
  --frames 1,2 --iters 20 --warmup 3 --d-step-ms "$d_ms" --machine-tag "$gpu-$tag-hand-bf16" --out "$OUT" \
  > "$OUT/hand.log" 2>&1
code=$?; echo "codec on the hand tiles rc=$code" >> "$OUT/report.txt"
[ "$code" -eq 0 ] || { tail -20 "$OUT/hand.log" >> "$OUT/report.txt"; rc=1; }
python3 - "$OUT" >> "$OUT/report.txt" 2>&1 <<'PY'
import glob, json, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/codec-2*.json")):
    doc = json.load(open(path))
    tiles = doc["summary"].get("conv_tiles", {})
    print(path.rsplit("/", 1)[-1], "conv tiles:", tiles.get("used"), tiles.get("why", ""), "convs a call (device ms):",
          tiles.get("calls"))
    for name, run in doc["summary"]["runs"].items():
        p = run.get("profile") or {}
        if p:
            print(name, "kernels/call", p.get("kernels_per_call"), "device ms/call", p.get("device_ms_per_call"),
                  "top", [(k["name"][:40], k["ms_per_call"], k["calls_per_call"]) for k in p.get("kernels", [])[:6]])
    for r in doc["rows"]:
        print(r["kernels"], r["mode"], f"{r['frames']}f", f"ms {r['ms']:.3f}",
              f"replay {r['replay_ms']:.3f}" if r.get("replay_ms") else "", f"of D {r['of_d_step']:.1%}")
PY
rm -f "$OUT/codec.log" "$OUT/hand.log"
timeout 150 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu/test_codec_graphs.py > "$OUT/pytest.txt" 2>&1
code=$?; echo "gpu-tests rc=$code" >> "$OUT/report.txt"
grep -E "^(real|tiny|GPU kernels)" "$OUT/pytest.txt" >> "$OUT/report.txt"; tail -4 "$OUT/pytest.txt" >> "$OUT/report.txt"
[ "$code" -eq 0 ] || { tail -60 "$OUT/pytest.txt" >> "$OUT/report.txt"; rc=1; }
rm -f "$OUT/pytest.txt"
exit $rc
