"""The scheduler hooks: step lifecycle, retirement, stats, and graph mode's launch/prepare split, for
the FLA-only service and the service over step tables (``tables=``), on the torch fill and the
Triton kernel under the interpreter."""

import attrs
import numpy as np
import pytest
import torch

from checks import assert_exact, assert_padded, assert_step_tables, tensors_for
from chunkmeta import ChunkMetaError, ChunkMetaService, GraphBuild, StepBatch, StepTables, tables
from chunkmeta.workloads import from_lengths, random_decode_first
from strategies import random_step


def batch_of(batch, step_id=None):
    qsl, qsl_cpu = tensors_for(batch)
    return StepBatch.decode_first(qsl, qsl_cpu, batch.first_seq, num_prefills=batch.num_seqs, step_id=step_id)


B1 = from_lengths([1, 1, 100, 0, 64], first_seq=2)
B2 = from_lengths([1, 300, 5], first_seq=1)


def service(**kw):
    return ChunkMetaService(8, 2000, device="cpu", **kw)


def test_lifecycle():
    svc = service()
    with pytest.raises(ChunkMetaError, match="no step is open"):
        _ = svc.current
    with pytest.raises(ChunkMetaError, match="end_step with no open step"):
        svc.end_step()
    md = svc.begin_step(batch_of(B1, step_id=7))
    assert svc.current is md and svc.in_step
    assert_exact(md, B1, 64)
    with pytest.raises(ChunkMetaError, match=r"begin_step while step 1 \(engine step 7\) is open"):
        svc.begin_step(batch_of(B2))
    assert svc.current is md  # the failed begin changed nothing
    svc.end_step()
    assert not svc.in_step
    with pytest.raises(ChunkMetaError, match="used with no open step"):
        svc.check(md)
    with svc.step(batch_of(B2)) as md2:
        assert svc.check(md2) is md2
        with pytest.raises(ChunkMetaError, match="not the open step's"):
            svc.check(md)
        assert_exact(md2, B2, 64)
    assert not svc.in_step


def test_step_context_ends_on_error():
    svc = service()
    with pytest.raises(RuntimeError):
        with svc.step(batch_of(B1)):
            raise RuntimeError("layer failed")
    assert not svc.in_step
    svc.begin_step(batch_of(B2))  # usable again


def test_bad_batch_leaves_no_open_step():
    svc = service()
    qsl, qsl_cpu = tensors_for(B1)
    with pytest.raises(ChunkMetaError, match="first_seq=9"):
        svc.begin_step(StepBatch(qsl, qsl_cpu, first_seq=9))
    assert not svc.in_step
    assert svc.stats().builds == 0


def test_strict_mode_retires_ended_steps():
    svc = service(strict=True)
    md = svc.begin_step(batch_of(B1))
    assert md.is_live
    md.check_live()
    svc.end_step()
    assert not md.is_live
    with pytest.raises(ChunkMetaError, match="retired: its step ended"):
        md.check_live()
    md2 = svc.begin_step(batch_of(B2))
    assert md2.is_live and not md.is_live


def test_default_mode_keeps_ended_metadata_until_the_ring_reuses_it():
    svc = service(ring_depth=2)
    md = svc.begin_step(batch_of(B1))
    svc.end_step()
    assert md.is_live  # async scheduling: step i's kernels may still read it
    with svc.step(batch_of(B2)):
        assert md.is_live
        assert_exact(md, B1, 64)
    with svc.step(batch_of(B1)):
        assert not md.is_live  # its slot was rebuilt


def test_step_batch_constructors_and_validation():
    qsl, qsl_cpu = tensors_for(B1)
    b = StepBatch.all_prefill(qsl, qsl_cpu, step_id=3)
    assert (b.first_seq, b.num_seqs, b.step_id) == (0, None, 3)
    with pytest.raises(ChunkMetaError, match="first_seq=1.5"):
        StepBatch(qsl, qsl_cpu, first_seq=1.5)
    with pytest.raises(ChunkMetaError, match="query_start_loc_cpu is a list"):
        StepBatch(qsl, [0, 1])
    with pytest.raises(AttributeError):
        b.first_seq = 1


