#!/bin/bash
# pdunit pod-isolation harness: run a command the way one container of a GPU pod sees
# the machine (NVIDIA device plugin + libnvidia-container), on a host where we are root.
#
#   pod_isolate.sh [--pidns] MINOR|all -- cmd...
#
#   MINOR   keep only /dev/nvidia<MINOR> (plus nvidiactl, nvidia-uvm*, nvidia-modeset) in a
#           private /dev, and show only that GPU under /proc/driver/nvidia/gpus
#           (params rewritten with ModifyDeviceFiles: 0 so the driver recreates nothing)
#   all     private mount namespace, every GPU visible (the proxy: NVIDIA_VISIBLE_DEVICES=all)
#   --pidns also a PID namespace of its own (a pod WITHOUT shareProcessNamespace);
#           without it the process stays in the caller's PID namespace, which P, D and the
#           proxy then share (shareProcessNamespace: true)
#
# Network, IPC and /dev/shm stay shared, as between the containers of one pod.
# CUDA_VISIBLE_DEVICES is NOT used: it hides GPUs from the runtime only, and IPC still
# works across it, so it does not reproduce a pod.
set -euo pipefail
PIDNS=0
if [ "${1:-}" = "--pidns" ]; then PIDNS=1; shift; fi
KEEP=${1:?usage: pod_isolate.sh [--pidns] MINOR|all -- cmd...}; shift
[ "${1:-}" = "--" ] && shift
HERE=$(cd "$(dirname "$0")" && pwd)
if [ "${PDUNIT_ISO_INNER:-}" != 1 ]; then
  export PDUNIT_ISO_INNER=1 PDUNIT_ISO_PIDNS=$PIDNS
  if [ $PIDNS = 1 ]; then
    exec unshare --mount --propagation private --pid --fork --kill-child --mount-proc -- \
      bash "$HERE/pod_isolate.sh" "$KEEP" -- "$@"
  fi
  exec unshare --mount --propagation private -- bash "$HERE/pod_isolate.sh" "$KEEP" -- "$@"
fi
unset PDUNIT_ISO_INNER CUDA_VISIBLE_DEVICES
log() { echo "[pod_isolate keep=$KEEP pidns=${PDUNIT_ISO_PIDNS:-0} pid=$$] $*" >&2; }

if [ "$KEEP" != all ]; then
  # 1. a private /dev: a tmpfs copy without the other GPUs' nodes
  STAGE=$(mktemp -d /tmp/pdunit-dev.XXXXXX)
  mount -t tmpfs -o mode=755,size=16m pdunit-dev "$STAGE"
  for node in /dev/*; do
    name=$(basename "$node")
    case "$name" in
      nvidia[0-9]*) [ "$name" = "nvidia$KEEP" ] || continue ;;
      nvidia-caps|char|shm|pts|mqueue|hugepages) continue ;;
    esac
    cp -a "$node" "$STAGE/" 2>/dev/null || true
  done
  # the pod's shared mounts under /dev stay the same mounts (shm: same POSIX shm objects)
  for sub in shm pts mqueue hugepages; do
    if mountpoint -q "/dev/$sub"; then mkdir -p "$STAGE/$sub"; mount --rbind "/dev/$sub" "$STAGE/$sub"; fi
  done
  mount --move "$STAGE" /dev
  rmdir "$STAGE" 2>/dev/null || true
  # 2. /proc/driver/nvidia shows only our GPU
  PNV=/proc/driver/nvidia
  if [ -d $PNV/gpus ]; then
    SAVE=$(mktemp -d /tmp/pdunit-pnv.XXXXXX)
    mount --bind $PNV "$SAVE"
    OWN=""
    for g in "$SAVE"/gpus/*; do
      minor=$(sed -n 's/^Device Minor:[[:space:]]*//p' "$g/information")
      [ "$minor" = "$KEEP" ] && OWN=$(basename "$g")
    done
    [ -n "$OWN" ] || { log "no GPU with minor $KEEP"; exit 3; }
    mount -t tmpfs -o mode=555 pdunit-pnv $PNV
    for f in params version registry; do [ -e "$SAVE/$f" ] && cat "$SAVE/$f" > $PNV/$f; done
    [ -e $PNV/params ] && sed -i 's/^ModifyDeviceFiles: 1/ModifyDeviceFiles: 0/' $PNV/params
    mkdir -p "$PNV/gpus/$OWN"
    mount --bind "$SAVE/gpus/$OWN" "$PNV/gpus/$OWN"
    umount -l "$SAVE"; rmdir "$SAVE" 2>/dev/null || true
  fi
  log "devices: $(ls /dev | grep nvidia | tr '\n' ' ') gpus: $(ls $PNV/gpus 2>/dev/null | tr '\n' ' ')"
else
  log "all GPUs visible: $(ls /dev | grep -c '^nvidia[0-9]') device nodes"
fi
exec "$@"
