"""An engine-like prefill step loop on one GPU: FLA's default path against chunkmeta.

    python bench/step_loop.py --out DIR [--layers 8] [--steps 30] [--loads 1x128,8x4k]

Prints the table below and writes its record (bench/results.py) to ``DIR/step_loop.runs.jsonl``.

Per step, as an engine runs it: the scheduler writes the step's ``query_start_loc`` into a pinned
host buffer and copies it to the device (non-blocking) into a static buffer; the metadata is
made (method-specific); then ``--layers`` layers of [input projection GEMM, FLA KDA forward,
output projection GEMM] run, and the step ends waiting for its result (``stream.synchronize()``:
engines copy sampled tokens back once a step). The host never waits anywhere else unless the
method forces it.

Methods (interleaved step by step, the order rotating each round: A B C D, B C D A, ...):

* ``fla``                 FLA derives the metadata itself in the first layer: its
                          ``prepare_chunk_indices`` reads chunk counts back to the host
                          (``repeat_interleave`` without ``output_size``): the step syncs there;
* ``chunkmeta``           ``ChunkMetadataBuilder.build`` once per step (exact layout), shared by
                          every layer; the builder is sized to the engine's limits (256 sequences,
                          32k tokens), as engines size it to max_num_seqs / max_num_batched_tokens;
* ``chunkmeta_graph``     only the metadata build replayed from a captured CUDA graph
                          (``GraphBuild``, tail-padded layout), the layers eager;
* ``chunkmeta_cudagraph`` the whole step's GPU work after the scheduler's copy (the in-graph
                          metadata fill, ``GraphBuild.launch()``, and every layer) captured once
                          in one ``torch.cuda.CUDAGraph``; per step the host runs the scheduler's
                          copy, ``GraphBuild.prepare()`` (host counts + an 8-byte staging copy)
                          and ``replay()``. FLA's default path cannot be captured at all (its
                          metadata needs the sync), so this is what sync-free metadata enables.
                          If the capture fails, the row says so with the reason, and the run goes on.

Both graph methods use a builder sized to the load's bucket, (next_pow2(sequences),
next_pow2(tokens)), as engines capture one graph per batch-size bucket: the padded layout's grids
then cover the bucket, not the engine's whole capacity. ``initial_state`` has one row per padded
sequence for them (the eager methods use its first ``num_seqs`` rows; all rows are zero).

Reported per load and method:

* ms per step (median of ``--steps``), tokens/s, the speed-up over ``fla`` (ratio of medians),
  and whether the step's output is bit-identical to ``fla``'s (``torch.equal``);

and, from torch profiler traces of 5 more steps per method (medians over those steps): a trace
with CPU and CUDA activities, each step a ``record_function`` range that ends *before* the
end-of-step wait (DtoH copies, host blocked), and a CUDA-only trace, in which the host runs at
nearly its own pace (sync gap, GPU idle; each step starts at the scheduler's HtoD copy):

* DtoH copies/step: device-to-host memcpys on the GPU timeline (the end-of-step wait is no
  copy; ``fla``'s metadata derivation shows as DtoH memcpys: 2 per step on torch 2.11);
* sync gap µs/step: for each such copy, the GPU idle time from its end to the start of the next
  GPU activity (kernel, memcpy or memset) of the step: the drain-and-restart bubble of the sync;
* host blocked µs/step: host time inside the step spent in CUDA runtime calls that wait for the
  GPU: calls named ``*Synchronize*`` (stream, device, event) and ``cudaMemcpy*`` calls that were
  in flight while a DtoH copy ran on the GPU (a pageable DtoH copy returns only when it is done,
  so its call holds the wait). Overlapping calls count once. The end-of-step wait is outside
  the step's range, hence excluded;
* GPU idle µs/step: the step's GPU span (its first activity's start to its last one's end) minus
  the time covered by kernels and copies. It holds the sync gap and also every time the GPU
  waited for the host to launch the next kernel: eager FLA is host-bound at light load (~15
  Python-heavy launches per layer), so this figure is large there with or without a sync.

Recording CPU activity slows the host (every op is recorded), which is why the GPU-timeline
columns come from the CUDA-only pass.
"""

from __future__ import annotations

