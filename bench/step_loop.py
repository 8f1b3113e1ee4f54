"""An engine-like prefill step loop on one GPU: FLA's default path against chunkmeta.

    python bench/step_loop.py --out DIR [--layers 8] [--steps 30]

Per step, as an engine runs it: the scheduler writes the step's ``query_start_loc`` into a pinned
host buffer and copies it to the device (non-blocking); the metadata is made (method-specific);
then ``--layers`` layers of [input projection GEMM, FLA KDA forward, output projection GEMM]
run, and the step ends waiting for its result (engines copy sampled tokens back once a step).
The host never waits anywhere else unless the method forces it.

Methods (interleaved step by step: A B C A B C ...):
* ``fla``             FLA derives the metadata itself in the first layer (one sync per step);
* ``chunkmeta``       ``ChunkMetadataBuilder.build`` once per step, shared by every layer;
* ``chunkmeta_graph`` the metadata build replayed from a captured CUDA graph (tail-padded layout).

Reports ms per step (median), tokens/s, the ratio to ``fla``, and the GPU idle time per step
from a profiler trace (the time inside a step's GPU span not covered by any kernel or copy).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from chunkmeta import ChunkMetadataBuilder, GraphBuild
from chunkmeta.integrations import kda
from chunkmeta.timing import median
from chunkmeta.workloads import workload

# (name, sequences, tokens): light load first, where the stall matters most
LOADS = [("1x128", 1, 128), ("1x512", 1, 512), ("4x512", 4, 512), ("8x1k", 8, 1024), ("8x4k", 8, 4096),
         ("32x8k", 32, 8192), ("64x16k", 64, 16384), ("128x32k", 128, 32768)]
METHODS = ("fla", "chunkmeta", "chunkmeta_graph")
HEADS, DIM = 16, 128
MODEL = HEADS * DIM
KDA_KW = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
              output_final_state=True)


class Engine:
    """Weights, static buffers and one prefill step per method, for one load."""

    def __init__(self, num_seqs: int, num_tokens: int, layers: int, max_seqs: int, max_tokens: int):
        import fla.ops.kda as fla_kda

        self.fla_kda = fla_kda
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.batch = workload(num_seqs, num_tokens, seed=num_seqs)
        self.num_seqs, self.num_tokens = num_seqs, num_tokens
        self.w_in = [torch.randn(MODEL, 4 * MODEL + HEADS, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
                     for _ in range(layers)]
        self.w_out = [torch.randn(MODEL, MODEL, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
                      for _ in range(layers)]
        self.x = torch.randn(num_tokens, MODEL, device="cuda", dtype=torch.bfloat16, generator=gen)
        # the scheduler's buffers: pinned host + static device query_start_loc (engines keep both)
        self.qsl_pinned = torch.zeros(max_seqs + 1, dtype=torch.int32, pin_memory=True)
        self.qsl_device = torch.zeros(max_seqs + 1, dtype=torch.int32, device="cuda")
        self.builder = ChunkMetadataBuilder(max_seqs, max_tokens, device="cuda")
        self.graph = GraphBuild(self.builder, self.qsl_device, pad="tail")
        self.graph.capture()
        padded = self.builder.padded_num_seqs["tail"]
        self.states = torch.zeros(max(padded, num_seqs), HEADS, DIM, DIM, device="cuda", dtype=torch.float32)

    def schedule(self):
        """The scheduler's part: host query_start_loc -> pinned -> device (non-blocking)."""
        n = self.num_seqs
        self.qsl_pinned[: n + 1].copy_(torch.tensor(self.batch.query_start_loc, dtype=torch.int32))
        self.qsl_device[: n + 1].copy_(self.qsl_pinned[: n + 1], non_blocking=True)
        # fresh views each step, as engines slice their buffers (FLA caches by tensor identity)
        return self.qsl_device[: n + 1], self.qsl_pinned[: n + 1]

    def layer(self, h, index, attention):
        proj = h @ self.w_in[index]
        t = h.shape[0]
        q, k, v, g = (proj[:, i * MODEL:(i + 1) * MODEL].view(1, t, HEADS, DIM) for i in range(4))
        beta = proj[:, 4 * MODEL:].view(1, t, HEADS)
        g = -5.0 * torch.sigmoid(g.float()).to(torch.bfloat16)
        o, _ = attention(q, k, v, g, beta)
        return o.reshape(t, MODEL) @ self.w_out[index]

    def step(self, method: str):
        qsl, qsl_cpu = self.schedule()
        n = self.num_seqs
        if method == "fla":
            def attention(q, k, v, g, beta):
                return self.fla_kda.chunk_kda(q, k, v, g, beta, initial_state=self.states[:n], cu_seqlens=qsl,
                                              **KDA_KW)
        elif method == "chunkmeta":
            md = self.builder.build(qsl, qsl_cpu)

            def attention(q, k, v, g, beta):
                return kda.chunk_kda(q, k, v, g, beta, metadata=md, initial_state=self.states[:n], **KDA_KW)
        else:
            md = self.graph.replay(qsl_cpu)
            padded = md.cu_seqlens.shape[0] - 1

            def attention(q, k, v, g, beta):
                return kda.chunk_kda(q, k, v, g, beta, metadata=md, initial_state=self.states[:padded], **KDA_KW)
        h = self.x
        for index in range(len(self.w_in)):
            h = self.layer(h, index, attention)
        return h


