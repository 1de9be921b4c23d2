# Sourced at the start of every device-machine script (nvidia-h200*, root): installs the
# carried wheels the image lacks into /tmp/site and makes `pdunit` importable from this
# checkout without putting the repo root on sys.path (operator/ would shadow the stdlib).
#   .out/transfer-whl: pydantic, grpcio, protobuf, ... (tests/gpu/harness/wheels.sh downloads them)
#   .out/cap-whl: fastapi, starlette, uvicorn, h11, httptools
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
_wheels=(.out/transfer-whl/*.whl)
[ -d .out/cap-whl ] && _wheels+=(.out/cap-whl/*.whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "${_wheels[@]}" || exit 10
mkdir -p /tmp/pdpkg/pdunit && cp pkg/*.py pkg/py.typed /tmp/pdpkg/pdunit/
for _d in engine kernels sidecars bench operator; do ln -sfn "$PWD/$_d" "/tmp/pdpkg/pdunit/$_d"; done
export PYTHONPATH=/tmp/site:/tmp/pdpkg
# The card's short name for result files (h100, h200; gpu where none is named) and its env line.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o 'H[0-9]\+' | head -1 | tr 'A-Z' 'a-z')
gpu=${gpu:-gpu}
gpu_env() { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1; }
