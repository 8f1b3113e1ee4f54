#!/usr/bin/env bash
# Rehearse a bundle's run on this CPU machine, as the lent GPU machine would import it: the
# engine's unpacked .py tree only (no compiled extensions), the image's packages
# (image_packages.txt) and the bundle's wheels (its requirements.txt) importable, nothing else of
# the venv (rehearse/sitecustomize.py). One GPU call saved per missing wheel or stray import.
#   bash bench/bundle/rehearse.sh NAME VENV_PYTHON [python args...]
#   e.g. bash bench/bundle/rehearse.sh vllm .venv-vllm/bin/python bench/vllm_builders.py --out /tmp/o --rounds 2
# NAME's bundle (.NAME_bundle, bench/NAME_bundle/make.sh) must exist. REHEARSE_FAKE_CUDA=1: torch
# and Triton believe in a GPU (import paths only). REHEARSE_ALSO: more distribution names to allow
# (this venv's versions may import what the image's do not). Triton comes from the repo's .venv.
# Always allowed besides: chunkmeta, and what the local venvs' huggingface_hub 2.x imports where
# the image's 1.33 imports httpx (httpx2, httpcore2, truststore).
set -euo pipefail
NAME=$1 VPY=$2
shift 2
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUNDLE=$ROOT/.${NAME}_bundle
[ -f "$BUNDLE/${NAME}_py.tar.xz" ] || { echo "rehearse: no $BUNDLE (bash bench/${NAME}_bundle/make.sh)" >&2; exit 2; }
RT=${REHEARSE_RT:-/tmp/chunkmeta_rehearse_$NAME}
STAMP=$(stat -c %Y "$BUNDLE/${NAME}_py.tar.xz")
if [ "$(cat "$RT/.stamp" 2>/dev/null)" != "$STAMP" ]; then
  rm -rf "$RT" && mkdir -p "$RT/py" "$RT/triton"
  tar -xJf "$BUNDLE/${NAME}_py.tar.xz" -C "$RT/py"
  for entry in "$ROOT"/.venv/lib/python*/site-packages/triton "$ROOT"/.venv/lib/python*/site-packages/triton-*.dist-info; do
    [ -e "$entry" ] && ln -s "$entry" "$RT/triton/"
  done
  echo "$STAMP" > "$RT/.stamp"
fi
export REHEARSE_ALLOWED="$ROOT/bench/bundle/image_packages.txt:$ROOT/bench/${NAME}_bundle/requirements.txt"
export REHEARSE_ALSO="chunkmeta httpx2 httpcore2 truststore ${REHEARSE_ALSO:-}"
export PYTHONPATH="$ROOT/bench/bundle/rehearse:$BUNDLE:$RT/py:$RT/triton:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
cd "$ROOT"
exec "$VPY" "$@"
