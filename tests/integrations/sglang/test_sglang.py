"""The SGLang adapter against a faithful model of SGLang's interfaces (tests/integrations/sglang/sglang_fake.py).

CPU (in `make test`, SGLang not imported): per forward mode (EXTEND, MIXED, DECODE, IDLE,
TARGET_VERIFY, a DP-relabelled decode), DP padding, extend_seq_lens_cpu missing (the bounded
layout), both CUDA-graph hook generations with capture/replay on CPU (GraphBuild under the Triton
interpreter), KDA tables through the kernel dispatcher and GDN/older KDA through the FLA router,
install/uninstall and the plugin entry point; every table checked against chunkmeta.reference.
GPU (`-m gpu`): the same paths with torch.cuda.set_sync_debug_mode("error"), and the in-graph build
captured in a torch.cuda.CUDAGraph, replayed with changing extend batches.
"""

import inspect
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

import sglang_fake
from checks import no_sync
from chunkmeta import ChunkMetaError, layout, reference
from sglang_fake import ForwardMode, decode_batch, extend_batch, mixed_batch
from sglang_faults import chunkmeta_warnings, failing

sg = pytest.importorskip("chunkmeta.integrations.sglang")
PAST_END = layout.PAST_END_CHUNK

T23 = sglang_fake.register("fake_sglang_0523", "0.5.23")
T21 = sglang_fake.register("fake_sglang_0521", "0.5.21")
T12 = sglang_fake.register("fake_sglang_0512", "0.5.12")
TREES = {"0.5.23": T23, "0.5.21": T21, "0.5.12": T12}


@pytest.fixture(autouse=True)
def _fresh_counts():
    for tree in TREES.values():
        tree.state.update(fla_syncs=0, base_syncs=0)


@pytest.fixture
def backends():
    """Build chunkmeta backends; close them (unregister from the router) after the test."""
    made = []

    def make(tree, kind, base=None, device="cpu", **runner):
        base = base or getattr(tree, f"{kind.upper()}AttnBackend")
        cls = sg.chunkmeta_backend(base, kind=kind, fla_package=tree.fla)
        backend = cls(sglang_fake.model_runner(device, **runner))
        made.append(backend)
        return backend

    yield make
    for backend in made:
        if backend.chunkmeta is not None:
            backend.chunkmeta.close()


def forward(backend, fb):
    """What a step does: the backend's eager init once, then a linear layer's extend."""
    backend.init_forward_metadata(fb)
    return backend.forward_extend(0, fb, torch.zeros(fb.input_ids.shape[0]), None, None)


def rows(t):
    return [tuple(r) for r in t.cpu().tolist()]


def qsl_of(lens):
    return [0] + np.cumsum(lens).tolist() if len(lens) else [0]


def assert_tables(tables, lens, layout="exact"):
    """The tables equal the reference for lens; padded layouts have (0, PAST_END) rows after."""
    ref = reference.chunk_metadata(qsl_of(lens), 64)
    assert tables.layout == layout
    assert tables.chunk_indices.dtype == torch.int32 and tables.chunk_offsets.dtype == torch.int64
    assert tables.query_start_loc.cpu().tolist() == ref.cu_seqlens
    got = rows(tables.chunk_indices)
    assert got[: ref.num_chunks] == ref.chunk_indices
    assert tables.chunk_offsets.cpu().tolist()[: ref.num_seqs + 1] == ref.chunk_offsets
    if layout == "exact":
        assert len(got) == ref.num_chunks and tables.metadata.num_chunks == ref.num_chunks
        assert tables.max_seqlen == ref.max_seqlen
    else:
        assert got[ref.num_chunks :] == [(0, PAST_END)] * (len(got) - ref.num_chunks)
        assert tables.num_rows == len(got) >= ref.num_chunks


BATCHES = [[128, 256], [128, 257], [300], [1, 64, 65, 129], [5, 70, 1, 1], [64], [1], [2000, 3, 0, 17]]


# -- sizes ------------------------------------------------------------------------------------


def test_backend_capacity(monkeypatch):
    runner = sglang_fake.model_runner(max_running_requests=32, chunked_prefill_size=8192, max_prefill_tokens=16384)
    assert sg.backend_capacity(runner) == (32, 16384 + 32)
    runner.server_args.chunked_prefill_size = -1  # chunked prefill off: one prompt may be context-long
    assert sg.backend_capacity(runner) == (32, 32768 + 32)
    runner.req_to_token_pool.size = 48  # a forward never holds more requests than the pool
    assert sg.backend_capacity(runner)[0] == 48
    monkeypatch.setenv("CHUNKMETA_SGLANG_MAX_NUM_TOKENS", "1000")
    monkeypatch.setenv("CHUNKMETA_SGLANG_MAX_NUM_SEQS", "7")
    assert sg.backend_capacity(runner) == (7, 1000)
    monkeypatch.setenv("CHUNKMETA_SGLANG_MAX_NUM_SEQS", "zero")
    with pytest.raises(ChunkMetaError, match="CHUNKMETA_SGLANG_MAX_NUM_SEQS='zero'"):
        sg.backend_capacity(runner)
    monkeypatch.delenv("CHUNKMETA_SGLANG_MAX_NUM_SEQS")
    monkeypatch.delenv("CHUNKMETA_SGLANG_MAX_NUM_TOKENS")
    bare = type("Runner", (), {})()
    with pytest.raises(ChunkMetaError, match="max_running_requests"):
        sg.backend_capacity(bare)


