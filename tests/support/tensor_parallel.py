"""One tensor-parallel rank of tests/core/test_tensor_parallel.py, run in a spawned process per GPU
(as engines start their workers): its own builder on its own device, exact tables, no sync, the C
path in use, graph replays on the last rank, then an NCCL all-reduce of every rank's checksum."""

from __future__ import annotations

import os

import numpy as np
import torch

from chunkmeta import ChunkMetadataBuilder, GraphBuild, layout, reference
from chunkmeta.workloads import random_decode_first

STEPS = 200
MAX_SEQS, MAX_TOKENS = 256, 65536


def rank_batches(rank: int):
    rng = np.random.default_rng(1000 + rank)
    return [random_decode_first(rng, MAX_SEQS, MAX_TOKENS) for _ in range(STEPS)]


def _weighted(values: torch.Tensor) -> torch.Tensor:
    """An order-sensitive checksum of a table, on the device (no sync)."""
    flat = values.reshape(-1).to(torch.int64)
    return (flat * torch.arange(1, flat.numel() + 1, device=flat.device)).sum()


def reference_checksum(batch) -> int:
    ref = reference.chunk_metadata(batch.query_start_loc, 64, batch.first_seq, batch.num_seqs)
    total = 0
    for table in (ref.cu_seqlens, [v for row in ref.chunk_indices for v in row], ref.chunk_offsets):
        total += sum(v * (k + 1) for k, v in enumerate(table))
    return total


def run_rank(rank: int, world_size: int, port: int) -> None:
    # NVLink multicast stays off: the lent machines' rule (it can take a shared host's GPUs down)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        NVSHMEM_DISABLE_NVLS="1",
    )
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    builder = ChunkMetadataBuilder(MAX_SEQS, MAX_TOKENS, device=device)
    batches = rank_batches(rank)
    inputs = [(torch.tensor(b.query_start_loc, dtype=torch.int32),) for b in batches]
    inputs = [(cpu.to(device), cpu) for (cpu,) in inputs]
    for (qsl, cpu), b in zip(inputs[:2], batches[:2], strict=True):  # the first build of a layout compiles its kernel
        builder.build(qsl, cpu, first_seq=b.first_seq, num_seqs=b.num_seqs)
    torch.cuda.synchronize(device)

    checksum = torch.zeros((), dtype=torch.int64, device=device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for (qsl, cpu), b in zip(inputs, batches, strict=True):
            md = builder.build(qsl, cpu, first_seq=b.first_seq, num_seqs=b.num_seqs)
            checksum += _weighted(md.cu_seqlens) + _weighted(md.chunk_indices) + _weighted(md.chunk_offsets)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    kernel = builder.native_kernel.get((None, torch.int32))
    assert kernel in ("cuda", "triton"), f"rank {rank}: the C build is not in use ({builder.native_kernel})"

    for (qsl, cpu), b in zip(inputs, batches, strict=True):  # exact, step by step (reads the device)
        md = builder.build(qsl, cpu, first_seq=b.first_seq, num_seqs=b.num_seqs)
        ref = reference.chunk_metadata(b.query_start_loc, 64, b.first_seq, b.num_seqs)
        assert md.cu_seqlens.device == device
        assert md.chunk_indices.cpu().tolist() == [list(r) for r in ref.chunk_indices], f"rank {rank}"
        assert md.chunk_offsets.cpu().tolist() == ref.chunk_offsets and md.cu_seqlens.cpu().tolist() == ref.cu_seqlens

    if rank == world_size - 1:
        _graph_replays(builder, batches[:50], device)

    import torch.distributed as dist

    dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
    try:
        dist.all_reduce(checksum)
        expected = sum(reference_checksum(b) for r in range(world_size) for b in rank_batches(r))
        assert int(checksum) == expected, (rank, int(checksum), expected)
    finally:
        dist.destroy_process_group()
    print(
        f"rank {rank} on {torch.cuda.get_device_name(device)}: {STEPS} steps exact, no sync, "
        f"C build launching the {kernel} fill, checksum {int(checksum)} all-reduced",
        flush=True,
    )


def _graph_replays(builder, batches, device) -> None:
    """Capture the graph-mode fill on this rank's device and replay it with a new batch each step."""
    static = torch.zeros(MAX_SEQS + 1, dtype=torch.int32, device=device)
    graph = GraphBuild(builder, static, pad="tail")
    graph.capture()
    pad_seq, pad_chunk = layout.padding_row("tail", builder.capacity.seqs)
    for b in batches:
        host = torch.tensor(b.query_start_loc, dtype=torch.int32).pin_memory()
        torch.cuda.set_sync_debug_mode("error")
        try:
            static[: host.shape[0]].copy_(host, non_blocking=True)
            md = graph.replay(host, first_seq=b.first_seq, num_seqs=b.num_seqs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        ref = reference.padded_chunk_metadata(
            b.query_start_loc, 64, graph.padded_num_seqs, graph.num_rows, pad_seq, b.first_seq, b.num_seqs, pad_chunk
        )
        assert md.chunk_indices.cpu().tolist() == [list(r) for r in ref.chunk_indices]
        assert md.cu_seqlens.cpu().tolist() == ref.cu_seqlens and md.chunk_offsets.cpu().tolist() == ref.chunk_offsets
