#!/bin/bash
# PD vs monolith capacity on a 2-GPU device machine (the device tool's nvidia-h200-x2),
# qwen3-4b-shape random weights, one `pdunit bench compare` run. Carried wheels (the
# image lacks them): .out/transfer-whl (pydantic, grpcio, protobuf) and .out/cap-whl
# (fastapi, starlette, uvicorn, h11). Results land in $OUT.
#   bash bench/device_capacity.sh [extra `pdunit bench compare` flags]
set -uo pipefail
source tests/gpu/harness/setup.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
timeout 560 python3 -m pdunit.engine.cli bench compare --model random:qwen3-4b-shape:0 --device cuda \
  --transfer ipc --pool-tokens 400000 --cache-tokens 60000 --ready-timeout-s 240 --run-dir /tmp/units \
  --out "$OUT/capacity-h200x2.json" --plot "$OUT/capacity-h200x2.png" "$@" 2>&1 | tee "$OUT/compare.log"
rc=${PIPESTATUS[0]}
# the units' logs, bounded, for what went wrong
for f in /tmp/units/*/logs/*.log; do [ -f "$f" ] && { echo "=== $f"; tail -c 4000 "$f"; }; done > "$OUT/unit_logs.txt" 2>&1
exit "$rc"
