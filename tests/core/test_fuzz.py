"""Hostile input, fuzzed: every public entry point raises ChunkMetaError naming the argument and
the value, and afterwards the builder still works and every live ChunkMetadata is unchanged.

Each example takes a valid step and applies one corruption. Entry points: build_chunk_metadata,
ChunkMetadataBuilder.build / build_padded, ChunkMetaService.begin_step, GraphBuild.prepare
(through the service's begin_graph_step), the KDA adapter (bad metadata), and
StepTablesBuilder.build (with the per-request inputs' corruptions too).

Note on chunk rows: a step whose sequences and tokens fit the capacity always fits its rows
(cdiv(a, C) + cdiv(b, C) <= cdiv(a + b, C) + 1, so NT <= cdiv(T, C) + N), hence "capacity + 1
rows" is reached through tokens or sequences, and a step at exactly the row capacity must work.
"""

import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checks import as_lists, assert_exact, tensors_for
from chunkmeta import (
    ChunkMetadataBuilder,
    ChunkMetaError,
    ChunkMetaService,
    StepBatch,
    StepTablesBuilder,
    build_chunk_metadata,
    reference,
    tables,
)
from chunkmeta.workloads import from_lengths
from strategies import batches

CAP_SEQS, CAP_TOKENS = 16, 4000
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _corruptions():
    """(name, fn(qsl, qsl_cpu, kwargs) -> (qsl, qsl_cpu, kwargs), expected message fragments)."""

    def swap_in_slice(qsl, cpu, kw):
        """Swap two different offsets inside the prefill slice (only the slice is read)."""
        first, n = kw["first_seq"], kw["num_seqs"]
        cpu = cpu.clone()
        if n < 2 or cpu[first + 1] == cpu[first + 2]:
            cpu = torch.tensor([0, 50, 20, 90], dtype=cpu.dtype)
            return cpu.clone(), cpu, {}
        cpu[first + 1], cpu[first + 2] = cpu[first + 2].clone(), cpu[first + 1].clone()
        return qsl, cpu, kw

    return [
        ("non-monotonic", swap_in_slice, ["query_start_loc_cpu", "decreasing"]),
        (
            "negative",
            lambda q, c, kw: (q, torch.cat([torch.tensor([-7], dtype=c.dtype), c[1:]]), {**kw, "first_seq": 0}),
            ["query_start_loc_cpu", "-7"],
        ),
        (
            "over 2^31 tokens",
            lambda q, c, kw: (torch.tensor([0, 10, 2**31 + 5]), torch.tensor([0, 10, 2**31 + 5]), {}),
            ["2147483653 tokens", "int32"],
        ),
        ("length mismatch", lambda q, c, kw: (q[:-1], c, kw), ["query_start_loc", "entries"]),
        ("float host", lambda q, c, kw: (q, c.float(), kw), ["query_start_loc_cpu", "torch.float32"]),
        ("bool host", lambda q, c, kw: (q, c.bool(), kw), ["query_start_loc_cpu", "torch.bool"]),
        ("int16 host", lambda q, c, kw: (q, c.to(torch.int16), kw), ["query_start_loc_cpu", "torch.int16"]),
        ("float device", lambda q, c, kw: (q.double(), c, kw), ["query_start_loc", "torch.float64"]),
        ("0-d host", lambda q, c, kw: (q, c[0], kw), ["query_start_loc_cpu", "shape ()"]),
        ("2-d host", lambda q, c, kw: (q, c.view(1, -1), kw), ["query_start_loc_cpu", "1-D"]),
        ("2-d device", lambda q, c, kw: (q.view(1, -1), c, kw), ["query_start_loc", "1-D"]),
        (
            "non-contiguous device",
            lambda q, c, kw: (torch.stack([q, q], 1)[:, 0], c, kw),
            ["query_start_loc", "stride 2"],
        ),
        ("wrong device", lambda q, c, kw: (q.to("meta"), c, kw), ["query_start_loc", "meta"]),
        ("host on device", lambda q, c, kw: (q, q.to("meta"), kw), ["query_start_loc_cpu", "meta"]),
        ("first_seq past the end", lambda q, c, kw: (q, c, {"first_seq": c.shape[0] + 3}), ["first_seq="]),
        ("negative first_seq", lambda q, c, kw: (q, c, {"first_seq": -2}), ["first_seq=-2"]),
        ("num_seqs past the end", lambda q, c, kw: (q, c, {**kw, "num_seqs": c.shape[0] + 1}), ["num_seqs="]),
        ("float num_seqs", lambda q, c, kw: (q, c, {**kw, "num_seqs": 2.5}), ["num_seqs=2.5"]),
    ]


