"""GPU behaviour (run with `pytest -m gpu` on a CUDA machine; skipped elsewhere).

Exactness on thousands of decode-first batches, zero host<->device syncs under
``torch.cuda.set_sync_debug_mode("error")``, one kernel launch and no metadata copies per build,
CUDA-graph capture + replay with a new batch every time, and independence across streams.
"""

import attrs
import numpy as np
import pytest
import torch

from checks import assert_exact, assert_padded, assert_step_tables, cuda_activity, no_sync
from chunkmeta import (
    ChunkMetadataBuilder,
    ChunkMetaService,
    GraphBuild,
    StepBatch,
    StepTables,
    build_chunk_metadata,
    layout,
    reference,
    tables,
)
from chunkmeta.fill.cuda_fill import CudaStepFill
from chunkmeta.workloads import from_lengths, random_decode_first, workload
from strategies import random_step

pytestmark = pytest.mark.gpu


def cuda_inputs(batch):
    qsl_cpu = torch.tensor(batch.query_start_loc, dtype=torch.int32)
    return qsl_cpu.cuda(), qsl_cpu


def random_batches(count, max_seqs, max_tokens, seed):
    rng = np.random.default_rng(seed)
    return [random_decode_first(rng, max_seqs, max_tokens) for _ in range(count)]


BIG = [
    workload(4096, 1 << 20, seed=1),
    workload(1024, 65536, seed=2),
    from_lengths([196608]),
    from_lengths([0] * 100 + [70000] + [1] * 3000, first_seq=50),
]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_builder_equals_reference_on_thousands_of_batches(backend):
    builder = ChunkMetadataBuilder(64, 32768, device="cuda", backend=backend)
    batches = random_batches(2000, 64, 32768, seed=11)
    inputs = [cuda_inputs(b) for b in batches[:3]]
    with no_sync():
        results = [
            builder.build(*x, first_seq=b.first_seq, num_seqs=b.num_seqs)
            for x, b in zip(inputs, batches[:3], strict=True)
        ]
    for md, b in zip(results, batches[:3], strict=True):
        assert_exact(md, b, 64)
    for b in batches:
        assert_exact(builder.build(*cuda_inputs(b), first_seq=b.first_seq, num_seqs=b.num_seqs), b, 64)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_large_batches(backend):
    builder = ChunkMetadataBuilder(4096, 1 << 20, device="cuda", backend=backend)
    for b in BIG:
        qsl, qsl_cpu = cuda_inputs(b)
        with no_sync():
            md = builder.build(qsl, qsl_cpu, first_seq=b.first_seq, num_seqs=b.num_seqs)
        assert_exact(md, b, 64)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_one_shot_equals_reference_and_fla(chunk_size):
    fla_index = pytest.importorskip("fla.ops.utils.index")
    for b in random_batches(300, 40, 8000, seed=chunk_size) + BIG[1:3]:
        qsl, qsl_cpu = cuda_inputs(b)
        with no_sync():
            md = build_chunk_metadata(qsl, qsl_cpu, chunk_size=chunk_size, first_seq=b.first_seq, num_seqs=b.num_seqs)
        assert_exact(md, b, chunk_size)
        cu = md.cu_seqlens.clone()  # fresh tensor: FLA caches by identity
        theirs = fla_index.prepare_chunk_indices(cu, chunk_size)
        assert theirs.dtype == md.chunk_indices.dtype and torch.equal(theirs, md.chunk_indices)
        offsets = fla_index.prepare_chunk_offsets(cu, chunk_size)
        assert offsets.dtype == md.chunk_offsets.dtype and torch.equal(offsets, md.chunk_offsets)


def test_service_steps_do_not_sync():
    service = ChunkMetaService(64, 32768, device="cuda", strict=True)
    batches = random_batches(200, 64, 32768, seed=3)
    inputs = [cuda_inputs(b) for b in batches]
    kept = []
    with no_sync():
        for b, (qsl, qsl_cpu) in zip(batches, inputs, strict=True):
            with service.step(StepBatch(qsl, qsl_cpu, b.first_seq, b.num_seqs)) as md:
                # what layers do with it: launch kernels reading it (a device copy stands in)
                kept.append((md.chunk_indices.clone(), md.chunk_offsets.clone(), md.cu_seqlens.clone()))
    for b, (indices, offsets, cu) in zip(batches, kept, strict=True):
        ref = reference.chunk_metadata(b.query_start_loc, 64, b.first_seq, b.num_seqs)
        assert [tuple(r) for r in indices.tolist()] == ref.chunk_indices
        assert offsets.tolist() == ref.chunk_offsets and cu.tolist() == ref.cu_seqlens
    assert service.stats().builds == 200


