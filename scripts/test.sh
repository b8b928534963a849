#!/usr/bin/env bash
# Builds blade twice (release, and debug with AddressSanitizer + UBSan) and runs the whole
# test suite under ctest in each.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

# ctest shows only failing tests' output, so the lines in which passing tests say what they
# left out on this machine ("SKIPPED: AVX-512 not supported by this CPU: ...", cmocka's
# "[  SKIPPED ]") are listed after each run.
report_skips() {
    local log="$1/Testing/Temporary/LastTest.log"
    [ -f "$log" ] || return 0
    local lines
    lines=$(awk '/^[0-9]+\/[0-9]+ Testing: / { test = $3 }
                 /^SKIPPED: |^\[  SKIPPED \] [A-Za-z0-9_]+$/ && !seen[test $0]++ { print "  " test ": " $0 }' "$log")
    if [ -n "$lines" ]; then
        echo "Not tested in $1 on this machine:"
        echo "$lines"
    fi
}

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$jobs"
status=0
ctest --test-dir build --output-on-failure -j "$jobs" || status=$?
report_skips build
[ "$status" -eq 0 ] || exit "$status"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DBLADE_SANITIZE=ON >/dev/null
cmake --build build-asan -j "$jobs"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --test-dir build-asan --output-on-failure -j "$jobs" ||
    status=$?
report_skips build-asan
exit "$status"