CORRUPTIONS = _corruptions()


def _capacity_corruptions():
    return [
        ("sequences + 1", from_lengths([1] * (CAP_SEQS + 1)), ["num_seqs=17", "capacity of 16"]),
        ("tokens + 1", from_lengths([CAP_TOKENS - 100, 101]), ["4001 tokens", "capacity of 4000"]),
    ]


class Live:
    """A builder with live metadata objects, and a snapshot of what they hold."""

    def __init__(self, backend="torch", **kw):
        self.builder = ChunkMetadataBuilder(CAP_SEQS, CAP_TOKENS, device="cpu", backend=backend, ring_depth=4, **kw)
        self.good = [from_lengths([1, 5, 64, 0, 130], first_seq=1), from_lengths([300, 1, 65])]
        self.objects = [self.builder.build(*tensors_for(b), first_seq=b.first_seq) for b in self.good]
        self.snapshot = [(as_lists(md), md.cu_seqlens_cpu.tolist()) for md in self.objects]

    def assert_unchanged_and_working(self):
        assert [(as_lists(md), md.cu_seqlens_cpu.tolist()) for md in self.objects] == self.snapshot
        assert all(md.is_live for md in self.objects)
        builds = self.builder.builds
        for md, b in zip(self.objects, self.good, strict=True):
            assert_exact(md, b, 64)
        assert self.builder.builds == builds  # checking built nothing


def _corrupt(batch, index):
    qsl, cpu = tensors_for(batch)
    kwargs = {"first_seq": batch.first_seq, "num_seqs": batch.num_seqs}
    name, fn, fragments = CORRUPTIONS[index]
    qsl, cpu, kwargs = fn(qsl, cpu, kwargs)
    return name, qsl, cpu, kwargs, fragments


def _expect(fn, fragments):
    with pytest.raises(ChunkMetaError) as info:
        fn()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


@pytest.mark.parametrize("entry", ["build", "build_padded", "one_shot", "service", "graph", "vllm_drop_in"])
@SETTINGS
@given(data=st.data())
def test_corrupted_steps_raise_and_change_nothing(entry, data):
    batch = data.draw(batches(64, max_requests=CAP_SEQS - 2, max_len=300))
    index = data.draw(st.integers(0, len(CORRUPTIONS) - 1))
    name, qsl, cpu, kwargs, fragments = _corrupt(batch, index)
    live = Live()
    if entry == "build":
        _expect(lambda: live.builder.build(qsl, cpu, **kwargs), fragments)
    elif entry == "build_padded":
        _expect(lambda: live.builder.build_padded(qsl, cpu, pad="tail", **kwargs), fragments)
    elif entry == "one_shot":
        if name in ("wrong device",):  # the one-shot allocates on the input's device: nothing to mismatch
            return
        _expect(lambda: build_chunk_metadata(qsl, cpu, **kwargs), fragments)
    elif entry == "vllm_drop_in":  # the ROCm Kimi-K3 helper's signature: whole batch, names cu_seqlens
        if name in (
            "wrong device",
            "first_seq past the end",
            "negative first_seq",
            "num_seqs past the end",
            "float num_seqs",
        ):
            return  # no slice arguments in that signature; it allocates on the input's device
        from chunkmeta.integrations import vllm

        _expect(
            lambda: vllm.prepare_chunk_metadata_device(qsl, cpu, 64),
            [f.replace("query_start_loc", "cu_seqlens") for f in fragments],
        )
    elif entry == "service":
        service = ChunkMetaService(CAP_SEQS, CAP_TOKENS, device="cpu")
        service.builder = live.builder  # serve from the builder whose live objects we watch
        try:
            batch_ = StepBatch(qsl, cpu, **{k: v for k, v in kwargs.items() if v is not None})
        except ChunkMetaError as exc:  # StepBatch itself refuses some (non-int slice arguments)
            assert any(f in str(exc) for f in fragments) or "StepBatch" in str(exc)
            return
        _expect(lambda: service.begin_step(batch_), fragments)
        assert not service.in_step
    else:  # graph mode: the host half validates the host copy against the static buffer
        if name in ("length mismatch", "float device", "2-d device", "non-contiguous device", "wrong device"):
            return  # device-side corruptions: the static buffer is fixed at GraphBuild creation
        service = ChunkMetaService(CAP_SEQS, CAP_TOKENS, device="cpu")
        static = torch.zeros(64, dtype=torch.int32)
        service.graph(static)
        try:
            batch_ = StepBatch(static, cpu, **{k: v for k, v in kwargs.items() if v is not None})
        except ChunkMetaError:
            return
        _expect(lambda: service.begin_graph_step(batch_), [f for f in fragments if f != "entries"])
        assert not service.in_step
    live.assert_unchanged_and_working()


