#!/usr/bin/env bash
# Build .sglang_bundle/ (git-ignored): SGLang 0.5.23's .py files and the wheels that the GPU test
# (tests/integrations/sglang/test_sglang_mamba2_gpu_real.py) and bench/sglang_mamba2.py import,
# for a GPU machine with torch / triton / numpy / transformers but no SGLang and no package index.
#   bash bench/sglang_bundle/make.sh      (needs .venv-sglang: `make test-sglang` builds it)
# requirements.txt: the distributions those imports load (check_imports.py lists them) that the
# GPU machine's image lacks (docs/gpu.md), pinned to .venv-sglang's versions.
# On the GPU machine: carry .sglang_bundle, then `source .sglang_bundle/setup_env.sh` before the run.
set -euo pipefail
cd "$(dirname "$0")/../.."
D=bench/sglang_bundle
# sglang.kernels.jit (imported by the Mamba SSD ops) checks at import that its JIT sources are there
export BUNDLE_DATA="sglang/kernels/jit/include sglang/kernels/jit/csrc"
exec bash bench/bundle/build.sh sglang .venv-sglang/bin/python $D/requirements.txt $D/sglang_bootstrap.py $D/check_imports.py
