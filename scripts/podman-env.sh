# SPDX-License-Identifier: Apache-2.0
# Sourced by scripts/image.sh and scripts/image-test.sh: podman with the
# project's own configuration (nothing in /etc changes) and the Debian base
# images made on the spot when missing (debootstrap from this machine's apt
# mirror; no registry is reached).
#
# This VM needs, before any container starts: nofile and nproc ulimits root
# may set (the hard limits; nproc at most pid_max), runc (crun refuses the hybrid cgroups) and the
# cgroupfs manager; with no systemd, health checks run by hand (`podman
# healthcheck run`: start containers with --health-interval=disable).
# CONTAINERS_CONF points at that file.

microd_podman_setup() {
  local root="$1"
  if [[ $(id -u) -ne 0 ]]; then
    echo "podman here runs as root (rootful): run as root" >&2
    return 1
  fi
  if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null; then
    bash "$root/scripts/install-deps.sh" --image
  fi
  PODMAN_DIR="${PODMAN_DIR:-$root/build/podman}"
  mkdir -p "$PODMAN_DIR"
  local nofile nproc
  nofile=$(ulimit -Hn)
  nproc=$(ulimit -Hu)
  # runc refuses an nproc limit above pid_max here (32768 on this VM).
  local pid_max
  pid_max=$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo 32768)
  if [[ $nproc == unlimited ]] || (( nproc > pid_max )); then nproc=$pid_max; fi
  [[ $nofile == unlimited ]] && nofile=1048576
  cat >"$PODMAN_DIR/containers.conf" <<CONF
# Written by scripts/podman-env.sh for the project's image commands.
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"

[network]
network_backend = "netavark"
CONF
  export CONTAINERS_CONF="$PODMAN_DIR/containers.conf"
}

# debian:bookworm and debian:bookworm-slim, when podman has not got them.
microd_base_images() {
  if podman image exists debian:bookworm && podman image exists debian:bookworm-slim; then
    return 0
  fi
  local mirror rootfs
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  mirror="${mirror:-http://deb.debian.org/debian}"
  rootfs=$(mktemp -d /var/tmp/microd-rootfs.XXXXXX)
  echo "image: debootstrap --variant=minbase bookworm from $mirror"
  if ! debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$PODMAN_DIR/debootstrap.log" 2>&1; then
    echo "debootstrap failed (see $PODMAN_DIR/debootstrap.log)" >&2
    rm -rf "$rootfs"
    return 1
  fi
  # The same mirror and apt settings inside as here, but not the docker-*
  # cache cleaning of official images: the Dockerfile must clean up itself.
  cp /etc/apt/sources.list.d/*.sources "$rootfs/etc/apt/sources.list.d/" 2>/dev/null || true
  [[ -f /etc/apt/sources.list ]] && cp /etc/apt/sources.list "$rootfs/etc/apt/"
  local f
  for f in /etc/apt/apt.conf.d/*; do
    case "$(basename "$f")" in docker-*) ;; *) cp "$f" "$rootfs/etc/apt/apt.conf.d/" ;; esac
  done
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
    "$rootfs"/var/cache/apt/archives/*.deb
  tar -C "$rootfs" -c . | podman import --change 'CMD ["bash"]' - debian:bookworm >/dev/null
  rm -rf "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
    "$rootfs"/usr/share/locale/*
  tar -C "$rootfs" -c . | podman import --change 'CMD ["bash"]' - debian:bookworm-slim >/dev/null
  rm -rf "$rootfs"
  podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep debian
}
