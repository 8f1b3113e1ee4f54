#!/usr/bin/env bash
# Build a git-ignored .py bundle of an engine for a GPU machine with torch / triton / numpy /
# transformers but no engine and no package index (bench/vllm_bundle/make.sh,
# bench/sglang_bundle/make.sh call this; docs/gpu.md says how the bundles are used).
#   bash bench/bundle/build.sh NAME VENV_PYTHON REQUIREMENTS [FILE...]   (paths from the repo root)
# Writes .NAME_bundle/ (BUNDLE_OUT overrides): NAME_py.tar.xz (every .py of the installed package
# NAME and its dist-info, read from VENV_PYTHON's site-packages), wheels/ (cp312 manylinux wheels of
# REQUIREMENTS, downloaded from PyPI by name, no deps), setup_env.sh, the shared Python helpers of
# bench/bundle/ and FILE... (the bundle's bootstrap and smoke test). BUNDLE_DATA: folders of the
# package (paths from site-packages) to pack whole, for data files its imports read.
set -euo pipefail
NAME=$1 VPY=$2 REQ=$3
shift 3
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."  # the callers give paths from here
OUT=${BUNDLE_OUT:-.${NAME}_bundle}
case $OUT in .*_bundle) grep -qx "/$OUT/" .git/info/exclude 2>/dev/null || echo "/$OUT/" >> .git/info/exclude ;; esac
read -r SITE VERSION < <("$VPY" -c 'import os, sys, importlib, importlib.metadata as m
n = sys.argv[1]; p = importlib.import_module(n)
print(os.path.dirname(os.path.dirname(p.__file__)), m.version(n))' "$NAME")
rm -rf "$OUT" && mkdir -p "$OUT/wheels"
cp "$HERE/setup_env.sh" "$HERE"/*.py "$@" "$OUT/"
# every .py of the package, and its dist-info (version checks read importlib.metadata.version)
(cd "$SITE" && { find "$NAME" -name '*.py' -o -name py.typed; find "$NAME-$VERSION.dist-info" -type f ! -name RECORD
  for d in ${BUNDLE_DATA:-}; do find "$d" -type f ! -name '*.pyc' ! -name '*.so'; done; } \
  | tar -cJf - -T -) > "$OUT/${NAME}_py.tar.xz"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  -d "$OUT/wheels" -r "$REQ"
du -sh "$OUT"
