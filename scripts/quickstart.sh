#!/usr/bin/env bash
# The main job of README.md's quick start: installs packages, builds, makes the default model,
# brings up a 1p3d P/D topology (READ mode, prefix caching off), drives it with
# `kvbridge bench --best-of-n 8` over several concurrency levels, checks that every instance
# drains, and stops the topology. Exit 0 only when every request succeeded and everything drained.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}
scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j"$JOBS" --target kvbridge
exec scripts/main_job.sh "$@"
