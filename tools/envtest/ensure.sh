#!/usr/bin/env bash
# Provide kube-apiserver, etcd and kubectl for the operator's integration tests (envtest)
# and print the folder that holds them (stdout: that one line; progress goes to stderr).
#
# 1. KUBEBUILDER_ASSETS set and holding all three executables: use it as is.
# 2. Else the cache folder ${PDUNIT_CACHE:-$HOME/.cache/pdunit}/envtest/<version>/ when a
#    previous run built it from the same go.mod/go.sum (stamp file): fast, no Go needed.
# 3. Else build all three ONCE from the Go modules pinned in tools/envtest/go.mod
#    (k8s.io/kubernetes v1.34.4, go.etcd.io/etcd/server/v3 v3.6.4) with the local Go
#    toolchain and the Go module proxy. About 10-20 minutes on 2 cores the first time.
#
# The cache lives outside the repo so a fresh clone (CI) on the same machine reuses it.
# Concurrent callers serialise on a lock file; the build goes to a temp folder and is
# renamed into place, so a killed build never leaves a half-filled cache folder.
set -euo pipefail

K8S_VERSION=v1.34.4
ETCD_VERSION=v3.6.4
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${PDUNIT_CACHE:-$HOME/.cache/pdunit}/envtest"
DEST="$CACHE_ROOT/${K8S_VERSION#v}-etcd${ETCD_VERSION#v}"
BINARIES=(kube-apiserver etcd kubectl)

log() { echo "envtest: $*" >&2; }

has_all() {
  local dir="$1" b
  for b in "${BINARIES[@]}"; do
    [[ -x "$dir/$b" ]] || return 1
  done
}

if [[ -n "${KUBEBUILDER_ASSETS:-}" ]]; then
  if has_all "$KUBEBUILDER_ASSETS"; then
    echo "$KUBEBUILDER_ASSETS"
    exit 0
  fi
  log "KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS lacks one of: ${BINARIES[*]}; using/building $DEST instead"
fi

# The stamp ties the cached binaries to the exact module graph that built them.
stamp="$(cat "$HERE/go.mod" "$HERE/go.sum" | sha256sum | cut -c1-16)"
if has_all "$DEST" && [[ "$(cat "$DEST/.stamp" 2>/dev/null)" == "$stamp" ]]; then
  echo "$DEST"
  exit 0
fi

command -v go >/dev/null || {
  log "no Go toolchain on PATH and no cached binaries in $DEST;" \
      "install Go >= 1.24 or set KUBEBUILDER_ASSETS to a folder with ${BINARIES[*]}"
  exit 1
}

mkdir -p "$CACHE_ROOT"
exec 9>"$CACHE_ROOT/.lock"
log "waiting for the build lock $CACHE_ROOT/.lock"
flock 9
# Another caller may have finished the build while we waited.
if has_all "$DEST" && [[ "$(cat "$DEST/.stamp" 2>/dev/null)" == "$stamp" ]]; then
  echo "$DEST"
  exit 0
fi

tmp="$(mktemp -d "$CACHE_ROOT/.build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

# Version stamps as Kubernetes' own hack/lib/version.sh sets them: without them the
# apiserver reports v0.0.0-master, and helm refuses charts with a kubeVersion constraint.
minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
ldv=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldv+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldv+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

start=$(date +%s)
cd "$HERE"
export CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
for target in kube-apiserver kubectl; do
  log "building $target $K8S_VERSION (first time only; slow on few cores)"
  go build -trimpath -ldflags "-s -w$ldv" -o "$tmp/$target" "k8s.io/kubernetes/cmd/$target"
done
log "building etcd $ETCD_VERSION"
go build -trimpath -ldflags "-s -w" -o "$tmp/etcd" go.etcd.io/etcd/server/v3

"$tmp/kube-apiserver" --version >&2
"$tmp/etcd" --version >&2
echo "$stamp" > "$tmp/.stamp"
rm -rf "$DEST"
mv "$tmp" "$DEST"
trap - EXIT
chmod 755 "$DEST"
log "built in $(( $(date +%s) - start ))s into $DEST"
echo "$DEST"
