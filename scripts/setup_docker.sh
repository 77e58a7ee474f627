#!/usr/bin/env bash
# Set up the sandbox backends on a Debian machine; safe to run again (each step is skipped when done).
#   1. apt-get install docker.io (ships docker-init for init=True), bubblewrap, debootstrap (only those missing)
#   2. start dockerd without iptables or a bridge (containers use network_mode=none), log to a file,
#      and wait (bounded) until `docker info` answers
#   3. build the base sandbox image offline (debootstrap + docker import) unless it exists
# Environment: RELAX_SANDBOX_IMAGE (default relax-agent/python:bookworm), RELAX_DOCKERD_LOG
# (default /var/log/relax-dockerd.log), RELAX_DOCKERD_WAIT_S (default 60), PYTHON (interpreter
# with relax-agent installed, used when the relax-agent command is not on PATH).
set -euo pipefail

IMAGE="${RELAX_SANDBOX_IMAGE:-relax-agent/python:bookworm}"
LOG="${RELAX_DOCKERD_LOG:-/var/log/relax-dockerd.log}"
WAIT_S="${RELAX_DOCKERD_WAIT_S:-60}"
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

log() { echo "[setup_docker] $*"; }

missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if [ "${#missing[@]}" -gt 0 ]; then
  log "installing ${missing[*]}"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}"
else
  log "docker.io, bubblewrap and debootstrap already installed"
fi

docker_up() { timeout 10 docker info >/dev/null 2>&1; }

if docker_up; then
  log "dockerd already answers"
else
  if ! pgrep -x dockerd >/dev/null 2>&1; then
    log "starting dockerd (log: $LOG)"
    $SUDO mkdir -p "$(dirname "$LOG")"
    $SUDO sh -c "nohup dockerd --iptables=false --ip6tables=false --bridge=none >>'$LOG' 2>&1 &"
  fi
  deadline=$((SECONDS + WAIT_S))
  until docker_up; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      log "dockerd did not answer within ${WAIT_S}s; last log lines:"
      tail -n 30 "$LOG" >&2 || true
      exit 1
    fi
    sleep 1
  done
  log "dockerd is up"
fi

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  log "image $IMAGE already exists"
else
  log "building $IMAGE (debootstrap, ~30 s)"
  if command -v relax-agent >/dev/null 2>&1; then
    relax-agent sandbox build-image --image "$IMAGE"
  else
    "${PYTHON:-python3}" -c 'import sys; from relax_agent.sandboxes.cli import app; sys.argv[0] = "sandbox"; app()' \
      build-image --image "$IMAGE"
  fi
fi
log "ready: docker $(docker version --format '{{.Server.Version}}'), bwrap $(bwrap --version | cut -d' ' -f2), image $IMAGE"