def test_stats():
    svc = service()
    rng = np.random.default_rng(0)
    batches = [random_decode_first(rng, 8, 2000) for _ in range(30)]
    for b in batches:
        with svc.step(batch_of(b)):
            pass
    stats = svc.stats()
    assert stats.builds == 30 and stats.window == 30 and stats.graph_steps == 0
    assert 0 < stats.host_us_p50 <= stats.host_us_p99
    last = batches[-1]
    assert (stats.last_num_seqs, stats.last_num_tokens) == (last.num_seqs, last.num_tokens)
    cap = svc.builder.capacity
    assert stats.seqs_use == max(b.num_seqs for b in batches) / cap.seqs
    assert stats.tokens_use == max(b.num_tokens for b in batches) / cap.tokens
    assert 0 <= stats.rows_use <= 1


def test_stats_window_wraps():
    svc = ChunkMetaService(8, 2000, device="cpu", stats_window=4)
    for _ in range(10):
        with svc.step(batch_of(B1)):
            pass
    assert svc.stats().builds == 10 and svc.stats().window == 4


@pytest.mark.parametrize("builds", [6, 7, 8])
def test_step_tables_stats_window_wraps(builds):
    """After the window wraps, the stats cover its last builds, and `last_*` is the newest one
    (each build's sizes distinct, the largest ones first: a stale window entry shows)."""
    svc = step_service(stats_window=3)
    sizes, rows = [], None
    for k in range(builds):
        n = builds - k  # prefills of 10 tokens after one decode
        qsl = [0, 1, *range(11, 11 + 10 * n, 10)]
        with svc.step(step_batch(qsl, 1, n, [0] * (n + 1), [0] * (n + 1))) as step:
            rows = {"fla": step.fla.num_chunks, "conv": step.conv.tot, "mamba2": step.mamba2.num_chunks}
        sizes.append((n, 10 * n))
    stats = svc.stats()
    assert stats.builds == builds and stats.window == 3
    assert (stats.last_num_seqs, stats.last_num_tokens) == sizes[-1] == (1, 10)
    assert {name: stats.last_rows[name] for name in rows} == rows
    assert stats.seqs_use == sizes[-3][0] / STEP_SEQS and stats.tokens_use == sizes[-3][1] / STEP_TOKENS


@pytest.mark.parametrize("window", [0, -1, 2.0, True, None, np.int64(0)])
def test_bad_stats_window(window):
    with pytest.raises(ChunkMetaError, match="stats_window"):
        ChunkMetaService(8, 2000, device="cpu", stats_window=window)


def test_stats_window_takes_numpy_ints():
    assert ChunkMetaService(8, 2000, device="cpu", stats_window=np.int64(4)).stats().window == 0


def test_stats_before_any_build():
    stats = step_service().stats()
    assert stats.builds == 0 and stats.window == 0 and stats.last_num_seqs == 0 and stats.last_rows["fla"] == 0


@pytest.mark.parametrize("pad", ["tail", "negative"])
def test_graph_mode_launch_prepare_split_on_cpu(pad):
    """The graph runner's two halves, without a graph: launch() reads (first_seq, num_seqs) from
    device memory, so after prepare() the same launch serves any batch (Triton interpreter on CPU)."""
    svc = service()
    static_qsl = torch.zeros(33, dtype=torch.int32)
    graph = svc.graph(static_qsl, pad=pad)
    assert svc.graph(static_qsl, pad=pad) is graph
    captured = svc.capture_step()  # what a graph runner would capture
    rng = np.random.default_rng(1)
    pad_seq = -1 if pad == "negative" else 8
    for _ in range(12):
        b = random_decode_first(rng, 8, 2000)
        qsl_cpu = torch.tensor(b.query_start_loc, dtype=torch.int32)
        static_qsl[: qsl_cpu.shape[0]].copy_(qsl_cpu)  # the engine updates its static buffer in place
        md = svc.begin_graph_step(StepBatch(static_qsl, qsl_cpu, b.first_seq, b.num_seqs))
        graph.launch()  # stands in for the replay
        assert md.chunk_indices is captured.chunk_indices  # same static tensors every step
        assert_padded(md, b, 64, graph.padded_num_seqs, svc.builder.capacity.rows, pad_seq)
        svc.end_step()
    assert svc.stats().graph_steps == 12


