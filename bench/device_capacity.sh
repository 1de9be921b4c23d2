#!/bin/bash
# PD vs monolith capacity on a 2-GPU device machine (the device tool's nvidia-h200-x2),
# qwen3-4b-shape random weights, one `pdunit bench compare` run. Carried wheels (the
# image lacks them): .out/transfer-whl (pydantic, grpcio, protobuf) and .out/cap-whl
# (fastapi, starlette, uvicorn, h11). Results land in $OUT.
#   bash bench/device_capacity.sh [extra `pdunit bench compare` flags]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .out/transfer-whl/*.whl .out/cap-whl/*.whl || exit 10
mkdir -p /tmp/pdpkg/pdunit && cp pkg/__init__.py /tmp/pdpkg/pdunit/
for d in engine kernels sidecars bench operator; do ln -sfn "$PWD/$d" "/tmp/pdpkg/pdunit/$d"; done
export PYTHONPATH=/tmp/site:/tmp/pdpkg
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
timeout 560 python3 -m pdunit.engine.cli bench compare --model random:qwen3-4b-shape:0 --device cuda \
  --transfer ipc --pool-tokens 400000 --cache-tokens 60000 --ready-timeout-s 240 --run-dir /tmp/units \
  --out "$OUT/capacity-h200x2.json" --plot "$OUT/capacity-h200x2.png" "$@" 2>&1 | tee "$OUT/compare.log"
rc=${PIPESTATUS[0]}
# the units' logs, bounded, for what went wrong
for f in /tmp/units/*/logs/*.log; do [ -f "$f" ] && { echo "=== $f"; tail -c 4000 "$f"; }; done > "$OUT/unit_logs.txt" 2>&1
exit "$rc"
