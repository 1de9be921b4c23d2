#!/bin/bash
# One device-tool call, several steps, each bounded by its own timeout; every step's
# files go to /tmp/res/<step>/ and come back as $OUT/results.tgz (the tool returns at
# most 8 files), with a one-line status per step in $OUT/summary.txt.
#   bash tests/gpu/harness/device_session.sh STEP[:SECONDS] ...
# Steps: gpu-tests ($GPU_TESTS), compare ($COMPARE_ARGS: `pdunit bench compare` flags, split as a shell
# would but with ';' a plain character: 'fp8=--a=1 --b=2' is one word),
# faults ($FAULTS_KINDS, $FAULTS_STEM), step ($STEP_ARGS; ';' between runs), prefill ($PREFILL_ARGS), attention ($ATTENTION_ARGS; ';' between runs),
# transfer ($TRANSFER_ARGS).
set -uo pipefail
source tests/gpu/harness/setup.sh
RES=/tmp/res; mkdir -p "$RES"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$RES/env.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$RES/env.txt" 2>&1
CAP="--model random:qwen3-4b-shape:0 --device cuda --transfer ipc --pool-tokens 400000 --cache-tokens 60000 --ready-timeout-s 240"
# runs a command with its output also appended to LOG; its exit status is the command's
logged() { local log=$1; shift; "$@" 2>&1 | tee -a "$log"; return "${PIPESTATUS[0]}"; }
run_step() {
  local step=${1%%:*} secs=${1#*:}; [ "$secs" = "$1" ] && secs=300
  local dir="$RES/$step"; mkdir -p "$dir"; local t0=$SECONDS rc=0
  echo "### $step (limit ${secs}s)"
  case $step in
    gpu-tests) logged "$dir/pytest.txt" timeout "$secs" python3 -m pytest -q -p no:cacheprovider -m gpu -rs \
        ${GPU_TESTS:-tests/kernels/test_kv_checksum.py tests/bench/test_step.py tests/gpu/test_unit_gpu.py} || rc=$? ;;
    compare) # COMPARE_ARGS split as a shell would, ';' kept inside a word: quotes group flags with spaces
      mapfile -d '' -t compare_argv < <(python3 -c 'import shlex, sys; sys.stdout.write("".join(a + "\0" for a in shlex.split(sys.argv[1])))' "${COMPARE_ARGS:-}")
      logged "$dir/compare.log" timeout "$secs" python3 -m pdunit.cli bench compare $CAP --run-dir /tmp/units \
        --out "$dir/capacity.json" --plot "$dir/capacity.png" "${compare_argv[@]}" || rc=$?
      # an engine's --sample-stacks file written there (e.g. --prefill-args=--sample-stacks=/tmp/res/compare/p.folded)
      for f in "$dir"/*.folded; do
        if [ -f "$f" ]; then python3 -m pdunit.bench.stacks --file "$f" --out "${f%.folded}.md" > /dev/null; fi
      done ;;
    faults)
      stem=${FAULTS_STEM:-faults-gpu}
      logged "$dir/faults.log" timeout "$secs" python3 -m pdunit.bench.faults --isolate --device cuda --transfer proxy \
        --kinds "${FAULTS_KINDS:-corrupt,slow,p_stop,lb_stop,p_kill,held_exit,proxy_stop}" \
        --transfers 2000 --faults 50 --max-seconds $((secs * 2 / 3)) --run-dir /tmp/units-faults/unit \
        --out "$dir/faults.json" --results "$stem" || rc=$?
      cp bench/results/"$stem".* "$dir/" 2>/dev/null ;;
    step) # runs separated by ';' (e.g. one per --kv-cache-dtype, each with its own --machine-tag), one after another
      IFS=';' read -ra runs <<< "${STEP_ARGS:---batches 64,128 --contexts 2048 --iters 10 --warmup 2}"
      for a in "${runs[@]}"; do
        logged "$dir/step.log" timeout $((secs / ${#runs[@]})) python3 -m pdunit.bench.step $a --out "$dir" || rc=$?
      done ;;
    prefill) logged "$dir/prefill.log" timeout "$secs" python3 -m pdunit.bench.prefill ${PREFILL_ARGS:---profile} --out "$dir" || rc=$? ;;
    attention) # runs separated by ';' (e.g. one per --kv-cache-dtype), one after another
      IFS=';' read -ra runs <<< "${ATTENTION_ARGS:-}"
      [ ${#runs[@]} -gt 0 ] || runs=("")
      for i in "${!runs[@]}"; do  # a folder per run: the results file's name is the same for each
        logged "$dir/attention.log" timeout $((secs / ${#runs[@]})) python3 -m pdunit.bench.attention ${runs[$i]} \
          --out "$dir/$i" || rc=$?
      done ;;
    transfer) logged "$dir/transfer.log" timeout "$secs" python3 -m pdunit.bench.transfer --work /tmp/pdw --out "$dir" ${TRANSFER_ARGS:-} || rc=$? ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
  # every unit's process logs, bounded: what went wrong
  for f in /tmp/units*/*/logs/*.log /tmp/pdw/*/*.log; do [ -f "$f" ] && { echo "=== $f"; tail -c 5000 "$f"; }; done > "$dir/process_logs.txt" 2>&1
  rm -rf /tmp/units*/*/logs
  echo "$step rc=$rc $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
  tar czf "$OUT/results.tgz" -C "$RES" .  # after every step: a call cut short keeps what ran
}
for s in "$@"; do run_step "$s"; done
