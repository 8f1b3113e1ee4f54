"""``bench/vllm_full_graph.py --smoke`` on the real vLLM 0.33.0, CPU (`make test-vllm`; ~55 s a run),
without and with levels.

The graph-safe mixed forwards (``integrations/vllm/mixed_step``: Kimi-Linear's KDA, Qwen3-Next's
GDN) on their padded bucket (8 request rows, 16 tokens) against vLLM's eager non-spec path on the
exact batch, on vLLM's own ops (its CPU conv, the vendored KDA / FLA under Triton's interpreter),
random batches with padded request rows in each: outputs of every real token and every real
block's states bit for bit, except GDN's decode rows, which vLLM runs through another kernel (their
difference bounded); then a whole step of each benchmark method,
with the capture and replay paths run as a graph would (``--simulate-graphs``: captured once,
each replay rewriting the static outputs; CUDA graphs need a GPU), states and outputs equal, and
decode-only steps of the bucket against Kimi's decode kernel. Run as its own process, as the
step-loop smoke test is (its ``run_smoke``).
"""

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test-vllm installs it)", allow_module_level=True)

from test_vllm_step_loop_smoke import run_smoke


@pytest.mark.parametrize("levels", ["0", "1"])  # 1: every kernel on the staged level's rows and chunk rows
def test_graph_safe_forward_equals_vllms_eager_path(tmp_path, levels):
    record = run_smoke(
        tmp_path, "bench/vllm_full_graph.py", "--exact-batches", "6", "--simulate-graphs", "--levels", levels
    )
    assert record["figures"]["capture"] == "simulate"  # the capture and replay paths, with no graph
    assert record["figures"]["levels"] == int(levels)
    kda, gdn, gdn_decodes = record["figures"]["exact"]
    for exact, layer in ((kda, "kda"), (gdn, "gdn"), (gdn_decodes, "gdn_with_decodes")):
        assert exact["layer"] == layer and exact["bit_identical"], exact
        assert exact["batches"] == 6 and exact["tokens_compared"] > 6
    assert kda["router_hits_per_batch"] >= 2  # Kimi's op took the bucket's tables, not its own derivation
    assert kda["router_misses"] == 0  # and asked for no table at another chunk size
    assert gdn["router_hits_per_batch"] == 0  # the GDN rule is handed its tables
    # decode rows: vLLM's recurrent kernel against the chunked rule, float16 under the interpreter
    assert 0 < gdn_decodes["decode_max_abs_output"] < 1e-3 and gdn_decodes["decode_max_abs_state"] < 1e-2
    # decode-only steps: the bucket's chunked path against Kimi's decode kernel (vLLM's FULL
    # decode graph), float32: other arithmetic, the same values to rounding
    (decode,) = record["figures"]["decode"]
    assert decode["finite"] and decode["max_abs_output"] < 1e-5 and decode["max_abs_state"] < 1e-5, decode
    (row,) = record["figures"]["steps"]
    assert row["last_output_equal"] and row["states_equal"] and row["finite_output"], row
    assert row["piecewise_output_equal"] and row["piecewise_states_equal"], row
    # the pipelined steps (async scheduling's) ran the same batches for every method
    assert row["async_states_equal"], row
    assert all(row[m]["async_ms_per_step"] > 0 for m in ("vllm_piecewise", "chunkmeta_piecewise", "chunkmeta_full"))