# every table a Kimi-Linear / Qwen3-Next step reads and a vLLM Mamba2 step's, in one service
STEP_TABLES = {
    "fla": tables.Fla(64),
    "fla_batch": tables.Fla(64, rows="batch"),
    "conv": tables.Conv(),
    "mamba2": tables.Mamba2(chunk_size=256, checkpoints=True),
    "mamba2_conv": tables.Conv(rows="prefill"),
}


def step_inputs(step, device="cuda"):
    """A random_step's StepBatch: device tensors and their host copies, made before any timed loop."""
    qsl, first, n, computed, checkpoints = step
    q, c, k = (torch.tensor(v, dtype=torch.int32) for v in (qsl, computed, checkpoints))
    return StepBatch.decode_first(
        q.to(device),
        q,
        first,
        num_prefills=n,
        num_computed_tokens=c.to(device),
        num_computed_tokens_cpu=c,
        checkpoint_offsets=k.to(device),
        checkpoint_offsets_cpu=k,
    )


def snapshot(step: StepTables) -> StepTables:
    """Device copies of every table (queued on the stream, no sync), as a StepTables with no
    lease: what layers would read, kept past the ring's reuse of the slot."""
    copies = {}
    for name in step.names:
        table = step[name]
        fields = {
            f.name: getattr(table, f.name).clone()
            for f in attrs.fields(type(table))
            if not f.name.startswith("_") and isinstance(getattr(table, f.name), torch.Tensor)
        }
        copies[name] = attrs.evolve(table, **fields)
    return attrs.evolve(step, tables=copies, lease=None)


def test_step_tables_service_steps_do_not_sync_and_are_exact():
    service = ChunkMetaService(64, 32768, device="cuda", strict=True, tables=STEP_TABLES)
    rng = np.random.default_rng(13)
    steps = [random_step(rng, 64, 32768) for _ in range(300)]
    batches = [step_inputs(step) for step in steps]
    with service.step(batches[0]):  # the layout's first build compiles the kernel: outside
        pass
    kept = []
    with no_sync():
        for batch in batches:
            with service.step(batch) as step:
                assert service.current is step
                kept.append((step, snapshot(step)))
    for (qsl, first, n, computed, checkpoints), (step, copy) in zip(steps, kept, strict=True):
        assert not step.is_live  # strict: retired at end_step
        assert_step_tables(copy, service.builder, qsl, first, n, computed, checkpoints)
    stats = service.stats()
    assert stats.builds == 301 and 0 < stats.rows_use <= 1
    assert set(stats.last_rows) == set(STEP_TABLES)
    # after the first build, the host side and the launch are one C call
    assert set(service.builder.c_build.values()) <= {"cuda", "triton"}, service.builder.c_build


def test_step_tables_service_graph_capture_once_replay_without_sync():
    service = ChunkMetaService(64, 32768, device="cuda", strict=True, tables=STEP_TABLES, pad="negative")
    static_qsl = torch.zeros(129, dtype=torch.int32, device="cuda")
    static_computed = torch.zeros(128, dtype=torch.int32, device="cuda")
    static_checkpoints = torch.zeros(128, dtype=torch.int32, device="cuda")
    buffers = dict(num_computed_tokens=static_computed, checkpoint_offsets=static_checkpoints)
    service.graph(static_qsl, **buffers)
    service.capture_step()  # compiles the kernel outside the capture
    torch.cuda.synchronize()
    engine_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(engine_graph):
        captured = service.capture_step()  # captured with the engine's layers
    rng = np.random.default_rng(19)
    steps = [random_step(rng, 64, 32768) for _ in range(300)]
    staged = [step_inputs(step) for step in steps]
    kept = []
    with no_sync():
        for batch in staged:
            # the engine's part: its static buffers refreshed in place on the stream
            num_requests = batch.query_start_loc.shape[0] - 1
            static_qsl[: num_requests + 1].copy_(batch.query_start_loc)
            static_computed[:num_requests].copy_(batch.num_computed_tokens)
            static_checkpoints[:num_requests].copy_(batch.checkpoint_offsets)
            graph_batch = attrs.evolve(batch, query_start_loc=static_qsl, **buffers)
            step = service.begin_graph_step(graph_batch)
            engine_graph.replay()
            assert step.padded and step.conv.batch_ptr is captured.conv.batch_ptr
            kept.append(snapshot(step))
            service.end_step()
    for (qsl, first, n, computed, checkpoints), copy in zip(steps, kept, strict=True):
        assert_step_tables(copy, service.builder, qsl, first, n, computed, checkpoints)
    assert service.stats().graph_steps == 300 and service.stats().staging_waits == 0