# -- classes and hooks --------------------------------------------------------------------------


def test_hook_generation_is_read_from_the_base():
    assert sg.hook_generation(T23.KDAAttnBackend) == "split"
    assert sg.hook_generation(T12.GDNAttnBackend) == "legacy"
    with pytest.raises(ChunkMetaError, match="base=object"):
        sg.hook_generation(object)
    new = sg.chunkmeta_backend(T23.KDAAttnBackend, kind="kda", fla_package=T23.fla)
    old = sg.chunkmeta_backend(T12.KDAAttnBackend, kind="kda", fla_package=T12.fla)
    assert new.chunkmeta_hooks == "split" and "init_forward_metadata_in_graph" in vars(sg.backends._SplitGraphHooks)
    assert issubclass(new, sg.backends._SplitGraphHooks) and not issubclass(new, sg.backends._LegacyGraphHooks)
    assert issubclass(old, sg.backends._LegacyGraphHooks) and not issubclass(old, sg.backends._SplitGraphHooks)
    assert issubclass(new, sg.backends._PrefillGraphHooks) and not issubclass(old, sg.backends._PrefillGraphHooks)
    assert new._chunkmeta_kwargs and not old._chunkmeta_kwargs  # chunk_kda takes tables from 0.5.22
    assert sg.chunkmeta_backend(T23.KDAAttnBackend, kind="kda", fla_package=T23.fla) is new
    with pytest.raises(ChunkMetaError, match="kind='mamba'"):
        sg.chunkmeta_backend(T23.KDAAttnBackend, kind="mamba")


@pytest.mark.parametrize("version", TREES)
@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_overrides_keep_the_base_signatures(version, kind):
    base = getattr(TREES[version], f"{kind.upper()}AttnBackend")
    cls = sg.chunkmeta_backend(base, kind=kind, fla_package=TREES[version].fla)
    overridden = [
        name
        for mixin in cls.__mro__
        if mixin.__module__ == sg.backends.__name__ and mixin is not cls
        for name, value in vars(mixin).items()
        if inspect.isfunction(value)
    ]
    checked = 0
    for name in overridden:
        if hasattr(base, name):
            assert parameters(getattr(cls, name)) == parameters(getattr(base, name)), name
            checked += 1
    assert checked >= 4


