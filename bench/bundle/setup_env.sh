# Source me (bash):  source .vllm_bundle/setup_env.sh
# Unpacks the vLLM 0.33.0 .py tree, installs the bundled wheels into a private
# target dir (no index, no deps), and exports PYTHONPATH so that
#   import vllm_bootstrap; from vllm.v1.attention.backends... import ...
# works with the host's own torch / triton / numpy / transformers.
# Knobs: PYTHON (default python3), VLLM_BUNDLE_RT (default /tmp/vllm_bundle_rt),
#        VLLM_BUNDLE_WHEELS (default <bundle>/wheels).
_vb_dir="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")" && pwd)"
_vb_rt="${VLLM_BUNDLE_RT:-/tmp/vllm_bundle_rt}"
_vb_py="${PYTHON:-python3}"
_vb_whl="${VLLM_BUNDLE_WHEELS:-$_vb_dir/wheels}"
if [ ! -f "$_vb_rt/.ok" ]; then
  rm -rf "$_vb_rt" && mkdir -p "$_vb_rt/py" "$_vb_rt/site" || return 1 2>/dev/null || exit 1
  tar -xJf "$_vb_dir/vllm_py.tar.xz" -C "$_vb_rt/py" || return 1 2>/dev/null || exit 1
  if "$_vb_py" -m pip --version >/dev/null 2>&1; then
    "$_vb_py" -m pip install -q --no-index --no-deps --disable-pip-version-check \
      --target "$_vb_rt/site" "$_vb_whl"/*.whl || return 1 2>/dev/null || exit 1
  else  # no pip: wheels here have no .data dirs, so a plain unzip is equivalent
    "$_vb_py" -c 'import sys,zipfile;[zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
      "$_vb_rt/site" "$_vb_whl"/*.whl || return 1 2>/dev/null || exit 1
  fi
  touch "$_vb_rt/.ok"
fi
export PYTHONPATH="$_vb_dir:$_vb_rt/site:$_vb_rt/py${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
unset _vb_dir _vb_rt _vb_py _vb_whl