def test_one_launch_and_no_copies_per_build():
    builder = ChunkMetadataBuilder(256, 16384, device="cuda")
    b = random_batches(1, 256, 16384, seed=5)[0]
    qsl, qsl_cpu = cuda_inputs(b)
    builder.build(qsl, qsl_cpu, first_seq=b.first_seq, num_seqs=b.num_seqs)  # compile outside
    kernels, copies = cuda_activity(lambda: builder.build(qsl, qsl_cpu, first_seq=b.first_seq, num_seqs=b.num_seqs))
    assert len(kernels) == 1 and "step_tables" in kernels[0], kernels
    assert copies == [], copies
    # the C build launches the CUDA C fill wherever NVRTC can compile it
    expected = "cuda" if cuda_fill_available() else "triton"
    assert builder.native_kernel.get((None, torch.int32)) == expected
    assert (expected == "cuda") == ("step_tables_fill" in kernels[0]), kernels
    # padded layout: also one launch
    builder.build_padded(qsl, qsl_cpu, first_seq=b.first_seq, num_seqs=b.num_seqs)
    kernels, copies = cuda_activity(
        lambda: builder.build_padded(qsl, qsl_cpu, first_seq=b.first_seq, num_seqs=b.num_seqs)
    )
    assert len(kernels) == 1 and copies == []
    # an empty prefill launches nothing at all
    empty = cuda_inputs(from_lengths([1, 1], first_seq=2))
    kernels, copies = cuda_activity(lambda: builder.build(*empty, first_seq=2))
    assert kernels == [] and copies == []


@pytest.mark.parametrize("pad", layout.PADS)
def test_graph_capture_once_replay_1000_batches(pad):
    builder = ChunkMetadataBuilder(64, 32768, device="cuda")
    static_qsl = torch.zeros(129, dtype=torch.int32, device="cuda")
    graph = GraphBuild(builder, static_qsl, pad=pad)
    graph.capture()
    batches = random_batches(1000, 64, 32768, seed=17)
    host = [torch.tensor(b.query_start_loc, dtype=torch.int32) for b in batches]
    staged = [h.cuda() for h in host]
    rows, seqs = builder.capacity.rows, graph.padded_num_seqs + 1
    history_idx = torch.empty(len(batches), rows, 2, dtype=torch.int32, device="cuda")
    history_off = torch.empty(len(batches), seqs, dtype=torch.int64, device="cuda")
    history_cu = torch.empty(len(batches), seqs, dtype=torch.int32, device="cuda")
    counts = []
    with no_sync():
        for k, (b, h, s) in enumerate(zip(batches, host, staged, strict=True)):
            static_qsl[: s.shape[0]].copy_(s)  # the engine refreshes its static buffer in place
            md = graph.replay(h, first_seq=b.first_seq, num_seqs=b.num_seqs)
            history_idx[k].copy_(md.chunk_indices)
            history_off[k].copy_(md.chunk_offsets)
            history_cu[k].copy_(md.cu_seqlens)
            counts.append((md.num_seqs, md.num_tokens, md.num_chunks))
    pad_seq, pad_chunk = layout.padding_row(pad, 64)
    idx, off, cu = history_idx.cpu(), history_off.cpu(), history_cu.cpu()
    for k, b in enumerate(batches):
        ref = reference.padded_chunk_metadata(
            b.query_start_loc, 64, graph.padded_num_seqs, rows, pad_seq, b.first_seq, b.num_seqs, pad_chunk
        )
        assert [tuple(r) for r in idx[k].tolist()] == ref.chunk_indices, k
        assert off[k].tolist() == ref.chunk_offsets and cu[k].tolist() == ref.cu_seqlens, k
        assert counts[k] == (ref.num_seqs, ref.num_tokens, ref.num_chunks)
    assert graph.staging_waits == 0


