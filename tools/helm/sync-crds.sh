#!/usr/bin/env bash
# Copy the generated CRDs (crds/*.yaml, from `make crds`) into both charts: charts/pdunit/crds/
# (Helm installs them before the templates on a first install, never on upgrade) and
# charts/pdunit-crds/templates/ (a release of their own, so `helm upgrade` updates them).
# tests/charts fails when any copy differs.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
shopt -s nullglob
src=("$ROOT"/crds/*.yaml)
if [ ${#src[@]} -eq 0 ]; then
  echo "tools/helm/sync-crds.sh: $ROOT/crds has no *.yaml: run 'make crds' first" >&2
  exit 1
fi
for dest in "$ROOT/charts/pdunit/crds" "$ROOT/charts/pdunit-crds/templates"; do
  mkdir -p "$dest"
  rm -f "$dest"/*.yaml
  cp "${src[@]}" "$dest/"
done
echo "synced ${#src[@]} CRD(s) into charts/pdunit/crds/ and charts/pdunit-crds/templates/" >&2
