#!/usr/bin/env bash
# Installs the Debian packages blade builds and tests with, skipping the ones already present.
set -euo pipefail
packages=(build-essential cmake ninja-build pkg-config clang libpcre2-dev libcmocka-dev libssl-dev libjansson-dev libmicrohttpd-dev libcurl4-openssl-dev libsqlite3-dev libhnswlib-dev)
# Clusters: UCX moves KV blocks between workers; the discovery tests start their own etcd;
# the transport tests build private networks with `ip netns`.
packages+=(libucx-dev etcd-server iproute2)
missing=()
# The OpenAI SDK tests need Node.js; a Node.js from elsewhere (with its own npm) is kept.
if ! command -v node >/dev/null; then
  packages+=(nodejs npm)
elif ! command -v npm >/dev/null; then
  packages+=(npm)
fi
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
# The SDK itself, pinned by tests/node/package-lock.json; reinstalled only when the lock changes.
node_dir="$(dirname "$0")/../tests/node"
if [ ! -f "$node_dir/node_modules/.package-lock.json" ] || [ "$node_dir/package-lock.json" -nt "$node_dir/node_modules/.package-lock.json" ]; then
  echo "installing the Node.js test dependencies (npm ci in tests/node)"
  (cd "$node_dir" && npm ci --no-audit --no-fund --loglevel=error)
fi