def test_graph_replay_is_one_kernel_and_one_params_copy():
    builder = ChunkMetadataBuilder(64, 32768, device="cuda")
    static_qsl = torch.zeros(65, dtype=torch.int32, device="cuda")
    graph = GraphBuild(builder, static_qsl)
    graph.capture()
    b = random_batches(1, 64, 32768, seed=8)[0]
    h = torch.tensor(b.query_start_loc, dtype=torch.int32)
    static_qsl[: h.shape[0]].copy_(h.cuda())
    kernels, copies = cuda_activity(lambda: graph.replay(h, first_seq=b.first_seq, num_seqs=b.num_seqs))
    assert len(kernels) == 1, kernels
    assert len(copies) == 1 and "htod" in copies[0].lower(), copies  # the 12-byte (first_seq, num_seqs, batch_seqs)


def test_second_builder_on_second_stream_is_independent():
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    b1 = ChunkMetadataBuilder(64, 32768, device="cuda")
    b2 = ChunkMetadataBuilder(64, 32768, device="cuda")
    assert b1.ring.pointer(0) != b2.ring.pointer(0)
    batches1 = random_batches(100, 64, 32768, seed=21)
    batches2 = random_batches(100, 64, 32768, seed=22)
    out1, out2 = [], []
    inputs1 = [cuda_inputs(b) for b in batches1]
    inputs2 = [cuda_inputs(b) for b in batches2]
    torch.cuda.synchronize()
    with no_sync():
        for (x1, h1), (x2, h2), c1, c2 in zip(inputs1, inputs2, batches1, batches2, strict=True):
            with torch.cuda.stream(s1):
                md = b1.build(x1, h1, first_seq=c1.first_seq, num_seqs=c1.num_seqs)
                out1.append((md.chunk_indices.clone(), md.chunk_offsets.clone()))
            with torch.cuda.stream(s2):
                md = b2.build(x2, h2, first_seq=c2.first_seq, num_seqs=c2.num_seqs)
                out2.append((md.chunk_indices.clone(), md.chunk_offsets.clone()))
    torch.cuda.synchronize()
    for outs, batches in ((out1, batches1), (out2, batches2)):
        for (indices, offsets), b in zip(outs, batches, strict=True):
            ref = reference.chunk_metadata(b.query_start_loc, 64, b.first_seq, b.num_seqs)
            assert [tuple(r) for r in indices.tolist()] == ref.chunk_indices
            assert offsets.tolist() == ref.chunk_offsets


def test_int64_query_start_loc_on_cuda():
    b = random_batches(1, 32, 8000, seed=9)[0]
    qsl_cpu = torch.tensor(b.query_start_loc, dtype=torch.int64)
    builder = ChunkMetadataBuilder(32, 8000, device="cuda")
    qsl = qsl_cpu.cuda()
    with no_sync():
        md = builder.build(qsl, qsl_cpu, first_seq=b.first_seq, num_seqs=b.num_seqs)
    assert_exact(md, b, 64)


def test_padded_eager_layout_on_cuda():
    builder = ChunkMetadataBuilder(64, 32768, device="cuda")
    for b in random_batches(50, 64, 32768, seed=4):
        inputs = cuda_inputs(b)
        for pad in layout.PADS:
            with no_sync():
                md = builder.build_padded(*inputs, first_seq=b.first_seq, num_seqs=b.num_seqs, pad=pad)
            assert_padded(md, b, 64, builder.padded_num_seqs[pad], builder.capacity.rows, *layout.padding_row(pad, 64))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bounded_layout_on_cuda_does_not_sync(backend):
    """No host lengths: rows from a host bound, NT found on the device, one launch, no sync."""
    builder = ChunkMetadataBuilder(64, 32768, device="cuda", backend=backend)
    rng = np.random.default_rng(6)
    # the whole batch is the slice (SGLang's EXTEND/MIXED rows): decodes, padding rows, prompts
    batches = [from_lengths(np.diff(b.query_start_loc).tolist()) for b in random_batches(300, 64, 30000, seed=6)]
    for k, b in enumerate(batches):
        qsl = torch.tensor(b.query_start_loc, dtype=torch.int32).cuda()
        bound = b.num_tokens + int(rng.integers(0, 2000))
        pad = layout.BOUNDED_PADS[k % 2]
        with no_sync():
            md = builder.build_bounded(qsl, max_num_tokens=bound, pad=pad)
        rows = layout.chunk_row_bound(b.num_seqs, bound, 64)
        assert md.bounded and md.chunk_indices.shape[0] == rows
        assert_padded(md, b, 64, b.num_seqs, rows, *layout.padding_row(pad, b.num_seqs))
    if backend == "triton":
        kernels, copies = cuda_activity(lambda: builder.build_bounded(qsl, max_num_tokens=bound))
        assert len(kernels) == 1 and copies == [], (kernels, copies)


