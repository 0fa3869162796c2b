#!/usr/bin/env bash
# Checks for the system packages railyard's build and tests need and installs the missing
# ones with apt-get (as root, or through sudo). Quiet and fast when nothing is missing.
#
# Usage: scripts/deps.sh [extra-package ...]
set -euo pipefail

packages=(pkg-config libibverbs-dev librdmacm-dev libhwloc-dev libudev-dev libclang-dev clang iproute2
  libfabric-dev libfabric-bin openssl "$@")

missing=()
for pkg in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

install_line="apt-get install -y --no-install-recommends ${missing[*]}"
if [[ $(id -u) -eq 0 ]]; then
  sudo_cmd=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  sudo_cmd=(sudo)
else
  echo "railyard needs system packages that are missing. Install them with:" >&2
  echo "  sudo apt-get update && sudo $install_line" >&2
  exit 1
fi

echo "deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq >/dev/null
# shellcheck disable=SC2086
"${sudo_cmd[@]}" $install_line -qq >/dev/null
