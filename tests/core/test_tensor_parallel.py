"""Tensor parallelism: a builder per rank, each on its own device (needs two GPUs).

Engines serve with one process per GPU, each building its own metadata, and some runners make
another device current in helper threads. The C launch path (primary context, cuLaunchKernel,
the NVRTC module) and the Triton path must launch on the builder's device, whatever is current.
"""

import socket

import numpy as np
import pytest
import torch

from checks import assert_exact, assert_padded, no_sync
from chunkmeta import ChunkMetadataBuilder, layout
from chunkmeta.workloads import random_decode_first

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_builder_per_rank_in_spawned_processes():
    """Two spawned processes, one per GPU: exact tables, no sync, the C path on both devices,
    graph capture and replay on cuda:1, then an NCCL all-reduce of every rank's table checksum
    (tests/support/tensor_parallel.py)."""
    import torch.multiprocessing as mp

    import tensor_parallel

    # a rank that fails raises here (ProcessRaisedException), with its traceback
    mp.start_processes(tensor_parallel.run_rank, args=(2, _free_port()), nprocs=2, start_method="spawn", join=True)


@pytest.mark.parametrize("home, current", [(1, 0), (0, 1)])
def test_a_builder_launches_on_its_own_device_whatever_is_current(home, current):
    """Builds on cuda:home while cuda:current is current: exact, on the builder's device, no sync
    (the C build steps aside, the Triton launch makes the builder's device current for itself)."""
    builder = ChunkMetadataBuilder(64, 32768, device=f"cuda:{home}")
    rng = np.random.default_rng(home)
    batches = [random_decode_first(rng, 64, 32768) for _ in range(40)]
    inputs = [torch.tensor(b.query_start_loc, dtype=torch.int32) for b in batches]
    inputs = [(cpu.to(f"cuda:{home}"), cpu) for cpu in inputs]
    builder.build(*inputs[0])  # compiles on the builder's device
    for (qsl, cpu), b in zip(inputs, batches, strict=True):
        kw = dict(first_seq=b.first_seq, num_seqs=b.num_seqs)
        with torch.cuda.device(current):
            torch.cuda.synchronize(home)
            with no_sync():
                exact = builder.build(qsl, cpu, **kw)
            assert torch.cuda.current_device() == current
        assert exact.chunk_indices.device.index == home
        assert_exact(exact, b, 64)
        with torch.cuda.device(current):
            padded = builder.build_padded(qsl, cpu, pad="past_end", **kw)
        assert_padded(
            padded,
            b,
            64,
            builder.padded_num_seqs["past_end"],
            builder.capacity.rows,
            *layout.padding_row("past_end", 64),
        )