def cuda_fill_available() -> bool:
    entries = tables.slot_layout({"fla": tables.Fla(64)}, 64, 4096, "tail").entries
    fill = CudaStepFill(entries=entries, block_seqs=64, padded=False)
    return fill.kernel((torch.int32,) * 3, torch.device("cuda", 0)) is not None


@pytest.fixture(params=["cuda", "triton"])
def c_build_kernel(request, monkeypatch):
    """Which kernel the C build launches: the CUDA C fill (skipped without NVRTC) or, with
    CHUNKMETA_CUDA_FILL=0, the Triton kernel."""
    if request.param == "cuda" and not cuda_fill_available():
        pytest.skip("NVRTC cannot compile the CUDA C fill here")
    monkeypatch.setenv("CHUNKMETA_CUDA_FILL", "1" if request.param == "cuda" else "0")
    return request.param


@pytest.mark.parametrize("capacity", [(64, 32768), (1000, 65536), (1024, 65536), (4096, 1 << 20), (8192, 1 << 20)])
def test_c_build_kernels_on_big_and_edge_batches(c_build_kernel, capacity):
    """Both kernels the C build can launch, at the launch shapes of five capacities (1000: the
    padded tail's entries fall inside the scanned lanes; 8192: the CUDA C fill's largest shape),
    on the large workloads and on batches full of zero-length and one-token sequences. A failed
    C-build launch would fall back to Triton and still be exact, but it also resets
    native_kernel: checked after the builds."""
    seqs, tokens = capacity
    builder = ChunkMetadataBuilder(seqs, tokens, device="cuda")
    rng = np.random.default_rng(seqs)
    batches = [b for b in BIG if b.num_seqs <= seqs and b.query_start_loc[-1] <= tokens]
    batches += [
        from_lengths(list(rng.choice([0, 0, 1, 1, 63, 64, 65, 129], size=seqs)), first_seq=int(rng.integers(0, 3)))
        for _ in range(20)
    ]
    batches += random_batches(200, seqs, tokens, seed=seqs)
    batches = [
        b for b in batches if b.query_start_loc[b.first_seq + b.num_seqs] - b.query_start_loc[b.first_seq] <= tokens
    ]
    for pad in (None, *layout.PADS):
        for b in batches:
            inputs = cuda_inputs(b)
            kw = dict(first_seq=b.first_seq, num_seqs=b.num_seqs)
            with no_sync():
                md = builder.build(*inputs, **kw) if pad is None else builder.build_padded(*inputs, pad=pad, **kw)
            if pad is None:
                assert_exact(md, b, 64)
            else:
                assert_padded(
                    md, b, 64, builder.padded_num_seqs[pad], builder.capacity.rows, *layout.padding_row(pad, seqs)
                )
        # above 4096 sequences the step builds launch the Triton kernel first (chunkmeta.step_builder)
        expected = c_build_kernel if seqs <= 4096 else "triton"
        assert builder.native_kernel.get((pad, torch.int32)) == expected, "the C build did not launch it"


