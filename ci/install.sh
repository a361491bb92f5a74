#!/usr/bin/env bash
# The one install script: the README's commands, CI and the Dockerfiles all run this, so every install
# step an image takes is one CI has taken too.
#
#   ci/install.sh [--browser] [--squid] [--redis] [--lab] [--images] [--bench] [--all] [--python] [--no-venv] [--venv=DIR]
#
# Always: find a Python >= 3.12 (mitmproxy 12 needs it; as root, Debian's python3 is installed when there is
# none), make a venv, pip-install egresswall into it.
# --browser: Debian's chromium (Playwright drives it; nothing downloads a browser build).
# --squid:   Debian's squid (benchmarks and the differential test compare against it).
# --redis:   Debian's redis-server (the shared session store's tests start their own on loopback).
# --lab:     iproute2, nftables and tcpdump for the network-namespace containment lab, and Debian's python3
#            (the lab's probes run as other users, who cannot execute a Python under root's home).
# --images:  mmdebstrap and buildah, which build the images from compose/Dockerfile.* (ci/images.sh).
# --bench:   squid, nginx-light, wrk and curl for the side-by-side benchmarks (make bench, make bench-pageload).
# --python:  with --no-venv: still find (or install) the Python, so a Dockerfile can take that step apart.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="${EGRESSWALL_VENV:-$here/.venv}"
want_venv=1
want_python=0
apt_packages=()

for arg in "$@"; do
  case "$arg" in
    --browser) apt_packages+=(chromium fonts-liberation) ;;
    --squid) apt_packages+=(squid) ;;
    --redis) apt_packages+=(redis-server) ;;
    --lab) apt_packages+=(iproute2 nftables tcpdump python3) ;;
    --images) apt_packages+=(mmdebstrap buildah) ;;
    --bench) apt_packages+=(squid nginx-light wrk curl) ;;
    --all) apt_packages+=(chromium fonts-liberation squid nginx-light iproute2 nftables tcpdump python3 redis-server) ;;
    --no-venv) want_venv=0 ;;
    --python) want_python=1 ;;
    --venv=*) venv="${arg#--venv=}" ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done

say() { printf 'install: %s\n' "$*" >&2; }

install_debian_packages() {
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -ne 0 ]; then
    say "missing Debian packages: ${missing[*]} (run as root, or install them first)"; exit 1
  fi
  say "apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# Prints the path of the first Python >= 3.12 it finds; the machine's default python3 may be older.
find_python() {
  local candidates=()
  [ -n "${EGRESSWALL_PYTHON:-}" ] && candidates+=("$EGRESSWALL_PYTHON")
  for name in python3.14 python3.13 python3.12 python3; do
    command -v "$name" >/dev/null 2>&1 && candidates+=("$(command -v "$name")")
  done
  for dir in /root/.pyenv/versions/3.1[2-9]* "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]* \
             /usr/local/bin /usr/bin; do
    for exe in "$dir"/bin/python3 "$dir"/python3.1[2-9]; do
      [ -x "$exe" ] && candidates+=("$exe")
    done
  done
  for exe in "${candidates[@]}"; do
    if "$exe" -c 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
      echo "$exe"; return 0
    fi
  done
  return 1
}

[ ${#apt_packages[@]} -gt 0 ] && install_debian_packages "${apt_packages[@]}"

if [ "$want_venv" -eq 1 ] || [ "$want_python" -eq 1 ]; then
  python=$(find_python) || {
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
      install_debian_packages python3 python3-venv; python=$(find_python) || true
    fi
    [ -n "${python:-}" ] || { say "no Python >= 3.12 found; set EGRESSWALL_PYTHON=/path/to/python3.12"; exit 1; }
  }
fi

if [ "$want_venv" -eq 1 ]; then
  # Rebuild the venv when its Python is gone or too old; reinstall when pyproject.toml changed.
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
    say "creating $venv with $python"
    rm -rf "$venv"; "$python" -m venv "$venv"
  fi
  stamp="$venv/.egresswall-installed"
  want=$(cat "$here/pyproject.toml" | sha256sum | cut -d' ' -f1)
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    pip_options=(-q --disable-pip-version-check)
    # An image build's secret "build-ca" (ci/images.sh passes the build machine's CA bundle, for registries
    # reached through a TLS-inspecting proxy): pip trusts it for this install; no image keeps it.
    [ -s /run/secrets/build-ca ] && pip_options+=(--cert /run/secrets/build-ca)
    say "pip install -e $here[test]"
    "$venv/bin/python" -m pip install "${pip_options[@]}" -e "$here[test]"
    echo "$want" > "$stamp"
  fi
fi