import argparse
import math
import sys
import traceback
from functools import partial
from statistics import median
from typing import NamedTuple

import results as runs  # bench/results.py: the record format
import torch

from chunkmeta import ChunkMetadataBuilder, GraphBuild
from chunkmeta.integrations import kda
from chunkmeta.timing import interleaved_ms
from chunkmeta.workloads import workload

# (name, sequences, tokens): light load first, where the stall matters most
LOADS = [
    ("1x128", 1, 128),
    ("1x512", 1, 512),
    ("4x512", 4, 512),
    ("8x1k", 8, 1024),
    ("8x4k", 8, 4096),
    ("32x8k", 32, 8192),
    ("64x16k", 64, 16384),
    ("128x32k", 128, 32768),
]
METHODS = ("fla", "chunkmeta", "chunkmeta_graph", "chunkmeta_cudagraph")
# the engine's limits (max_num_seqs, max_num_batched_tokens): the eager builder and the static
# query_start_loc buffer are sized to them
ENGINE_MAX_SEQS, ENGINE_MAX_TOKENS = 256, 32768
HEADS, DIM = 16, 128
MODEL = HEADS * DIM
KDA_KW = dict(
    use_qk_l2norm_in_kernel=True,
    use_beta_sigmoid_in_kernel=True,
    safe_gate=True,
    lower_bound=-5.0,
    output_final_state=True,
)
WARMUP_STEPS = 2  # per method: Triton compiles and FLA autotunes here, outside timing and capture
PROFILED_STEPS = 5
STEP_LABEL = "step_loop.step"  # the record_function range around each profiled step's host work


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def graph_bucket(num_seqs: int, num_tokens: int) -> tuple[int, int]:
    """The capacity an engine's graph for this batch would have: its batch-size bucket."""
    return next_pow2(max(1, num_seqs)), max(64, next_pow2(num_tokens))


