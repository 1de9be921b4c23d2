#!/usr/bin/env bash
# Provide a pinned, real `helm` (v3) for the chart tests and `make helm`.
#
# Order: the `helm` on PATH when its version is exactly the pin; else a binary already
# built into the cache folder; else build it once with `go install` from the Go module
# proxy into the cache (outside the repo, so CI's fresh clone on the same machine reuses
# it). Never downloads a prebuilt binary: only registries are reachable here.
#
# Prints the binary's absolute path as the LAST line of stdout; progress goes to stderr.
# Env: PDUNIT_HELM_VERSION (default the pin below), PDUNIT_CACHE (default ~/.cache/pdunit).
set -euo pipefail

HELM_VERSION="${PDUNIT_HELM_VERSION:-v3.22.0}"
CACHE="${PDUNIT_CACHE:-$HOME/.cache/pdunit}"
DEST="$CACHE/helm/$HELM_VERSION"
BIN="$DEST/helm"

# `helm version --template` prints e.g. v3.22.0; returns nothing for non-helm binaries.
version_of() {
  "$1" version --template '{{.Version}}' 2>/dev/null || true
}

if command -v helm >/dev/null 2>&1; then
  onpath="$(command -v helm)"
  if [ "$(version_of "$onpath")" = "$HELM_VERSION" ]; then
    echo "$onpath"
    exit 0
  fi
fi

if [ -x "$BIN" ] && [ "$(version_of "$BIN")" = "$HELM_VERSION" ]; then
  echo "$BIN"
  exit 0
fi

if ! command -v go >/dev/null 2>&1; then
  echo "tools/helm/ensure.sh: no helm $HELM_VERSION on PATH and no 'go' to build it;" \
       "install Go >= 1.24 or put helm $HELM_VERSION on PATH" >&2
  exit 1
fi

mkdir -p "$DEST"
# A lock so that two concurrent callers (make -j, parallel test sessions) build once.
exec 9>"$DEST/.lock"
flock 9
if ! { [ -x "$BIN" ] && [ "$(version_of "$BIN")" = "$HELM_VERSION" ]; }; then
  echo "tools/helm/ensure.sh: building helm $HELM_VERSION with go install (minutes, once)" >&2
  start=$(date +%s)
  # Build into a temporary GOBIN so an interrupted build never leaves a half binary at $BIN.
  tmp="$(mktemp -d "$DEST/.build.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  GOBIN="$tmp" GOFLAGS="${GOFLAGS:--buildvcs=false}" CGO_ENABLED=0 \
    go install -ldflags "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >&2
  mv "$tmp/helm" "$BIN"
  echo "tools/helm/ensure.sh: built in $(( $(date +%s) - start )) s" >&2
fi
got="$(version_of "$BIN")"
if [ "$got" != "$HELM_VERSION" ]; then
  echo "tools/helm/ensure.sh: $BIN reports version '$got', expected $HELM_VERSION" >&2
  exit 1
fi
echo "$BIN"
