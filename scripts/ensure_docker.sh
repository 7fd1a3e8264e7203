#!/usr/bin/env bash
# Makes a Docker engine reachable and the sandbox image present. Idempotent; safe to call from `make test`.
#   1. if `docker info` fails: start dockerd fully detached (setsid + nohup, stdin from /dev/null, log in
#      $AGENTRL_CACHE/dockerd.log) so that it outlives the calling shell, then wait until it answers;
#   2. build the offline sandbox image if missing (scripts/build_sandbox_image.sh).
# Exits non-zero with a message naming the log if the engine does not come up in $DOCKER_WAIT_S seconds.
# Usage: scripts/ensure_docker.sh [IMAGE]
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${AGENTRL_CACHE:-$HOME/.cache/agentrl}
WAIT_S=${DOCKER_WAIT_S:-60}
LOG=$CACHE/dockerd.log
mkdir -p "$CACHE"

docker_ok() { timeout 10 docker info >/dev/null 2>&1; }

if ! command -v docker >/dev/null 2>&1; then
  echo "agentrl: the docker client is missing: apt-get install -y docker.io (or run scripts/install_system.sh)" >&2
  exit 1
fi

if ! docker_ok; then
  DOCKERD=$(command -v dockerd || echo /usr/sbin/dockerd)
  [ -x "$DOCKERD" ] || { echo "agentrl: dockerd is missing: apt-get install -y docker.io" >&2; exit 1; }
  [ "$(id -u)" -eq 0 ] || { echo "agentrl: dockerd is not running and starting it needs root" >&2; exit 1; }
  # One starter at a time: a second caller waits for the first one's engine instead of starting another.
  exec 9>"$CACHE/dockerd.start.lock"
  flock -w "$WAIT_S" 9
  if ! docker_ok; then
    if pgrep -x dockerd >/dev/null 2>&1; then
      echo "agentrl: dockerd is running but not answering yet; waiting (log: $LOG)"
    else
      echo "agentrl: starting dockerd (log: $LOG)"
      setsid nohup "$DOCKERD" >>"$LOG" 2>&1 </dev/null 9>&- &  # 9>&-: dockerd must not hold the lock
      disown || true
    fi
    for _ in $(seq 1 $((WAIT_S * 4))); do
      docker_ok && break
      sleep 0.25
    done
    docker_ok || { echo "agentrl: dockerd did not answer within ${WAIT_S}s; last log lines:" >&2
                   tail -20 "$LOG" >&2 || true; exit 1; }
  fi
  flock -u 9
  exec 9>&-
fi
echo "agentrl: docker engine ready"
exec bash "$HERE/build_sandbox_image.sh" "$@"