def parameters(fn):
    """Names, kinds and defaults: what a caller relies on (annotations may be strings or types)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


# -- eager forwards -----------------------------------------------------------------------------


@pytest.mark.parametrize("lens", BATCHES)
def test_kda_tables_reach_chunk_kda_through_the_dispatcher(backends, lens):
    backend = backends(T23, "kda")
    run = forward(backend, extend_batch(lens))
    tables = backend.chunkmeta.tables
    assert_tables(tables, lens)
    assert run.chunk_indices is tables.chunk_indices and run.chunk_offsets is tables.chunk_offsets
    assert run.cu_seqlens is tables.query_start_loc  # SGLang's own tensor stays FLA's cu_seqlens
    assert T23.state["fla_syncs"] == 0 and backend.chunkmeta.counts["kwargs"] == 1


@pytest.mark.parametrize("lens", BATCHES + [[5, 7], [20, 9, 3]])
def test_gdn_tables_reach_fla_through_the_router(backends, lens):
    backend = backends(T23, "gdn")
    run = forward(backend, extend_batch(lens))
    tables = backend.chunkmeta.tables
    assert_tables(tables, lens)
    assert run.chunk_indices is tables.chunk_indices and run.chunk_offsets is tables.chunk_offsets
    # chunk_fwd_o's table at BT = min(64, max(16, next_pow2(T))): served too (small T: one chunk each)
    assert run.output_chunk_indices is tables.chunk_indices
    assert rows(run.output_chunk_indices) == reference.chunk_metadata(qsl_of(lens), run.output_chunk_size).chunk_indices
    assert T23.state["fla_syncs"] == 0


@pytest.mark.parametrize("version", ["0.5.21", "0.5.12"])
def test_older_kda_is_served_through_the_router(backends, version):
    tree = TREES[version]
    backend = backends(tree, "kda")
    assert not type(backend)._chunkmeta_kwargs
    lens = [300, 1, 64]
    run = forward(backend, extend_batch(lens))
    assert_tables(backend.chunkmeta.tables, lens)
    assert run.chunk_indices is backend.chunkmeta.tables.chunk_indices
    assert tree.state["fla_syncs"] == 0


def test_rocm_kda_keeps_the_dispatcher_untouched(backends, monkeypatch):
    """On ROCm an injected chunk_indices would switch off SGLang's gfx950 KDA prefill kernel (taken
    only when none is passed): the router serves chunk_kda instead."""
    monkeypatch.setattr(torch.version, "hip", "7.2.0", raising=False)
    cls = sg.chunkmeta_backend(T23.KDAAttnBackend, kind="kda", fla_package=T23.fla)
    assert not cls._chunkmeta_kwargs and cls._chunkmeta_router is not None
    backend = backends(T23, "kda")
    assert type(backend) is cls
    seen = {}
    original = T23.fla_kda.chunk_kda
    monkeypatch.setattr(T23.fla_kda, "chunk_kda", lambda **kw: seen.update(kw) or original(**kw))
    lens = [300, 1, 64]
    run = forward(backend, extend_batch(lens))
    assert seen["chunk_indices"] is None  # what the dispatcher passed on: nothing
    assert run.chunk_indices is backend.chunkmeta.tables.chunk_indices  # what chunk_kda ran on: ours
    assert T23.state["fla_syncs"] == 0 and backend.chunkmeta.counts["kwargs"] == 0


def test_without_chunkmeta_fla_syncs_once_per_forward():
    stock = T23.GDNAttnBackend(sglang_fake.model_runner())
    lens = [3, 0, 127, 1]
    run = forward(stock, extend_batch(lens))
    assert T23.state["fla_syncs"] == 1  # the 64-token table (chunk_fwd_o's BT=64 call is the same in SGLang)
    ref = reference.chunk_metadata(qsl_of(lens), 64)
    # SGLang's vendored helper numbers only sequences with rows: the empty sequence shifts the ids.
    assert rows(run.chunk_indices) != ref.chunk_indices
    assert run.chunk_offsets.tolist() == ref.chunk_offsets


def test_mixed_batch_decode_rows_are_one_token_extends(backends):
    backend = backends(T23, "kda")
    fb = mixed_batch([300, 64, 7], num_decodes=5)
    assert fb.forward_mode.is_mixed()
    run = forward(backend, fb)
    lens = [300, 64, 7, 1, 1, 1, 1, 1]
    assert_tables(backend.chunkmeta.tables, lens)
    assert rows(run.chunk_indices)[-5:] == [(3, 0), (4, 0), (5, 0), (6, 0), (7, 0)]


@pytest.mark.parametrize(
    "fb",
    [
        decode_batch(4),
        decode_batch(4, mode=ForwardMode.IDLE),
        decode_batch(2, mode=ForwardMode.TARGET_VERIFY, draft_token_num=4),
        decode_batch(3, relabelled=True),
    ],
    ids=["decode", "idle", "target_verify", "dp_relabelled_decode"],
)
@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_modes_without_chunk_tables(backends, kind, fb):
    backend = backends(T23, kind)
    forward(backend, extend_batch([100, 5]))
    assert backend.chunkmeta.tables is not None
    backend.init_forward_metadata(fb)
    assert backend.chunkmeta.tables is None and backend.chunkmeta.served == {}
    assert backend.forward_metadata.query_start_loc is not None  # the base's own metadata is untouched
    assert backend.chunkmeta.counts["none"] == 1


def test_random_batches_match_the_reference(backends):
    backend = backends(T23, "kda")
    rng = np.random.default_rng(11)
    for _ in range(300):
        lens = random_lens(rng)
        mixed = rng.random() < 0.5
        fb = extend_batch(
            lens,
            mode=ForwardMode.MIXED if mixed else ForwardMode.EXTEND,
            num_tokens=sum(lens) + int(rng.integers(0, 64)),
        )
        run = forward(backend, fb)
        assert_tables(backend.chunkmeta.tables, lens)
        assert run.chunk_indices is backend.chunkmeta.tables.chunk_indices
    assert T23.state["fla_syncs"] == 0 and backend.chunkmeta.counts["exact"] == 300


def test_empty_and_fabricated_extends(backends):
    backend = backends(T23, "gdn")
    forward(backend, extend_batch([0, 0]))  # an all-empty prefill: empty tables, not None
    tables = backend.chunkmeta.tables
    assert tables.chunk_indices.shape == (0, 2) and tables.chunk_offsets.tolist() == [0, 0, 0]
    # an idle DP rank replaying a padded prefill shape fabricates one extend of num_tokens
    # (logical_forward_mode stays EXTEND: only a decode original is restored); its linear layers
    # are skipped by SGLang, and its tables are simply exact
    fb = extend_batch([256])
    fb._original_forward_mode, fb.global_num_token_non_padded_cpu = ForwardMode.IDLE, 0
    forward(backend, fb)
    assert_tables(backend.chunkmeta.tables, [256])


def test_dp_padding(backends):
    """An EXTEND rank padded to the largest rank's token count keeps its real query_start_loc;
    zero-length rows (at the tail) keep their index and get no rows."""
    backend = backends(T23, "kda")
    lens = [70, 5]
    fb = extend_batch(lens, num_tokens=512)
    assert fb.extend_num_tokens == 512 and fb.input_ids.shape[0] == 512
    forward(backend, fb)
    assert_tables(backend.chunkmeta.tables, lens)
    lens = [70, 5, 0, 0]
    forward(backend, extend_batch(lens, num_tokens=256))
    tables = backend.chunkmeta.tables
    assert_tables(tables, lens)
    assert tables.chunk_offsets.tolist() == [0, 2, 3, 3, 3]


@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_missing_host_lengths_give_the_bounded_layout(backends, kind):
    """gpu_only batches (extend_seq_lens_cpu None): rows sized by the host bound from the base's
    logical_num_tokens, filled on the device; the base's own device read is SGLang's, not ours."""
    backend = backends(T23, kind)
    lens = [65, 1, 129, 0, 7]
    run = forward(backend, extend_batch(lens, host_lens=False))
    tables = backend.chunkmeta.tables
    assert_tables(tables, lens, layout="bounded")
    assert tables.num_rows == layout.chunk_row_bound(5, sum(lens), 64)
    assert run.chunk_indices is tables.chunk_indices
    assert T23.state["fla_syncs"] == 0 and T23.state["base_syncs"] == 1


def test_bounded_layout_bounds(backends):
    # 0.5.12 has no logical_num_tokens: the bound comes from extend_num_tokens, padded under DP
    backend = backends(T12, "kda")
    lens = [3, 64]
    forward(backend, extend_batch(lens, host_lens=False, num_tokens=300))
    tables = backend.chunkmeta.tables
    assert_tables(tables, lens, layout="bounded")
    assert tables.num_rows == layout.chunk_row_bound(2, 300, 64) and T12.state["base_syncs"] == 0
    # no extend_num_tokens either: the number of input tokens (a host shape)
    fb = extend_batch(lens, host_lens=False)
    fb.extend_num_tokens = None
    forward(backend, fb)
    assert backend.chunkmeta.tables.num_rows == layout.chunk_row_bound(2, 67, 64)
    # a two-batch-overlap child: SGLang does not trust its host lengths, nor do we
    backend = backends(T23, "kda")
    forward(backend, extend_batch([100, 28], tbo_child=True))
    assert_tables(backend.chunkmeta.tables, [100, 28], layout="bounded")


def test_capacity_overflow_falls_back_to_fla_once_warned(backends, caplog):
    backend = backends(T23, "kda", max_running_requests=2, chunked_prefill_size=128, max_prefill_tokens=128)
    with caplog.at_level(logging.WARNING, logger=sg.__name__):
        run = forward(backend, extend_batch([100, 100, 100]))  # 3 sequences > 2
        forward(backend, extend_batch([1, 1, 1]))
    assert backend.chunkmeta.tables is None and backend.chunkmeta.counts["fallback"] == 2
    assert T23.state["fla_syncs"] == 2  # FLA derived them itself: correct, with its sync
    assert rows(run.chunk_indices) == reference.chunk_metadata(qsl_of([100] * 3), 64).chunk_indices
    assert sum("CHUNKMETA_SGLANG_MAX_NUM_SEQS" in r.message for r in caplog.records) == 1
    forward(backend, extend_batch([100, 31]))  # 131 tokens > 128 + 2
    assert backend.chunkmeta.counts["fallback"] == 3


@pytest.mark.parametrize("kind", ["kda", "gdn"])
@pytest.mark.parametrize("layout_name", ["exact", "bounded"])
def test_failed_build_leaves_the_forward_to_fla_once_warned(backends, monkeypatch, caplog, kind, layout_name):
    """A build that raises (a ChunkMetaError the host checks let through, or a compile/launch
    failure) leaves that forward to FLA, one warning per cause whatever its numbers, counted; the
    next forward is chunkmeta's again."""
    backend = backends(T23, kind)
    chunks = backend.chunkmeta
    host = layout_name == "exact"
    builder, name = (chunks.steps, "build") if host else (chunks.service.builder, "build_bounded")
    errors = [ChunkMetaError(f"query_start_loc has {n} entries, want {n + 1}") for n in (3, 5)]
    failing(monkeypatch, builder, name, [*errors, RuntimeError("Triton: launch failed at 0x7f00")])
    batches = [[100, 28], [9, 1, 300], [64, 64]]
    with caplog.at_level(logging.WARNING, logger=sg.__name__):
        for lens in batches:
            run = forward(backend, extend_batch(lens, host_lens=host))
            assert chunks.tables is None and chunks.conv_blocks is None
            assert rows(run.chunk_indices) == reference.chunk_metadata(qsl_of(lens), 64).chunk_indices
    assert T23.state["fla_syncs"] == 3  # FLA derived them itself, each forward
    warned = chunkmeta_warnings(caplog)
    assert len(warned) == 2 and all("build failed" in w for w in warned)
    assert "ChunkMetaError" in warned[0] and "RuntimeError" in warned[1]
    stats = chunks.stats()
    assert stats["fallback"] == stats["build_failed"] == 3 and stats[layout_name] == 0
    assert stats["fallback_causes"] == {
        "ChunkMetaError: query_start_loc has N entries, want N": 2,
        "RuntimeError: Triton: launch failed at N": 1,
    }
    run = forward(backend, extend_batch([70, 5], host_lens=host))
    assert_tables(chunks.tables, [70, 5], layout=layout_name)
    assert run.chunk_indices is chunks.tables.chunk_indices and T23.state["fla_syncs"] == 3
    assert chunks.counts[layout_name] == 1


