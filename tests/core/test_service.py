"""The scheduler hooks: step lifecycle, retirement, stats, and graph mode's launch/prepare split."""

import numpy as np
import pytest
import torch

from checks import assert_exact, assert_padded, tensors_for
from chunkmeta import ChunkMetaError, ChunkMetaService, GraphBuild, StepBatch
from chunkmeta.workloads import from_lengths, random_decode_first


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
