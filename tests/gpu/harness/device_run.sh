#!/bin/bash
# Entry point on the device machine (nvidia-h200-x2, root): install the carried wheels,
# make `pdunit` importable from this checkout, then run what is asked:
#   bash tests/gpu/harness/device_run.sh smoke   # imports, kernels, a small harness run
#   bash tests/gpu/harness/device_run.sh full    # GPU tests + the full benchmark
#   bash tests/gpu/harness/device_run.sh bench   # the full benchmark only
# Everything it writes for the caller goes under $OUT.
set -uo pipefail
MODE=${1:-smoke}
source tests/gpu/harness/setup.sh
{ nvidia-smi; nvidia-smi topo -m; python3 -c 'import torch, cuda.bindings, grpc, google.protobuf as p; print("torch", torch.__version__, "gpus", torch.cuda.device_count(), "cuda-bindings", cuda.bindings.__version__, "grpc", grpc.__version__, "protobuf", p.__version__)'; } 2>&1 | tee "$OUT/env.txt"
if [ "$MODE" = smoke ]; then
  timeout 300 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/gpu/test_cuda_rows.py 2>&1 | tee "$OUT/pytest_kernels.txt"
  timeout 420 python3 -m pdunit.bench.transfer --layers 4 --pool-tokens 1024 --tokens 256 --iters 3 --warmup 1 \
    --per-row-iters 1 --tcp-iters 1 --work /tmp/pdw --out "$OUT" --machine-tag smoke 2>&1 | tee "$OUT/bench_smoke.txt"
  rc=$?
else
  [ "$MODE" = full ] && timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu -rs 2>&1 | tee "$OUT/pytest_gpu.txt"
  timeout 400 python3 -m pdunit.bench.transfer --work /tmp/pdw --out "$OUT" 2>&1 | tee "$OUT/bench_full.txt"
  rc=$?
fi
# per-process logs of the isolation phases (proxy/D/P), bounded
for ph in none pod-shared pod-separate; do
  for n in proxy d p; do [ -f /tmp/pdw/$ph/$n.log ] && { echo "=== $ph/$n"; tail -c 6000 /tmp/pdw/$ph/$n.log; }; done
done > "$OUT/harness_logs.txt" 2>&1
exit $rc
