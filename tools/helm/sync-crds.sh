#!/usr/bin/env bash
# Copy the generated CRDs (crds/*.yaml, from `make crds`) into the chart's crds/ folder,
# which Helm installs before the templates. tests/charts fails when the two differ.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
shopt -s nullglob
src=("$ROOT"/crds/*.yaml)
if [ ${#src[@]} -eq 0 ]; then
  echo "tools/helm/sync-crds.sh: $ROOT/crds has no *.yaml: run 'make crds' first" >&2
  exit 1
fi
rm -f "$ROOT"/charts/pdunit/crds/*.yaml
cp "${src[@]}" "$ROOT/charts/pdunit/crds/"
echo "synced ${#src[@]} CRD(s) into charts/pdunit/crds/" >&2