@pytest.mark.parametrize("kind", ["kda", "gdn"])
@pytest.mark.parametrize("failing_build", ["build", "build_bounded"])
def test_failed_warm_up_keeps_sglangs_path(backends, monkeypatch, caplog, kind, failing_build):
    """The builders' first build runs when the backend is made: where it fails, the backend keeps
    SGLang's own path for good (no chunkmeta, FLA derives every forward's tables), one warning."""
    from chunkmeta.builder import ChunkMetadataBuilder
    from chunkmeta.step_builder import StepTablesBuilder

    owner = StepTablesBuilder if failing_build == "build" else ChunkMetadataBuilder
    assert callable(getattr(owner, failing_build))

    def refuse(*args, **kwargs):
        raise RuntimeError("NVRTC: compilation failed")

    with caplog.at_level(logging.WARNING, logger=sg.__name__):
        with monkeypatch.context() as patch:
            patch.setattr(owner, failing_build, refuse)
            backend = backends(T23, kind)
        for lens in ([100, 28], [70, 5]):
            run = forward(backend, extend_batch(lens))
            assert rows(run.chunk_indices) == reference.chunk_metadata(qsl_of(lens), 64).chunk_indices
    assert backend.chunkmeta is None and T23.state["fla_syncs"] == 2
    why = (
        "keeps SGLang's own chunk metadata: RuntimeError: NVRTC: compilation failed "
        "(the engine runs on without it; CHUNKMETA_SGLANG=0 turns chunkmeta off)"
    )
    assert chunkmeta_warnings(caplog) == [f"chunkmeta: {type(backend).__name__} {why}"]