def test_graph_mode_errors():
    svc = service()
    with pytest.raises(ChunkMetaError, match="graph mode is not enabled"):
        svc.capture_step()
    static_qsl = torch.zeros(9, dtype=torch.int32)
    svc.graph(static_qsl)
    with pytest.raises(ChunkMetaError, match="already enabled"):
        svc.graph(torch.zeros(9, dtype=torch.int32))
    qsl, qsl_cpu = tensors_for(B1)
    with pytest.raises(ChunkMetaError, match="not the static buffer"):
        svc.begin_graph_step(StepBatch(qsl, qsl_cpu))
    too_long = torch.arange(12, dtype=torch.int32)
    with pytest.raises(ChunkMetaError, match="static query_start_loc buffer holds 9"):
        svc.begin_graph_step(StepBatch(static_qsl, too_long))
    graph = GraphBuild(svc.builder, static_qsl)
    with pytest.raises(ChunkMetaError, match="before capture"):
        graph.replay(qsl_cpu)


def test_graph_metadata_retires_at_next_prepare():
    svc = service()
    static_qsl = torch.zeros(9, dtype=torch.int32)
    graph = svc.graph(static_qsl)
    qsl_cpu = torch.tensor([0, 5, 70], dtype=torch.int32)
    static_qsl[:3] = qsl_cpu
    md = graph.prepare(qsl_cpu)
    assert md.is_live
    md2 = graph.prepare(qsl_cpu)
    assert not md.is_live and md2.is_live
    with pytest.raises(ChunkMetaError, match="retired"):
        md.check_live()


def test_graph_metadata_is_inference_tensors():
    """chunkmeta.ring.TABLE_MEMORY covers graph mode's own tables too."""
    static_qsl = torch.zeros(9, dtype=torch.int32)
    graph = service().graph(static_qsl)
    qsl_cpu = torch.tensor([0, 5, 70], dtype=torch.int32)
    static_qsl[:3] = qsl_cpu
    md = graph.prepare(qsl_cpu)
    tensors = (md.cu_seqlens, md.cu_seqlens_cpu, md.chunk_indices, md.chunk_offsets)
    assert all(t.is_inference() for t in tensors) and md.cu_seqlens_cpu.tolist()[:3] == [0, 5, 70]


def test_audit_catches_a_device_copy_that_differs_from_the_host_copy():
    svc = service(audit_every=2)
    qsl, qsl_cpu = tensors_for(B1)
    bad = qsl.clone()
    bad[3] += 1
    with svc.step(StepBatch(qsl, qsl_cpu, first_seq=2)):  # step 0: audited, consistent
        pass
    with svc.step(StepBatch(bad, qsl_cpu, first_seq=2)):  # step 1: not audited (every 2nd)
        pass
    with pytest.raises(ChunkMetaError, match=r"query_start_loc\[3\]=.* on the device but query_start_loc_cpu\[3\]"):
        svc.begin_step(StepBatch(bad, qsl_cpu, first_seq=2))  # step 2: audited
    assert not svc.in_step


# --- the service over step tables (ChunkMetaService(tables=...)) -------------------------------

# a Kimi-Linear / Qwen3-Next step's tables, and vLLM's Mamba2 step's (checkpoints included)
KDA = {"fla": tables.Fla(64), "fla_batch": tables.Fla(64, rows="batch"), "conv": tables.Conv()}
MAMBA2 = {"mamba2": tables.Mamba2(chunk_size=32, checkpoints=True), "conv": tables.Conv(rows="prefill")}
STEP_SEQS, STEP_TOKENS = 12, 2048


def step_service(specs=None, **kw):
    specs = {**KDA, **MAMBA2, "conv": tables.Conv()} if specs is None else specs
    return ChunkMetaService(STEP_SEQS, STEP_TOKENS, device="cpu", tables=specs, **kw)


def step_batch(qsl, first, n, computed, checkpoints, step_id=None, qsl_tensor=None, rows=None):
    """A StepBatch with each per-request array as a device tensor and a separate host copy."""
    q = torch.tensor(qsl, dtype=torch.int32)
    c = torch.tensor(computed, dtype=torch.int32)
    k = torch.tensor(checkpoints, dtype=torch.int32)
    rows = rows or {}
    return StepBatch.decode_first(
        q.clone() if qsl_tensor is None else qsl_tensor,
        q,
        first,
        num_prefills=n,
        step_id=step_id,
        num_computed_tokens=rows.get("num_computed_tokens", c.clone()),
        num_computed_tokens_cpu=c,
        checkpoint_offsets=rows.get("checkpoint_offsets", k.clone()),
        checkpoint_offsets_cpu=k,
    )


