#!/usr/bin/env bash
# Release build of both images for several platforms with buildah, from the real bases
# (python:3.12-slim-bookworm, nvidia/cuda): one manifest list per image, $NAME:$IMAGE_TAG,
# pushed to $IMAGE_REGISTRY with PUSH=1 (`make images`; docs/images.md).
#   IMAGE_PLATFORMS  linux/amd64,linux/arm64   IMAGE_TAG  the chart's appVersion
#   IMAGES           unit operator             BUILD_ARGS extra buildah build arguments
# A platform other than the host's runs its RUN steps under qemu: install
# qemu-user-static (with binfmt_misc registered) first, or build each arch on its own host.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILDAH=${BUILDAH:-buildah}
PLATFORMS=${IMAGE_PLATFORMS:-linux/amd64,linux/arm64}
TAG=${IMAGE_TAG:-$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/pdunit/Chart.yaml)}
REGISTRY=${IMAGE_REGISTRY:-}
read -r -a extra <<< "${BUILD_ARGS:-}"

for name in ${IMAGES:-unit operator}; do
  list=pdunit/$name:$TAG
  # A rebuild starts a fresh list (buildah would add to the old one).
  $BUILDAH manifest rm "$list" >/dev/null 2>&1 || true
  $BUILDAH build --platform "$PLATFORMS" --manifest "$list" --layers \
    --ignorefile "images/$name/Dockerfile.dockerignore" -f "images/$name/Dockerfile" \
    "${extra[@]}" .
  if [ "${PUSH:-0}" = 1 ]; then
    [ -n "$REGISTRY" ] || { echo "PUSH=1 needs IMAGE_REGISTRY (e.g. registry.example.com)" >&2; exit 1; }
    $BUILDAH manifest push --all "$list" "docker://$REGISTRY/pdunit/$name:$TAG"
  fi
  echo "$list ($PLATFORMS)"
done
