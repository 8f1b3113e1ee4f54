"""Host latency of one build, per workload (pytest-benchmark).

In `make test` these run once each with benchmarking disabled (a smoke test of the timed code).
On a GPU machine, time them:

    pytest bench/bench_build.py --benchmark-enable --benchmark-columns=median,iqr,ops

On CUDA the builder uses the Triton kernel; on CPU the torch fill (whose time is the fill itself,
not launch overhead). The GPU comparison with the anchors is bench/gpu_compare.py.
"""

import pytest
import torch

from chunkmeta import ChunkMetadataBuilder, GraphBuild, build_chunk_metadata
from chunkmeta.workloads import workload

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WORKLOADS = [(1, 4096), (8, 4096), (128, 4096), (128, 32768), (1024, 65536), (1, 196608), (4096, 1 << 20)]


def _inputs(num_seqs, num_tokens):
    batch = workload(num_seqs, num_tokens, seed=num_seqs)
    qsl_cpu = torch.tensor(batch.query_start_loc, dtype=torch.int32)
    return qsl_cpu.to(DEVICE), qsl_cpu


def _ids(w):
    return f"{w[0]}x{w[1] // 1024}k"


@pytest.mark.parametrize("shape", WORKLOADS, ids=_ids)
def bench_builder_build(benchmark, shape):
    qsl, qsl_cpu = _inputs(*shape)
    builder = ChunkMetadataBuilder(max(256, shape[0]), max(8192, shape[1]), device=DEVICE)
    builder.build(qsl, qsl_cpu)  # compile / warm up
    md = benchmark(builder.build, qsl, qsl_cpu)
    assert md.num_seqs == shape[0] and md.num_tokens == shape[1]


@pytest.mark.parametrize("shape", WORKLOADS[:3], ids=_ids)
def bench_one_shot(benchmark, shape):
    qsl, qsl_cpu = _inputs(*shape)
    md = benchmark(build_chunk_metadata, qsl, qsl_cpu)
    assert md.num_tokens == shape[1]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", WORKLOADS, ids=_ids)
def bench_graph_replay(benchmark, shape):
    qsl, qsl_cpu = _inputs(*shape)
    builder = ChunkMetadataBuilder(max(256, shape[0]), max(8192, shape[1]), device=DEVICE)
    static = torch.zeros(builder.capacity.seqs + 1, dtype=torch.int32, device=DEVICE)
    static[: qsl.shape[0]].copy_(qsl)
    graph = GraphBuild(builder, static)
    graph.capture()
    md = benchmark(graph.replay, qsl_cpu)
    assert md.num_tokens == shape[1]


def bench_stress_smoke(tmp_path):
    """bench/stress.py's loop, briefly, on this machine (the full run is on the GPU)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import stress

    assert stress.main(["--steps", "60", "--ring", "16", "--device", DEVICE, "--out", str(tmp_path)]) == 0