def test_builder_too_large_for_past_end_rows_keeps_sglangs_path(backends, monkeypatch, caplog):
    """(0, PAST_END_CHUNK) padding rows are safe only while no sequence can reach that chunk
    (max_num_tokens <= PAST_END_CHUNK * 64), and the core refuses them otherwise. Such a backend
    still serves exact tables; forwards without host lengths and graph extends take SGLang's own
    path (FLA derives the tables), with one warning."""
    monkeypatch.setenv("CHUNKMETA_SGLANG_MAX_NUM_TOKENS", str(PAST_END * 64 + 1))
    backend = graph_backend(backends, T23, "gdn")
    with caplog.at_level(logging.WARNING, logger=sg.__name__):
        for lens in ([70, 5], [9, 1, 300]):
            run = forward(backend, extend_batch(lens, host_lens=False))
            assert backend.chunkmeta.tables is None
            assert rows(run.chunk_indices) == reference.chunk_metadata(qsl_of(lens), 64).chunk_indices
        static = StaticExtend(4, num_tokens=256)
        backend.init_forward_metadata_out_graph(static.load([64] * 4), in_capture=True)
        backend.init_forward_metadata_in_graph(static.fb)
        assert backend.chunkmeta.tables is None
    assert backend.chunkmeta.counts["fallback"] == 3 and T23.state["fla_syncs"] >= 2
    assert sum("PAST_END_CHUNK" in r.getMessage() for r in caplog.records) == 1
    forward(backend, extend_batch([70, 5]))  # host lengths: exact tables, no padding rows needed
    assert_tables(backend.chunkmeta.tables, [70, 5])


def test_padding_rows_are_sglangs_own():
    """SGLang's KDA prefill graph pads with (0, 1 << 20) (the fake models its host tables)."""
    assert layout.padding_row(sg.PAD, 16) == (0, 1 << 20)
    fb = extend_batch([70, 3])
    assert rows(sglang_fake._host_prefill_tables(fb, "cpu").chunk_indices)[-1] == (0, PAST_END)


def test_router_falls_through_for_other_calls(backends):
    backend = backends(T23, "gdn")
    forward(backend, extend_batch([100, 5]))
    tables = backend.chunkmeta.tables
    router = backend.chunkmeta.router
    other = torch.tensor([0, 3, 70], dtype=torch.int32)
    # not our tensor: SGLang's own helper runs, with its own signature (no cu_seqlens_cpu)
    assert rows(T23.fla_chunk.prepare_chunk_indices(other, 64)) == [(0, 0), (1, 0), (1, 1)]
    assert T23.state["fla_syncs"] == 1
    # ours at a chunk size we cannot serve (a sequence longer than 32): FLA's own, counted as a miss
    misses = router.misses
    T23.fla_chunk.prepare_chunk_indices(tables.query_start_loc, 32)
    assert router.misses == misses + 1 and T23.state["fla_syncs"] == 2
    # a later forward's tables never answer for an earlier forward's tensor
    forward(backend, extend_batch([9]))
    T23.fla_chunk.prepare_chunk_indices(tables.query_start_loc, 64)
    assert T23.state["fla_syncs"] == 3
    backend.chunkmeta.close()
    T23.fla_chunk.prepare_chunk_indices(backend.forward_metadata.query_start_loc, 64)
    assert T23.state["fla_syncs"] == 4


def test_kda_prefill_graph_brings_its_own_tables(backends):
    backend = backends(T23, "kda")
    fb = extend_batch([70, 3])
    forward(backend, fb)
    meta = backend.init_prefill_graph_metadata(fb)
    assert backend.chunkmeta.tables is None
    run = backend.forward_extend(0, fb, torch.zeros(73), None, None)
    assert run.chunk_indices is meta.chunk_indices and run.cu_seqlens is meta.cu_seqlens
    # and an injected table never replaces one the caller passed
    forward(backend, fb)
    kwargs = {"chunk_indices": meta.chunk_indices}
    backend.chunkmeta.add_table_kwargs(backend.forward_metadata.query_start_loc, kwargs)
    assert kwargs == {"chunk_indices": meta.chunk_indices}


def test_default_eager_entry_does_not_take_the_graph_path(backends):
    """A base whose eager init is AttentionBackend's default (out_graph + in_graph) still gets the
    exact layout: the graph hooks stand aside while the eager entry runs."""

    class EagerViaHooks(T23.KDAAttnBackend):
        init_forward_metadata = T23.AttentionBackend.init_forward_metadata

        def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
            self.forward_metadata = self._forward_metadata(forward_batch)

    backend = backends(T23, "kda", base=EagerViaHooks)
    forward(backend, extend_batch([70, 3]))
    assert_tables(backend.chunkmeta.tables, [70, 3])


