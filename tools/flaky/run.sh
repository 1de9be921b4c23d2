#!/usr/bin/env bash
# `make test-flaky`: the flake hunt. CI's exact command (`bash .ci/run`) on fresh clones
# of the commit HEAD names when it starts (every run tests that commit), one clone per
# run: plain twice, once in random order (pytest-randomly, with the seed printed), twice while every core is kept busy by a CPU burner this script
# starts and always stops. Exits non-zero if any run failed.
#
# Owns: the clones under one temp folder, the burners, the per-run log and the summary.
# Never edits the repository it runs from; uncommitted changes are not in the clones.
#
# Env:
#   FLAKY_RUNS   the plan: a count (the first N of the default plan) or a comma list of
#                plain | random | busy (default plain,plain,random,busy,busy)
#   FLAKY_ARGS   pytest arguments for every run (a subset: tests/engine -x), through
#                PYTEST_ADDOPTS; empty = the whole suite as `make test` runs it
#   FLAKY_SEED   the random-order seed (default: drawn here, printed)
#   FLAKY_DIR    where the clones and logs go (default: a new temp folder); a passing
#                run's clone is removed, every log is kept
#   FLAKY_BUSY_MAX_S  a burner ends by itself after this long even if this script dies
#                (default 3600)
# The clones share the envtest/helm builds (PDUNIT_CACHE, ~/.cache/pdunit) and pip's
# cache (PIP_CACHE_DIR, default ~/.cache/pip), so only the first install downloads.
set -uo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
default_plan="plain,plain,random,busy,busy"
plan="${FLAKY_RUNS:-$default_plan}"
if [[ "$plan" =~ ^[0-9]+$ ]]; then
  plan="$(echo "$default_plan" | cut -d, -f1-"$plan")"
fi
IFS=, read -r -a runs <<< "$plan"
for kind in "${runs[@]}"; do
  case "$kind" in
    plain | random | busy) ;;
    *) echo "FLAKY_RUNS: unknown run kind '$kind' (plain | random | busy, or a count)" >&2; exit 2 ;;
  esac
done
seed="${FLAKY_SEED:-$(( (RANDOM << 15) | RANDOM ))}"
busy_max_s="${FLAKY_BUSY_MAX_S:-3600}"
export PDUNIT_CACHE="${PDUNIT_CACHE:-$HOME/.cache/pdunit}"
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$HOME/.cache/pip}"
work="${FLAKY_DIR:-$(mktemp -d -t pdunit-flaky.XXXXXX)}"
mkdir -p "$work"
head="$(git -C "$repo" rev-parse --short HEAD)"

burners=()
stop_burners() {
  local pid
  for pid in "${burners[@]}"; do
    kill "$pid" 2>/dev/null
  done
  for pid in "${burners[@]}"; do
    wait "$pid" 2>/dev/null
  done
  burners=()
}
start_burners() {
  local i
  for ((i = 0; i < $(nproc); i++)); do
    timeout "$busy_max_s" bash -c 'while :; do :; done' &
    burners+=("$!")
  done
}
trap stop_burners EXIT
trap 'stop_burners; exit 130' INT TERM

echo "flake hunt of $head: runs $plan; clones in $work; random-order seed $seed"
[ -n "${FLAKY_ARGS:-}" ] && echo "pytest arguments of every run: $FLAKY_ARGS"
results=()
failed=0
t_all=$SECONDS
for i in "${!runs[@]}"; do
  kind="${runs[$i]}"
  n=$((i + 1))
  dir="$work/run-$n-$kind"
  log="$work/run-$n-$kind.log"
  rm -rf "$dir"
  # every run tests the commit the hunt started on, whatever lands in the repository meanwhile
  git clone -q "$repo" "$dir" && git -C "$dir" checkout -q --detach "$head" ||
    { echo "run $n: git clone of $head failed" >&2; exit 1; }
  addopts="--durations=20 ${FLAKY_ARGS:-}"
  if [ "$kind" = random ]; then
    addopts="-p randomly --randomly-seed=$seed $addopts"
  fi
  [ "$kind" = busy ] && start_burners
  echo "run $n/${#runs[@]} ($kind$([ "$kind" = random ] && echo ", seed $seed")$([ "$kind" = busy ] && echo ", ${#burners[@]} burners")): $log"
  t0=$SECONDS
  (cd "$dir" && PYTEST_ADDOPTS="$addopts" bash .ci/run) > "$log" 2>&1
  rc=$?
  took=$((SECONDS - t0))
  stop_burners
  summary="$(grep -E '^(=+ )?[0-9]+ (passed|failed)|^FAILED|^ERROR' "$log" | tail -n 12)"
  if [ "$rc" -eq 0 ]; then
    results+=("run $n $kind: passed in ${took}s")
    rm -rf "$dir"
  else
    failed=1
    results+=("run $n $kind: FAILED (exit $rc) in ${took}s; log $log, clone $dir")
  fi
  echo "${results[-1]}"
  [ -n "$summary" ] && echo "$summary" | sed 's/^/    /'
done

echo
echo "slowest 20 tests of run 1 (${runs[0]}):"
sed -n '/slowest 20 durations/,/^$/p' "$work/run-1-${runs[0]}.log" | sed '1d;/^$/d;s/^/  /'
echo "flake hunt of $head (random-order seed $seed), $((SECONDS - t_all))s in all:"
printf '  %s\n' "${results[@]}"
if [ "$failed" -eq 0 ]; then
  echo "all ${#runs[@]} runs green; logs under $work"
  exit 0
fi
echo "some runs failed: logs and clones under $work" >&2
exit 1
