#!/bin/bash
# Issue 26's codec run on one GPU (nvidia-h200, or an H100: the tag says which), ~3-5 min:
# the codec's GPU tests (graph == eager, the Triton ring attention == torch's and ==
# transformers' one-shot decode, the stage's start-up capture), then `pdunit bench codec`
# at Mimi's real shape (random weights, 32 codebooks), batches 1-512, 1 and 2 frames a
# call, eager and CUDA graphs: bf16 (with the top kernels of one eager call at 256
# streams), fp32, and bf16 graphs on torch's gather + SDPA attention at 256 and 512 (the
# ring kernel's gain). $OUT gets report.txt (env, one status line a step, the tests'
# output), codec-<date>-<gpu>-<tag>.json and .md, and the log of any failed step: the
# device tool brings back only a few files.
#   bash bench/gpu/codec_h200.sh        (from the repo root, on the device machine)
# Carry .out/transfer-whl (tests/gpu/harness/setup.sh) with, beside its usual wheels,
# transformers 5.24.0 and what it imports at our pins (huggingface-hub, tokenizers,
# safetensors, hf-xet, httpx2, httpcore2, h11, anyio, idna, truststore, typer, click,
# shellingham, rich, markdown-it-py, mdurl, Pygments, annotated-doc, fsspec, filelock;
# `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux2014_x86_64 -d .out/transfer-whl NAME==PIN ...` with constraints.txt's pins):
# the image's transformers 5.17 has another Mimi module layout and no latent_stride.
set -uo pipefail
source tests/gpu/harness/setup.sh
gpu_env > "$OUT/env.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" \
  >> "$OUT/env.txt" 2>&1
rc=0
step() {  # step NAME SECONDS LOG CMD...: the command under a timeout, its output also in LOG
  local name=$1 secs=$2 log=$3 t0=$SECONDS code; shift 3
  timeout "$secs" "$@" 2>&1 | tee "$log"; code=${PIPESTATUS[0]}
  echo "$name rc=$code $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  if [ "$code" -eq 0 ] && [ "$log" != "$OUT/pytest.txt" ]; then rm -f "$log"; else rc=$((rc | (code != 0))); fi
}
step gpu-tests 100 "$OUT/pytest.txt" python3 -m pytest -q -p no:cacheprovider -m gpu -rs -s tests/gpu/test_codec_graphs.py
bench() {  # bench TAG SECONDS ARGS...: one `pdunit bench codec` at the real shape
  local tag=$1 secs=$2; shift 2
  step "codec-$tag" "$secs" "$OUT/codec-$tag.log" python3 -m pdunit.bench.codec --shape real --iters 10 --warmup 2 \
    --machine-tag "$gpu-$tag" --out "$OUT" "$@"
}
bench bf16 110 --dtype bf16 --mode both --batches 1,64,128,256,512 --frames 1,2 --profile-batch 256
bench fp32 100 --dtype fp32 --mode both --batches 1,64,128,256,512 --frames 1,2
bench bf16-torchattn 60 --dtype bf16 --mode graphs --attention torch --batches 256,512 --frames 1,2
cat "$OUT/env.txt" "$OUT/summary.txt" "$OUT/pytest.txt" > "$OUT/report.txt" 2>/dev/null
rm -f "$OUT/env.txt" "$OUT/summary.txt" "$OUT/pytest.txt"
exit $rc
