"""chunkmeta against the anchors, side by side, on one GPU (issue: GPU latency).

    python bench/gpu_compare.py --out DIR [--rounds 30] [--chunk-size 64]

For each workload (sequences, tokens) and method it measures, interleaving the methods round by
round (A B C ... A B C ...):

* host µs, queue idle: wall time of single calls issued back to back (no sync in between);
* host µs, queue busy: wall time of one call issued behind ~1 ms of queued GPU work (a sync
  shows as waiting for the queue);
* device µs per call: CUDA events around 100 calls queued behind a sleep kernel (host ahead);
* whether the result equals ``chunkmeta.reference`` (real rows; padded layouts' padding too).

Prints a table (medians, p99, ratios to chunkmeta's builder) and a host-time breakdown of
chunkmeta's build; writes its record (bench/results.py: ``gpu_compare.runs.jsonl``) and
``latency.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import anchors
import results as runs  # bench/results.py: the record format

import chunkmeta
from chunkmeta import ChunkMetadataBuilder, reference
from chunkmeta.fill import cuda_fill
from chunkmeta.integrations import kda
from chunkmeta.timing import busy_queue, device_us_per_call, median, percentile
from chunkmeta.workloads import workload

WORKLOADS = [(1, 4096), (8, 4096), (128, 4096), (128, 32768), (1024, 65536), (1, 196608), (4096, 1048576)]
CHUNKMETA = ["chunkmeta", "chunkmeta_graph", "chunkmeta_oneshot"]
SYNCING = {"fla_sync", "fla_host"}


def capture_trivial_graph():
    """One captured CUDA graph of one small kernel (bench/diagnostics/graph_floor.py: once three
    are captured, every launch costs the GPU more, even after they are freed)."""
    g = torch.cuda.CUDAGraph()
    y = torch.zeros(4, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        y.add_(1)
    return g, y


def capacity_for(num_seqs: int, num_tokens: int) -> tuple[int, int]:
    """The builder capacity an engine serving this load would configure."""
    return max(256, num_seqs), max(8192, num_tokens)


def chunkmeta_methods(pkg, qsl, qsl_cpu, num_seqs: int, num_tokens: int, chunk_size: int, device: str = "cuda"):
    """The builder and the ``CHUNKMETA`` methods of one workload as zero-argument calls, made by
    ``pkg``: this tree's chunkmeta, or an old tree's loaded beside it
    (bench/diagnostics/ab_host.py). The graph replay is captured here, on CUDA only."""
    cap_seqs, cap_tokens = capacity_for(num_seqs, num_tokens)
    builder = pkg.ChunkMetadataBuilder(cap_seqs, cap_tokens, chunk_size=chunk_size, device=device)
    methods = {"chunkmeta": lambda: builder.build(qsl, qsl_cpu)}
    if device == "cuda":
        static_qsl = torch.zeros(cap_seqs + 1, dtype=torch.int32, device=device)
        static_qsl[: qsl.shape[0]].copy_(qsl)
        graph = pkg.GraphBuild(builder, static_qsl)
        graph.capture()
        methods["chunkmeta_graph"] = lambda: graph.replay(qsl_cpu)
    methods["chunkmeta_oneshot"] = lambda: pkg.build_chunk_metadata(qsl, qsl_cpu, chunk_size=chunk_size)
    return builder, methods


def compare_workload(num_seqs: int, num_tokens: int):
    """``(key, batch)``: a workload's name in the records and its batch, the same in every
    benchmark that measures gpu_compare's workloads (bench/diagnostics/ab_host.py too)."""
    return f"{num_seqs}x{num_tokens // 1024}k", workload(num_seqs, num_tokens, seed=num_seqs)


