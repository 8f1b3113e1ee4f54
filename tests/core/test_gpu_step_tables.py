"""Step tables and the one-shot on a GPU (``pytest -m gpu``; skipped elsewhere): exact on
thousands of random steps per table set, zero syncs under ``set_sync_debug_mode("error")``, one
kernel and no copies per build."""

import numpy as np
import pytest
import torch

from checks import assert_exact, assert_step_tables, cuda_activity, no_sync
from chunkmeta import StepTablesBuilder, build_chunk_metadata, reference
from chunkmeta import tables as T
from chunkmeta.workloads import Batch
from strategies import random_step

pytestmark = pytest.mark.gpu

# the table sets of the hybrid families (docs/design.md): Kimi-Linear / Qwen3-Next (FLA per
# slice + conv), vLLM's Mamba2 family (SSD + conv of the prefill rows), SGLang's Mamba2
TABLE_SETS = {
    "kda_gdn": {"fla": T.Fla(64), "fla_batch": T.Fla(64, rows="batch"), "conv": T.Conv()},
    "mamba2_vllm": {"mamba2": T.Mamba2(chunk_size=256, checkpoints=True), "conv": T.Conv(rows="prefill")},
    "mamba2_sglang": {"sglang": T.SglangMamba2(chunk_size=64), "conv": T.Conv(rows="prefill", paired=True)},
}
MAX_SEQS, MAX_TOKENS = 256, 16384


def cuda_step(qsl, computed, checkpoints, dtype=torch.int32):
    q = torch.tensor(qsl, dtype=dtype)
    c = torch.tensor(computed, dtype=dtype)
    k = torch.tensor(checkpoints, dtype=torch.int32)
    return dict(
        query_start_loc=q.cuda(),
        query_start_loc_cpu=q,
        num_computed_tokens=c.cuda(),
        num_computed_tokens_cpu=c,
        checkpoint_offsets=k.cuda(),
        checkpoint_offsets_cpu=k,
    )


def build(builder, inputs, first, n, padded=False):
    return builder.build(
        inputs["query_start_loc"],
        inputs["query_start_loc_cpu"],
        first_seq=first,
        num_seqs=n,
        num_computed_tokens=inputs["num_computed_tokens"],
        num_computed_tokens_cpu=inputs["num_computed_tokens_cpu"],
        checkpoint_offsets=inputs["checkpoint_offsets"],
        checkpoint_offsets_cpu=inputs["checkpoint_offsets_cpu"],
        padded=padded,
    )


@pytest.mark.parametrize("backend", ["cuda", "triton", "torch"])
@pytest.mark.parametrize("table_set", list(TABLE_SETS))
def test_thousands_of_random_steps(table_set, backend, monkeypatch):
    """cuda / triton: the kernel the C build launches after a layout's first build (the CUDA C
    step fill, or with CHUNKMETA_CUDA_FILL=0 the Triton kernel); torch: the torch fill."""
    from chunkmeta.fill import cuda_fill

    if backend == "cuda" and cuda_fill.nvrtc_version() is None:
        pytest.skip("no NVRTC here: the C build launches the Triton kernel")
    monkeypatch.setenv("CHUNKMETA_CUDA_FILL", "1" if backend == "cuda" else "0")
    fill = "torch" if backend == "torch" else "triton"
    builder = StepTablesBuilder(MAX_SEQS, MAX_TOKENS, tables=TABLE_SETS[table_set], device="cuda", backend=fill)
    rng = np.random.default_rng(hash(table_set) % 1000)
    steps = 200 if backend == "torch" else 2000
    for i in range(steps):
        qsl, first, n, computed, checkpoints = random_step(rng, MAX_SEQS, MAX_TOKENS)
        inputs = cuda_step(qsl, computed, checkpoints, torch.int64 if i % 5 == 0 else torch.int32)
        tables = build(builder, inputs, first, n, padded=i % 7 == 0)
        assert_step_tables(tables, builder, qsl, first, n, computed, checkpoints)
    if backend != "torch":
        assert set(builder.c_build.values()) == {backend}, builder.c_build