def test_unserved_devices_keep_sglang_stock(backends):
    backend = backends(T23, "kda", device="meta")
    assert backend.chunkmeta is None
    assert backend.kernel_dispatcher.extend.__func__ is T23.kda_module.KDAKernelDispatcher.extend


# -- CUDA-graph hooks ---------------------------------------------------------------------------


def graph_backend(backends, tree, kind="kda", max_bs=4):
    base = getattr(tree, f"{kind.upper()}AttnBackend")
    capable = type(f"GraphExtend{base.__name__}", (base,), {"graph_extends": True})
    backend = backends(tree, kind, base=capable)
    backend.init_cuda_graph_state(max_bs, max_bs * 4)
    return backend


class StaticExtend:
    """A graph runner's static extend inputs for batch size bs: device buffers refilled in place."""

    def __init__(self, bs, num_tokens, device="cpu"):
        self.fb = extend_batch([0] * bs, device=device, num_tokens=num_tokens)
        self.bs = bs

    def load(self, lens):
        padded = list(lens) + [0] * (self.bs - len(lens))  # padded rows: zero-length, at the tail
        values = torch.tensor(padded, dtype=torch.int32)
        self.fb.extend_seq_lens.copy_(values)
        self.fb.extend_start_loc.zero_()
        self.fb.extend_start_loc[1:].copy_(torch.cumsum(values[:-1], 0))
        self.fb.extend_seq_lens_cpu = list(lens)  # host lengths of the real rows
        return self.fb


@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_split_hooks_capture_then_replay_changing_extends_on_cpu(backends, kind):
    backend = graph_backend(backends, T23, kind)
    static = StaticExtend(4, num_tokens=256)
    backend.init_forward_metadata_out_graph(static.load([64] * 4), in_capture=True)
    backend.init_forward_metadata_in_graph(static.fb)  # the captured part; on CPU it just runs
    captured = backend.chunkmeta.tables
    assert captured.layout == "graph" and captured.num_rows == backend.chunkmeta.capacity.rows
    for lens in ([100, 3, 1, 1], [255], [0, 64, 65], [1, 1], [128, 128]):
        backend.init_forward_metadata_out_graph(static.load(lens))  # host side, before replay
        backend.init_forward_metadata_in_graph(static.fb)  # stands in for graph.replay()
        tables = backend.chunkmeta.tables
        # the captured kernels read the same static tensors, rewritten in place
        assert tables.chunk_indices is captured.chunk_indices and tables.query_start_loc is captured.query_start_loc
        ref = reference.chunk_metadata(qsl_of(lens + [0] * (4 - len(lens))), 64)
        got = rows(tables.chunk_indices)
        assert got[: ref.num_chunks] == ref.chunk_indices
        assert got[ref.num_chunks :] == [(0, PAST_END)] * (captured.num_rows - ref.num_chunks)
        assert tables.chunk_offsets.tolist() == ref.chunk_offsets
        run = backend.forward_extend(0, static.fb, torch.zeros(256), None, None)
        assert run.chunk_indices is captured.chunk_indices and T23.state["fla_syncs"] == 0
    # a batch over the capacity is refused before anything is staged
    with pytest.raises(ChunkMetaError, match="over the builder's capacity"):
        backend.init_forward_metadata_out_graph(static.load([1, 1, 1, 5000]))


def test_split_hooks_decode_graphs_get_no_tables(backends):
    backend = graph_backend(backends, T23)
    forward(backend, extend_batch([100]))
    fb = decode_batch(3)
    backend.init_forward_metadata_out_graph(fb, in_capture=True)
    backend.init_forward_metadata_in_graph(fb)
    assert backend.chunkmeta.tables is None
    assert backend.forward_metadata.query_start_loc is backend.query_start_loc_list[2]
    verify = decode_batch(2, mode=ForwardMode.TARGET_VERIFY, draft_token_num=4)
    backend.init_forward_metadata_out_graph(verify)
    assert backend.chunkmeta.tables is None and backend.chunkmeta.counts["none"] == 2


def test_split_hooks_errors(backends):
    # SGLang <= 0.5.23: the linear base raises for extends in graph hooks; passed through unchanged
    backend = backends(T23, "kda")
    backend.init_cuda_graph_state(4, 16)
    with pytest.raises(ValueError, match="Invalid forward mode"):
        backend.init_forward_metadata_out_graph(extend_batch([5, 5]), in_capture=True)
    assert backend.chunkmeta.tables is None
    backend = graph_backend(backends, T23)
    static = StaticExtend(2, num_tokens=64)
    with pytest.raises(ChunkMetaError, match="did not see at capture"):
        backend.init_forward_metadata_out_graph(static.load([5, 5]))
    backend.init_forward_metadata_out_graph(static.load([5, 5]), in_capture=True)
    static.fb.extend_seq_lens_cpu = None
    with pytest.raises(ChunkMetaError, match="extend_seq_lens_cpu=None in a CUDA-graph extend replay"):
        backend.init_forward_metadata_out_graph(static.fb)
    big = graph_backend(backends, T23, max_bs=20)  # graphs for more requests than the capacity (16)
    with pytest.raises(ChunkMetaError, match="captured for 20 requests"):
        big.init_forward_metadata_out_graph(StaticExtend(20, num_tokens=64).load([1] * 20), in_capture=True)


