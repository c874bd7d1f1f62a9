#!/usr/bin/env bash
# Installs the Debian 12 packages kvbridge builds and tests with. Idempotent: a
# package already present is skipped, and apt-get is not touched when nothing is missing.
set -euo pipefail
PKGS=(
  build-essential cmake ninja-build pkg-config git python3 curl iproute2 procps
  clang-14 libclang-rt-14-dev clang-format
  libgtest-dev libgmock-dev googletest libbenchmark-dev librapidcheck-dev
  nlohmann-json3-dev libcpp-httplib-dev libspdlog-dev libfmt-dev libcli11-dev
  libtomlplusplus-dev libxxhash-dev libmsgpack-cxx-dev libeigen3-dev libboost-dev libopenblas-dev
  libucx-dev ucx-utils libssl-dev zlib1g-dev nginx-light
  libpcre2-dev libicu-dev nodejs
  python3-jinja2
  etcd-server etcd-client
  prometheus python3-matplotlib
)
missing=()
# npm: Debian's package, unless the installed nodejs already brings it (NodeSource's does, and
# conflicts with Debian's npm).
command -v npm >/dev/null 2>&1 || PKGS+=(npm)
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-deps: installing ${missing[*]}"
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install-deps: all ${#PKGS[@]} packages present"
fi