def test_large_steps():
    specs = {name: spec for tables in TABLE_SETS.values() for name, spec in tables.items() if name != "conv"}
    specs["conv"] = T.Conv()
    builder = StepTablesBuilder(4096, 1 << 20, tables=specs, device="cuda")
    rng = np.random.default_rng(7)
    for max_seqs, max_tokens in ((4096, 1 << 20), (1024, 65536), (1, 196608)):
        qsl, first, n, computed, checkpoints = random_step(rng, max_seqs, max_tokens)
        tables = build(builder, cuda_step(qsl, computed, checkpoints), first, n)
        assert_step_tables(tables, builder, qsl, first, n, computed, checkpoints)


@pytest.mark.parametrize("table_set", list(TABLE_SETS))
def test_builds_do_not_sync_and_are_one_kernel_no_copies(table_set):
    builder = StepTablesBuilder(MAX_SEQS, MAX_TOKENS, tables=TABLE_SETS[table_set], device="cuda")
    rng = np.random.default_rng(3)
    steps = [random_step(rng, MAX_SEQS, MAX_TOKENS) for _ in range(50)]
    inputs = [cuda_step(qsl, c, k) for qsl, _, _, c, k in steps]
    for padded in (False, True):  # compile outside
        build(builder, inputs[0], steps[0][1], steps[0][2], padded)
    results = []
    with no_sync():
        for i, (step, step_inputs) in enumerate(zip(steps, inputs, strict=True)):
            results.append((step, build(builder, step_inputs, step[1], step[2], padded=i % 2 == 1)))
            if len(results) == builder.ring.depth - 1:
                break
    for (qsl, first, n, computed, checkpoints), tables in results:
        assert_step_tables(tables, builder, qsl, first, n, computed, checkpoints)
    with no_sync():
        for step, step_inputs in zip(steps, inputs, strict=True):
            build(builder, step_inputs, step[1], step[2], padded=False)
    # every layout's host side and launch run in one C call (chunkmeta.native), launching the
    # CUDA C step fill wherever NVRTC compiles it
    from chunkmeta.fill import cuda_fill

    expected = "cuda" if cuda_fill.nvrtc_version() is not None else "triton"
    assert set(builder.c_build.values()) == {expected}, builder.c_build
    qsl, first, n, _, _ = steps[1]
    for padded in (False, True):
        kernels, copies = cuda_activity(lambda padded=padded: build(builder, inputs[1], first, n, padded))
        assert len(kernels) == 1 and ("step_tables_fill" if expected == "cuda" else "step_tables_kernel") in kernels[0]
        assert copies == [], copies


def test_one_shot_exact_no_sync_one_kernel():
    rng = np.random.default_rng(11)
    steps = [random_step(rng, MAX_SEQS, MAX_TOKENS) for _ in range(300)]
    for qsl, first, _n, _, _ in steps[:5]:  # compile the buckets outside
        build_chunk_metadata(torch.tensor(qsl, dtype=torch.int32).cuda(), torch.tensor(qsl), first_seq=first)
    side = torch.cuda.Stream()  # every fifth build on another stream: its own arena
    made = []
    for i, (qsl, first, n, _, _) in enumerate(steps):
        dtype = torch.int64 if i % 3 == 0 else torch.int32
        q = torch.tensor(qsl, dtype=dtype)
        with torch.cuda.stream(side if i % 5 == 0 else torch.cuda.current_stream()):
            made.append(build_chunk_metadata(q.cuda(), q, first_seq=first, num_seqs=n, indices_dtype=dtype))
    torch.cuda.synchronize()
    # checked after all of them ran: no later build wrote over an earlier one's tables
    for i, (md, (qsl, first, n, _, _)) in enumerate(zip(made, steps, strict=True)):
        if i % 3:
            assert_exact(md, Batch(qsl, first, n), 64)
        else:
            ref = reference.chunk_metadata(qsl, 64, first, n)
            assert md.chunk_indices.dtype == torch.int64
            assert [tuple(r) for r in md.chunk_indices.cpu().tolist()] == ref.chunk_indices
            assert md.chunk_offsets.cpu().tolist() == ref.chunk_offsets
    from chunkmeta import arena
    from chunkmeta import one_shot as one_shot_module

    # after its first call per bucket, the one-shot's host side and launch run in C, into views
    # of one arena per stream
    assert any(one_shot_module._C["auto"].values()), one_shot_module._C
    assert {key[1] for key in arena._ARENAS} >= {side.cuda_stream, torch.cuda.current_stream().cuda_stream}
    qsl, first, n, _, _ = steps[0]
    q = torch.tensor(qsl, dtype=torch.int32)
    qd = q.cuda()
    build_chunk_metadata(qd, q, first_seq=first, num_seqs=n)
    with no_sync():
        for _ in range(20):
            build_chunk_metadata(qd, q, first_seq=first, num_seqs=n)
    kernels, copies = cuda_activity(lambda: build_chunk_metadata(qd, q, first_seq=first, num_seqs=n))
    assert len(kernels) == 1 and copies == [], (kernels, copies)