@pytest.mark.parametrize("name,batch,fragments", _capacity_corruptions(), ids=lambda v: v if isinstance(v, str) else "")
def test_capacity_plus_one(name, batch, fragments):
    live = Live()
    _expect(lambda: live.builder.build(*tensors_for(batch)), fragments)
    _expect(lambda: live.builder.build_padded(*tensors_for(batch)), fragments)
    live.assert_unchanged_and_working()


def test_row_capacity_is_reachable_exactly():
    builder = ChunkMetadataBuilder(2, 100, chunk_size=16, device="cpu")  # rows = 7 + 2
    best = max(((a, 100 - a) for a in range(101)), key=lambda p: -(-p[0] // 16) + -(-p[1] // 16))
    batch = from_lengths(list(best))
    md = builder.build(*tensors_for(batch))
    assert_exact(md, batch, 16)
    assert md.num_chunks <= builder.capacity.rows


@pytest.mark.parametrize("chunk_size", [0, 1, 8, 24, 63, 65, 100, 8192, -64, 64.0, "64", None, True])
def test_bad_chunk_sizes_everywhere(chunk_size):
    qsl, cpu = tensors_for(from_lengths([5, 70]))
    _expect(lambda: ChunkMetadataBuilder(4, 100, chunk_size=chunk_size, device="cpu"), ["chunk_size="])
    _expect(lambda: build_chunk_metadata(qsl, cpu, chunk_size=chunk_size), ["chunk_size="])
    _expect(lambda: ChunkMetaService(4, 100, chunk_size=chunk_size, device="cpu"), ["chunk_size="])


@SETTINGS
@given(data=st.data())
def test_valid_steps_never_raise(data):
    """The other half of the contract: whatever fits the capacity builds, and builds exactly."""
    live = Live()
    for _ in range(3):
        batch = data.draw(batches(64, max_requests=CAP_SEQS - 2, max_len=300))
        assert_exact(
            live.builder.build(*tensors_for(batch), first_seq=batch.first_seq, num_seqs=batch.num_seqs), batch, 64
        )


def test_adapter_entry_points_refuse_bad_metadata():
    kda = pytest.importorskip("chunkmeta.integrations.kda")
    x = torch.zeros(1, 4, 2, 32)
    for bad, fragment in (
        (None, "pass the step's ChunkMetadata"),
        ("meta", "pass the step's ChunkMetadata"),
        (object(), "pass the step's ChunkMetadata"),
    ):
        _expect(lambda: kda.chunk_kda(x, x, x, x, x[..., 0], metadata=bad), [fragment])
        _expect(lambda: kda.chunk_gated_delta_rule(x, x, x, x[..., 0], x[..., 0], metadata=bad), [fragment])


def test_two_builders_share_nothing():
    a = ChunkMetadataBuilder(8, 1000, device="cpu")
    b = ChunkMetadataBuilder(8, 1000, device="cpu")
    assert {a.ring.pointer(k) for k in range(a.ring.depth)}.isdisjoint({b.ring.pointer(k) for k in range(b.ring.depth)})
    ba, bb = from_lengths([100, 3]), from_lengths([1, 1, 1, 500])
    ma = a.build(*tensors_for(ba))
    for _ in range(10):  # b spins its ring; a's object is untouched
        b.build(*tensors_for(bb))
    assert_exact(ma, ba, 64) and ma.is_live


def test_service_refuses_a_second_thread_and_can_be_handed_over():
    service = ChunkMetaService(8, 1000, device="cpu")
    batch = StepBatch(*tensors_for(from_lengths([5, 70])))
    with service.step(batch):
        pass
    errors = []

    def other():
        try:
            service.begin_step(batch)
        except ChunkMetaError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert errors and "serves one thread" in errors[0] and not service.in_step

    def adopt():
        service.adopt_thread()
        with service.step(batch) as md:
            errors.append(md.num_tokens)

    thread = threading.Thread(target=adopt)
    thread.start()
    thread.join()
    assert errors[-1] == 75


def test_one_service_per_thread_works_concurrently():
    results = {}

    def worker(seed):
        service = ChunkMetaService(16, 4000, device="cpu")
        rng = np.random.default_rng(seed)
        ok = True
        for _ in range(50):
            lengths = rng.integers(0, 200, int(rng.integers(1, 16))).tolist()
            b = from_lengths(lengths)
            with service.step(StepBatch(*tensors_for(b))) as md:
                try:
                    assert_exact(md, b, 64)
                except AssertionError:
                    ok = False
        results[seed] = ok

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: True, 1: True, 2: True, 3: True}


# --- the step builder: the same corruptions, and the per-request inputs' ------------------------

STEP_SPECS = {
    "fla": tables.Fla(64),
    "conv": tables.Conv(),
    "mamba2": tables.Mamba2(chunk_size=64, checkpoints=True),
    "sglang": tables.SglangMamba2(chunk_size=16),
}


def _row_kwargs(batch):
    rows = len(batch.query_start_loc) - 1
    computed = torch.arange(rows, dtype=torch.int32) * 7
    return {
        "num_computed_tokens": computed.clone(),
        "num_computed_tokens_cpu": computed,
        "checkpoint_offsets": torch.zeros(rows, dtype=torch.int32),
        "checkpoint_offsets_cpu": torch.zeros(rows, dtype=torch.int32),
    }


def _row_corruptions():
    """(name, fn(kwargs, batch) -> kwargs, expected message fragments)."""

    def with_value(key, index_from_end, value):
        def corrupt(kw, batch):
            tensor = kw[key].clone()
            tensor[-index_from_end] = value
            return {**kw, key: tensor}

        return corrupt

    def computed_past_int32(kw, batch):
        host = kw["num_computed_tokens_cpu"].clone()
        host[batch.first_seq] = 2**31 - 1  # the slice's first request has new tokens (see the test)
        return {**kw, "num_computed_tokens_cpu": host}

    def checkpoint_past_the_tokens(kw, batch):
        lengths = np.diff(batch.query_start_loc)
        host = kw["checkpoint_offsets_cpu"].clone()
        host[batch.first_seq] = int(lengths[batch.first_seq]) + 1
        return {**kw, "checkpoint_offsets_cpu": host}

    return [
        (
            "computed short",
            lambda kw, b: {**kw, "num_computed_tokens_cpu": kw["num_computed_tokens_cpu"][:-1]},
            ["num_computed_tokens_cpu has shape"],
        ),
        ("computed negative", with_value("num_computed_tokens_cpu", 1, -3), ["num_computed_tokens_cpu[", "=-3"]),
        (
            "computed float",
            lambda kw, b: {**kw, "num_computed_tokens_cpu": kw["num_computed_tokens_cpu"].float()},
            ["torch.float32"],
        ),
        (
            "computed list",
            lambda kw, b: {**kw, "num_computed_tokens_cpu": kw["num_computed_tokens_cpu"].tolist()},
            ["is a list"],
        ),
        (
            "computed device short",
            lambda kw, b: {**kw, "num_computed_tokens": kw["num_computed_tokens"][:-1]},
            ["num_computed_tokens has shape"],
        ),
        (
            "computed device 2-d",
            lambda kw, b: {**kw, "num_computed_tokens": kw["num_computed_tokens"].view(1, -1)},
            ["num_computed_tokens has shape"],
        ),
        (
            "computed wrong device",
            lambda kw, b: {**kw, "num_computed_tokens": kw["num_computed_tokens"].to("meta")},
            ["num_computed_tokens is on meta"],
        ),
        (
            "computed host on device",
            lambda kw, b: {**kw, "num_computed_tokens_cpu": kw["num_computed_tokens"].to("meta")},
            ["num_computed_tokens_cpu is on meta"],
        ),
        (
            "computed missing",
            lambda kw, b: {**kw, "num_computed_tokens": None},
            ["num_computed_tokens and num_computed_tokens_cpu are required"],
        ),
        ("computed past int32", computed_past_int32, ["2147483647", "int32"]),
        ("checkpoint past the new tokens", checkpoint_past_the_tokens, ["checkpoint_offsets_cpu[", "new tokens"]),
        ("checkpoint negative", with_value("checkpoint_offsets_cpu", 1, -1), ["checkpoint_offsets_cpu[", "=-1"]),
        ("checkpoint missing", lambda kw, b: {**kw, "checkpoint_offsets_cpu": None}, ["checkpoint_offsets and"]),
    ]


ROW_CORRUPTIONS = _row_corruptions()


class LiveSteps:
    """A step builder with live StepTables, and a snapshot of its buffers."""

    def __init__(self):
        self.builder = StepTablesBuilder(CAP_SEQS, CAP_TOKENS, tables=STEP_SPECS, device="cpu", backend="torch")
        self.good = [from_lengths([1, 5, 64, 0, 130], first_seq=1), from_lengths([300, 1, 65])]
        self.objects = [self.builder.build(*tensors_for(b), first_seq=b.first_seq, **_row_kwargs(b)) for b in self.good]
        self.arena = self.builder.ring.arena.clone()

    def assert_unchanged_and_working(self):
        assert torch.equal(self.builder.ring.arena, self.arena)
        assert all(t.is_live for t in self.objects) and self.builder.builds == len(self.good)
        for b in self.good:  # and it still builds
            step = self.builder.build(*tensors_for(b), first_seq=b.first_seq, **_row_kwargs(b))
            assert (
                step.fla.cu_seqlens.tolist() == reference.chunk_metadata(b.query_start_loc, 64, b.first_seq).cu_seqlens
            )


@SETTINGS
@given(data=st.data())
def test_step_builder_refuses_corrupted_steps_and_changes_nothing(data):
    batch = data.draw(batches(64, max_requests=CAP_SEQS - 2, max_len=300))
    if len(batch.query_start_loc) - 1 > CAP_SEQS:  # the conv table's whole-batch slice must fit
        batch = from_lengths([1, 1, 40, 3], first_seq=2)
    live = LiveSteps()
    if data.draw(st.booleans()):  # a query_start_loc corruption
        name, qsl, cpu, kwargs, fragments = _corrupt(batch, data.draw(st.integers(0, len(CORRUPTIONS) - 1)))
        rows = _row_kwargs(batch)
        _expect(lambda: live.builder.build(qsl, cpu, **kwargs, **rows), fragments)
    else:
        if batch.num_seqs == 0 or batch.query_start_loc[batch.first_seq + 1] == batch.query_start_loc[batch.first_seq]:
            batch = from_lengths([1, 40, 3], first_seq=1)  # a slice whose first request has new tokens
        name, corrupt, fragments = ROW_CORRUPTIONS[data.draw(st.integers(0, len(ROW_CORRUPTIONS) - 1))]
        kwargs = corrupt(_row_kwargs(batch), batch)
        qsl, cpu = tensors_for(batch)
        _expect(
            lambda: live.builder.build(qsl, cpu, first_seq=batch.first_seq, num_seqs=batch.num_seqs, **kwargs),
            fragments,
        )
    live.assert_unchanged_and_working()
