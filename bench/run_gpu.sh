# Run the GPU stages on a CUDA machine.
#   bash bench/run_gpu.sh engine tests benchmarks bench steptables diag steploop stress demo stepsweep diagnostics vllm vllmbuilders fullgraph
#   (TESTS_K=expr: pytest -k for tests; TESTS_TIMEOUT_S: stop the tests stage's pytest after that
#   long, so that the later stages still run and every record comes back; ROUNDS, COMPARE_ARGS
#   (e.g. --workloads 1x4,1024x64), STEPS, STRESS_STEPS, STEPSWEEP_ARGS, VLLM_LOOP_BUDGET_S, ENGINE_ARGS: see each stage)
# Each stage writes its log and its record(s) (<kind>.runs.jsonl, bench/results.py) to a scratch
# directory; $OUT (default ./gpu_out) gets two files only, runs.jsonl (every record) and
# logs.tar.gz (the logs, the benchmark JSON, the plot), since a lent GPU machine returns only a
# few files. Back on the development machine:
#   python bench/results.py add <that runs.jsonl> && python bench/results.py render
# Set CHUNKMETA_COMMIT to the commit being measured: a copied checkout's git metadata can lag.
# Uses the machine's python3 (torch, triton, pytest, pytest-benchmark); fla-core comes from
# .whl/ when present (a machine with no package index), else it must be installed.
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  SITE=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl || exit 3
  export PYTHONPATH=$SITE:${PYTHONPATH:-}
fi
# chunkmeta.integrations maps to integrations/: an editable install, or this checkout on the path
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || export PYTHONPATH=$PWD:${PYTHONPATH:-}
python3 - <<'PY' | tee "$WORK/versions.txt"
import platform, torch, triton
from importlib.metadata import version
print(torch.cuda.get_device_name(), "| torch", torch.__version__, "| triton", triton.__version__,
      "| fla-core", version("fla-core"), "| python", platform.python_version())
import chunkmeta.integrations.kda
from chunkmeta.fill import cuda_fill
print("NVRTC for the CUDA C fill:", cuda_fill.nvrtc_version())
PY

# A record from a stage's own output (pytest's log, the benchmark JSON, the demo's log).
record() {  # KIND FILE COMMAND
  python3 bench/results.py record "$1" "$2" --out "$WORK" --command "$3" || echo "no $1 record: see $2"
}