class Case:
    """One workload: inputs on the device and host, and every method as a zero-argument call."""

    def __init__(self, num_seqs: int, num_tokens: int, chunk_size: int):
        self.key, self.batch = compare_workload(num_seqs, num_tokens)
        self.chunk_size = chunk_size
        self.ref = reference.chunk_metadata(self.batch.query_start_loc, chunk_size)
        self.qsl_cpu = torch.tensor(self.batch.query_start_loc, dtype=torch.int32)
        self.qsl = self.qsl_cpu.cuda()
        self.builder, self.methods = chunkmeta_methods(
            chunkmeta, self.qsl, self.qsl_cpu, num_seqs, num_tokens, chunk_size
        )
        # FLA caches by tensor identity (last 4 calls): cycle through more distinct tensors than that
        self.cu_pool = [self.qsl.clone() for _ in range(8)]
        self.cu_cpu = self.qsl_cpu.clone()
        self.turn = 0
        for name, make in anchors.ANCHORS.items():
            fn = make(chunk_size)
            self.methods[name] = lambda fn=fn: fn(self._fresh_cu(), self.cu_cpu)

    def _fresh_cu(self):
        self.turn = (self.turn + 1) % len(self.cu_pool)
        return self.cu_pool[self.turn]

    def check(self, name: str) -> bool:
        """Run the method once and compare with the reference (reads device memory)."""
        out = self.methods[name]()
        ref = self.ref
        if name in CHUNKMETA:
            indices, offsets, cu = out.chunk_indices, out.chunk_offsets, out.cu_seqlens
            if out.padded:
                rows = [tuple(r) for r in indices.cpu().tolist()]
                pad = rows[ref.num_chunks :]
                cu_l = cu.cpu().tolist()
                return (
                    rows[: ref.num_chunks] == ref.chunk_indices
                    and all(cu_l[s] == cu_l[s + 1] and t == 0 for s, t in pad)
                    and offsets.cpu().tolist()[: ref.num_seqs + 1] == ref.chunk_offsets
                    and cu_l[: ref.num_seqs + 1] == ref.cu_seqlens
                )
            if cu.cpu().tolist() != ref.cu_seqlens:
                return False
        else:
            indices, offsets = out
        rows = [tuple(r) for r in indices.cpu().tolist()]
        if name == "fla_static":  # capacity-shaped: real rows, then (-1, 0)
            return (
                rows[: ref.num_chunks] == ref.chunk_indices
                and all(r == (-1, 0) for r in rows[ref.num_chunks :])
                and offsets.cpu().tolist() == ref.chunk_offsets
            )
        return (
            rows == ref.chunk_indices
            and offsets.cpu().tolist() == ref.chunk_offsets
            and indices.dtype == torch.int32
            and offsets.dtype == torch.int64
        )


def host_idle(fn, calls: int) -> list[float]:
    samples = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    return samples


def host_busy(fn) -> float:
    torch.cuda.synchronize()
    busy_queue(1000.0)
    start = time.perf_counter_ns()
    fn()
    elapsed = (time.perf_counter_ns() - start) / 1e3
    torch.cuda.synchronize()
    return elapsed