class Engine:
    """Weights, the scheduler's buffers, and one prefill step per method, for one load."""

    def __init__(self, num_seqs: int, num_tokens: int, layers: int):
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        self.fla_chunk_kda = fla_chunk_kda
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.batch = workload(num_seqs, num_tokens, seed=num_seqs)
        self.num_seqs, self.num_tokens = num_seqs, num_tokens
        self.w_in = [
            torch.randn(MODEL, 4 * MODEL + HEADS, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
            for _ in range(layers)
        ]
        self.w_out = [
            torch.randn(MODEL, MODEL, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(layers)
        ]
        self.x = torch.randn(num_tokens, MODEL, device="cuda", dtype=torch.bfloat16, generator=gen)
        # the scheduler's buffers: pinned host + static device query_start_loc (engines keep both)
        self.qsl_pinned = torch.zeros(ENGINE_MAX_SEQS + 1, dtype=torch.int32, pin_memory=True)
        self.qsl_device = torch.zeros(ENGINE_MAX_SEQS + 1, dtype=torch.int32, device="cuda")
        self.builder = ChunkMetadataBuilder(ENGINE_MAX_SEQS, ENGINE_MAX_TOKENS, device="cuda")
        self.graph_capacity = graph_bucket(num_seqs, num_tokens)
        bucket = ChunkMetadataBuilder(*self.graph_capacity, device="cuda")
        self.metadata_graph = GraphBuild(bucket, self.qsl_device, pad="tail")
        self.metadata_graph.capture()
        # the whole-step graph's own GraphBuild: its fill is captured inside the step's graph
        self.step_metadata = GraphBuild(bucket, self.qsl_device, pad="tail")
        # FLA wants one initial state per sequence of cu_seqlens: the padded layout's count
        self.initial_state = torch.zeros(
            bucket.padded_num_seqs["tail"], HEADS, DIM, DIM, device="cuda", dtype=torch.float32
        )
        self.step_graph = None
        self.step_graph_output = None

    def schedule(self):
        """The scheduler's part: host query_start_loc -> pinned -> device (non-blocking)."""
        n = self.num_seqs
        self.qsl_pinned[: n + 1].copy_(torch.tensor(self.batch.query_start_loc, dtype=torch.int32))
        self.qsl_device[: n + 1].copy_(self.qsl_pinned[: n + 1], non_blocking=True)
        # fresh views each step, as engines slice their buffers (FLA caches by tensor identity)
        return self.qsl_device[: n + 1], self.qsl_pinned[: n + 1]

    def forward(self, attention):
        """The step's layers: [input GEMM, KDA through ``attention``, output GEMM] each."""
        h = self.x
        t = h.shape[0]
        for w_in, w_out in zip(self.w_in, self.w_out, strict=True):
            proj = h @ w_in
            q, k, v, g = (proj[:, i * MODEL : (i + 1) * MODEL].view(1, t, HEADS, DIM) for i in range(4))
            beta = proj[:, 4 * MODEL :].view(1, t, HEADS)
            g = -5.0 * torch.sigmoid(g.float()).to(torch.bfloat16)
            o, _ = attention(q, k, v, g, beta)
            h = o.reshape(t, MODEL) @ w_out
        return h

    def graph_forward(self):
        """What the whole-step graph holds: the in-graph metadata fill, then every layer."""
        metadata = self.step_metadata.launch()
        return self.forward(partial(kda.chunk_kda, metadata=metadata, initial_state=self.initial_state, **KDA_KW))

    def capture_step_graph(self) -> None:
        """Capture ``graph_forward`` once; raises whatever the capture raises."""
        _, qsl_cpu = self.schedule()
        # eager warm-up on a side stream (torch's recipe): compiles, autotunes, and leaves the
        # capture nothing that would sync
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self.step_metadata.prepare(qsl_cpu)
                self.graph_forward()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = self.graph_forward()
        self.step_graph, self.step_graph_output = graph, output

    def step(self, method: str) -> torch.Tensor:
        """Queue one step; returns its output (the graph's static output for the cudagraph)."""
        qsl, qsl_cpu = self.schedule()
        if method == "chunkmeta_cudagraph":
            self.step_metadata.prepare(qsl_cpu)
            self.step_graph.replay()
            return self.step_graph_output
        n = self.num_seqs
        if method == "fla":
            attention = partial(self.fla_chunk_kda, initial_state=self.initial_state[:n], cu_seqlens=qsl, **KDA_KW)
        elif method == "chunkmeta":
            attention = partial(
                kda.chunk_kda, metadata=self.builder.build(qsl, qsl_cpu), initial_state=self.initial_state[:n], **KDA_KW
            )
        else:
            attention = partial(
                kda.chunk_kda, metadata=self.metadata_graph.replay(qsl_cpu), initial_state=self.initial_state, **KDA_KW
            )
        return self.forward(attention)


# -- trace analysis (pure Python over (name, start µs, end µs) spans) -------------------------


class Span(NamedTuple):
    name: str
    start: float
    end: float


def may_block(name: str) -> bool:
    """A CUDA runtime/driver call that can wait for the GPU."""
    lowered = name.lower()
    return "synchronize" in lowered or lowered.startswith(("cudamemcpy", "cumemcpy"))


def trace_spans(events, device_type) -> tuple[list[Span], list[Span], list[Span]]:
    """Step ranges, GPU activities and host calls that may block, from profiler events
    (``FunctionEvent``: ``.name``, ``.device_type``, ``.time_range`` in µs)."""
    steps, gpu, host = [], [], []
    for event in events:
        span = Span(event.name, event.time_range.start, event.time_range.end)
        if event.device_type == device_type:
            # the profiler mirrors record_function ranges onto the GPU timeline: not GPU work
            if event.name != STEP_LABEL and not getattr(event, "is_user_annotation", False):
                gpu.append(span)
        elif event.name == STEP_LABEL:
            steps.append(span)
        elif may_block(event.name):
            host.append(span)
    return sorted(steps, key=lambda s: s.start), sorted(gpu, key=lambda s: s.start), host


def split_steps(steps: list[Span], gpu: list[Span], host: list[Span]):
    """Yield each step's (GPU activities, host calls). A step's GPU work starts after its range
    starts and ends before the next one starts (the end-of-step wait lies between); its host
    calls lie inside its range, which closes before the end-of-step wait."""
    limits = [s.start for s in steps[1:]] + [math.inf]
    for step, limit in zip(steps, limits, strict=True):
        yield (
            [g for g in gpu if step.start <= g.start < limit],
            [h for h in host if step.start <= h.start and h.end <= step.end],
        )


def covered_us(spans: list[Span]) -> float:
    """Length of the union of the spans."""
    covered, reach = 0.0, -math.inf
    for span in sorted(spans, key=lambda s: s.start):
        if span.end > reach:
            covered += span.end - max(span.start, reach)
            reach = span.end
    return covered


def idle_after(t: float, gpu: list[Span]) -> float:
    """GPU idle time from ``t`` to the next activity starting at or after ``t`` (0 if none)."""
    later = [g.start for g in gpu if g.start >= t]
    if not later:
        return 0.0
    busy_until = max((g.end for g in gpu if g.start < t), default=t)
    return max(0.0, min(later) - max(t, busy_until))


def step_metrics(gpu: list[Span], host: list[Span]) -> dict:
    """One step's DtoH copies and host blocked time (see the docstring)."""
    dtoh = [g for g in gpu if "dtoh" in g.name.lower()]
    waits = [
        h for h in host if "synchronize" in h.name.lower() or any(h.start < d.end and d.start < h.end for d in dtoh)
    ]
    return {"dtoh_copies_per_step": len(dtoh), "host_blocked_us": covered_us(waits)}


def trace_metrics(steps: list[Span], gpu: list[Span], host: list[Span]) -> dict:
    """Medians over the profiled steps of ``step_metrics`` (NaN if the trace has no steps)."""
    per_step = [step_metrics(g, h) for g, h in split_steps(steps, gpu, host)]
    keys = ("dtoh_copies_per_step", "host_blocked_us")
    return {key: median(m[key] for m in per_step) if per_step else math.nan for key in keys}


# -- the run --------------------------------------------------------------------------------


def warm_up(engine: Engine, methods) -> dict:
    """``WARMUP_STEPS`` steps per method; returns each method's last output."""
    outputs = {}
    for method in methods:
        for _ in range(WARMUP_STEPS):
            outputs[method] = engine.step(method)
    torch.cuda.synchronize()
    return outputs


def time_steps(engine: Engine, methods, steps: int) -> dict:
    """Wall ms of each step, methods interleaved step by step, the order rotating each round;
    each step ends with the end-of-step wait for sampled tokens."""
    return interleaved_ms(engine.step, methods, steps, wait=torch.cuda.current_stream().synchronize)


def split_at_step_copies(gpu: list[Span], steps: int) -> list[list[Span]]:
    """A CUDA-only trace of ``steps`` steps, cut into steps. Every step begins with the
    scheduler's host-to-device copy of ``query_start_loc`` and issues the same copies each time,
    so with k HtoD copies per step, step i starts at the (i*k)-th. (Gaps cannot tell steps apart:
    eager FLA leaves the GPU idle longer between its own launches than across a step boundary.)
    Empty if the copies do not divide evenly into the steps."""
    htod = [g for g in gpu if "htod" in g.name.lower()]
    if not htod or len(htod) % steps:
        return []
    k = len(htod) // steps
    starts = [htod[i * k].start for i in range(steps)] + [math.inf]
    return [[g for g in gpu if a <= g.start < b] for a, b in zip(starts, starts[1:], strict=False)]


def gpu_timeline_metrics(gpu: list[Span], steps: int) -> dict:
    """Sync gap and GPU idle per step from a CUDA-only trace of ``steps`` steps (medians).

    Without CPU activity the profiler barely slows the host, so these gaps are the loop's own."""
    per_step = [chunk for chunk in split_at_step_copies(gpu, steps) if chunk]
    if not per_step:
        return {"sync_gap_us": math.nan, "gpu_idle_us": math.nan}
    idle = [max(g.end for g in chunk) - chunk[0].start - covered_us(chunk) for chunk in per_step]
    sync_gap = [sum(idle_after(g.end, chunk) for g in chunk if "dtoh" in g.name.lower()) for chunk in per_step]
    return {"sync_gap_us": median(sync_gap), "gpu_idle_us": median(idle)}


def profile_method(engine: Engine, method: str) -> dict:
    """Trace metrics of ``PROFILED_STEPS`` steps of one method, from two profiled passes: CPU and
    CUDA activities (step ranges, DtoH copies, host calls that wait), then CUDA only (the GPU
    timeline at the loop's own pace: sync gap, GPU idle)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    stream = torch.cuda.current_stream()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            with record_function(STEP_LABEL):
                engine.step(method)
            stream.synchronize()  # outside the range: the end-of-step wait is not the method's
    metrics = trace_metrics(*trace_spans(prof.events(), torch.autograd.DeviceType.CUDA))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            engine.step(method)
            stream.synchronize()
    gpu = sorted(
        (
            Span(e.name, e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
        ),
        key=lambda g: g.start,
    )
    metrics.update(gpu_timeline_metrics(gpu, PROFILED_STEPS))
    return metrics


def run_load(name: str, num_seqs: int, num_tokens: int, layers: int, steps: int) -> dict:
    engine = Engine(num_seqs, num_tokens, layers)
    unavailable = {}
    try:
        engine.capture_step_graph()
    except Exception as exc:  # noqa: BLE001  (a failed capture is a result to report, not a reason to stop)
        traceback.print_exc()
        unavailable["chunkmeta_cudagraph"] = f"{type(exc).__name__}: {exc}"
    methods = [m for m in METHODS if m not in unavailable]
    outputs = warm_up(engine, methods)
    identical = {m: torch.equal(outputs[m], outputs["fla"]) for m in methods}
    times = time_steps(engine, methods, steps)
    traces = {m: profile_method(engine, m) for m in methods}
    fla_ms = median(times["fla"])
    row = {
        "load": name,
        "num_seqs": num_seqs,
        "num_tokens": num_tokens,
        "graph_capacity": {"max_num_seqs": engine.graph_capacity[0], "max_num_tokens": engine.graph_capacity[1]},
        "bit_identical": all(identical.values()),
    }
    for method in METHODS:
        if method in unavailable:
            row[method] = {"available": False, "error": unavailable[method]}
            continue
        ms = median(times[method])
        row[method] = {
            "available": True,
            "ms_per_step": ms,
            "tokens_per_s": num_tokens / ms * 1e3,
            "ratio_to_fla": fla_ms / ms,
            "identical_to_fla": identical[method],
            **traces[method],
        }
    del engine, outputs
    torch.cuda.empty_cache()
    return row


def format_table(rows, meta) -> str:
    lines = [
        f"# step loop: {meta['device']}, {meta['layers']} layers of [GEMM + FLA KDA (H={HEADS}, K=V={DIM}) + GEMM], "
        f"bf16, {meta['steps']} steps per method, medians; profiler metrics: medians of {PROFILED_STEPS} "
        f"profiled steps; {meta['date']}",
        "",
        "| load | method | ms/step | tokens/s | speed-up vs fla | DtoH copies/step | sync gap µs/step "
        "| host blocked µs/step | GPU idle µs/step | output = fla |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for method in METHODS:
            m = row[method]
            if not m["available"]:
                reason = m["error"].splitlines()[0].replace("|", "/")[:120] if m["error"] else "?"
                lines.append(f"| {row['load']} | {method} | not available: {reason} | | | | | | | |")
                continue
            lines.append(
                f"| {row['load']} | {method} | {m['ms_per_step']:.3f} | {m['tokens_per_s']:,.0f} | "
                f"{m['ratio_to_fla']:.3f}x | {m['dtoh_copies_per_step']:g} | {m['sync_gap_us']:.1f} | "
                f"{m['host_blocked_us']:.0f} | {m['gpu_idle_us']:.0f} | "
                f"{'yes' if m['identical_to_fla'] else 'NO'} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--loads", default="all", help="comma-separated load names, or 'all'")
    args = parser.parse_args()
    loads = LOADS if args.loads == "all" else [load for load in LOADS if load[0] in args.loads.split(",")]
    rows = [run_load(name, n, t, args.layers, args.steps) for name, n, t in loads]
    figures = {
        "layers": args.layers,
        "steps": args.steps,
        "profiled_steps": PROFILED_STEPS,
        "engine_capacity": [ENGINE_MAX_SEQS, ENGINE_MAX_TOKENS],
        "rows": rows,
    }
    record = runs.save("step_loop", figures, script="bench/step_loop.py", argv=sys.argv[1:], out=args.out)
    print(format_table(rows, dict(figures, device=record["device"].get("gpu"), date=record["date"])))
    return 0 if all(r["bit_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
