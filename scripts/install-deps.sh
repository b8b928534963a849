#!/usr/bin/env bash
# Installs the Debian packages blade builds and tests with, skipping the ones already present.
set -euo pipefail
packages=(build-essential cmake ninja-build pkg-config clang libpcre2-dev libcmocka-dev libssl-dev libjansson-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
