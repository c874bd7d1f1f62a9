#!/usr/bin/env bash
# Builds every libFuzzer target with clang (build dir build-fuzz, -DKVBRIDGE_FUZZ=ON), replays
# each target's corpus fuzz/corpus/<target>/, then fuzzes all targets for at most
# FUZZ_SECONDS (default 60) in total. Fuzz targets are executables named <name>_fuzz that land
# in build-fuzz/fuzz/ (see src/model/CMakeLists.txt); new modules just follow the convention.
# Usage: scripts/fuzz.sh        env: FUZZ_SECONDS=60 CC=clang-14 CXX=clang++-14 JOBS=2
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=build-fuzz
FUZZ_SECONDS=${FUZZ_SECONDS:-60}
JOBS=${JOBS:-$(nproc)}
export CC=${CC:-clang-14} CXX=${CXX:-clang++-14}
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVBRIDGE_FUZZ=ON \
  -DKVBRIDGE_BUILD_TESTS=OFF -DKVBRIDGE_BUILD_BENCHMARKS=OFF -DKVBRIDGE_WITH_CUDA=OFF \
  -DCMAKE_C_FLAGS="-fsanitize=fuzzer-no-link $SAN" -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link $SAN" \
  >/dev/null
mapfile -t TARGETS < <(ninja -C "$BUILD" -t targets all | sed -n 's/^\([A-Za-z0-9_]*_fuzz\): phony$/\1/p' | grep -v '^cmake_' | sort -u)
if ((${#TARGETS[@]} == 0)); then
  echo "fuzz: no *_fuzz targets found"; exit 1
fi
echo "fuzz: targets: ${TARGETS[*]}"
cmake --build "$BUILD" -j"$JOBS" --target "${TARGETS[@]}"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1
per=$((FUZZ_SECONDS / ${#TARGETS[@]}))
((per < 1)) && per=1
status=0
for t in "${TARGETS[@]}"; do
  bin="$BUILD/fuzz/$t"
  [[ -x "$bin" ]] || { echo "fuzz: $bin missing (targets must set RUNTIME_OUTPUT_DIRECTORY \${CMAKE_BINARY_DIR}/fuzz)"; status=1; continue; }
  corpus="fuzz/corpus/$t"
  mkdir -p "$corpus"
  echo "=== fuzz $t: replay $(find "$corpus" -type f | wc -l) corpus inputs"
  # Replay the committed corpus (each input once), then fuzz into a scratch copy so the
  # committed corpus only changes when someone adds inputs on purpose.
  "$bin" -runs=0 "$corpus" || { echo "fuzz: $t failed on its corpus"; status=1; continue; }
  scratch="$BUILD/corpus/$t"
  mkdir -p "$scratch"
  echo "=== fuzz $t: ${per}s"
  "$bin" -max_total_time="$per" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
    -artifact_prefix="$BUILD/$t-" "$scratch" "$corpus" 2>&1 | tail -n 5 \
    || { echo "fuzz: $t found a crash (see $BUILD/$t-*)"; status=1; }
done
exit $status
