#!/usr/bin/env bash
# Builds the Docker sandbox image offline (no Docker Hub): a Debian bookworm root filesystem made with
# debootstrap --variant=minbase, then `docker import`. Two kinds:
#   default  python3 + numpy + sympy and the cpp and nodejs toolchains (g++, nodejs): agentrl-sandbox:bookworm
#   --slim   python3 + numpy + sympy only (Python and bash programs):                agentrl-sandbox:bookworm-slim
# AGENTRL_SANDBOX_PACKAGES adds Debian packages (comma-separated, e.g. default-jdk-headless,golang-go,rustc,
# node-typescript for the other languages; a new recipe, so a new image and tarball).
# Idempotent: does nothing if an image with this recipe exists; the rootfs tarball is cached outside the repo
# ($AGENTRL_CACHE, default ~/.cache/agentrl), so a rebuild after `docker rmi` takes seconds.
# Usage: scripts/build_sandbox_image.sh [--slim] [IMAGE]
# For machines with a registry, docker/Dockerfile builds an equivalent image.
set -euo pipefail
slim=0
if [ "${1:-}" = --slim ]; then slim=1; shift; fi
CACHE=${AGENTRL_CACHE:-$HOME/.cache/agentrl}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=python3-minimal,python3,python3-numpy,python3-sympy
if [ "$slim" = 1 ]; then
  IMAGE=${1:-agentrl-sandbox:bookworm-slim}
else
  IMAGE=${1:-${AGENTRL_SANDBOX_IMAGE:-agentrl-sandbox:bookworm}}
  PACKAGES=$PACKAGES,g++,nodejs
fi
[ -n "${AGENTRL_SANDBOX_PACKAGES:-}" ] && PACKAGES=$PACKAGES,$AGENTRL_SANDBOX_PACKAGES
RECIPE="bookworm-minbase-$PACKAGES-v1"
TARBALL=$CACHE/sandbox-rootfs-$(echo -n "$RECIPE" | sha256sum | cut -c1-12).tar

have_image() {
  [ "$(docker image inspect -f '{{ index .Config.Labels "agentrl.recipe" }}' "$IMAGE" 2>/dev/null)" = "$RECIPE" ]
}

if have_image; then
  echo "agentrl: docker image $IMAGE is up to date"
  exit 0
fi
mkdir -p "$CACHE"
exec 8>"$CACHE/sandbox-image.lock"  # one builder at a time; later callers find the image built
flock -w 900 8
if have_image; then echo "agentrl: docker image $IMAGE is up to date"; exit 0; fi

# Unmounts whatever debootstrap left mounted under $1 (proc, sys) before anything deletes or archives it:
# `rm -rf` through a live bind or proc mount must never happen.
unmount_under() {
  local m
  for m in $(awk -v root="$1/" 'index($2, root) == 1 { print $2 }' /proc/mounts | sort -r); do
    umount -l "$m" || true
  done
}

if [ ! -s "$TARBALL" ]; then
  command -v debootstrap >/dev/null 2>&1 || [ -x /usr/sbin/debootstrap ] || {
    echo "agentrl: debootstrap is missing: apt-get install -y debootstrap" >&2; exit 1; }
  [ "$(id -u)" -eq 0 ] || { echo "agentrl: debootstrap needs root to build $IMAGE" >&2; exit 1; }
  ROOTFS=$(mktemp -d "$CACHE/rootfs.XXXXXX")
  cleanup() { unmount_under "$ROOTFS"; rm -rf --one-file-system "$ROOTFS"; rm -f "$TARBALL.partial"; }
  trap cleanup EXIT
  echo "agentrl: debootstrap bookworm ($PACKAGES) into $ROOTFS (1-2 minutes; log: $CACHE/debootstrap.log)"
  if ! PATH=$PATH:/usr/sbin timeout 1200 debootstrap --variant=minbase --include="$PACKAGES" bookworm \
      "$ROOTFS" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1; then
    tail -20 "$CACHE/debootstrap.log" >&2
    echo "agentrl: debootstrap failed (log above); check that $MIRROR is reachable" >&2
    exit 1
  fi
  unmount_under "$ROOTFS"
  # Shrink: package caches, docs, man pages, locales.
  rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* \
    "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/locale/*
  tar --one-file-system --numeric-owner -C "$ROOTFS" \
    --exclude='./proc/*' --exclude='./sys/*' --exclude='./dev/*' -cf "$TARBALL.partial" .
  mv "$TARBALL.partial" "$TARBALL"
fi
echo "agentrl: importing $TARBALL as $IMAGE"
docker import \
  --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'USER 65534:65534' \
  --change 'WORKDIR /tmp' \
  --change "LABEL agentrl.recipe=$RECIPE" \
  "$TARBALL" "$IMAGE" >/dev/null
docker run --rm --network none "$IMAGE" python3 -c \
  "import numpy, sympy, shutil; print('agentrl: image $IMAGE ready: numpy', numpy.__version__, 'sympy', sympy.__version__,
  'toolchains:', ' '.join(t for t in ('g++', 'gcc', 'node', 'javac', 'go', 'rustc', 'tsc') if shutil.which(t)) or 'none')"
