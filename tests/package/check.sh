#!/usr/bin/env bash
# Installs the build tree ($1) to a temporary prefix and builds tests/package against it.
set -euo pipefail
build=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
# The top CMakeLists.txt takes Highway from third_party when present (the GPU machine has no
# other); a consumer of the package needs the same hint.
deps=()
hwy_dir="$(cd "$(dirname "$0")/../.." && pwd)/third_party/hwy/lib/x86_64-linux-gnu/cmake/hwy"
[ -d "$hwy_dir" ] && deps+=("-Dhwy_DIR=$hwy_dir")
cmake -S "$(dirname "$0")" -B "$tmp/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$tmp/prefix" \
  "${deps[@]}" >/dev/null
cmake --build "$tmp/consumer" >/dev/null
"$tmp/consumer/consumer"