def test_one_shot_in_a_captured_graph_allocates_from_its_pool():
    """A one-shot captured into a CUDA graph takes no arena memory: each replay rewrites its
    outputs, which must be the graph's own."""
    qsl = [0, 5, 300, 301, 1000]
    q = torch.tensor(qsl, dtype=torch.int32)
    qd = q.cuda()
    build_chunk_metadata(qd, q)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        md = build_chunk_metadata(qd, q)
    graph.replay()
    torch.cuda.synchronize()
    assert_exact(md, Batch(qsl, 0, 4), 64)
    from chunkmeta import arena

    blocks = [block for a in arena._ARENAS.values() for block in a.blocks()]
    inside = [
        b.untyped_storage().data_ptr() <= t.data_ptr() < b.untyped_storage().data_ptr() + b.untyped_storage().nbytes()
        for b in blocks
        for t in (md.cu_seqlens, md.chunk_indices, md.chunk_offsets)
    ]
    assert not any(inside)


@pytest.mark.parametrize("table_set", list(TABLE_SETS))
def test_graph_capture_once_replay_many_steps(table_set):
    from chunkmeta import StepGraphBuild

    builder = StepTablesBuilder(MAX_SEQS, MAX_TOKENS, tables=TABLE_SETS[table_set], device="cuda", pad="negative")
    qsl_static = torch.zeros(MAX_SEQS + 1, dtype=torch.int32, device="cuda")
    computed_static = torch.zeros(MAX_SEQS, dtype=torch.int32, device="cuda")
    checkpoints_static = torch.zeros(MAX_SEQS, dtype=torch.int32, device="cuda")
    graph = StepGraphBuild(
        builder, qsl_static, num_computed_tokens=computed_static, checkpoint_offsets=checkpoints_static
    )
    graph.capture()
    rng = np.random.default_rng(21)
    for i in range(300):
        qsl, first, n, computed, checkpoints = random_step(rng, MAX_SEQS, MAX_TOKENS)
        host = [torch.tensor(v, dtype=torch.int32) for v in (qsl, computed, checkpoints)]
        # the engine's part: its static buffers updated in place on the stream, before the replay
        qsl_static[: len(qsl)].copy_(host[0], non_blocking=True)
        computed_static[: len(computed)].copy_(host[1], non_blocking=True)
        checkpoints_static[: len(checkpoints)].copy_(host[2], non_blocking=True)
        kwargs = dict(first_seq=first, num_seqs=n, num_computed_tokens_cpu=host[1], checkpoint_offsets_cpu=host[2])
        if i % 50 == 49:
            with no_sync():
                tables = graph.replay(host[0], **kwargs)
        else:
            tables = graph.replay(host[0], **kwargs)
        assert_step_tables(tables, builder, qsl, first, n, computed, checkpoints)
    kernels, copies = cuda_activity(lambda: graph.replay(host[0], **kwargs))
    assert len(kernels) == 1 and "step_tables_kernel" in kernels[0], kernels
    assert len(copies) == 1, copies  # the params copy
    assert graph.staging_waits == 0
