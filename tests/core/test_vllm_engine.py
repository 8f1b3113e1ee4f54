"""bench/vllm_engine.py's driver on CPU: the serving loop's figures, the logprob comparison, and the
whole parent/child run on a stand-in engine, including a method whose engine fails or hangs."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests" / "support"))

import vllm_engine  # noqa: E402

import vllm_engine_fake  # noqa: E402


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class _TickingEngine(vllm_engine_fake._Engine):
    """The fake engine on a clock that advances 10 ms a step."""

    def __init__(self, clock):
        super().__init__()
        self.clock = clock

    def step(self):
        self.clock.now += 0.010
        return super().step()


def test_serve_keeps_concurrency_and_times_tokens():
    clock = _Clock()
    engine = _TickingEngine(clock)
    batch = [([1] * 10, 4), ([2] * 20, 4), ([3] * 30, 4)]
    run = vllm_engine.serve(engine, batch, 2, vllm_engine_fake.params, clock=clock)
    reqs = run["requests"]
    assert [r["index"] for r in reqs] == [0, 1, 2]
    assert all(len(r["tokens"]) == 4 and len(r["times"]) == 4 for r in reqs)
    # two at a time: the third starts when the first two finish (a prefill step, then four tokens)
    assert reqs[0]["start"] == reqs[1]["start"] == 0.0
    assert reqs[2]["start"] == pytest.approx(0.05)
    m = vllm_engine.metrics(run)
    assert m["requests"] == 3 and m["output_tokens"] == 12 and m["input_tokens"] == 60
    assert m["mean_ttft_ms"] == pytest.approx(20.0)  # the prefill step, then the first token's step
    assert m["mean_tpot_ms"] == pytest.approx(10.0)
    assert m["median_itl_ms"] == pytest.approx(10.0)
    assert m["total_tok_s"] == pytest.approx(72 / run["seconds"], rel=1e-3)
    # steps that began with a request waiting for its first token: each wave's prefill step and
    # the step that returns its first tokens
    assert m["prefill_steps"] == 4 and m["prefill_steps"] < m["steps"]
    assert m["mean_prefill_step_ms"] == pytest.approx(10.0) and m["mean_decode_step_ms"] == pytest.approx(10.0)
    # TTFT of the prompts the largest capture size holds, and of the longer ones
    split = vllm_engine.metrics(run, graph_tokens=20)
    assert (split["prompts_in_graphs"], split["prompts_over_graphs"]) == (2, 1)
    assert split["mean_ttft_in_graphs_ms"] == pytest.approx(20.0) and split[
        "mean_ttft_over_graphs_ms"
    ] == pytest.approx(20.0)
    assert "prompts_in_graphs" not in m


def test_requests_are_the_same_for_every_method_and_new_in_every_run():
    a = vllm_engine.requests("prefix", 8, 1000, run=1)
    assert a == vllm_engine.requests("prefix", 8, 1000, run=1)
    assert len(a) == 32
    spec = vllm_engine.WORKLOADS["prefix"]
    ids = [r[0] for r in a]
    assert ids[0][: spec["prefix"]] == ids[spec["groups"]][: spec["prefix"]]  # shared inside a run
    assert ids[0][: spec["prefix"]] != ids[1][: spec["prefix"]]
    # another run (or the warm-up, run 0) shares no prompt's first block with this one: vLLM's
    # prefix cache, on by default, would serve it from the earlier run's blocks
    for other in (0, 2):
        firsts = {tuple(r[0][:16]) for r in vllm_engine.requests("prefix", 8, 1000, run=other)}
        assert not firsts & {tuple(p[:16]) for p in ids}
    seed = vllm_engine.requests("seed", 1, 1000)
    assert {len(p) for p, _ in seed} == {8192} and {o for _, o in seed} == {128}
    assert len(vllm_engine.requests("short", 1, 1000)) == 16  # enough requests for TTFT at concurrency 1
    staggered = {o for _, o in vllm_engine.requests("staggered", 8, 1000)}
    assert len(staggered) > 10 and min(staggered) >= 16 and max(staggered) <= 256


def test_the_correctness_warm_up_pass_shares_no_prefix_with_the_compared_one():
    part = vllm_engine.CORRECTNESS_STAGGERED
    warm, fixed = (vllm_engine.correctness_requests(part, 1000, shift) for shift in (1, 0))
    for (w, wo), (f, fo), (n, osl) in zip(warm, fixed, part, strict=True):
        assert len(w) == len(f) == n and wo == fo == osl and w[0] != f[0]


def test_logprob_comparison_names_the_first_divergence():
    base = {"tokens": [[1, 2, 3], [4, 5]], "logprobs": [[-0.1, -0.2, -0.3], [-0.4, -0.5]]}
    same = json.loads(json.dumps(base))
    other = json.loads(json.dumps(base))
    other["logprobs"][1][1] = -0.55
    base["kernel_configs"] = {"_chunk_scan_fwd_kernel": "BLOCK_SIZE_M: 64", "inductor:triton_red_0": "XBLOCK: 1"}
    other["kernel_configs"] = {"_chunk_scan_fwd_kernel": "BLOCK_SIZE_M: 32", "inductor:triton_red_0": "XBLOCK: 1"}
    other["repeat"] = {"identical": True, "first_divergence": None}
    out = vllm_engine.compare_logprobs({"vllm": base, "chunkmeta": same, "chunkmeta_graphs": other})
    assert out["chunkmeta"]["identical"] is True and out["chunkmeta"]["first_divergence"] is None
    assert out["chunkmeta_graphs"]["identical"] is False
    assert out["chunkmeta_graphs"]["first_divergence"]["request"] == 1
    assert out["chunkmeta_graphs"]["first_divergence"]["position"] == 1
    # the kernels that ran another autotuned config than vLLM's process: a named cause for a divergence
    assert out["chunkmeta_graphs"]["configs_differ"] == ["_chunk_scan_fwd_kernel"]
    assert out["chunkmeta_graphs"]["repeat"]["identical"] is True
    assert out["chunkmeta_graphs"]["configs_one_side"] == 0 and "weights_identical" not in out["chunkmeta"]
    other["kernel_configs"]["inductor:triton_poi_1"] = "XBLOCK: 8"  # tuned in one process only
    base["weights_digest"], same["weights_digest"], other["weights_digest"] = "a", "a", "b"
    out = vllm_engine.compare_logprobs({"vllm": base, "chunkmeta": same, "chunkmeta_graphs": other})
    assert out["chunkmeta_graphs"]["configs_one_side"] == 1
    assert out["chunkmeta"]["weights_identical"] is True and out["chunkmeta_graphs"]["weights_identical"] is False


def test_kernel_configs_name_every_shape_key_of_an_autotuner(monkeypatch):
    """Triton's Autotuner keeps a choice per shape key; its best_config is only the last launch's."""

    class Autotuner:
        def __init__(self, name, cache):
            self.base_fn = types.SimpleNamespace(__name__=name)
            self.cache = cache
            self.best_config = list(cache.values())[-1]

    monkeypatch.setitem(sys.modules, "triton.runtime.autotuner", type(sys)("autotuner_stand_in"))
    sys.modules["triton.runtime.autotuner"].Autotuner = Autotuner
    monkeypatch.delitem(sys.modules, "torch._inductor.runtime.triton_heuristics", raising=False)
    kept = Autotuner("_chunk_scan_fwd_kernel", {(64, "bf16"): "BLOCK_M: 64", (512, "bf16"): "BLOCK_M: 32"})
    configs = vllm_engine.kernel_configs()
    assert configs["_chunk_scan_fwd_kernel[64, 'bf16']"] == "BLOCK_M: 64"
    assert configs["_chunk_scan_fwd_kernel[512, 'bf16']"] == "BLOCK_M: 32"
    del kept


def test_weights_digest_tells_one_changed_bit():
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    vllm_engine.reinit_weights(model, seed=1)
    first = vllm_engine.weights_digest(model)
    vllm_engine.reinit_weights(model, seed=1)
    assert vllm_engine.weights_digest(model) == first  # the same draw, the same digest
    with torch.no_grad():
        bits = model[0].weight.view(torch.int32)
        bits[1, 2] += 1  # one ulp
    assert vllm_engine.weights_digest(model) != first
    model[1].num_batches_tracked += 1  # a buffer counts too
    assert vllm_engine.weights_digest(model) != first


def _run(tmp_path, *extra, env=None):
    cmd = [sys.executable, str(ROOT / "bench" / "vllm_engine.py"), "--smoke", "--out", str(tmp_path), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300)


def test_smoke_run_writes_one_record_with_every_row(tmp_path):
    done = _run(tmp_path, "--models", "qwen3_5,nemotron_h", "--workloads", "short,prefix")
    assert done.returncode == 0, done.stdout + done.stderr
    (record,) = [json.loads(line) for line in (tmp_path / "vllm_engine.runs.jsonl").read_text().splitlines()]
    figures = record["figures"]
    keys = {(r["model"], r["workload"], r["concurrency"]) for r in figures["rows"]}
    assert keys == {(m, w, c) for m in ("qwen3_5", "nemotron_h") for w in ("short", "prefix") for c in (1, 2)}
    qwen = next(r for r in figures["rows"] if r["model"] == "qwen3_5")
    # chunkmeta_graphs did not engage (no workloads); vLLM runs twice by default, the noise
    assert set(qwen["methods"]) == {"vllm", "chunkmeta", "vllm#2"}
    assert "tok_s_gain_pct" in qwen["chunkmeta_vs_vllm"] and "tok_s_gain_pct" in qwen["vllm#2_vs_vllm"]
    for model in ("qwen3_5", "nemotron_h"):  # both families have a graph-safe layer: the method applies
        assert "not_applicable" not in figures["methods"][model]["chunkmeta_graphs"]
        assert "did not" not in figures["methods"][model]["chunkmeta_graphs"].get("reason", "")
    assert figures["logprobs"]["qwen3_5"]["chunkmeta"]["identical"] is True
    # each process served the correctness requests twice: the fake engine's bits are the same
    assert figures["logprobs"]["qwen3_5"]["repeat_vllm"]["identical"] is True
    # each model's first process is the prime (vLLM's, the correctness pass only): no row, its logprobs compared
    assert [r["method"] for r in json.loads((tmp_path / "vllm_engine_rows.json").read_text())][:1] == ["vllm#prime"]
    assert "error" not in figures["methods"]["nemotron_h"]["vllm#prime"]
    assert "vllm#prime" in figures["logprobs"]["qwen3_5"]


def test_a_failing_or_hanging_engine_gives_its_row_and_the_others_run(tmp_path):
    done = _run(
        tmp_path,
        "--models",
        "qwen3_5",
        "--workloads",
        "short",
        "--engine-timeout-s",
        "15",  # a healthy stand-in process takes a few seconds (torch, triton) on a loaded CI core
        env={"FAKE_ENGINE_FAULT": "chunkmeta:fail,chunkmeta_graphs:hang"},
    )
    assert done.returncode == 1  # some row failed; the record is written all the same
    (record,) = [json.loads(line) for line in (tmp_path / "vllm_engine.runs.jsonl").read_text().splitlines()]
    methods = record["figures"]["methods"]["qwen3_5"]
    assert "fake engine start failed" in methods["chunkmeta"]["error"]
    assert "after stage 'start'" in methods["chunkmeta"]["error"]
    assert methods["chunkmeta_graphs"]["error"].startswith("ran past 15 s after stage 'start'")
    assert "error" not in methods["vllm"]
    assert {tuple(r["methods"]) for r in record["figures"]["rows"]} == {("vllm", "vllm#2")}


def test_bad_workload_is_refused():
    with pytest.raises(SystemExit):
        vllm_engine.main(["--smoke", "--workloads", "nope"])


def test_reinit_weights_draws_matrices_and_sets_norms():
    torch = pytest.importorskip("torch")

    class GemmaRMSNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.full((4,), 1e-3))

    class RMSNorm(GemmaRMSNorm):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), GemmaRMSNorm(), RMSNorm())
    counts = vllm_engine.reinit_weights(model, seed=1)
    assert counts == {"matrices": 1, "norms": 2, "kept": 1}  # the Linear's bias keeps its value
    assert torch.all(model[1].weight == 0) and torch.all(model[2].weight == 1)
    first = model[0].weight.clone()
    vllm_engine.reinit_weights(model, seed=1)
    assert torch.equal(first, model[0].weight)


def test_concurrency_argument_round_trips():
    parsed = vllm_engine.parse_concurrency("seed:1/8,short:1/8/32")
    assert parsed == {"seed": (1, 8), "short": (1, 8, 32)}
    assert vllm_engine.parse_concurrency(vllm_engine.format_concurrency(parsed)) == parsed
    with pytest.raises(ValueError, match="WORKLOAD one of"):
        vllm_engine.parse_concurrency("nope:1")


def test_graph_figures_come_from_vllms_log_lines():
    lines = [
        "INFO 12-07 08:27:50 [model_runner.py:1163] Graph capturing finished in 2 secs, took 0.31 GiB",
        "Capturing CUDA graphs (FULL): 100%",
        "INFO 12-07 08:27:56 [model_runner.py:1163] Graph capturing finished in 6 secs, took 1.89 GiB",
        "(MainProcess pid=1) INFO 12-07 08:27:56 [gpu_worker.py:1003] CUDA graph pool memory: 1.89 GiB (actual), "
        "0.43 GiB (estimated), difference: 1.46 GiB (77.1%).",
    ]
    # the last capture (the first is vLLM's memory profile's) and the pool against the estimate
    assert vllm_engine.graph_figures(lines) == {
        "capture_s": 6.0, "capture_gib": 1.89, "pool_gib": 1.89, "pool_estimated_gib": 0.43
    }  # fmt: skip
    assert vllm_engine.graph_figures(["no graphs here"]) == {}


def test_capture_sizes_replace_the_default_list_for_every_method():
    args = vllm_engine.engine_args((512, 256, 384, 256))
    assert args["compilation_config"]["cudagraph_capture_sizes"] == [256, 384, 512]
    assert args["compilation_config"]["custom_ops"] == ["none"]
    # the module's own arguments are untouched
    assert vllm_engine.ENGINE_ARGS["compilation_config"]["cudagraph_capture_sizes"] == list(vllm_engine.CAPTURE_SIZES)
    assert vllm_engine.engine_args(()) is vllm_engine.ENGINE_ARGS


def test_capture_totals_keep_chunkmetas_graphs_apart_from_vllms():
    captures = [
        {"mode": "FULL", "num_tokens": 256, "num_reqs": 16, "chunkmeta": True, "seconds": 0.5, "bytes": 2**30},
        {"mode": "FULL", "num_tokens": 256, "num_reqs": 8, "chunkmeta": True, "seconds": 0.25, "bytes": 2**29},
        {"mode": "PIECEWISE", "num_tokens": 256, "num_reqs": None, "chunkmeta": False, "seconds": 0.1, "bytes": 0},
    ]
    totals = vllm_engine.capture_totals(captures)
    assert totals["chunkmeta"] == {"graphs": 2, "seconds": 0.75, "gib": 1.5}
    assert totals["vllm"] == {"graphs": 1, "seconds": 0.1, "gib": 0.0}


def test_decode_profile_times_the_decode_steps_and_leaves_no_request_behind():
    torch = pytest.importorskip("torch")

    class MatmulEngine(vllm_engine_fake._Engine):
        def step(self):
            torch.mm(torch.ones(8, 8), torch.ones(8, 8))  # the step's one "kernel" (host ops off CUDA)
            return super().step()

    engine = MatmulEngine()
    profile = vllm_engine.decode_profile(engine, 1000, vllm_engine_fake.params, requests=3, steps=5)
    assert profile["steps"] == 5 and profile["kernels"]["aten::mm"][1] == 1.0  # one launch a step
    assert "aten::mm" in profile["kernel_names"] and profile["device_us_per_step"] > 0
    assert not engine.live  # every profiling request ran to its end


def test_decode_profiles_compare_kernels_against_vllms():
    base = {"device_us_per_step": 100.0, "launches_per_step": 3.0, "kernel_names": ["gemm", "ssu"],
            "kernels": {"gemm": [80.0, 2.0], "ssu": [20.0, 1.0]}}  # fmt: skip
    other = {"device_us_per_step": 101.0, "launches_per_step": 4.0, "kernel_names": ["gemm", "ssu", "fill"],
             "kernels": {"gemm": [80.0, 2.0], "ssu": [20.5, 1.0], "fill": [0.5, 1.0]}}  # fmt: skip
    out = vllm_engine.compare_decode_profiles(base, other)
    assert out["only_this"] == ["fill"] and out["only_vllm"] == []
    assert out["device_us_per_step"] == [100.0, 101.0]
    assert out["largest_deltas"] == [("fill", 0.5), ("ssu", 0.5), ("gemm", 0.0)]
    assert vllm_engine.compare_decode_profiles(base, {"error": "no CUPTI"}) == {}