# cached prefixes: partial first chunks, chunk-aligned prefixes, zero-length rows (one mid-chunk)
CACHED = ([0, 1, 2, 302, 302, 367, 367, 500], 2, 5, [9, 4, 64, 40, 30, 0, 256], [0, 0, 100, 0, 65, 0, 0])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_step_tables_lifecycle_and_strict_retire(backend):
    svc = step_service(backend=backend, strict=True)
    batch = step_batch(*CACHED, step_id=4)
    step = svc.begin_step(batch)
    assert isinstance(step, StepTables) and svc.current is step and svc.check(step) is step
    assert_step_tables(step, svc.builder, *CACHED)
    with pytest.raises(ChunkMetaError, match=r"begin_step while step 1 \(engine step 4\) is open"):
        svc.begin_step(batch)
    assert svc.current is step and step.is_live
    svc.end_step()
    assert not step.is_live  # strict: every table of the step dies with it
    with pytest.raises(ChunkMetaError, match="retired: its step ended"):
        step.check_live()
    with pytest.raises(ChunkMetaError, match="StepTables of build 1 used with no open step"):
        svc.check(step)
    rng = np.random.default_rng(5)
    for _ in range(20 if backend == "torch" else 4):
        qsl, first, n, computed, checkpoints = random_step(rng, STEP_SEQS, STEP_TOKENS)
        with svc.step(step_batch(qsl, first, n, computed, checkpoints)) as step2:
            assert_step_tables(step2, svc.builder, qsl, first, n, computed, checkpoints)
            with pytest.raises(ChunkMetaError, match="not the open step's"):
                svc.check(step)
        assert not step2.is_live


def test_step_tables_default_mode_keeps_tables_until_the_ring_reuses_them():
    svc = step_service(ring_depth=2)
    step = svc.begin_step(step_batch(*CACHED))
    svc.end_step()
    assert step.is_live  # async scheduling: step i's kernels may still read it
    with svc.step(step_batch([0, 5], 0, 1, [0], [0])):
        assert_step_tables(step, svc.builder, *CACHED)
    with svc.step(step_batch([0, 5], 0, 1, [0], [0])):
        assert not step.is_live


def test_step_tables_stats():
    svc = step_service()
    rng = np.random.default_rng(2)
    sizes = []
    for _ in range(25):
        qsl, first, n, computed, checkpoints = random_step(rng, STEP_SEQS, STEP_TOKENS)
        with svc.step(step_batch(qsl, first, n, computed, checkpoints)) as step:
            rows = {
                "fla": step.fla.num_chunks,
                "fla_batch": step.fla_batch.num_chunks,
                "conv": step.conv.tot,
                "mamba2": step.mamba2.num_chunks,
            }
        sizes.append((n, qsl[first + n] - qsl[first]))
    stats = svc.stats()
    assert stats.builds == 25 and stats.window == 25 and stats.graph_steps == 0
    assert 0 < stats.host_us_p50 <= stats.host_us_p99
    assert (stats.last_num_seqs, stats.last_num_tokens) == sizes[-1]
    assert stats.last_rows == rows and stats.last_num_chunks == sum(rows.values())
    assert stats.seqs_use == max(n for n, _ in sizes) / STEP_SEQS
    assert stats.tokens_use == max(t for _, t in sizes) / STEP_TOKENS
    assert 0 < stats.rows_use <= 1


def test_step_batch_rows_come_in_pairs_and_are_tensors():
    q = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ChunkMetaError, match="num_computed_tokens is given without StepBatch.num_computed_tokens_cpu"):
        StepBatch(q, q, num_computed_tokens=q[:1])
    with pytest.raises(ChunkMetaError, match="checkpoint_offsets_cpu is given without StepBatch.checkpoint_offsets"):
        StepBatch(q, q, checkpoint_offsets_cpu=q[:1])
    with pytest.raises(ChunkMetaError, match="num_computed_tokens_cpu is a list"):
        StepBatch(q, q, num_computed_tokens=q[:1], num_computed_tokens_cpu=[0])
    with pytest.raises(ChunkMetaError, match="checkpoint_offsets is a list"):
        StepBatch(q, q, checkpoint_offsets=[0], checkpoint_offsets_cpu=q[:1])
    with pytest.raises(TypeError):
        StepBatch(q, q, 0, None, None, q[:1])  # keyword-only: the positional order is unchanged
    b = StepBatch.all_prefill(q, q, num_computed_tokens=q[:1], num_computed_tokens_cpu=q[:1].numpy())
    assert b.checkpoint_offsets is None and b.num_computed_tokens_cpu.tolist() == [0]