@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_legacy_hooks_clear_tables(backends, kind):
    backend = backends(T12, kind)
    backend.init_cuda_graph_state(4, 16)
    forward(backend, extend_batch([100, 4]))
    assert backend.chunkmeta.tables is not None
    req = torch.arange(3)
    backend.init_forward_metadata_capture_cuda_graph(3, 3, req, torch.ones(3), None, ForwardMode.DECODE, None)
    assert backend.chunkmeta.tables is None
    assert backend.forward_metadata.query_start_loc is backend.query_start_loc_list[2]
    forward(backend, extend_batch([100, 4]))
    backend.init_forward_metadata_replay_cuda_graph(
        3, req, torch.ones(3), 3, None, ForwardMode.DECODE, None, torch.tensor([50, 50, 1])
    )
    assert backend.chunkmeta.tables is None
    assert backend.forward_metadata.query_start_loc.tolist() == [0, 1, 2, 2]  # the base's padding, untouched
    with pytest.raises(ValueError, match="Invalid forward mode"):  # the base's own limit
        backend.init_forward_metadata_capture_cuda_graph(3, 9, req, torch.ones(3), None, ForwardMode.EXTEND, None)


# -- install / uninstall / plugin ---------------------------------------------------------------


def test_install_is_idempotent_and_uninstall_restores():
    stock_kda, stock_gdn = T23.kda_module.KDAAttnBackend, T23.gdn_module.GDNAttnBackend
    try:
        classes = sg.install(T23.root)
        assert sg.installed(T23.root)
        assert T23.kda_module.KDAAttnBackend is classes["kda"] and classes["kda"].chunkmeta_base is stock_kda
        assert T23.gdn_module.GDNAttnBackend is classes["gdn"] and classes["gdn"].chunkmeta_base is stock_gdn
        assert sg.install(T23.root) == classes

        def attn_backend_wrapper(runner):  # SGLang imports the class inside the function body
            from fake_sglang_0523.srt.layers.attention.linear.kda_backend import KDAAttnBackend

            return KDAAttnBackend(runner)

        backend = attn_backend_wrapper(sglang_fake.model_runner())
        assert isinstance(backend.chunkmeta, sg.BackendChunkMeta)
        backend.chunkmeta.close()
    finally:
        sg.uninstall(T23.root)
    assert T23.kda_module.KDAAttnBackend is stock_kda and T23.gdn_module.GDNAttnBackend is stock_gdn
    assert not sg.installed(T23.root)
    sg.uninstall(T23.root)  # again: nothing to do


def test_install_on_a_legacy_layout():
    try:
        classes = sg.install(T12.root)
        assert classes["kda"].chunkmeta_hooks == "legacy"
        assert classes["gdn"]._chunkmeta_router.package == T12.fla == "fake_sglang_0512.srt.layers.attention.fla"
    finally:
        sg.uninstall(T12.root)


def test_install_errors():
    with pytest.raises(ChunkMetaError, match="package='no_such_sglang' is not importable"):
        sg.install("no_such_sglang")
    sglang_fake.register("fake_sglang_old", "0.5.12")
    try:
        import sys

        sys.modules["fake_sglang_old"].__version__ = "0.5.8"
        with pytest.raises(
            ChunkMetaError, match=r"fake_sglang_old 0\.5\.8 is untested .* supports 0\.5\.9 to 0\.5\.23"
        ):
            sg.install("fake_sglang_old")
        sys.modules["fake_sglang_old"].__version__ = "0.5.12"
        del sys.modules["fake_sglang_old.srt.layers.attention.linear.gdn_backend"].GDNAttnBackend
        with pytest.raises(ChunkMetaError, match="no GDN backend class"):
            sg.install("fake_sglang_old")
    finally:
        sg.uninstall("fake_sglang_old")
        sglang_fake.unregister("fake_sglang_old")