status=0
for stage in "$@"; do
  echo "=== $stage ==="
  case $stage in
    tests) ${TESTS_TIMEOUT_S:+timeout "$TESTS_TIMEOUT_S"} python3 -m pytest -m gpu -q -p no:cacheprovider --durations=12 ${TESTS_K:+-k "$TESTS_K"} tests bench 2>&1 \
        | tee "$WORK/gpu_tests.log" | tail -40
      rc=${PIPESTATUS[0]}
      record gpu_tests "$WORK/gpu_tests.log" "${TESTS_K:+TESTS_K=\"$TESTS_K\" }bash bench/run_gpu.sh tests" ;;
    benchmarks) python3 -m pytest -q -p no:cacheprovider bench/bench_build.py -m "not gpu or gpu" --benchmark-enable \
        --benchmark-columns=min,median,iqr,rounds --benchmark-json="$WORK/pytest_benchmark.json" 2>&1 \
        | tee "$WORK/pytest_benchmark.log" | tail -40
      rc=${PIPESTATUS[0]}
      record pytest_benchmark "$WORK/pytest_benchmark.json" "bash bench/run_gpu.sh benchmarks" ;;
    bench) python3 bench/gpu_compare.py --out "$WORK" --rounds "${ROUNDS:-20}" ${COMPARE_ARGS:-} 2>&1 | tee "$WORK/gpu_compare.log"
      rc=${PIPESTATUS[0]} ;;
    steptables)  # vLLM's own functions beside chunkmeta's: from the carried .vllm_bundle where there is one
      (
        if [ -f .vllm_bundle/setup_env.sh ] && ! source .vllm_bundle/setup_env.sh; then
          echo ".vllm_bundle did not set up here: step_tables runs without vLLM's functions"
        fi
        python3 bench/step_tables.py --out "$WORK" --rounds "${ROUNDS:-20}" 2>&1 | tee "$WORK/step_tables.log"
        exit "${PIPESTATUS[0]}"
      )
      rc=$? ;;
    diag) python3 bench/diagnostics/diag_launch.py --out "$WORK" 2>&1 | tee "$WORK/diag_launch.log"
      rc=${PIPESTATUS[0]} ;;
    steploop) python3 bench/step_loop.py --out "$WORK" --steps "${STEPS:-20}" 2>&1 | tee "$WORK/step_loop.log"
      rc=${PIPESTATUS[0]} ;;
    stress) python3 bench/stress.py --out "$WORK" --steps "${STRESS_STEPS:-100000}" 2>&1 | tee "$WORK/stress.log" | tail -30
      rc=${PIPESTATUS[0]} ;;
    demo) python3 -m chunkmeta 2>&1 | tee "$WORK/demo.log" | tail -8
      rc=${PIPESTATUS[0]}
      record demo "$WORK/demo.log" "bash bench/run_gpu.sh demo" ;;
    stepsweep) python3 bench/diagnostics/step_fill_sweep.py --out "$WORK" ${STEPSWEEP_ARGS:-} 2>&1 | tee "$WORK/step_fill_sweep.log"
      rc=${PIPESTATUS[0]} ;;
    diagnostics)  # the launch floor's drift: each in a fresh process (graph_floor needs one)
      rc=0
      for script in launch_floor graph_floor; do
        python3 "bench/diagnostics/$script.py" --out "$WORK" 2>&1 | tee "$WORK/$script.log"
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      done ;;
    vllm)  # vLLM 0.33.0's real builders and ops: an installed vLLM, or the carried .vllm_bundle
      rc=0
      (
        if [ -f .vllm_bundle/setup_env.sh ]; then source .vllm_bundle/setup_env.sh || exit 3; fi
        s=0
        python3 -m pytest -m gpu -q -p no:cacheprovider tests/integrations/vllm/test_vllm_gpu.py 2>&1 \
          | tee "$WORK/vllm_gpu_tests.log" | tail -30
        [ "${PIPESTATUS[0]}" = 0 ] || s=1
        record gpu_tests "$WORK/vllm_gpu_tests.log" "bash bench/run_gpu.sh vllm (tests/integrations/vllm/test_vllm_gpu.py)"
        python3 bench/vllm_builders.py --out "$WORK" --rounds "${ROUNDS:-20}" 2>&1 | tee "$WORK/vllm_builders.log"
        [ "${PIPESTATUS[0]}" = 0 ] || s=1
        python3 bench/vllm_step_loop.py --out "$WORK" --steps "${STEPS:-20}" \
          --budget-s "${VLLM_LOOP_BUDGET_S:-0}" 2>&1 | tee "$WORK/vllm_step_loop.log"
        [ "${PIPESTATUS[0]}" = 0 ] || s=1
        exit $s
      ) || rc=1 ;;
    vllmbuilders)  # bench/vllm_builders.py alone (the vllm stage's second step): ROUNDS, DECODE_ROUNDS
      rc=0
      (
        if [ -f .vllm_bundle/setup_env.sh ]; then source .vllm_bundle/setup_env.sh || exit 3; fi
        python3 bench/vllm_builders.py --out "$WORK" --rounds "${ROUNDS:-20}" --decode-rounds "${DECODE_ROUNDS:-2000}" \
          2>&1 | tee "$WORK/vllm_builders.log"
        exit "${PIPESTATUS[0]}"
      ) || rc=1 ;;
    fullgraph)  # issue 34: a Kimi-Linear mixed step in one CUDA graph on vLLM's ops (FULL_GRAPH_ARGS: e.g. --shapes 8x256)
      rc=0
      (
        if [ -f .vllm_bundle/setup_env.sh ]; then source .vllm_bundle/setup_env.sh || exit 3; fi
        python3 bench/vllm_full_graph.py --out "$WORK" ${FULL_GRAPH_ARGS:-} 2>&1 | tee "$WORK/vllm_full_graph.log"
        exit "${PIPESTATUS[0]}"
      ) || rc=1 ;;
    engine)  # vLLM's own engine serving the dummy-weight models, per method (ENGINE_ARGS: e.g. --models qwen3_5 --budget-s 500)
      rc=0
      (
        if [ -f .vllm_bundle/setup_env.sh ]; then source .vllm_bundle/setup_env.sh || exit 3; fi
        python3 bench/vllm_engine.py --out "$WORK" ${ENGINE_ARGS:-} 2>&1 | tee "$WORK/vllm_engine.log"
        exit "${PIPESTATUS[0]}"
      ) || rc=1 ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
  [ "$rc" = 0 ] || status=1
done
python3 bench/results.py gather "$WORK" --to "$OUT/runs.jsonl"
tar -czf "$OUT/logs.tar.gz" -C "$WORK" . && rm -rf "$WORK"
exit $status