def bad_step_inputs():
    qsl, first, n, computed, checkpoints = CACHED
    c = torch.tensor(computed, dtype=torch.int32)
    short = torch.tensor(computed[:-1], dtype=torch.int32)
    return {
        "computed missing": (dict(num_computed_tokens=None, num_computed_tokens_cpu=None), "num_computed_tokens and"),
        "computed too short": (
            dict(num_computed_tokens=short, num_computed_tokens_cpu=short),
            r"num_computed_tokens_cpu has shape \(6,\)",
        ),
        "computed negative": (
            dict(num_computed_tokens=c, num_computed_tokens_cpu=torch.where(c == 30, -1, c)),
            r"num_computed_tokens_cpu\[4\]=-1: must be >= 0",
        ),
        "computed past int32": (
            dict(num_computed_tokens=c, num_computed_tokens_cpu=torch.where(c == 64, 2**31 - 10, c)),
            r"num_computed_tokens_cpu\[2\]=2147483638",
        ),
        "computed a float tensor": (
            dict(num_computed_tokens=c.float(), num_computed_tokens_cpu=c),
            "num_computed_tokens has dtype torch.float32",
        ),
        "checkpoint past the new tokens": (
            dict(checkpoint_offsets=c, checkpoint_offsets_cpu=torch.full((7,), 3, dtype=torch.int32)),
            r"checkpoint_offsets_cpu\[3\]=3: more than request 3's 0 new tokens",
        ),
        "first_seq past the batch": (dict(first_seq=9), "first_seq=9"),
    }


@pytest.mark.parametrize("case", list(bad_step_inputs()))
def test_bad_step_input_names_the_field_and_changes_nothing(case):
    fields, message = bad_step_inputs()[case]
    svc = step_service()
    good = step_batch(*CACHED)
    with svc.step(good) as kept:
        pass
    before = (svc.builder.builds, svc.stats().builds)
    bad = attrs.evolve(good, **fields)
    with pytest.raises(ChunkMetaError, match=message):
        svc.begin_step(bad)
    assert not svc.in_step
    assert (svc.builder.builds, svc.stats().builds) == before
    assert kept.is_live  # no slot advanced
    assert_step_tables(kept, svc.builder, *CACHED)
    with svc.step(good) as again:  # the service keeps working
        assert_step_tables(again, svc.builder, *CACHED)


def test_step_service_arguments():
    with pytest.raises(ChunkMetaError, match="chunk_size=32 with tables=: each table has its own chunk size"):
        ChunkMetaService(8, 2000, device="cpu", chunk_size=32, tables=KDA)
    with pytest.raises(ChunkMetaError, match="tables must be a non-empty dict"):
        ChunkMetaService(8, 2000, device="cpu", tables={})
    with pytest.raises(ChunkMetaError, match="pad='sideways'"):
        ChunkMetaService(8, 2000, device="cpu", pad="sideways")
    svc = step_service(KDA)
    q = torch.tensor([0, 1, 70], dtype=torch.int32)
    # tables that read no per-request arrays take a batch without them (and ignore them if given)
    with svc.step(StepBatch(q, q, 1)) as step:
        assert_step_tables(step, svc.builder, [0, 1, 70], 1, 1)
    with svc.step(StepBatch(q, q, 1, num_computed_tokens=q[:2], num_computed_tokens_cpu=q[:2])) as step:
        assert_step_tables(step, svc.builder, [0, 1, 70], 1, 1)
    fla_only = service()
    with fla_only.step(StepBatch(q, q, 1, num_computed_tokens=q[:2], num_computed_tokens_cpu=q[:2])) as md:
        assert_exact(md, from_lengths([1, 69], first_seq=1), 64)


def test_step_tables_audit_checks_the_per_request_arrays():
    svc = step_service(MAMBA2, audit_every=1)
    good = step_batch(*CACHED)
    with svc.step(good):
        pass
    wrong = good.num_computed_tokens.clone()
    wrong[4] += 1
    with pytest.raises(ChunkMetaError, match=r"num_computed_tokens\[4\]=31 on the device but num_computed_tokens_cpu"):
        svc.begin_step(attrs.evolve(good, num_computed_tokens=wrong))
    assert not svc.in_step and svc.stats().builds == 1


