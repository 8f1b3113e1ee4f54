"""vLLM 0.33.0's own engine serving a hybrid model, with and without chunkmeta: the figures a user acts on.

    python bench/vllm_engine.py --out DIR [--models qwen3_5,nemotron_h] [--methods vllm,chunkmeta,chunkmeta_graphs,vllm]
                                [--workloads seed,short,prefix,staggered] [--budget-s S] [--engine-timeout-s S]
    python bench/vllm_engine.py --smoke --out DIR      (CPU: the driver end to end on a stand-in engine)

On a GPU machine vLLM is an installed one or the carried ``.vllm_bundle`` (``source
.vllm_bundle/setup_env.sh`` first); ``bash bench/run_gpu.sh engine`` does both. Each (model,
method) runs in its own process (chunkmeta is wired at vLLM's start by its plugin, under
``CHUNKMETA_VLLM``): ``vllm.LLM`` in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), vLLM's
defaults (Model Runner V2, torch.compile, piecewise mixed and FULL decode CUDA graphs, prefix
caching, async scheduling) except what the image forces (``ENGINE_ARGS``: Triton attention,
native custom ops, the FLA-Triton GDN prefill, fewer capture sizes) and the seed's limits
(``max_num_batched_tokens`` 4096, ``max_num_seqs`` 128). Weights: ``load_format="dummy"`` from
``bench/engine_models/<model>/config.json`` (published dimensions), then redrawn from one seed
(``reinit_weights``) so that greedy decoding is not degenerate; the same for every method.

Per process: a correctness pass (fixed prompts in one batch, greedy, the sampled token's logprob;
syncs counted per engine step and inside the metadata builders' ``build()`` under
``torch.cuda.set_sync_debug_mode("warn")``), then each workload as ``vllm bench serve`` runs it
(a closed loop at a fixed max concurrency, request rate unbounded; TTFT, TPOT, ITL, total and
output tokens/s), then chunkmeta's own counters read inside the engine and every metadata
builder's class. The parent never stops on one failure: a process that fails or runs past
``--engine-timeout-s`` gives a row saying which stage it reached. One record ``vllm_engine``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import results as runs  # noqa: E402  bench/results.py

MODELS_DIR = HERE / "engine_models"
METHODS = ("vllm", "chunkmeta", "chunkmeta_graphs", "chunkmeta_graphs_vllm_keys", "chunkmeta_graphs_levels")
METHOD_ENV = {  # the one thing that differs between methods: chunkmeta's opt-ins
    "vllm": {"CHUNKMETA_VLLM": "0", "CHUNKMETA_VLLM_FULL_GRAPH": "0"},
    "chunkmeta": {"CHUNKMETA_VLLM": "1", "CHUNKMETA_VLLM_FULL_GRAPH": "0"},
    "chunkmeta_graphs": {"CHUNKMETA_VLLM": "1", "CHUNKMETA_VLLM_FULL_GRAPH": "1"},
    # the mixed graphs at vLLM's own request capacity, min(N, max_num_seqs): what the request
    # buckets are measured against
    "chunkmeta_graphs_vllm_keys": {
        "CHUNKMETA_VLLM": "1",
        "CHUNKMETA_VLLM_FULL_GRAPH": "1",
        "CHUNKMETA_VLLM_REQUEST_BUCKETS": "0",
    },
    # the mixed graphs with their state-carrying kernels on levels (CUDA graph IF nodes): a
    # padded request row costs no state traffic; off by default until measured
    "chunkmeta_graphs_levels": {
        "CHUNKMETA_VLLM": "1",
        "CHUNKMETA_VLLM_FULL_GRAPH": "1",
        "CHUNKMETA_VLLM_LEVELS": "1",
    },
}
DEFAULT_METHODS = ("vllm", "chunkmeta", "chunkmeta_graphs", "vllm")  # vllm#2: the noise every ratio stands on
# A model's first process on a machine compiles and autotunes, and its logprobs differ from those
# of every later process, which load what it stored (H100, Nemotron-H: the first process of each
# of two calls gave -7.598443 at one first token, every later one another value,
# vllm_engine@2026-12-07T08:39:39Z and …08:44:35Z). The prime is that first process, vLLM's, the
# correctness pass only: every compared process then starts warm. Its logprobs are in the record.
PRIME = "vllm#prime"
# Workloads: input and output length ranges (per request, uniform), concurrencies, prompts per
# unit of concurrency (at least ``min``), shared prefix tokens and prefix groups. "seed": vLLM
# #51862's (random ISL 8192 / OSL 128). "staggered": output lengths that differ, so requests end
# at different steps and new prompts join running decodes (mixed steps), as in serving traffic;
# the closed loops of fixed output length run in waves of all-prefill then all-decode steps.
WORKLOADS = {
    "seed": {"isl": (8192, 8192), "osl": (128, 128), "concurrency": (1, 8, 32), "per": 4},
    "short": {"isl": (64, 512), "osl": (64, 64), "concurrency": (1, 8, 32), "per": 4, "min": 16},
    "prefix": {"isl": (128, 512), "osl": (64, 64), "concurrency": (8,), "per": 4, "prefix": 2048, "groups": 4},
    "staggered": {"isl": (64, 512), "osl": (16, 256), "concurrency": (8, 32), "per": 8},
}
START_RESERVE_S = 120  # no engine is started with less of --budget-s left (a cold start takes about that)
# up to 512 tokens, vLLM's own largest size on an H100 at its default max_num_seqs (1024; the
# seed's 128 would stop vLLM's default at 256): 15 sizes of vLLM's 51, so that a start fits a call
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
ENGINE_ARGS = {
    "load_format": "dummy",
    "skip_tokenizer_init": True,
    "dtype": "bfloat16",
    "max_model_len": 8192 + 256,
    "max_num_batched_tokens": 4096,
    "max_num_seqs": 128,
    "gpu_memory_utilization": 0.85,
    "seed": 0,
    # the image has no FlashAttention / FlashInfer build and no vLLM custom kernels
    "attention_config": {"backend": "TRITON_ATTN"},
    "compilation_config": {"custom_ops": ["none"], "cudagraph_capture_sizes": list(CAPTURE_SIZES)},
}
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in this process: chunkmeta's counters readable
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_TARGET_DEVICE": "cuda",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # Triton's autotuner keeps its choice on disk: every method's process runs the kernel configs
    # the first one chose (a choice by timing differs between processes, and with it the last
    # bits of a reduction: H200, vllm_engine@2026-12-06T20:39:31Z's logprobs)
    "TRITON_CACHE_AUTOTUNING": "1",
}
MODEL_ARGS = {  # per model: what its layers need on the image (the same for every method)
    "qwen3_5": {"additional_config": {"gdn_prefill_backend": "triton"}},
}
# kept for every repeat
RUN_KEYS = (
    "total_tok_s",
    "mean_ttft_ms",
    "median_ttft_ms",
    "mean_tpot_ms",
    "max_step_ms",
    "compiles",
    "autotunes",
    "mixed_steps",
)
CORRECTNESS_PROMPTS = (48, 300, 1, 1024, 2000, 64, 777, 3000, 129, 512, 5, 1500)  # lengths; 24 tokens out
# (length, output length) served at concurrency 4: requests end at different steps and new short
# prompts join running decodes, the mixed steps that the mixed-step graphs replay
CORRECTNESS_STAGGERED = (
    (40, 9), (130, 30), (17, 5), (200, 22), (64, 14), (90, 40), (33, 7), (150, 18), (12, 26), (75, 11), (180, 33),
    (25, 6),
)  # fmt: skip


# ------------------------------------------------------------------ prompts and the serving loop


def requests(name: str, concurrency: int, vocab: int, run: int = 1) -> list[tuple[list[int], int]]:
    """A workload's requests, ``(token ids, output length)``: the same for every method, seeded by
    the workload, the concurrency and ``run`` (0: the warm-up). Each run draws new tokens, shared
    prefixes included: a run never hits the prefix cache that an earlier run filled (vLLM's
    prefix caching is on), only the prefixes shared inside it."""
    import numpy as np

    spec = WORKLOADS[name]
    rng = np.random.default_rng([sum(map(ord, name)), concurrency, run])
    count = max(spec["per"] * concurrency, spec.get("min", 0))
    lengths = rng.integers(spec["isl"][0], spec["isl"][1] + 1, size=count)
    outputs = rng.integers(spec["osl"][0], spec["osl"][1] + 1, size=count)
    prefixes = [rng.integers(10, vocab - 10, size=spec["prefix"]).tolist() for _ in range(spec.get("groups", 0))]
    out = []
    for i, (length, osl) in enumerate(zip(lengths, outputs, strict=True)):
        body = rng.integers(10, vocab - 10, size=int(length)).tolist()
        out.append(((prefixes[i % len(prefixes)] + body) if prefixes else body, int(osl)))
    return out


def serve(engine, reqs: list[tuple[list[int], int]], concurrency: int, make_params, *, clock=time.perf_counter):
    """Closed loop at ``concurrency`` (``vllm bench serve --max-concurrency``, unbounded rate):
    a new request as soon as one finishes. ``reqs``: ``(token ids, output length)``. Per
    request: its start, each token's time, the tokens and their logprobs; per step its host
    time. ``engine``: ``add_request(id, prompt, params)`` and ``step()`` (vLLM's ``LLMEngine``)."""
    pending = list(enumerate(reqs))[::-1]
    live: dict[str, dict] = {}
    done: list[dict] = []
    steps = 0
    start = clock()

    def admit():
        while pending and len(live) < concurrency:
            index, (ids, osl) = pending.pop()
            rid = f"r{index}"
            live[rid] = {"index": index, "isl": len(ids), "start": clock(), "times": [], "tokens": [], "logprobs": []}
            engine.add_request(rid, {"prompt_token_ids": ids}, make_params(osl))

    step_ms, waiting = [], []
    admit()
    while live:
        # a step that begins with a request still waiting for its first token serves a prefill
        # (or follows one: async scheduling returns a step's tokens a step later)
        waiting.append(any(not req["tokens"] for req in live.values()))
        before = clock()
        outputs = engine.step()
        steps += 1
        now = clock()
        step_ms.append((now - before) * 1e3)
        for out in outputs:
            req = live.get(out.request_id)
            if req is None:
                continue
            completion = out.outputs[0]
            new = completion.token_ids[len(req["tokens"]) :]
            req["times"].extend([now] * len(new))
            req["tokens"].extend(new)
            if completion.logprobs is not None:
                for position in range(len(req["logprobs"]), len(completion.logprobs)):
                    entry = completion.logprobs[position]
                    token = req["tokens"][position]
                    req["logprobs"].append(float(entry[token].logprob) if token in entry else None)
            if out.finished:
                done.append(live.pop(out.request_id))
        admit()
    return {
        "requests": sorted(done, key=lambda r: r["index"]),
        "seconds": clock() - start,
        "steps": steps,
        "step_ms": step_ms,
        "waiting": waiting,
    }


def _summary(name: str, values: list[float]) -> dict:
    """Mean, median and p99 as ``vllm bench serve`` gives them (numpy's interpolated percentile)."""
    import numpy as np

    if not values:
        return {}
    return {
        f"mean_{name}_ms": round(statistics.fmean(values), 3),
        f"median_{name}_ms": round(statistics.median(values), 3),
        f"p99_{name}_ms": round(float(np.percentile(values, 99)), 3),
    }


def metrics(run: dict, graph_tokens: int = 0) -> dict:
    """``vllm bench serve``'s figures from ``serve()``'s requests (ms; tokens/s). With
    ``graph_tokens`` (the largest capture size) also the mean TTFT of the prompts a graph can
    hold and of the longer ones, which run without a graph in every method."""
    reqs = run["requests"]
    firsts = [(r["isl"], (r["times"][0] - r["start"]) * 1e3) for r in reqs if r["times"]]  # (ISL, TTFT)
    ttft = [ms for _, ms in firsts]
    by_length = {}
    if graph_tokens:
        for name, keep in (("in_graphs", lambda n: n <= graph_tokens), ("over_graphs", lambda n: n > graph_tokens)):
            picked = [ms for isl, ms in firsts if keep(isl)]
            by_length[f"prompts_{name}"] = len(picked)
            by_length[f"mean_ttft_{name}_ms"] = round(statistics.fmean(picked), 3) if picked else None
    tpot = [(r["times"][-1] - r["times"][0]) * 1e3 / (len(r["times"]) - 1) for r in reqs if len(r["times"]) > 1]
    itl = [(b - a) * 1e3 for r in reqs for a, b in zip(r["times"], r["times"][1:], strict=False)]
    out_tokens = sum(len(r["tokens"]) for r in reqs)
    in_tokens = sum(r["isl"] for r in reqs)
    seconds = run["seconds"]
    return {
        "requests": len(reqs),
        "duration_s": round(seconds, 4),
        "steps": run["steps"],
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "output_tok_s": round(out_tokens / seconds, 2),
        "total_tok_s": round((in_tokens + out_tokens) / seconds, 2),
        **_summary("ttft", ttft),
        **_summary("tpot", tpot),
        **_summary("itl", itl),
        **_summary("step", run.get("step_ms", [])),
        "max_step_ms": round(max(run.get("step_ms") or [0.0]), 3),
        **_step_split(run.get("step_ms", []), run.get("waiting", [])),
        **by_length,
    }


def _step_split(step_ms: list[float], waiting: list[bool]) -> dict:
    """Steps that began with a request waiting for its first token (prefills, and the step after
    one) and the others (decodes only): how many, and their mean ms. Tells a gain on the steps
    with a prefill (what the mixed-step graphs replay) from one on every step."""
    if len(step_ms) != len(waiting):
        return {}
    prefill = [ms for ms, w in zip(step_ms, waiting, strict=True) if w]
    decode = [ms for ms, w in zip(step_ms, waiting, strict=True) if not w]
    return {
        "prefill_steps": len(prefill),
        "mean_prefill_step_ms": round(statistics.fmean(prefill), 3) if prefill else None,
        "mean_decode_step_ms": round(statistics.fmean(decode), 3) if decode else None,
    }


# ------------------------------------------------------------------ one (model, method): the child process

EVENT = "ENGINE_EVENT "


def emit(event: str, **fields) -> None:
    """One line the parent reads (the rest of the output is the engine's log)."""
    print(EVENT + json.dumps({"event": event, "t": round(time.time(), 3), **fields}, default=str), flush=True)


def reinit_weights(model, seed: int = 0) -> dict:
    """Redraw the dummy weights from ``seed`` (in place: captured graphs keep their addresses):
    matrices N(0, 1/fan_in), norm scales at their identity (1, or 0 for Gemma-style ``1 + w``
    norms); vLLM's dummy values (uniform +-1e-3) make every logit nearly equal, and greedy
    decoding one repeated token. Everything else keeps vLLM's dummy values."""
    import torch

    norms = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if "Norm" in type(module).__name__ and isinstance(weight, torch.Tensor) and weight.dim() == 1:
            norms[f"{name}.weight" if name else "weight"] = 0.0 if "Gemma" in type(module).__name__ else 1.0
    counts = {"matrices": 0, "norms": 0, "kept": 0}
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if not param.is_floating_point():
                counts["kept"] += 1
            elif name in norms:
                param.fill_(norms[name])
                counts["norms"] += 1
            elif param.dim() >= 2:
                param.normal_(0.0, param[0].numel() ** -0.5, generator=generator)
                counts["matrices"] += 1
            else:
                counts["kept"] += 1
    return counts


def _redraw(worker) -> dict:
    """In the worker: the weights redrawn (``reinit_weights``), and their digest."""
    model = _worker_of(worker).model_runner.model
    return reinit_weights(model) | {"digest": _or_error(lambda: weights_digest(model))}


def weights_digest(model) -> str:
    """A digest of every parameter's and buffer's bits (exact integer sums, per tensor): two
    processes that drew the same weights give the same digest, so a logprob difference between
    them is not the weights'."""
    import hashlib

    import torch

    views = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    parts = []
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    with torch.no_grad():
        for name, t in sorted(tensors.items()):
            flat = t.detach().reshape(-1)
            if flat.dtype == torch.bool:
                flat = flat.view(torch.uint8)
            flat = flat.view(views[flat.element_size()])
            total = torch.zeros(2, dtype=torch.int64, device=flat.device)
            for start in range(0, flat.numel(), 1 << 24):  # a bounded int64 temporary
                chunk = flat[start : start + (1 << 24)].to(torch.int64)
                total[0] += chunk.sum()
                total[1] += (chunk * chunk).sum()  # wraps alike in every process: still a digest
            parts.append(f"{name}:{tuple(t.shape)}:{t.dtype}:{total.tolist()}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _worker_of(obj):
    return getattr(obj, "worker", obj)


def _builders(worker):
    runner = _worker_of(worker).model_runner
    for groups in getattr(runner, "attn_groups", ()):
        for group in groups:
            yield from getattr(group, "metadata_builders", ())


def wiring(worker) -> dict:
    """What runs inside the engine: every metadata builder's class and chunkmeta's counters."""
    found = {}
    for builder in _builders(worker):
        name = type(builder).__name__
        entry = found.setdefault(name, {"count": 0, "chunkmeta": hasattr(builder, "chunkmeta_stats")})
        entry["count"] += 1
        if hasattr(builder, "chunkmeta_stats"):
            entry.setdefault("stats", []).append(builder.chunkmeta_stats())
    out = {"builders": found, "runner": type(_worker_of(worker).model_runner).__module__}
    if "chunkmeta.integrations.vllm" in sys.modules:
        from chunkmeta.integrations import vllm as cm

        out["installed"] = sorted(f"{k.__name__}->{v.__name__}" for k, v in cm.installed().items())
        out["pending"] = list(cm.pending())
        out["stats"] = cm.stats()
    return out


class SyncCounter:
    """The engine with its steps under ``set_sync_debug_mode("warn")``: syncs per step, and those
    inside the metadata builders' ``build()`` (each builder's bound ``build`` wrapped while
    counting). Anything but ``step`` is the engine's."""

    WARNING = "called a synchronizing CUDA operation"

    def __init__(self, engine, worker):
        self.engine, self.steps, self.total, self.in_build, self.sites = engine, 0, 0, 0, {}
        self._caught = None
        self._wrapped = []
        for builder in _builders(worker):
            self._wrap(builder)

    def _wrap(self, builder):
        original = builder.build

        def build(*args, **kwargs):
            before = self._count()
            try:
                return original(*args, **kwargs)
            finally:
                self.in_build += self._count() - before

        builder.build = build
        self._wrapped.append(builder)

    def _count(self) -> int:
        return sum(self.WARNING in str(w.message) for w in self._caught) if self._caught is not None else 0

    def step(self):
        import warnings

        import torch

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self._caught = caught
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return self.engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
                self._caught = None
                self.steps += 1
                for w in caught:
                    if self.WARNING in str(w.message):
                        self.total += 1
                        site = f"{Path(w.filename).as_posix().split('site-packages/')[-1].split('/py/')[-1]}:{w.lineno}"
                        self.sites[site] = self.sites.get(site, 0) + 1

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def undo(self):
        for builder in self._wrapped:
            del builder.build
        self._wrapped = []

    def figures(self) -> dict:
        steps = max(self.steps, 1)
        return {
            "steps": self.steps,
            "syncs_per_step": round(self.total / steps, 3),
            "builder_syncs_per_step": round(self.in_build / steps, 3),
            "sync_sites": dict(sorted(self.sites.items(), key=lambda kv: -kv[1])[:8]),
        }


class KernelWatch:
    """Triton's work inside a measured run: kernels compiled (a specialization not yet in this
    process's cache: loaded from the disk cache or built) and autotuner benchmarks, each with its
    host seconds, by kernel name. A run that compiles or autotunes pays for it in TTFT; the
    figures say whether a method's run did (Triton's own hooks, ``triton.knobs.runtime``)."""

    def __init__(self):
        self._compiling: dict[str, float] = {}
        self.compiles: dict[str, int] = {}
        self.autotunes: dict[str, int] = {}
        self.seconds = {"compile": 0.0, "autotune": 0.0}
        try:
            import triton
            from triton.runtime.autotuner import Autotuner
        except ImportError:  # the fake engine's machine may lack Triton
            return
        knobs = triton.knobs.runtime
        self._before, self._after = knobs.jit_cache_hook, knobs.jit_post_compile_hook
        knobs.jit_cache_hook, knobs.jit_post_compile_hook = self._on_compile, self._on_compiled
        bench = Autotuner._bench
        watch = self

        def _bench(tuner, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return bench(tuner, *args, **kwargs)
            finally:
                name = tuner.base_fn.__name__
                watch.autotunes[name] = watch.autotunes.get(name, 0) + 1
                watch.seconds["autotune"] += time.perf_counter() - t0

        Autotuner._bench = _bench

    def _on_compile(self, *, key, fn, **kwargs):
        self._compiling[str(key)] = time.perf_counter()
        # a true answer would skip the compile: pass on whatever hook was there
        return self._before(key=key, fn=fn, **kwargs) if self._before else None

    def _on_compiled(self, *, key, fn, **kwargs):
        t0 = self._compiling.pop(str(key), None)
        if t0 is not None:
            self.seconds["compile"] += time.perf_counter() - t0
        self.compiles[fn.name] = self.compiles.get(fn.name, 0) + 1
        return self._after(key=key, fn=fn, **kwargs) if self._after else None

    def take(self) -> dict:
        """What happened since the last ``take``, and start again."""
        out = {
            "compiles": sum(self.compiles.values()),
            "autotunes": sum(self.autotunes.values()),
            "compile_s": round(self.seconds["compile"], 3),
            "autotune_s": round(self.seconds["autotune"], 3),
            "kernels": dict(sorted((self.compiles | self.autotunes).items(), key=lambda kv: -kv[1])[:8]),
        }
        self.compiles, self.autotunes = {}, {}
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        return out


def _sampling(osl: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=osl, ignore_eos=True, logprobs=0)


def engine_args(capture_sizes: tuple[int, ...] = ()) -> dict:
    """``ENGINE_ARGS`` with other CUDA graph capture sizes (none: ``CAPTURE_SIZES``); a step over
    the largest size runs without a graph in every method."""
    if not capture_sizes:
        return ENGINE_ARGS
    compilation = ENGINE_ARGS["compilation_config"] | {"cudagraph_capture_sizes": sorted(set(capture_sizes))}
    return ENGINE_ARGS | {"compilation_config": compilation}


def child(args) -> int:
    emit("start", model=args.model, method=args.method, pid=os.getpid())
    deadline = args.deadline or float("inf")
    # before the engine: what its start-up compiles (chunkmeta's fill kernels among them), by kernel
    watch = KernelWatch()
    if args.engine == "fake":
        import vllm_engine_fake as fake  # tests/support: the CPU smoke test's stand-in engine

        llm, vocab, make_params = fake.FakeLLM(args.model, args.method), 1000, fake.params
    else:
        try:
            import vllm_bootstrap  # noqa: F401  the carried .vllm_bundle
        except ImportError:
            pass
        from vllm import LLM

        config = json.loads((MODELS_DIR / args.model / "config.json").read_text())
        vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
        t0 = time.perf_counter()
        llm = LLM(
            model=str(MODELS_DIR / args.model), **engine_args(args.capture_sizes), **MODEL_ARGS.get(args.model, {})
        )
        emit("engine_ready", startup_s=round(time.perf_counter() - t0, 1), startup_kernels=watch.take())
        make_params = _sampling
        emit("weights", **llm.collective_rpc(_redraw)[0])
    engine = llm.llm_engine
    emit("wiring", **llm.collective_rpc(wiring)[0])

    # correctness: one batch of fixed prompts, greedy, syncs counted. A first pass on other tokens
    # of the same lengths compiles and autotunes this batch's kernels: a process that autotunes
    # inside the compared pass gives other logprobs than one that loaded the choice from disk
    # (H100, vllm_engine@2026-12-07T00:06:58Z: the first process alone differed). Other tokens,
    # so that the compared pass's prefills miss the prefix cache.
    # Then the staggered part (CORRECTNESS_STAGGERED), the same way.
    counter = llm.collective_rpc(lambda w: SyncCounter(engine, w))[0] if args.engine != "fake" else None
    counted = counter if counter is not None else engine
    batch = [(n, 24) for n in CORRECTNESS_PROMPTS]
    compared, tuned = [], []
    for part, concurrency in ((batch, len(batch)), (CORRECTNESS_STAGGERED, 4)):
        serve(engine, correctness_requests(part, vocab, shift=1), concurrency, make_params)
        mixed = _mixed_steps(llm)  # the staggered part's compared pass's, in the end
        watch.take()
        compared += serve(counted, correctness_requests(part, vocab), concurrency, make_params)["requests"]
        tuned.append(watch.take())  # a compared pass that compiles or autotunes: its logprobs may differ
    if counter is not None:
        counter.undo()
    mixed = _mixed_steps(llm) - mixed  # of the staggered part's compared pass
    # the same requests again in this process, the prefix cache emptied: whether this process's
    # kernels give the same bits twice (if not, no two processes can be expected to)
    again = []
    try:
        if llm.reset_prefix_cache() is False:  # vLLM's answer while a request still runs
            raise RuntimeError("vLLM did not empty the prefix cache")
        for part, concurrency in ((batch, len(batch)), (CORRECTNESS_STAGGERED, 4)):
            again += serve(engine, correctness_requests(part, vocab), concurrency, make_params)["requests"]
        repeat = first_divergence(compared, again)
    except Exception as exc:  # noqa: BLE001  a diagnostic: the workloads run all the same
        repeat = {"error": f"{type(exc).__name__}: {exc}"}
    emit(
        "correctness",
        tokens=[r["tokens"] for r in compared],
        logprobs=[r["logprobs"] for r in compared],
        syncs=counter.figures() if counter is not None else None,
        mixed_steps=mixed,
        triton=tuned,
        repeat=repeat,
        kernel_configs=_or_error(kernel_configs),
    )
    after = llm.collective_rpc(wiring)[0]
    emit("wiring_after_correctness", **after)
    if base_method(args.method).startswith("chunkmeta_graphs"):
        # engaged: mixed-step graphs captured (each bucket's capture staged it); the steps they
        # served are counted per run
        if not any(s.get("mixed_buckets") for b in after["builders"].values() for s in b.get("stats", [])):
            emit("not_engaged", reason=_why_not_engaged(after))
            return 0

    for name in args.workloads:
        spec = WORKLOADS[name]
        for concurrency in args.concurrency.get(name, spec["concurrency"]):
            if time.time() > deadline:
                emit("skipped", workload=name, concurrency=concurrency, reason="past the time budget")
                continue
            watch.take()
            # warm-up: one wave at this concurrency (its step shapes' kernels and autotuning)
            serve(engine, requests(name, concurrency, vocab, run=0)[:concurrency], concurrency, make_params)
            warmup = watch.take()
            each = []
            for run in range(1, args.repeats + 1):
                before = _mixed_steps(llm)
                served = serve(engine, requests(name, concurrency, vocab, run), concurrency, make_params)
                figures = metrics(served, graph_tokens=max(args.capture_sizes or CAPTURE_SIZES))
                each.append(figures | watch.take() | {"mixed_steps": _mixed_steps(llm) - before})
            # the figures are the last run's (steady state); every run's headline figures are kept
            result = each[-1] | {"runs": [{k: r.get(k) for k in RUN_KEYS} for r in each], "warmup_triton": warmup}
            emit("workload", workload=name, concurrency=concurrency, **result)
    if args.engine != "fake" and time.time() < deadline:
        # after the measured runs: which kernels a decode-only step launches, and for how long
        emit("decode_profile", **_or_error(lambda: decode_profile(engine, vocab, make_params)))
    emit("final", **llm.collective_rpc(wiring)[0])
    return 0


def decode_profile(engine, vocab: int, make_params, *, requests: int = 8, steps: int = 32, top: int = 25) -> dict:
    """The device kernels of ``steps`` decode-only engine steps (``requests`` short prompts, all
    decoding), by name: device us per step and launches per step, the ``top`` longest. Tells
    which kernels one method's decode steps run that another's do not (mixed-step graphs leave
    vLLM's decode graphs alone, so every method's should match)."""
    import torch

    osl = steps + 24
    reqs = [([(31 * i + 7 * j) % (vocab - 20) + 10 for j in range(16)], osl) for i in range(requests)]
    for i, (ids, n) in enumerate(reqs):
        engine.add_request(f"profile{i}", {"prompt_token_ids": ids}, make_params(n))
    produced: dict[str, int] = {}

    def step():
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                produced[out.request_id] = osl

    # off CUDA (the CPU test's stand-in engine) the host ops stand for the kernels
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    while len(produced) < requests or min(produced.values()) < 4:  # every prefill done, decoding
        step()
    sync()
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(steps):
            step()
        sync()
    while min(produced.values()) < osl:  # the requests run out before the next measurement
        step()
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == kind:
            entry = kernels.setdefault(event.name, [0.0, 0])
            entry[0] += event.device_time if cuda else event.cpu_time  # us
            entry[1] += 1
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    return {
        "requests": requests,
        "steps": steps,
        "device_us_per_step": round(sum(v[0] for v in kernels.values()) / steps, 2),
        "launches_per_step": round(sum(v[1] for v in kernels.values()) / steps, 2),
        "kernels": {name: [round(us / steps, 2), round(n / steps, 2)] for name, (us, n) in ranked[:top]},
        "kernel_names": sorted(kernels),
    }


def compare_decode_profiles(base: dict, other: dict) -> dict:
    """One method's decode-step profile against vLLM's: device us per step each, the kernels only
    one of them launched, and the largest per-kernel differences (us per step)."""
    if not base or not other or "kernels" not in base or "kernels" not in other:
        return {}
    names = set(base["kernels"]) | set(other["kernels"])
    deltas = {n: round(other["kernels"].get(n, [0.0])[0] - base["kernels"].get(n, [0.0])[0], 2) for n in names}
    return {
        "device_us_per_step": [base["device_us_per_step"], other["device_us_per_step"]],
        "launches_per_step": [base["launches_per_step"], other["launches_per_step"]],
        "only_vllm": sorted(set(base["kernel_names"]) - set(other["kernel_names"])),
        "only_this": sorted(set(other["kernel_names"]) - set(base["kernel_names"])),
        "largest_deltas": sorted(deltas.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:8],
    }


def correctness_requests(part, vocab: int, shift: int = 0) -> list[tuple[list[int], int]]:
    """The correctness pass's requests for ``part``'s ``(length, output length)`` (``shift`` 1:
    the warm-up pass's, other tokens of the same lengths)."""
    out = []
    for index, (length, osl) in enumerate(part):
        if index % 2:
            ids = [(t + 97 * shift) % (vocab - 20) + 10 for t in range(1, 1 + length)]
        else:
            ids = [(7 * j + index + 13 * shift) % (vocab - 20) + 10 for j in range(length)]
        out.append((ids, osl))
    return out


def kernel_configs() -> dict[str, str]:
    """The launch config each autotuned kernel of this process runs: Triton's ``@autotune``
    kernels (vLLM's Mamba2 SSD, FLA's) and inductor's compiled ones, by name. A choice made by
    timing differs between processes, and with it the last bits of a reduction."""
    import gc

    out: dict[str, str] = {}
    # only what this process loaded (importing inductor to look would take seconds): a module
    # not imported has no kernels
    tuner = getattr(sys.modules.get("triton.runtime.autotuner"), "Autotuner", None)
    inductor = getattr(sys.modules.get("torch._inductor.runtime.triton_heuristics"), "CachingAutotuner", None)
    if tuner is None and inductor is None:
        return out
    for obj in gc.get_objects():
        if tuner is not None and isinstance(obj, tuner):
            # a choice per shape key (best_config is only the last launch's)
            found = [(f"{obj.base_fn.__name__}{list(k)}", str(c)) for k, c in getattr(obj, "cache", {}).items()]
        elif inductor is not None and isinstance(obj, inductor) and len(obj.launchers) == 1:
            found = [(f"inductor:{obj.fn.__name__}", str(obj.launchers[0].config))]
        else:
            continue
        for name, config in found:
            key, n = name, 1
            while key in out and out[key] != config:  # one name, several kernels (inductor's per graph)
                n += 1
                key = f"{name}#{n}"
            out[key] = config
    return out


def _or_error(fn):
    """``fn()``, or its error as ``{"error": ...}``: a diagnostic never stops the process's workloads."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}


def _mixed_steps(llm) -> int:
    """Steps staged into mixed-step graphs so far, every chunkmeta builder summed (0 without)."""
    found = llm.collective_rpc(wiring)[0]["builders"]
    return sum(s.get("mixed_steps", 0) for b in found.values() for s in b.get("stats", []))


def _why_not_engaged(after: dict) -> str:
    stats = [s for b in after["builders"].values() for s in b.get("stats", [])]
    causes = sorted({c for s in stats for key in ("mixed_fallbacks", "mixed_turned_away") for c in s.get(key, {})})
    if not any("mixed_steps" in s for s in stats):
        return "no chunkmeta builder with the mixed-step opt-in is in the engine"
    if causes:
        return "mixed steps stayed on vLLM's path: " + "; ".join(causes)
    if not any(s.get("mixed_buckets") for s in stats):
        return f"{after['runner']} has no mixed-step graph (the engine log says why)"
    return f"no mixed step was staged by {after['runner']}: no mixed batch replayed a FULL graph"


# ------------------------------------------------------------------ the parent: every (model, method), the record


def run_one(model: str, method: str, args, log_dir: Path, workloads: list[str] | None = None) -> dict:
    """One engine process (``workloads``: the call's unless given); its events, or why it stopped
    (the stage it had reached)."""
    workloads = args.workloads if workloads is None else workloads
    log = log_dir / f"engine_{model}_{method}.log"
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--model",
        model,
        "--method",
        method,
        "--engine",
        args.engine,
        "--workloads",
        ",".join(workloads),
        "--concurrency",
        format_concurrency(args.concurrency),
        "--deadline",
        str(args.deadline or 0),
        "--repeats",
        str(args.repeats),
        "--capture-sizes",
        ",".join(map(str, args.capture_sizes)),
    ]
    env = {**os.environ, **ENGINE_ENV, **METHOD_ENV[base_method(method)]}
    if args.engine == "fake":
        env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "tests" / "support"), env.get("PYTHONPATH", "")])
    timeout = args.engine_timeout_s
    if args.deadline:
        timeout = max(10.0, min(timeout, args.deadline - time.time() + 60))
    started = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc = None
    lines = log.read_text().splitlines()
    events = [json.loads(line[len(EVENT) :]) for line in lines if line.startswith(EVENT)]
    row = {"model": model, "method": method, "seconds": round(time.time() - started, 1), "events": events}
    graphs = graph_figures(lines)
    if graphs:
        row["graphs"] = graphs
    stage = events[-1]["event"] if events else "process start"
    if rc is None:
        row["error"] = f"ran past {timeout:.0f} s after stage {stage!r}"
    elif rc != 0:
        tail = [line for line in lines if line.strip()][-3:]
        row["error"] = f"exit {rc} after stage {stage!r}: " + " | ".join(tail)[-600:]
    return row


# vLLM's own log lines at start-up (v1/worker/gpu/model_runner.py:1163, gpu_worker.py:1003): the
# last capture (the first is its memory profile's) and its pool against the profile's estimate
_CAPTURED = re.compile(r"Graph capturing finished in ([\d.]+) secs, took ([\d.]+) GiB")
_POOL = re.compile(r"CUDA graph pool memory: ([\d.]+) GiB \(actual\), ([\d.]+) GiB \(estimated\)")


def graph_figures(lines: list[str]) -> dict:
    """The engine's CUDA graph capture seconds and GiB, and its pool's actual and estimated GiB,
    from vLLM's log lines (what a start-up spends on graphs; empty where vLLM logged none)."""
    out = {}
    for line in lines:
        if found := _CAPTURED.search(line):
            out["capture_s"], out["capture_gib"] = float(found[1]), float(found[2])
        if found := _POOL.search(line):
            out["pool_gib"], out["pool_estimated_gib"] = float(found[1]), float(found[2])
    return out


def base_method(method: str) -> str:
    """``vllm#2`` (a method's second run in one call, the noise it shows) -> ``vllm``."""
    return method.partition("#")[0]


def label_repeats(methods: list[str]) -> list[str]:
    """``[vllm, chunkmeta, vllm]`` -> ``[vllm, chunkmeta, vllm#2]``."""
    seen: dict[str, int] = {}
    out = []
    for method in methods:
        seen[method] = seen.get(method, 0) + 1
        out.append(method if seen[method] == 1 else f"{method}#{seen[method]}")
    return out


def not_applicable(model: str, method: str) -> str | None:
    """Why a method does not apply to a model (no process is started for it), or None."""
    if not base_method(method).startswith("chunkmeta_graphs"):
        return None
    config = json.loads((MODELS_DIR / model / "config.json").read_text())
    from chunkmeta.integrations.vllm import full_graph

    patched = full_graph.KIMI_ARCHITECTURES | full_graph.QWEN_ARCHITECTURES | full_graph.MAMBA2_ARCHITECTURES
    if set(config.get("architectures", ())) & patched:
        return None
    return (
        f"{config.get('architectures')}: the mixed-step opt-in patches Kimi-Linear's, Qwen3-Next / Qwen3.5's "
        "and MambaMixer2's layers only"
    )


def _event(row: dict, name: str) -> dict | None:
    return next((e for e in row["events"] if e["event"] == name), None)


def summarize(rows: list[dict]) -> dict:
    """The record's figures: per (model, workload, concurrency) each method's serving figures and
    chunkmeta's ratios to vLLM; per model the logprob comparison and each method's status."""
    keys = (
        "total_tok_s",
        "output_tok_s",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
        "median_itl_ms",
        "p99_itl_ms",
        "duration_s",
        "steps",
        "mean_step_ms",
        "p99_step_ms",
        "max_step_ms",
        "prefill_steps",
        "mean_prefill_step_ms",
        "mean_decode_step_ms",
        "prompts_in_graphs",
        "mean_ttft_in_graphs_ms",
        "prompts_over_graphs",
        "mean_ttft_over_graphs_ms",
        "compiles",
        "autotunes",
        "compile_s",
        "autotune_s",
        "kernels",
        "mixed_steps",
        "warmup_triton",
        "runs",
    )
    table: dict[tuple, dict] = {}
    methods: dict[str, dict] = {}
    correctness: dict[str, dict] = {}
    for row in rows:
        model, method = row["model"], row["method"]
        status = {"seconds": row["seconds"]}
        for name in ("engine_ready", "weights", "not_engaged"):
            event = _event(row, name)
            if event:
                status.update({k: v for k, v in event.items() if k not in ("event", "t")})
        for key in ("error", "not_applicable", "graphs"):
            if key in row:
                status[key] = row[key]
        final = _event(row, "final") or _event(row, "wiring_after_correctness") or _event(row, "wiring")
        if final:
            status["builders"] = {k: v["count"] for k, v in final["builders"].items()}
            status["runner"] = final.get("runner")
            if "stats" in final:
                stats = final["stats"]
                status["chunkmeta"] = {k: stats.get(k) for k in ("builders", "active", "builds", "served", "fallbacks")}
            captures = next(
                (
                    s["graph_captures"]
                    for b in final["builders"].values()
                    for s in b.get("stats", [])
                    if s.get("graph_captures")
                ),
                None,
            )
            if captures:  # each graph vLLM captured, timed by chunkmeta's start-up (mixed-step graphs on)
                status["graph_captures"] = captures
                status["graph_capture_totals"] = capture_totals(captures)
        check = _event(row, "correctness")
        if check:
            status["syncs"] = check.get("syncs")
            status["correctness_mixed_steps"] = check.get("mixed_steps")
            correctness.setdefault(model, {})[method] = check | {"weights_digest": status.get("digest")}
        profile = _event(row, "decode_profile")
        if profile:
            status["decode_profile"] = {k: v for k, v in profile.items() if k not in ("event", "t")}
        methods.setdefault(model, {})[method] = status
        for event in row["events"]:
            if event["event"] == "workload":
                cell = table.setdefault((model, event["workload"], event["concurrency"]), {})
                cell[method] = {k: event[k] for k in keys if k in event}
    out_rows = []
    for (model, workload, concurrency), cells in table.items():
        entry = {"model": model, "workload": workload, "concurrency": concurrency, "methods": cells}
        base = cells.get("vllm")
        for method, cell in cells.items():
            if method == "vllm" or base is None:
                continue
            entry[f"{method}_vs_vllm"] = {
                "tok_s_gain_pct": round(100 * (cell["total_tok_s"] / base["total_tok_s"] - 1), 2),
                "ttft_ratio": round(base["mean_ttft_ms"] / cell["mean_ttft_ms"], 3),
                "tpot_ratio": round(base["mean_tpot_ms"] / cell["mean_tpot_ms"], 3) if "mean_tpot_ms" in cell else None,
            }
        out_rows.append(entry)
    profiles = {
        model: {
            method: compare_decode_profiles(by_method["vllm"].get("decode_profile"), status.get("decode_profile"))
            for method, status in by_method.items()
            if method != "vllm"
        }
        for model, by_method in methods.items()
        if "vllm" in by_method
    }
    return {
        "rows": out_rows,
        "methods": methods,
        "logprobs": {m: compare_logprobs(c) for m, c in correctness.items()},
        "decode_profiles": profiles,
    }


def first_divergence(base: list[dict], check: list[dict], names=("first", "second")) -> dict:
    """Two passes' requests (``tokens``, ``logprobs`` each): equal, or where they first differ."""
    first = None
    for i, (ra, rb) in enumerate(zip(base, check, strict=False)):
        for j, (a, b, x, y) in enumerate(zip(ra["tokens"], rb["tokens"], ra["logprobs"], rb["logprobs"], strict=False)):
            if a != b or x != y:
                first = {"request": i, "position": j, names[0]: [a, x], names[1]: [b, y]}
                break
        if first or len(ra["tokens"]) != len(rb["tokens"]):
            first = first or {"request": i, "lengths": [len(ra["tokens"]), len(rb["tokens"])]}
            break
    if first is None and len(base) != len(check):
        first = {"requests": [len(base), len(check)]}
    return {"identical": first is None, "first_divergence": first}


def _requests_of(check: dict) -> list[dict]:
    return [{"tokens": t, "logprobs": lp} for t, lp in zip(check["tokens"], check["logprobs"], strict=True)]


def capture_totals(captures: list[dict]) -> dict:
    """Graphs, seconds and GiB of the captures, chunkmeta's mixed-step graphs and vLLM's apart."""
    out = {}
    for who, mine in (("chunkmeta", True), ("vllm", False)):
        picked = [c for c in captures if c.get("chunkmeta") is mine]
        out[who] = {
            "graphs": len(picked),
            "seconds": round(sum(c["seconds"] for c in picked), 2),
            "gib": round(sum(c["bytes"] for c in picked) / 2**30, 3),
        }
    return out


def compare_logprobs(by_method: dict) -> dict:
    """Every method's greedy tokens and logprobs against vLLM's: equal, or where they first differ;
    each process's own repeat; the autotuned kernels whose configs differ from vLLM's process's
    (and how many were tuned in only one of the two); whether both drew the same weights."""
    base = by_method.get("vllm")
    out = {}
    if base is None:
        return {"note": "no vllm row to compare with"}
    distinct = len({t for req in base["tokens"] for t in req})
    out["distinct_tokens_vllm"] = distinct
    out["repeat_vllm"] = base.get("repeat")
    for method, check in by_method.items():
        if method == "vllm":
            continue
        out[method] = first_divergence(_requests_of(base), _requests_of(check), ("vllm", method))
        out[method]["repeat"] = check.get("repeat")
        ours, theirs = check.get("kernel_configs") or {}, base.get("kernel_configs") or {}
        out[method]["configs_differ"] = sorted(k for k in ours.keys() & theirs.keys() if ours[k] != theirs[k])
        # kernels (or shape keys) tuned in one of the two processes only: not compared above
        out[method]["configs_one_side"] = len(ours.keys() ^ theirs.keys())
        if isinstance(check.get("weights_digest"), str) and isinstance(base.get("weights_digest"), str):
            out[method]["weights_identical"] = check["weights_digest"] == base["weights_digest"]
    return out


def print_table(figures: dict) -> None:
    for model, methods in figures["methods"].items():
        for method, status in methods.items():
            flag = status.get("error") or status.get("reason") or status.get("not_applicable") or ""
            print(
                f"{model:12s} {method:17s} start {status.get('startup_s', '-')} s "
                f"({(status.get('startup_kernels') or {}).get('compiles', '-')} Triton compiles) "
                f"builders {status.get('builders')} "
                f"chunkmeta {status.get('chunkmeta')} syncs {status.get('syncs')} graphs {status.get('graphs')} "
                f"captures {status.get('graph_capture_totals')} {flag}"
            )
    print(
        f"{'model':12s} {'workload':8s} {'conc':>4s}  {'method':17s} {'tok/s':>9s} {'TTFT ms':>9s} "
        f"{'TPOT ms':>8s} {'step ms: prefill / decode':>26s}  vs vllm"
    )
    nan = float("nan")
    for row in figures["rows"]:
        for method, cell in row["methods"].items():
            ratio = row.get(f"{method}_vs_vllm")
            vs = f"{ratio['tok_s_gain_pct']:+.2f}% tok/s, TTFT {ratio['ttft_ratio']:.3f}x" if ratio else ""
            print(
                f"{row['model']:12s} {row['workload']:8s} {row['concurrency']:4d}  {method:17s} "
                f"{cell['total_tok_s']:9.1f} {cell.get('mean_ttft_ms', float('nan')):9.2f} "
                f"{cell.get('mean_tpot_ms', float('nan')):8.3f} "
                f"{cell.get('mean_prefill_step_ms') or nan:12.3f} / "
                f"{cell.get('mean_decode_step_ms') or nan:11.3f}  {vs}"
            )
    for model, check in figures["logprobs"].items():
        print(f"logprobs {model}: {json.dumps(check)}")
    for model, by_method in figures.get("decode_profiles", {}).items():
        print(f"decode steps {model} (us per step: vllm, method; kernels in one only): {json.dumps(by_method)}")


def parse_concurrency(text: str) -> dict[str, tuple[int, ...]]:
    """``seed:1/8,short:1/8/32`` -> ``{"seed": (1, 8), "short": (1, 8, 32)}``."""
    out = {}
    for item in filter(None, text.split(",")):
        name, _, values = item.partition(":")
        if name not in WORKLOADS or not values:
            raise ValueError(f"{item!r}: want WORKLOAD:C1/C2/..., WORKLOAD one of {', '.join(WORKLOADS)}")
        out[name] = tuple(int(v) for v in values.split("/"))
    return out


def format_concurrency(concurrency: dict) -> str:
    return ",".join(f"{name}:{'/'.join(map(str, values))}" for name, values in concurrency.items())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out")
    parser.add_argument("--models", default="qwen3_5,nemotron_h")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"of {', '.join(METHODS)}")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--concurrency", default="", help="concurrencies per workload, e.g. seed:1/8,short:1/8/32")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each workload; the figures are the last's")
    parser.add_argument("--engine", choices=("vllm", "fake"), default="vllm")
    parser.add_argument("--engine-timeout-s", type=float, default=540.0)
    parser.add_argument("--budget-s", type=float, default=0.0, help="stop starting engines past this (0: none)")
    parser.add_argument("--start-reserve-s", type=float, default=START_RESERVE_S, help="budget an engine start needs")
    parser.add_argument("--smoke", action="store_true", help="CPU: the stand-in engine, small workloads")
    parser.add_argument(
        "--no-prime", dest="prime", action="store_false",
        help=f"no {PRIME} process before each model's methods (the first compared one then starts cold)",
    )  # fmt: skip
    parser.add_argument(
        "--capture-sizes", default="", help="CUDA graph capture sizes for every method, e.g. 1,2,4,...,256,384,512"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    try:
        args.concurrency = parse_concurrency(args.concurrency)
        args.capture_sizes = tuple(int(n) for n in args.capture_sizes.split(",") if n)
        if any(n < 1 for n in args.capture_sizes):
            raise ValueError("a capture size is a positive token count")
    except ValueError as exc:
        parser.error(f"--concurrency / --capture-sizes: {exc}")
    unknown = [w for w in args.workloads if w not in WORKLOADS] + [
        m for m in args.methods.split(",") if base_method(m) not in METHODS
    ]
    if unknown:
        parser.error(f"unknown workload or method: {unknown}")
    if args.child:
        return child(args)
    if args.smoke:
        args.engine = "fake"
        args.concurrency = {w: (1, 2) for w in args.workloads} | args.concurrency
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.deadline = time.time() + args.budget_s if args.budget_s else 0.0
    rows = []
    for i, model in enumerate(args.models.split(",")):
        order = label_repeats(args.methods.split(","))
        order = order if i % 2 == 0 else order[::-1]  # alternate the order between models
        for method in [PRIME, *order] if args.prime else order:
            if args.deadline and time.time() > args.deadline - args.start_reserve_s:
                rows.append(
                    {
                        "model": model,
                        "method": method,
                        "seconds": 0,
                        "events": [],
                        "error": "not started: too little of the time budget left",
                    }
                )
                continue
            reason = not_applicable(model, method)
            if reason:
                rows.append({"model": model, "method": method, "seconds": 0, "events": [], "not_applicable": reason})
                continue
            rows.append(run_one(model, method, args, out, workloads=[] if method == PRIME else None))
            print(f"{model} {method}: {rows[-1].get('error', 'ok')} ({rows[-1]['seconds']} s)", flush=True)
    figures = summarize(rows)
    figures["engine_args"] = engine_args(args.capture_sizes) | {"per_model": MODEL_ARGS}
    figures["engine_env"] = ENGINE_ENV
    figures["engine"] = args.engine
    figures["standins"] = _standins()
    (out / "vllm_engine_rows.json").write_text(json.dumps(rows, indent=1, default=str))
    print_table(figures)
    record = runs.save("vllm_engine", figures, script="bench/vllm_engine.py", argv=argv, out=out)
    print(f"record {record['id']}")
    return 0 if all("error" not in r for r in rows) else 1


def _standins() -> list[str]:
    """What stands in for vLLM's compiled pieces on this machine (the same for every method)."""
    try:
        import vllm_c_standins
    except ImportError:
        return []
    return [f"torch.ops._C.{name}" for name in vllm_c_standins.SCHEMAS] + ["vllm.vllm_flash_attn._vllm_fa2_C (empty)"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
