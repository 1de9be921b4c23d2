#!/bin/bash
# Downloads into .out/transfer-whl the wheels a device-machine run carries (the image has
# torch, triton, numpy, cupy, cuda-bindings; see tests/gpu/harness/setup.sh), at
# constraints.txt's pins, for the image's CPython 3.12 on x86_64: the engine's core
# dependencies and transformers 5.24 (the image's 5.17 lays Mimi out otherwise) with what
# it imports. Run here, from the repo root; then carry .out/transfer-whl.
set -euo pipefail
dest=.out/transfer-whl
mkdir -p "$dest"
names=(pydantic pydantic-core annotated-types typing-inspection typing-extensions grpcio protobuf
  fastapi starlette anyio uvicorn h11 httptools httpx httpcore certifi idna click prometheus-client
  opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto
  opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-common
  googleapis-common-protos importlib-metadata zipp
  transformers huggingface-hub tokenizers safetensors hf-xet fsspec filelock tqdm regex packaging
  typer shellingham rich markdown-it-py mdurl pygments annotated-doc httpx2 httpcore2 truststore)
pins=()
for n in "${names[@]}"; do
  pin=$(grep -i -E "^${n//-/[-_]}==" constraints.txt | head -1 || true)
  [ -n "$pin" ] && pins+=("$pin") || echo "not pinned in constraints.txt, skipped: $n" >&2
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64 -d "$dest" "${pins[@]}"
du -sh "$dest"