def test_c_build_engine_pattern_all_layouts_both_dtypes(c_build_kernel):
    """The engine's pattern: persistent pinned + device buffers refreshed in place each step and
    passed as fresh prefix views; exact and both padded layouts; int32 and int64 buffers on one
    builder (the kernel is compiled per pointer dtype). Every build goes through the C build
    after the first of each (layout, dtype), with no sync inside a step; results cloned on the
    device and checked against the reference at the end."""
    builder = ChunkMetadataBuilder(64, 32768, device="cuda")
    batches = random_batches(600, 64, 32768, seed=31)
    layouts = [None, *layout.PADS]
    buffers = {
        dtype: (torch.zeros(130, dtype=dtype, pin_memory=True), torch.zeros(130, dtype=dtype, device="cuda"))
        for dtype in (torch.int32, torch.int64)
    }
    for dtype, (pinned, device) in buffers.items():  # compile every (layout, dtype) outside the check
        for pad in layouts:
            b = batches[0]
            pinned[: len(b.query_start_loc)] = torch.tensor(b.query_start_loc, dtype=dtype)
            device.copy_(pinned)
            args = (device[: len(b.query_start_loc)], pinned[: len(b.query_start_loc)])
            builder.build(*args) if pad is None else builder.build_padded(*args, pad=pad)
    assert all(builder.native_kernel.get((pad, dtype)) == c_build_kernel for pad in layouts for dtype in buffers)
    kept = []
    for k, b in enumerate(batches):
        dtype = (torch.int32, torch.int64)[k % 2]
        pad = layouts[k % len(layouts)]
        pinned, device = buffers[dtype]
        r1 = len(b.query_start_loc)
        # no_sync() begins with a device-wide wait: the engine's end-of-step wait, after which the
        # pinned buffer may be rewritten (the previous step's copy has run)
        with no_sync():
            pinned[:r1] = torch.tensor(b.query_start_loc, dtype=dtype)
            device[:r1].copy_(pinned[:r1], non_blocking=True)
            args = (device[:r1], pinned[:r1])
            kw = dict(first_seq=b.first_seq, num_seqs=b.num_seqs)
            md = builder.build(*args, **kw) if pad is None else builder.build_padded(*args, pad=pad, **kw)
            kept.append(
                (
                    md.cu_seqlens.clone(),
                    md.chunk_indices.clone(),
                    md.chunk_offsets.clone(),
                    md.cu_seqlens_cpu.clone(),
                    (md.num_seqs, md.num_tokens, md.num_chunks, md.max_seqlen),
                )
            )
    # every launch succeeded (a failed one turns the layout's C build off)
    assert all(builder.native_kernel.get((pad, dtype)) == c_build_kernel for pad in layouts for dtype in buffers)
    for k, (b, (cu, indices, offsets, cu_cpu, counts)) in enumerate(zip(batches, kept, strict=True)):
        pad = layouts[k % len(layouts)]
        if pad is None:
            ref = reference.chunk_metadata(b.query_start_loc, 64, b.first_seq, b.num_seqs)
        else:
            pad_seq, pad_chunk = layout.padding_row(pad, 64)
            ref = reference.padded_chunk_metadata(
                b.query_start_loc,
                64,
                builder.padded_num_seqs[pad],
                builder.capacity.rows,
                pad_seq,
                b.first_seq,
                b.num_seqs,
                pad_chunk,
            )
        assert [tuple(r) for r in indices.tolist()] == ref.chunk_indices, k
        assert offsets.tolist() == ref.chunk_offsets and cu.tolist() == ref.cu_seqlens, k
        assert cu_cpu.tolist() == ref.cu_seqlens, k
        assert counts == (ref.num_seqs, ref.num_tokens, ref.num_chunks, ref.max_seqlen), k


def test_c_build_int32_chunk_offsets(c_build_kernel):
    """offsets_dtype=torch.int32 (CuteDSL GDN's): both kernels the C build launches write int32
    chunk_offsets themselves, exact in every layout, with no sync."""
    builder = ChunkMetadataBuilder(1024, 65536, device="cuda", offsets_dtype=torch.int32)
    for k, b in enumerate(random_batches(120, 1024, 65536, seed=41)):
        inputs = cuda_inputs(b)
        kw = dict(first_seq=b.first_seq, num_seqs=b.num_seqs)
        pad = (None, *layout.PADS)[k % 4]
        with no_sync():
            md = builder.build(*inputs, **kw) if pad is None else builder.build_padded(*inputs, pad=pad, **kw)
        assert md.chunk_offsets.dtype == torch.int32
        if pad is None:
            assert_exact(md, b, 64)
        else:
            assert_padded(
                md, b, 64, builder.padded_num_seqs[pad], builder.capacity.rows, *layout.padding_row(pad, 1024)
            )
    assert all(builder.native_kernel.get((pad, torch.int32)) == c_build_kernel for pad in (None, *layout.PADS))