def engine_steps(case: Case, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inputs as an engine passes them: every step a new batch of the workload's N sequences
    (new lengths, T in [T/2, T], so a new row count nearly every step: the builder's row views
    are made, its sequence-count views reused), each as fresh prefix views of device and host
    buffers sized for the builder's capacity."""
    rng = torch.Generator().manual_seed(case.ref.num_seqs)
    n, num_tokens = case.ref.num_seqs, case.ref.num_tokens
    cap = case.builder.capacity.seqs + 1
    steps = []
    for k in range(count):
        t = int(torch.randint(max(n, num_tokens // 2), num_tokens + 1, (1,), generator=rng))
        qsl_cpu = torch.zeros(cap, dtype=torch.int32)
        qsl_cpu[: n + 1] = torch.tensor(workload(n, t, seed=k).query_start_loc, dtype=torch.int32)
        steps.append((qsl_cpu.cuda()[: n + 1], qsl_cpu[: n + 1]))
    return steps


def triton_launcher(builder: ChunkMetadataBuilder, query_start_loc: torch.Tensor, num_seqs: int, num_chunks: int):
    """A call of Triton's own launcher alone on the builder's exact-layout step kernel (the one its
    first build compiled), writing ring slot 0; None without a direct launcher (then launch()
    launches nothing: timing it would read ~0 µs)."""
    steps = builder.step_builder()
    fill = steps._fills.get((False, False))
    if fill is None:
        return None
    qsl = query_start_loc.data_ptr()
    dtypes = (query_start_loc.dtype, torch.int32, torch.int32)
    dummy = steps._dummy.data_ptr()
    args = (dtypes, (qsl, dummy, dummy, steps.ring.pointer(0), qsl), (0, num_seqs, 0, num_chunks, 0, 0, 0, 0, 0))
    return (lambda: fill.launch(*args)) if fill.launch(*args) else None


def host_breakdown(case: Case, reps: int = 2000) -> dict[str, float]:
    """Where chunkmeta's build host time goes (medians of per-call times, µs): the build, the C
    step build alone (``native.step``, the one call ``build()`` makes once a layout's kernel is
    known), Triton's own launcher on the same kernel, the host plan (``builder.plan``), the
    ``ChunkMetadata`` constructor and an empty call."""
    b = case.builder
    b.build(case.qsl, case.qsl_cpu)  # the C build's constants exist after a first build
    steps = engine_steps(case, reps + 101)  # no batch is seen twice
    turn = iter(range(1 << 62))
    n = case.ref.num_seqs
    nt = case.ref.num_chunks
    host = case.qsl_cpu.numpy()
    steps_builder = b.step_builder()
    c_step = steps_builder._c_step if b.native_kernel.get((None, case.qsl.dtype)) in ("cuda", "triton") else None
    built = b.build(case.qsl, case.qsl_cpu)
    cu, indices, offsets = built.cu_seqlens, built.chunk_indices, built.chunk_offsets
    parts = {
        "build": lambda: b.build(case.qsl, case.qsl_cpu),
        "build, fresh views": lambda: b.build(case.qsl[:], case.qsl_cpu[:]),
        "build, engine pattern (new N-sequence batch each call, as fresh views)": (
            lambda: b.build(*steps[next(turn) % len(steps)])
        ),
        "C step build via native.step (checks + plan + launch + host copy + ChunkMetadata + ring slot)": (
            (lambda: steps_builder._native.step(c_step, case.qsl, case.qsl_cpu, 0, None, None, None, None, None, False))
            if c_step
            else None
        ),
        "Triton launcher alone": triton_launcher(b, case.qsl, n, nt),
        "host plan via builder.plan": lambda: b.plan(host),
        "ChunkMetadata(...), general path only": lambda: chunkmeta.ChunkMetadata(
            cu_seqlens=cu,
            cu_seqlens_cpu=case.qsl_cpu,
            chunk_indices=indices,
            chunk_offsets=offsets,
            chunk_size=64,
            num_seqs=n,
            num_tokens=1,
            num_chunks=nt,
            max_seqlen=1,
            padding=None,
            generation=1,
            lease=b.ring,
            slot=0,
        ),
        "empty python call": lambda: None,
    }
    out = {}
    for name, fn in parts.items():
        if fn is None:
            continue
        for _ in range(100):
            fn()
        out[name] = median(host_idle(fn, reps))
    torch.cuda.synchronize()
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--workloads", default="all", help="comma list like 1x4,128x32 (seqs x k tokens)")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    workloads = WORKLOADS
    if args.workloads != "all":
        keep = set(args.workloads.split(","))
        workloads = [w for w in WORKLOADS if f"{w[0]}x{w[1] // 1024}" in keep]

    # An engine has captured dozens of CUDA graphs before it serves, and from the third one on
    # every kernel launch costs the GPU ~0.2 µs more (bench/diagnostics/graph_floor.py). Capturing
    # three here puts every workload on that engine-like floor, not only those after the third.
    warm_graphs = [capture_trivial_graph() for _ in range(3)]
    results = {}
    breakdowns = {}
    for num_seqs, num_tokens in workloads:
        case = Case(num_seqs, num_tokens, args.chunk_size)
        names = list(case.methods)
        matched = {name: (None if name == "floor" else case.check(name)) for name in names}
        for name in names:  # warm-up: compile, allocator, FLA's caches
            for _ in range(5):
                case.methods[name]()
        torch.cuda.synchronize()
        idle = {name: [] for name in names}
        busy = {name: [] for name in names}
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate: no method always first
            for name in order:
                idle[name] += host_idle(case.methods[name], 5)
                torch.cuda.synchronize()
                busy[name].append(host_busy(case.methods[name]))
        device = {}
        for name in names:
            torch.cuda.synchronize()
            # the queued sleep must outlast issuing every call, or the GPU idles between calls
            lead = 100 * max(50.0, 2.0 * median(idle[name]))
            device[name] = device_us_per_call(case.methods[name], calls=100, lead_us=lead, repeats=3)
        torch.cuda.synchronize()
        results[case.key] = {
            name: {
                "host_idle_p50": median(idle[name]),
                "host_idle_p99": percentile(idle[name], 99),
                "host_busy_p50": median(busy[name]),
                "host_busy_p99": percentile(busy[name], 99),
                "device_us": device[name],
                "matched": matched[name],
                "host_bound_device": name in SYNCING,
            }
            for name in names
        }
        results[case.key]["_workload"] = {
            "num_seqs": num_seqs,
            "num_tokens": num_tokens,
            "num_chunks": case.ref.num_chunks,
            "capacity": capacity_for(num_seqs, num_tokens),
            "c_build_kernel": case.builder.native_kernel.get((None, torch.int32)),
        }
        breakdowns[case.key] = host_breakdown(case)
        del case
        torch.cuda.empty_cache()

    figures = {
        "chunk_size": args.chunk_size,
        "rounds": args.rounds,
        "graphs_captured_first": len(warm_graphs),
        "results": results,
        "host_breakdown": breakdowns,
    }
    record = runs.save("gpu_compare", figures, script="bench/gpu_compare.py", argv=sys.argv[1:], out=args.out)
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "fla": kda.fla_version() or "not installed",
        "nvrtc": cuda_fill.nvrtc_version(),
        "date": record["date"],
        **figures,
    }
    print(format_table(results, meta))
    print(format_breakdown(breakdowns))
    _plot(results, out_dir / "latency.png")
    return (
        0 if all(m["matched"] is not False for w in results.values() for k, m in w.items() if k != "_workload") else 1
    )


def format_table(results: dict, meta: dict) -> str:
    lines = [
        f"# {meta['device']}  torch {meta['torch']}  triton {meta['triton']}  fla-core {meta['fla']}  "
        f"C={meta['chunk_size']}  rounds={meta['rounds']}  {meta['date']}  NVRTC {meta['nvrtc']}  "
        f"graphs captured first: {meta['graphs_captured_first']}",
        "",
        "| workload | method | host idle p50 (p99) µs | host busy p50 (p99) µs | device µs | "
        "x chunkmeta (idle / busy / device) | match |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, methods in results.items():
        base = methods["chunkmeta"]
        kernel = methods["_workload"].get("c_build_kernel")
        for name, m in methods.items():
            if name == "_workload":
                continue
            label = f"{name} [{kernel} kernel]" if name == "chunkmeta" and kernel else name
            device = f"{m['device_us']:.2f}" + (" (host-bound)" if m["host_bound_device"] else "")
            ratio = (
                f"{m['host_idle_p50'] / base['host_idle_p50']:.1f} / {m['host_busy_p50'] / base['host_busy_p50']:.1f}"
                f" / {m['device_us'] / base['device_us']:.1f}"
            )
            lines.append(
                f"| {key} | {label} | {m['host_idle_p50']:.1f} ({m['host_idle_p99']:.1f}) | "
                f"{m['host_busy_p50']:.1f} ({m['host_busy_p99']:.1f}) | {device} | {ratio} | "
                f"{ {True: 'yes', False: 'NO', None: 'n/a'}[m['matched']] } |"
            )
    return "\n".join(lines)


def format_breakdown(breakdowns: dict) -> str:
    lines = ["", "chunkmeta build, host µs by part (median of single calls):"]
    for key, parts in breakdowns.items():
        lines.append(f"  {key}: " + ", ".join(f"{name} {us:.2f}" for name, us in parts.items()))
    return "\n".join(lines)


def _plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    keys = list(results)
    names = [n for n in results[keys[0]] if n != "_workload"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    titles = ["host µs, queue idle (p50)", "host µs, queue busy (p50)", "device µs per build"]
    for ax, metric, title in zip(axes, ["host_idle_p50", "host_busy_p50", "device_us"], titles, strict=True):
        for name in names:
            ax.plot(
                range(len(keys)),
                [results[k][name][metric] for k in keys],
                marker="o",
                label=name,
                linewidth=2.5 if name == "chunkmeta" else 1,
            )
        ax.set_xticks(range(len(keys)), keys, rotation=30)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
