"""Stress run on one GPU: many random steps, every result checked, no sync per step.

    python bench/stress.py --steps 100000 --out DIR

Steps mix what engines do: decode-first batches (``build``), spec-decode-like slices (one-token
prefills and zero-length padding rows), padded layouts (``build_padded``, both pad modes) and
CUDA-graph replays (``GraphBuild.replay``). The reference (``chunkmeta.reference``, plain Python)
is computed on the host and sent to the device with a non-blocking copy from a ring of pinned
buffers; the device compares it with the step's tables and adds mismatching entries to a
counter on the device. The host reads the counter once at the end (and synchronizes only when it
wraps around the ring of pinned buffers, every ``--ring`` steps, never per step). Reports steps,
mismatches, steps/s and the CUDA allocator's memory at the start and the end, and writes them as
its record (bench/results.py) to ``DIR/stress.runs.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import results as runs  # bench/results.py: the record format
import torch

from chunkmeta import ChunkMetadataBuilder, GraphBuild, reference
from chunkmeta.workloads import from_lengths, random_decode_first

MAX_SEQS, MAX_TOKENS = 128, 16384


def spec_like(rng):
    """Spec decode in vLLM: plain decodes become one-token prefills; padding rows stay, zero-length."""
    lengths = [1] * int(rng.integers(0, 40)) + [int(n) for n in rng.integers(1, 600, int(rng.integers(0, 6)))]
    rng.shuffle(lengths)
    lengths += [0] * int(rng.integers(0, 8))
    return from_lengths(lengths[:MAX_SEQS] or [0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--ring", type=int, default=512, help="pinned reference buffers (host syncs once per ring)")
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", help="cuda; cpu runs a smoke test (graphs launched eagerly)")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()

    builder = ChunkMetadataBuilder(MAX_SEQS, MAX_TOKENS, device=device)
    static_qsl = torch.zeros(MAX_SEQS + 1, dtype=torch.int32, device=device)
    graphs = {pad: GraphBuild(builder, static_qsl, pad=pad) for pad in ("tail", "negative")}
    if on_cuda:
        for graph in graphs.values():
            graph.capture()
    rows, seqs = builder.capacity.rows, MAX_SEQS + 2
    # per ring slot: reference (indices, offsets, cu) in pinned memory, and the host qsl
    ref_idx = torch.zeros(args.ring, rows, 2, dtype=torch.int32, pin_memory=on_cuda)
    ref_off = torch.zeros(args.ring, seqs, dtype=torch.int64, pin_memory=on_cuda)
    ref_cu = torch.zeros(args.ring, seqs, dtype=torch.int32, pin_memory=on_cuda)
    qsl_pinned = torch.zeros(args.ring, MAX_SEQS + 1, dtype=torch.int32, pin_memory=on_cuda)
    dev_idx = torch.zeros(rows, 2, dtype=torch.int32, device=device)
    dev_off = torch.zeros(seqs, dtype=torch.int64, device=device)
    dev_cu = torch.zeros(seqs, dtype=torch.int32, device=device)
    mismatches = torch.zeros((), dtype=torch.int64, device=device)
    kinds = {"build": 0, "spec": 0, "padded_tail": 0, "padded_negative": 0, "graph_tail": 0, "graph_negative": 0}
    memory = torch.cuda.memory_allocated if on_cuda else (lambda: 0)
    memory_start = memory()
    start = time.perf_counter()

    for step in range(args.steps):
        slot = step % args.ring
        if slot == 0 and step and on_cuda:
            torch.cuda.current_stream().synchronize()  # the ring of pinned buffers wraps: reuse them
        kind = list(kinds)[int(rng.integers(0, len(kinds)))]
        kinds[kind] += 1
        batch = spec_like(rng) if kind == "spec" else random_decode_first(rng, MAX_SEQS, MAX_TOKENS)
        n_req = len(batch.query_start_loc)
        qsl_host = qsl_pinned[slot, :n_req]
        qsl_host.numpy()[:] = batch.query_start_loc
        qsl_dev = static_qsl[:n_req]
        qsl_dev.copy_(qsl_host, non_blocking=True)
        pad = kind.split("_")[1] if "_" in kind else None
        if kind.startswith("graph") and on_cuda:
            md = graphs[pad].replay(qsl_host, first_seq=batch.first_seq, num_seqs=batch.num_seqs)
        elif kind.startswith("graph"):  # no graphs on CPU: the same two halves, launched eagerly
            md = graphs[pad].prepare(qsl_host, first_seq=batch.first_seq, num_seqs=batch.num_seqs)
            graphs[pad].launch()
        elif pad is not None:
            md = builder.build_padded(qsl_dev, qsl_host, first_seq=batch.first_seq, num_seqs=batch.num_seqs, pad=pad)
        else:
            md = builder.build(qsl_dev, qsl_host, first_seq=batch.first_seq, num_seqs=batch.num_seqs)

        # the reference, on the host, padded the same way, then to the device without a sync
        if pad is None:
            ref = reference.chunk_metadata(batch.query_start_loc, 64, batch.first_seq, batch.num_seqs)
        else:
            padded_seqs = builder.padded_num_seqs[pad]
            ref = reference.padded_chunk_metadata(
                batch.query_start_loc,
                64,
                padded_seqs,
                rows,
                -1 if pad == "negative" else MAX_SEQS,
                batch.first_seq,
                batch.num_seqs,
            )
        n_rows, n_cu = len(ref.chunk_indices), len(ref.cu_seqlens)
        if n_rows:
            ref_idx[slot, :n_rows].numpy()[:] = ref.chunk_indices
        ref_off[slot, :n_cu].numpy()[:] = ref.chunk_offsets
        ref_cu[slot, :n_cu].numpy()[:] = ref.cu_seqlens
        dev_idx[:n_rows].copy_(ref_idx[slot, :n_rows], non_blocking=True)
        dev_off[:n_cu].copy_(ref_off[slot, :n_cu], non_blocking=True)
        dev_cu[:n_cu].copy_(ref_cu[slot, :n_cu], non_blocking=True)
        # shapes are host facts: a wrong shape is a mismatch by itself
        if (
            tuple(md.chunk_indices.shape) != (n_rows, 2)
            or md.cu_seqlens.shape[0] != n_cu
            or (md.num_seqs, md.num_tokens, md.num_chunks) != (ref.num_seqs, ref.num_tokens, ref.num_chunks)
        ):
            mismatches += 1
            continue
        mismatches += (md.chunk_indices != dev_idx[:n_rows]).sum()
        mismatches += (md.chunk_offsets != dev_off[:n_cu]).sum()
        mismatches += (md.cu_seqlens != dev_cu[:n_cu]).sum()

    total = int(mismatches)  # the one read of the device counter
    elapsed = time.perf_counter() - start
    figures = {
        "steps": args.steps,
        "mismatches": total,
        "kinds": kinds,
        "seconds": round(elapsed, 1),
        "steps_per_s": round(args.steps / elapsed),
        "memory_allocated_start_bytes": memory_start,
        "memory_allocated_end_bytes": memory(),
        "memory_peak_bytes": torch.cuda.max_memory_allocated() if on_cuda else 0,
        "graph_staging_waits": {pad: g.staging_waits for pad, g in graphs.items()},
    }
    record = runs.save(
        "stress", figures, script="bench/stress.py", argv=sys.argv[1:] if argv is None else argv, out=args.out
    )
    print(
        json.dumps(
            {"device": record["device"].get("gpu"), **figures, "command": record["command"], "date": record["date"]},
            indent=1,
        )
    )
    return 0 if total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
