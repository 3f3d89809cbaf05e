#!/usr/bin/env bash
# What `make image-test` needs on a Debian machine without a Docker daemon: podman/buildah and
# debootstrap (to make the base image locally). Root, apt-get; does nothing when podman is there.
set -euo pipefail
command -v podman >/dev/null && command -v debootstrap >/dev/null && exit 0
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends podman buildah debootstrap runc fuse-overlayfs \
  slirp4netns uidmap netavark aardvark-dns