def gpu_idle_us_per_step(prof, steps: int) -> float:
    """Per step: GPU span (first kernel start to last kernel end) minus the time covered by
    kernels and copies. Steps are separated by a host sync, whose gap is excluded."""
    intervals = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA)
    if not intervals:
        return float("nan")
    # split into steps at the largest gaps (the end-of-step syncs)
    gaps = sorted(((intervals[i + 1][0] - intervals[i][1], i) for i in range(len(intervals) - 1)), reverse=True)
    cuts = sorted(i for _, i in gaps[: steps - 1])
    idle, start = 0.0, 0
    for cut in cuts + [len(intervals) - 1]:
        chunk = intervals[start: cut + 1]
        covered, end = 0.0, chunk[0][0]
        for s, e in chunk:
            if e > end:
                covered += e - max(s, end)
                end = e
        idle += (chunk[-1][1] - chunk[0][0]) - covered if len(chunk) > 1 else 0.0
        start = cut + 1
    return idle / steps


def run_load(name, num_seqs, num_tokens, layers, steps):
    engine = Engine(num_seqs, num_tokens, layers, max_seqs=256, max_tokens=32768)
    stream = torch.cuda.current_stream()
    outputs = {}
    for method in METHODS:  # warm-up: compile and autotune outside the timed steps
        for _ in range(2):
            outputs[method] = engine.step(method)
        stream.synchronize()
    # the three methods compute the same thing
    same = all(torch.equal(outputs[m], outputs["fla"]) for m in METHODS)
    times = {m: [] for m in METHODS}
    for r in range(steps):
        order = METHODS[r % 3:] + METHODS[: r % 3]
        for method in order:
            start = time.perf_counter()
            engine.step(method)
            stream.synchronize()  # the end-of-step wait for sampled tokens
            times[method].append((time.perf_counter() - start) * 1e3)
    idle = {}
    from torch.profiler import ProfilerActivity, profile

    for method in METHODS:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                engine.step(method)
                stream.synchronize()
        idle[method] = gpu_idle_us_per_step(prof, 5)
    row = {"load": name, "num_seqs": num_seqs, "num_tokens": num_tokens, "bit_identical": same}
    for method in METHODS:
        ms = median(times[method])
        row[method] = {"ms_per_step": ms, "tokens_per_s": num_tokens / ms * 1e3, "gpu_idle_us": idle[method],
                       "ratio_to_fla": median(times["fla"]) / ms}
    del engine
    torch.cuda.empty_cache()
    return row


def format_table(rows, meta) -> str:
    lines = [f"# step loop: {meta['device']}, {meta['layers']} layers of [GEMM + FLA KDA (H={HEADS}, K=V={DIM}) + GEMM], "
             f"bf16, {meta['steps']} steps per method, medians; {meta['date']}", "",
             "| load | method | ms/step | tokens/s | speed-up vs fla | GPU idle µs/step | outputs identical |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        for method in METHODS:
            m = row[method]
            lines.append(f"| {row['load']} | {method} | {m['ms_per_step']:.3f} | {m['tokens_per_s']:,.0f} | "
                         f"{m['ratio_to_fla']:.3f}x | {m['gpu_idle_us']:.0f} | {'yes' if row['bit_identical'] else 'NO'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--loads", default="all")
    args = parser.parse_args()
    loads = LOADS if args.loads == "all" else [l for l in LOADS if l[0] in args.loads.split(",")]
    rows = [run_load(name, n, t, args.layers, args.steps) for name, n, t in loads]
    meta = {"device": torch.cuda.get_device_name(), "layers": args.layers, "steps": args.steps,
            "torch": torch.__version__, "fla": kda.fla_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": " ".join(sys.argv)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_loop.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(format_table(rows, meta))
    return 0 if all(r["bit_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
