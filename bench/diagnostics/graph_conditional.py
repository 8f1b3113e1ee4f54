"""Can a captured step skip work it does not need? CUDA graph conditional (IF) nodes, through
torch's ``CUDAGraph.begin_capture_to_if_node``, with Triton kernels and torch ops inside the body.

Prints one JSON object (also ``OUT/graph_conditional.json``): whether the API exists, whether the
bodies run exactly when their device predicate says so (a ladder of levels, one taken per replay,
no sync under ``set_sync_debug_mode("error")``), and the replay time of a graph of ``--levels``
IF nodes of ``--kernels`` kernels each against the same kernels captured once without conditions.

    python3 bench/diagnostics/graph_conditional.py --out OUT
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl


@triton.jit
def _axpy(x, y, n, a, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y + offs, tl.load(y + offs, mask=mask) + a * tl.load(x + offs, mask=mask), mask=mask)


def _body(x, y, kernels, a):
    for _ in range(kernels):
        _axpy[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), a, BLOCK=1024)
    scratch = torch.empty_like(y)  # an allocation inside the body, from the graph's pool
    torch.mul(y, 1.0, out=scratch)
    y.copy_(scratch)


def _time(graph, reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        graph.replay()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--levels", type=int, default=8)
    parser.add_argument("--kernels", type=int, default=6)
    parser.add_argument("--numel", type=int, default=1 << 16)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    rec["api"] = hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node") and hasattr(
        torch.cuda.CUDAGraph, "get_currently_capturing_graph"
    )
    if rec["api"]:
        dev = torch.device("cuda")
        x = torch.randn(args.numel, device=dev)
        y = torch.zeros(args.numel, device=dev)
        level = torch.zeros((), dtype=torch.int64, device=dev)  # which body runs, staged per replay
        preds = torch.zeros(args.levels, dtype=torch.bool, device=dev)
        _body(x, y, args.kernels, 1.0)  # compile outside capture
        torch.cuda.synchronize()

        plain = torch.cuda.CUDAGraph()
        with torch.cuda.graph(plain):
            _body(x, y, args.kernels, 1.0)

        ladder = torch.cuda.CUDAGraph()
        with torch.cuda.graph(ladder):
            torch.eq(torch.arange(args.levels, device=dev), level, out=preds)
            capturing = torch.cuda.CUDAGraph.get_currently_capturing_graph()  # what a layer sees
            rec["capturing_graph_found"] = capturing is ladder
            for k in range(args.levels):
                capturing.begin_capture_to_if_node(preds[k])
                try:
                    _body(x, y, args.kernels, float(k + 1))
                finally:
                    capturing.end_capture_to_conditional_node()

        ok = True
        torch.cuda.set_sync_debug_mode("error")
        try:
            for k in list(range(args.levels)) + [args.levels]:  # the last: no body runs
                y.zero_()
                level.fill_(k)
                ladder.replay()
                want = x * args.kernels * (k + 1) if k < args.levels else torch.zeros_like(x)
                torch.cuda.set_sync_debug_mode("default")
                ok &= bool(torch.allclose(y, want))
                torch.cuda.set_sync_debug_mode("error")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        rec["ladder_exact"] = ok
        level.fill_(0)
        rec["plain_us"] = _time(plain, args.reps)
        rec["ladder_one_taken_us"] = _time(ladder, args.reps)
        level.fill_(args.levels)
        rec["ladder_none_taken_us"] = _time(ladder, args.reps)
        rec.update(levels=args.levels, kernels=args.kernels, numel=args.numel)
    print(json.dumps(rec))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "graph_conditional.json"), "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