def test_plugin_is_opt_in(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(sg.wiring, "install", lambda package="sglang": calls.append(package))
    monkeypatch.delenv("CHUNKMETA_SGLANG", raising=False)
    sg.sglang_plugin()
    monkeypatch.setenv("CHUNKMETA_SGLANG", "0")
    sg.sglang_plugin()
    assert calls == []  # installed chunkmeta changes nothing by itself
    monkeypatch.setenv("CHUNKMETA_SGLANG", "1")
    sg.sglang_plugin()
    assert calls == ["sglang"]

    def broken(package="sglang"):
        raise ChunkMetaError("package='sglang' is not importable")

    monkeypatch.setattr(sg.wiring, "install", broken)
    with caplog.at_level(logging.WARNING, logger=sg.__name__):
        sg.sglang_plugin()  # never raises into SGLang's plugin loader
    assert "not enabled in SGLang, which keeps its own chunk metadata: ChunkMetaError" in caplog.text
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["sglang.srt.plugins"] == {
        "chunkmeta": "chunkmeta.integrations.sglang:sglang_plugin"
    }


# -- GPU -------------------------------------------------------------------------------------------


def random_lens(rng, max_seqs=16, max_tokens=4096):
    n = int(rng.integers(1, max_seqs + 1))
    lens = rng.integers(1, 400, size=n)
    lens[rng.random(n) < 0.3] = 1  # decode rows of MIXED batches
    while lens.sum() > max_tokens:
        lens[int(np.argmax(lens))] //= 2
    return [int(x) for x in lens]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_gpu_eager_forwards_do_not_sync(backends, kind):
    backend = backends(
        T23, kind, device="cuda", max_running_requests=16, chunked_prefill_size=4096, max_prefill_tokens=4096
    )
    rng = np.random.default_rng(7)
    all_lens = [random_lens(rng) for _ in range(100)]
    batches = [extend_batch(lens, device="cuda") for lens in all_lens]  # H2D inputs: the engine's, made first
    kept = []
    forward(backend, batches[0])  # compiles the fill outside
    with no_sync():
        for fb in batches:
            run = forward(backend, fb)
            tables = backend.chunkmeta.tables
            assert run.chunk_indices is tables.chunk_indices
            kept.append((run.chunk_indices.clone(), run.chunk_offsets.clone()))
    for lens, (indices, offsets) in zip(all_lens, kept, strict=True):
        ref = reference.chunk_metadata(qsl_of(lens), 64)
        assert rows(indices) == ref.chunk_indices and offsets.tolist() == ref.chunk_offsets
    assert T23.state["fla_syncs"] == 0


@pytest.mark.gpu
def test_gpu_bounded_layout_does_not_sync(backends):
    backend = backends(T23, "kda", device="cuda")
    rng = np.random.default_rng(8)
    all_lens = [random_lens(rng) for _ in range(50)]
    prepared = []
    for lens in all_lens:  # the base's own metadata (it reads the device count itself here)
        fb = extend_batch(lens, device="cuda", host_lens=False)
        backend.init_forward_metadata(fb)
        prepared.append((fb, backend.forward_metadata))
    kept = []
    with no_sync():
        for fb, fm in prepared:
            tables = backend.chunkmeta.bind_eager(fb, fm)
            kept.append((tables.chunk_indices.clone(), tables.chunk_offsets.clone(), tables.num_rows))
    for lens, (indices, offsets, num_rows) in zip(all_lens, kept, strict=True):
        ref = reference.chunk_metadata(qsl_of(lens), 64)
        assert num_rows == layout.chunk_row_bound(len(lens), sum(lens), 64)
        assert rows(indices) == ref.chunk_indices + [(0, PAST_END)] * (num_rows - ref.num_chunks)
        assert offsets.tolist() == ref.chunk_offsets


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_gpu_in_graph_build_captured_and_replayed(backends, kind):
    """The split hooks as a graph runner drives them: out_graph(in_capture=True), in_graph inside
    torch.cuda.graph, then per step: refresh the static inputs in place, out_graph, replay."""
    base = getattr(T23, f"{kind.upper()}AttnBackend")
    capable = type(f"GraphExtend{base.__name__}", (base,), {"graph_extends": True})
    backend = backends(
        T23,
        kind,
        base=capable,
        device="cuda",
        max_running_requests=16,
        chunked_prefill_size=4096,
        max_prefill_tokens=4096,
    )
    bs, num_tokens = 16, 4096
    backend.init_cuda_graph_state(bs, bs)
    static = StaticExtend(bs, num_tokens, device="cuda")
    capture_lens = [num_tokens // bs] * bs
    fb = static.load(capture_lens)
    backend.init_forward_metadata_out_graph(fb, in_capture=True)
    backend.init_forward_metadata_in_graph(fb)  # warm-up run: compiles the fill outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.init_forward_metadata_in_graph(fb)
    captured = backend.chunkmeta.tables

    rng = np.random.default_rng(9)
    all_lens = [random_lens(rng, bs, num_tokens) for _ in range(200)]
    host = []
    for lens in all_lens:
        padded = lens + [0] * (bs - len(lens))
        starts = [0] + np.cumsum(padded[:-1]).tolist()
        host.append(
            (torch.tensor(padded, dtype=torch.int32).pin_memory(), torch.tensor(starts, dtype=torch.int32).pin_memory())
        )
    history = torch.empty(len(all_lens), captured.num_rows, 2, dtype=torch.int32, device="cuda")
    offsets = torch.empty(len(all_lens), bs + 1, dtype=torch.int64, device="cuda")
    with no_sync():
        for k, (lens, (lens_h, starts_h)) in enumerate(zip(all_lens, host, strict=True)):
            fb.extend_seq_lens.copy_(lens_h, non_blocking=True)  # the runner refreshes its inputs in place
            fb.extend_start_loc.copy_(starts_h, non_blocking=True)
            fb.extend_seq_lens_cpu = lens
            backend.init_forward_metadata_out_graph(fb)
            graph.replay()
            tables = backend.chunkmeta.tables
            assert tables.chunk_indices is captured.chunk_indices
            history[k].copy_(tables.chunk_indices)
            offsets[k].copy_(tables.chunk_offsets)
    history, offsets = history.cpu(), offsets.cpu()
    for k, lens in enumerate(all_lens):
        ref = reference.chunk_metadata(qsl_of(lens + [0] * (bs - len(lens))), 64)
        assert rows(history[k]) == ref.chunk_indices + [(0, PAST_END)] * (captured.num_rows - ref.num_chunks), k
        assert offsets[k].tolist() == ref.chunk_offsets, k
    assert T23.state["fla_syncs"] == 0