@pytest.mark.parametrize("pad", ["tail", "negative"])
def test_step_tables_graph_mode_on_cpu(pad):
    """The graph runner's two halves over the step tables, without a graph: launch() reads
    (first_seq, num_seqs, batch_seqs) from device memory (Triton interpreter on CPU)."""
    svc = step_service(pad=pad, strict=True)
    static_qsl = torch.zeros(STEP_SEQS + 5, dtype=torch.int32)
    static_computed = torch.zeros(STEP_SEQS + 4, dtype=torch.int32)
    static_checkpoints = torch.zeros(STEP_SEQS + 4, dtype=torch.int32)
    buffers = dict(num_computed_tokens=static_computed, checkpoint_offsets=static_checkpoints)
    graph = svc.graph(static_qsl, **buffers)
    assert svc.graph(static_qsl, **buffers) is graph
    captured = svc.capture_step()
    rng = np.random.default_rng(3)
    steps = [CACHED] + [random_step(rng, STEP_SEQS, STEP_TOKENS) for _ in range(3)]
    for k, (qsl, first, n, computed, checkpoints) in enumerate(steps):
        # the engine updates its static buffers in place
        static_qsl[: len(qsl)] = torch.tensor(qsl, dtype=torch.int32)
        static_computed[: len(computed)] = torch.tensor(computed, dtype=torch.int32)
        static_checkpoints[: len(checkpoints)] = torch.tensor(checkpoints, dtype=torch.int32)
        batch = step_batch(qsl, first, n, computed, checkpoints, qsl_tensor=static_qsl, rows=buffers)
        step = svc.begin_graph_step(batch)
        graph.launch()  # stands in for the replay
        assert step.padded and step.conv.batch_ptr is captured.conv.batch_ptr  # the same static tensors
        assert_step_tables(step, svc.builder, qsl, first, n, computed, checkpoints)
        svc.end_step()
        assert not step.is_live
        assert svc.stats().graph_steps == k + 1


def test_step_tables_graph_mode_errors():
    svc = step_service(MAMBA2)
    static_qsl = torch.zeros(9, dtype=torch.int32)
    static_computed = torch.zeros(8, dtype=torch.int32)
    static_checkpoints = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ChunkMetaError, match="graph mode is not enabled"):
        svc.capture_step()
    with pytest.raises(ChunkMetaError, match="graph\\(pad='negative'\\): the step tables' padding is the builder's"):
        svc.graph(static_qsl, pad="negative", num_computed_tokens=static_computed)
    with pytest.raises(ChunkMetaError, match="num_computed_tokens must be the engine's static 1-D device buffer"):
        svc.graph(static_qsl, checkpoint_offsets=static_checkpoints)
    with pytest.raises(ChunkMetaError, match="num_computed_tokens has 7 entries but the static query_start_loc"):
        svc.graph(static_qsl, num_computed_tokens=static_computed[:7], checkpoint_offsets=static_checkpoints)
    buffers = dict(num_computed_tokens=static_computed, checkpoint_offsets=static_checkpoints)
    svc.graph(static_qsl, **buffers)
    with pytest.raises(ChunkMetaError, match="already enabled"):
        svc.graph(static_qsl, num_computed_tokens=static_computed.clone(), checkpoint_offsets=static_checkpoints)
    qsl, computed = [0, 5, 70], [3, 0]
    static_qsl[:3] = torch.tensor(qsl, dtype=torch.int32)
    static_computed[:2] = torch.tensor(computed, dtype=torch.int32)
    not_static = step_batch(qsl, 0, 2, computed, [0, 0], qsl_tensor=static_qsl)
    with pytest.raises(ChunkMetaError, match="batch.num_computed_tokens is not the static buffer"):
        svc.begin_graph_step(not_static)
    missing = attrs.evolve(not_static, num_computed_tokens=None, num_computed_tokens_cpu=None)
    with pytest.raises(ChunkMetaError, match="batch.num_computed_tokens is not the static buffer"):
        svc.begin_graph_step(missing)
    assert not svc.in_step and svc.stats().graph_steps == 0
    step = svc.begin_graph_step(step_batch(qsl, 0, 2, computed, [0, 0], qsl_tensor=static_qsl, rows=buffers))
    assert step.mamba2.num_chunks == 4  # 5 tokens after 3 cached: one chunk; 65 from 0: cut at 32 and 64
    fla_only = service()
    with pytest.raises(ChunkMetaError, match="FLA-only service's tables read no per-request arrays"):
        fla_only.graph(static_qsl, num_computed_tokens=static_computed)
