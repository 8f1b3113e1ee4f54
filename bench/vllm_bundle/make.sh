#!/usr/bin/env bash
# Build .vllm_bundle/ (git-ignored): vLLM 0.33.0's pure-Python files and the wheels they import, for
# a GPU machine with torch / triton / numpy / transformers but no vLLM and no package index
# (bench/step_tables.py measures vLLM's own table builders there; docs/gpu.md says how).
#   bash bench/vllm_bundle/make.sh      (needs .venv-vllm: `make test-vllm` builds it)
# On the GPU machine: carry .vllm_bundle, then `source .vllm_bundle/setup_env.sh` before the run.
set -euo pipefail
cd "$(dirname "$0")/../.."
D=bench/vllm_bundle
exec bash bench/bundle/build.sh vllm .venv-vllm/bin/python $D/requirements.txt $D/vllm_bootstrap.py $D/vllm_c_standins.py \
  $D/check_imports.py
