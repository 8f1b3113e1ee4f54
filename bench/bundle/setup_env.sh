# Source me (bash):  source .vllm_bundle/setup_env.sh   (or .sglang_bundle/setup_env.sh)
# One script for every .py bundle that bench/bundle/build.sh makes: the bundle holds one
# <name>_py.tar.xz (the engine's .py tree) and wheels/. This unpacks the tree, installs the wheels
# into a private target dir (no index, no deps), and exports PYTHONPATH so that
#   import <name>_bootstrap; from <name>... import ...
# works with the host's own torch / triton / numpy / transformers.
# Knobs (NAME upper-cased: VLLM, SGLANG): PYTHON (default python3),
#   <NAME>_BUNDLE_RT (default /tmp/<name>_bundle_rt), <NAME>_BUNDLE_WHEELS (default <bundle>/wheels).
_vb_dir="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")" && pwd)"
_vb_tar=$(ls "$_vb_dir"/*_py.tar.xz 2>/dev/null | head -n 1)
[ -n "$_vb_tar" ] || { echo "setup_env.sh: no *_py.tar.xz in $_vb_dir" >&2; return 1 2>/dev/null || exit 1; }
_vb_name=$(basename "$_vb_tar" _py.tar.xz)
_vb_knob=$(echo "$_vb_name" | tr '[:lower:]' '[:upper:]')_BUNDLE
_vb_rt=$(eval echo "\${${_vb_knob}_RT:-/tmp/${_vb_name}_bundle_rt}")
_vb_whl=$(eval echo "\${${_vb_knob}_WHEELS:-$_vb_dir/wheels}")
_vb_py="${PYTHON:-python3}"
if [ ! -f "$_vb_rt/.ok" ]; then
  rm -rf "$_vb_rt" && mkdir -p "$_vb_rt/py" "$_vb_rt/site" || return 1 2>/dev/null || exit 1
  tar -xJf "$_vb_tar" -C "$_vb_rt/py" || return 1 2>/dev/null || exit 1
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
unset _vb_dir _vb_tar _vb_name _vb_knob _vb_rt _vb_py _vb_whl
