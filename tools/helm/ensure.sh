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
# Written beside the binary after a successful build; bump RECIPE when the build flags
# change so cached binaries built the old way are rebuilt.
RECIPE="go-install-ldflags-2"
STAMP="$DEST/helm.recipe"

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

cached_ok() {
  [ -x "$BIN" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$RECIPE" ] \
    && [ "$(version_of "$BIN")" = "$HELM_VERSION" ]
}

if cached_ok; then
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
if ! cached_ok; then
  echo "tools/helm/ensure.sh: building helm $HELM_VERSION with go install (minutes, once)" >&2
  start=$(date +%s)
  # The same -X flags as helm's release Makefile: the version, and the default
  # Kubernetes version of `helm template`/`helm lint` (client-go v0.X -> 1.X), which a
  # plain `go install` leaves at v1.20 (too old for charts with kubeVersion >= 1.30).
  gomod="$(go mod download -json "helm.sh/helm/v3@$HELM_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')"
  client_go="$(sed -n 's#^[[:space:]]*k8s.io/client-go v0\.\([0-9]*\)\..*#\1#p' "$gomod" | head -1)"
  if [ -z "$client_go" ]; then
    echo "tools/helm/ensure.sh: cannot read k8s.io/client-go's version from $gomod" >&2
    exit 1
  fi
  ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
  for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    ldflags="$ldflags -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$client_go"
  done
  # Build into a temporary GOBIN so an interrupted build never leaves a half binary at $BIN.
  tmp="$(mktemp -d "$DEST/.build.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  GOBIN="$tmp" GOFLAGS="${GOFLAGS:--buildvcs=false}" CGO_ENABLED=0 \
    go install -trimpath -ldflags "$ldflags" "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >&2
  mv "$tmp/helm" "$BIN"
  echo "$RECIPE" > "$STAMP"
  echo "tools/helm/ensure.sh: built in $(( $(date +%s) - start )) s (default Kubernetes 1.$client_go)" >&2
fi
got="$(version_of "$BIN")"
if [ "$got" != "$HELM_VERSION" ]; then
  echo "tools/helm/ensure.sh: $BIN reports version '$got', expected $HELM_VERSION" >&2
  exit 1
fi
echo "$BIN"
