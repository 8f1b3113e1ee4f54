#!/usr/bin/env bash
# Run the GPU stages on a CUDA machine, logs and results under $OUT (default ./gpu_out).
#   bash bench/run_gpu.sh tests bench steploop stress demo     (TESTS_K=expr: pytest -k for tests)
# Uses the machine's python3 (torch, triton, pytest, pytest-benchmark); fla-core comes from
# .whl/ when present (a machine with no package index), else it must be installed.
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/chunkmeta-site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/chunkmeta-site:${PYTHONPATH:-}
fi
# chunkmeta.integrations maps to integrations/: an editable install, or this checkout on the path
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || export PYTHONPATH=$PWD:${PYTHONPATH:-}
python3 - <<'PY' | tee "$OUT/versions.txt"
import platform, torch, triton
from importlib.metadata import version
print(torch.cuda.get_device_name(), "| torch", torch.__version__, "| triton", triton.__version__,
      "| fla-core", version("fla-core"), "| python", platform.python_version())
import chunkmeta.integrations.kda
from chunkmeta.fill import cuda_fill
print("NVRTC for the CUDA C fill:", cuda_fill.nvrtc_version())
PY
status=0
for stage in "$@"; do
  echo "=== $stage ==="
  case $stage in
    tests) python3 -m pytest -m gpu -q -p no:cacheprovider --durations=12 ${TESTS_K:+-k "$TESTS_K"} tests bench 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -40 ;;
    benchmarks) python3 -m pytest -q -p no:cacheprovider bench/bench_build.py -m "not gpu or gpu" --benchmark-enable \
        --benchmark-columns=min,median,iqr,rounds --benchmark-json="$OUT/pytest_benchmark.json" 2>&1 \
        | tee "$OUT/pytest_benchmark.log" | tail -40 ;;
    bench) python3 bench/gpu_compare.py --out "$OUT" --rounds "${ROUNDS:-20}" 2>&1 | tee "$OUT/gpu_compare.log" ;;
    steploop) python3 bench/step_loop.py --out "$OUT" --steps "${STEPS:-20}" 2>&1 | tee "$OUT/step_loop.log" ;;
    stress) python3 bench/stress.py --out "$OUT" --steps "${STRESS_STEPS:-100000}" 2>&1 | tee "$OUT/stress.log" | tail -30 ;;
    demo) python3 -m chunkmeta 2>&1 | tee "$OUT/demo.log" | tail -8 ;;
    sweep) python3 bench/kernel_sweep.py ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/kernel_sweep.log" ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
exit $status
