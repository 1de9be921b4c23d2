#!/usr/bin/env bash
# A local stand-in for the images' Python bases, for building them where no registry
# answers (tests/images/test_images.py): Debian bookworm (debootstrap --variant=minbase)
# with python3 and a venv at /opt/python first on PATH, so `python` and `pip` work as in
# python:3.12-slim. The rootfs tarball is built once into $PDUNIT_CACHE/images; each call
# imports it as $PDUNIT_BASE_IMAGE when the storage lacks it.
#   BUILDAH='buildah --root DIR --storage-driver vfs' bash tools/images/local-base.sh
# Needs root, debootstrap, buildah and deb.debian.org (or DEBIAN_MIRROR).
set -euo pipefail
BUILDAH=${BUILDAH:-buildah}
PDUNIT_CACHE=${PDUNIT_CACHE:-$HOME/.cache/pdunit}
SUITE=${DEBIAN_SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
ARCH=$(dpkg --print-architecture)
IMAGE=${PDUNIT_BASE_IMAGE:-localhost/pdunit-base:$SUITE}
DIR=$PDUNIT_CACHE/images
TAR=$DIR/base-$SUITE-$ARCH.tar
mkdir -p "$DIR"

if [ ! -s "$TAR" ]; then
  root=$(mktemp -d "$DIR/rootfs.XXXXXX")
  trap 'rm -rf "$root"' EXIT
  debootstrap --variant=minbase --arch="$ARCH" --include=python3,python3-venv,ca-certificates \
    "$SUITE" "$root" "$MIRROR" >&2
  chroot "$root" /usr/bin/python3 -m venv /opt/python
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/*
  tar -C "$root" --numeric-owner -cf "$TAR.tmp" .
  mv "$TAR.tmp" "$TAR"
fi

if ! $BUILDAH inspect --type image "$IMAGE" >/dev/null 2>&1; then
  ctr=$($BUILDAH from scratch)
  $BUILDAH add "$ctr" "$TAR" / >/dev/null
  $BUILDAH config --os linux --arch "$ARCH" \
    --env PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd python "$ctr"
  $BUILDAH commit --rm "$ctr" "$IMAGE" >/dev/null
fi
echo "$IMAGE"
