#!/usr/bin/env bash
# Build .vllm_bundle/ (git-ignored): vLLM 0.33.0's pure-Python files and the wheels they import, for
# a GPU machine with torch / triton / numpy / transformers but no vLLM and no package index
# (bench/step_tables.py measures vLLM's own table builders there; docs/gpu.md says how).
#   bash bench/vllm_bundle/make.sh      (needs .venv-vllm: `make test-vllm` builds it)
# On the GPU machine: carry .vllm_bundle, then `source .vllm_bundle/setup_env.sh` before the run.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=.vllm_bundle
grep -qx '/.vllm_bundle/' .git/info/exclude 2>/dev/null || echo '/.vllm_bundle/' >> .git/info/exclude
SITE=$(.venv-vllm/bin/python -c 'import os, vllm; print(os.path.dirname(os.path.dirname(vllm.__file__)))')
rm -rf "$OUT" && mkdir -p "$OUT/wheels"
cp bench/vllm_bundle/setup_env.sh bench/vllm_bundle/vllm_bootstrap.py bench/vllm_bundle/check_imports.py "$OUT/"
# every .py of the package, and its dist-info (platform detection reads version("vllm"))
(cd "$SITE" && { find vllm -name '*.py' -o -name py.typed; find vllm-0.33.0.dist-info -type f ! -name RECORD; } \
  | tar -cJf - -T -) > "$OUT/vllm_py.tar.xz"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  -d "$OUT/wheels" -r bench/vllm_bundle/requirements.txt
du -sh "$OUT"
