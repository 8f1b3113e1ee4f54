"""Mamba2's extend metadata, GDN's conv block table, the tracking indices and chunk_fwd_o's tables,
served by chunkmeta on the installed SGLang (``make test-sglang``; skipped without SGLang).

Each test runs SGLang's own code twice on the same hand-built ForwardBatch: the stock backend
(``Mamba2AttnBackend`` / ``GDNAttnBackend``, its ``init_forward_metadata`` as released) gives the
expected metadata; then chunkmeta's subclass runs with SGLang's own builders patched to raise
(``Mamba2Metadata.prepare_mixed``, ``_query_start_loc_to_chunk_indices_offsets``,
``_init_track_conv_indices``, ``_init_prefill_conv_block_table``), and every field of its metadata
must equal the stock one (tensors: dtype, shape and values). Batches with and without cached
prefixes, EXTEND / MIXED / SPLIT_PREFILL / DRAFT_EXTEND_V2, with and without radix-cache tracking.
Syncs are counted on CPU by ``sync_count.SyncCounter`` (the idioms that sync on CUDA).
"""

import contextlib
import dataclasses
import functools
import importlib.util
import logging

import numpy as np
import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (make test-sglang builds a venv with it)", allow_module_level=True)

import sglang_cpu_stubs

sglang_cpu_stubs.install()  # before any SGLang import: its config modules import torchvision

from sglang.srt.layers.attention import hybrid_linear_attn_backend as hlab
from sglang.srt.layers.attention.linear import gdn_backend, kda_backend
from sglang.srt.layers.attention.mamba.mamba2_metadata import Mamba2Metadata
from sglang.srt.model_executor import forward_batch_info
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from checks import must_not_run
from chunkmeta import ChunkMetaError, reference
from chunkmeta.integrations import sglang as sg
from chunkmeta.integrations.sglang.mamba2 import Mamba2ChunkMeta
from chunkmeta.step_builder import StepTablesBuilder
from sglang_faults import chunkmeta_warnings, failing
from sync_count import SyncCounter
from test_sglang_real import CONV_LEN, FLA, KernelRecorder, backend, construct, model_runner

STOCK_MAMBA2 = hlab.Mamba2AttnBackend


def mamba2_backend(cls, chunk_size):
    """A Mamba2 backend made by SGLang's ``__init__`` on a stand-in model runner whose model has
    ``mamba_chunk_size=chunk_size`` (chunkmeta's subclass sizes its ``Mamba2ChunkMeta`` there)."""
    obj = construct(cls, model_runner(mamba_chunk_size=chunk_size))
    assert obj.mamba_chunk_size == chunk_size
    if cls is not STOCK_MAMBA2:
        assert isinstance(obj.chunkmeta, Mamba2ChunkMeta)
    return obj


def forward_batch(lens, prefix, mode=ForwardMode.EXTEND, host=True, track=None):
    """An extend ForwardBatch as ForwardBatch.init_new fills it; ``track``: per row, the sequence
    length to snapshot at (None: not tracked), with SGLang's host lists beside the device ones."""
    bs = len(lens)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    start = torch.zeros(bs, dtype=torch.int32)
    start[1:] = torch.cumsum(lens_t[:-1], 0)
    fields = {}
    if track is not None:
        mask = [t is not None for t in track]
        seqlens = [t if t is not None else 0 for t in track]
        fields = {
            "mamba_track_mask": torch.tensor(mask),
            "mamba_track_indices": torch.arange(100, 100 + bs, dtype=torch.int64),
            "mamba_track_seqlens": torch.tensor(seqlens, dtype=torch.int64),
            "mamba_prefill_track_mask_cpu": mask if host else None,
            "mamba_track_seqlens_cpu": seqlens if host else None,
        }
    return ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=torch.zeros(sum(lens), dtype=torch.int64),
        req_pool_indices=torch.arange(bs),
        seq_lens=(lens_t + torch.tensor(prefix, dtype=torch.int32)).long(),
        out_cache_loc=torch.zeros(sum(lens), dtype=torch.int64),
        seq_lens_sum=sum(lens) + sum(prefix),
        extend_num_tokens=sum(lens),
        extend_seq_lens=lens_t,
        extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32),
        extend_start_loc=start,
        extend_seq_lens_cpu=list(lens) if host else None,
        extend_prefix_lens_cpu=list(prefix) if host else None,
        **fields,
    )


def assert_same(got, want, path="metadata"):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), path
        assert torch.equal(got, want), f"{path}: {got.tolist()} != {want.tolist()}"
    elif dataclasses.is_dataclass(want):
        assert type(got) is type(want), path
        for field in dataclasses.fields(want):
            assert_same(getattr(got, field.name), getattr(want, field.name), f"{path}.{field.name}")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


_raise = functools.partial(must_not_run, "SGLang")


@contextlib.contextmanager
def sglang_builders_refused(monkeypatch):
    with monkeypatch.context() as patch:
        patch.setattr(Mamba2Metadata, "prepare_mixed", classmethod(_raise("prepare_mixed")))
        patch.setattr(Mamba2Metadata, "_query_start_loc_to_chunk_indices_offsets", staticmethod(_raise("chunk loop")))
        patch.setattr(hlab.MambaAttnBackendBase, "_init_track_conv_indices", _raise("_init_track_conv_indices"))
        yield


@pytest.fixture(autouse=True)
def cache_chunk(monkeypatch):
    # ForwardBatch.mamba_track_aligned_lens reads the server's mamba cache chunk: the tests' chunk size
    monkeypatch.setattr(forward_batch_info, "mamba_cache_chunk_size", lambda: 64)


def stock_and_ours(lens, prefix, monkeypatch, chunk_size=64, **kw):
    stock = mamba2_backend(STOCK_MAMBA2, chunk_size)
    stock.init_forward_metadata(forward_batch(lens, prefix, **kw))
    ours = mamba2_backend(sg.chunkmeta_backend(STOCK_MAMBA2, kind="mamba2"), chunk_size)
    with sglang_builders_refused(monkeypatch):
        ours.init_forward_metadata(forward_batch(lens, prefix, **kw))
    return stock.forward_metadata, ours.forward_metadata, ours


CASES = [  # (lens, prefix lens, mode)
    ([5, 70, 1, 1], [0, 128, 30, 0], ForwardMode.MIXED),
    ([128, 257], [0, 0], ForwardMode.EXTEND),  # no cached prefix: no logical chunks
    ([1, 64, 65, 129], [64, 0, 3, 200], ForwardMode.EXTEND),
    ([70, 5, 3], [10, 0, 0], ForwardMode.SPLIT_PREFILL),
    ([7, 300], [1, 1], ForwardMode.DRAFT_EXTEND_V2),
    ([1], [5000], ForwardMode.EXTEND),
]


def random_cases(seed=0, count=40):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n = int(rng.integers(1, 12))
        lens = [int(x) for x in rng.choice([1, 2, 17, 63, 64, 65, 200, 513], n)]
        prefix = [int(x) * int(rng.integers(0, 2)) for x in rng.integers(0, 400, n)]
        if rng.integers(0, 3) == 0:
            prefix = [0] * n  # no row has a cached prefix
        yield lens, prefix, ForwardMode.EXTEND if rng.integers(0, 2) else ForwardMode.MIXED


@pytest.mark.parametrize("chunk_size", [16, 64, 128, 256])  # Nemotron-H, Falcon-H1: 128, 256
def test_mamba2_metadata_equals_prepare_mixed(monkeypatch, chunk_size):
    with_prefix = without = 0
    for lens, prefix, mode in [*CASES, *random_cases()]:
        want, got, ours = stock_and_ours(lens, prefix, monkeypatch, chunk_size, mode=mode)
        assert_same(got, want)
        mixed = got.mixed_metadata
        assert ours.chunkmeta.counts["mamba2"] == 1 and mixed.seq_idx is ours.chunkmeta.tables.seq_idx
        if any(prefix):
            with_prefix += 1
            assert mixed.chunk_indices is ours.chunkmeta.tables.chunk_indices
            q = [0, *np.cumsum(lens).tolist()]
            ref_indices, ref_offsets = reference.sglang_chunk_indices_offsets(q, chunk_size)
            assert mixed.chunk_indices.tolist() == ref_indices and mixed.chunk_offsets.tolist() == ref_offsets
        else:
            without += 1
            assert mixed.chunk_indices is None and mixed.prep_initial_states is False
    assert with_prefix > 10 and without > 3


def test_mamba2_with_radix_cache_tracking(monkeypatch):
    lens, prefix = [300, 5, 130, 64], [64, 0, 10, 128]
    track = [64 + 256, None, 10 + 128, 128 + 64]  # tracked rows snapshot at a cache-chunk boundary
    want, got, _ = stock_and_ours(lens, prefix, monkeypatch, track=track)
    assert want.has_mamba_track_mask and want.track_conv_indices.shape == (3, CONV_LEN)
    assert_same(got, want)
    assert got.mamba_track_mask_indices.tolist() == [0, 2, 3]


def test_mamba2_syncs(monkeypatch):
    lens, prefix = [5, 70, 1, 300, 9], [0, 128, 30, 0, 7]
    track = [128 + 64, None, None, 256, None]
    stock = mamba2_backend(STOCK_MAMBA2, 64)
    ours = mamba2_backend(sg.chunkmeta_backend(STOCK_MAMBA2, kind="mamba2"), 64)
    counted = {}
    for name, obj in (("stock", stock), ("chunkmeta", ours)):
        obj.init_forward_metadata(forward_batch(lens, prefix, track=track))  # first build: compiles, checks
        with SyncCounter() as syncs:
            obj.init_forward_metadata(forward_batch(lens, prefix, track=track))
        counted[name] = syncs.count
    # stock: .item(), arange(N), the loop's 0-d slice bounds, the tracking clamp
    assert counted["stock"] >= 4 * len(lens) and counted["chunkmeta"] == 0, counted


def test_mamba2_keeps_sglangs_path_without_host_data(monkeypatch):
    ours = mamba2_backend(sg.chunkmeta_backend(STOCK_MAMBA2, kind="mamba2"), 64)
    stock = mamba2_backend(STOCK_MAMBA2, 64)
    batch = forward_batch([5, 70], [0, 3], host=False)
    stock.init_forward_metadata(batch)
    ours.init_forward_metadata(forward_batch([5, 70], [0, 3], host=False))
    assert_same(ours.forward_metadata, stock.forward_metadata)
    assert ours.chunkmeta.counts == {"mamba2": 0, "stock": 1, "fallback": 0, "build_failed": 0}
    decode = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=2,
        input_ids=torch.zeros(2, dtype=torch.int64),
        req_pool_indices=torch.arange(2),
        seq_lens=torch.tensor([9, 4]),
        out_cache_loc=torch.zeros(2, dtype=torch.int64),
        seq_lens_sum=13,
    )
    ours.init_forward_metadata(decode)
    assert ours.forward_metadata.num_decodes == 2 and ours.forward_metadata.mixed_metadata is None


def test_mamba2_over_capacity_falls_back(monkeypatch):
    ours = mamba2_backend(sg.chunkmeta_backend(STOCK_MAMBA2, kind="mamba2"), 64)
    ours.chunkmeta = Mamba2ChunkMeta(device="cpu", max_num_seqs=2, max_num_tokens=64)
    ours.init_forward_metadata(forward_batch([5, 70], [0, 3]))
    assert ours.chunkmeta.counts["fallback"] == 1 and ours.forward_metadata.mixed_metadata.chunk_indices is not None


# -- builds that fail: the forward is SGLang's own ------------------------------------------------


FAILURES = {
    "ChunkMetaError": lambda n: ChunkMetaError(f"num_computed_tokens has {n} entries, want {n + 1}"),
    "RuntimeError": lambda n: RuntimeError(f"Triton: launch failed (CUDA error {n}) at 0x7f{n}0"),
}


@pytest.mark.parametrize("error", sorted(FAILURES))
def test_mamba2_failed_build_gives_prepare_mixed_once_warned(monkeypatch, caplog, error):
    """A build that raises leaves that forward to SGLang's prepare_mixed, whose metadata it then is,
    field for field; one warning per cause whatever its numbers, counted; the next forward is
    chunkmeta's again."""
    stock = mamba2_backend(STOCK_MAMBA2, 64)
    ours = mamba2_backend(sg.chunkmeta_backend(STOCK_MAMBA2, kind="mamba2"), 64)
    chunks = ours.chunkmeta
    ours.init_forward_metadata(forward_batch([9, 80], [3, 0]))  # makes (and warms up) the builder
    failing(monkeypatch, chunks.builder, "build", [FAILURES[error](n) for n in (2, 7)])
    with caplog.at_level(logging.DEBUG, logger="chunkmeta"):
        for lens, prefix, mode in CASES[:2]:
            stock.init_forward_metadata(forward_batch(lens, prefix, mode))
            ours.init_forward_metadata(forward_batch(lens, prefix, mode))
            assert chunks.tables is None
            assert_same(ours.forward_metadata, stock.forward_metadata)
    warned = chunkmeta_warnings(caplog)
    assert len(warned) == 1 and error in warned[0] and "prepare_mixed" in warned[0], warned
    stats = chunks.stats()
    assert stats["fallback"] == stats["build_failed"] == 2 and stats["mamba2"] == 1 and stats["disabled"] is None
    (cause,) = stats["fallback_causes"]
    assert stats["fallback_causes"][cause] == 2 and "2" not in cause and "7" not in cause
    lens, prefix, mode = CASES[2]
    stock.init_forward_metadata(forward_batch(lens, prefix, mode))
    with sglang_builders_refused(monkeypatch):
        ours.init_forward_metadata(forward_batch(lens, prefix, mode))
    assert_same(ours.forward_metadata, stock.forward_metadata)
    assert chunks.counts["mamba2"] == 2 and ours.forward_metadata.mixed_metadata.seq_idx is chunks.tables.seq_idx


def test_mamba2_failed_warm_up_keeps_prepare_mixed(monkeypatch, caplog):
    """The builder's first build (made on the first extend, a [0, 1] step) fails: that forward and
    every later one are SGLang's prepare_mixed, with one warning, also once the fill would work."""
    stock = mamba2_backend(STOCK_MAMBA2, 64)
    ours = mamba2_backend(sg.chunkmeta_backend(STOCK_MAMBA2, kind="mamba2"), 64)
    chunks = ours.chunkmeta
    with caplog.at_level(logging.WARNING, logger="chunkmeta"):
        with monkeypatch.context() as patch:
            failing(patch, StepTablesBuilder, "build", [RuntimeError("NVRTC: compilation failed")])
            for lens, prefix, mode in CASES[:3]:
                stock.init_forward_metadata(forward_batch(lens, prefix, mode))
                ours.init_forward_metadata(forward_batch(lens, prefix, mode))
                assert_same(ours.forward_metadata, stock.forward_metadata)
        ours.init_forward_metadata(forward_batch([9, 80], [3, 0]))
    assert chunkmeta_warnings(caplog) == [
        "chunkmeta: Mamba2 keeps SGLang's own prepare_mixed: RuntimeError: NVRTC: compilation failed "
        "(the engine runs on without it; CHUNKMETA_SGLANG=0 turns chunkmeta off)"
    ]
    assert chunks.builder is None and chunks.disabled == "RuntimeError: NVRTC: compilation failed"
    assert chunks.counts == {"mamba2": 0, "stock": 4, "fallback": 0, "build_failed": 0}


def test_breakable_graph_replay_runs_our_eager_build(monkeypatch):
    """SGLang's breakable prefill graph calls the linear backend's eager init before each replay."""
    ours = mamba2_backend(sg.chunkmeta_backend(STOCK_MAMBA2, kind="mamba2"), 64)
    wrapper = object.__new__(hlab.HybridLinearAttnBackend)
    wrapper.full_attn_backend = type("Full", (), {"init_forward_metadata": lambda self, fb: None})()
    wrapper.linear_attn_backend = ours
    with sglang_builders_refused(monkeypatch):
        wrapper.prepare_forward_metadata_for_breakable_cuda_graph_replay(None, forward_batch([9, 80], [3, 0]))
    assert ours.chunkmeta.counts["mamba2"] == 1 and ours.forward_metadata.mixed_metadata.prep_initial_states


def test_install_puts_mamba2_where_sglang_finds_it():
    try:
        classes = sg.install()
        assert hlab.Mamba2AttnBackend is classes["mamba2"] and classes["mamba2"].chunkmeta_base is STOCK_MAMBA2
        from sglang.srt.layers.attention.hybrid_linear_attn_backend import Mamba2AttnBackend

        assert Mamba2AttnBackend is classes["mamba2"] and classes["mamba2"]._chunkmeta_router is None
    finally:
        sg.uninstall()
    assert hlab.Mamba2AttnBackend is STOCK_MAMBA2


# -- GDN: the conv block table from the forward's build, tracking, chunk_fwd_o --------------------


def gdn_pair(monkeypatch):
    """SGLang's GDN backend and chunkmeta's, both made by SGLang's ``__init__`` on one runner."""
    monkeypatch.setattr(gdn_backend, "is_cuda", lambda: True)  # SGLang builds the table on CUDA only
    runner = model_runner()
    ours = backend("gdn", runner)
    assert ours.chunkmeta.conv_block_m == gdn_backend.CAUSAL_CONV1D_FWD_BLOCK_M
    return construct(gdn_backend.GDNAttnBackend, runner), ours


def test_gdn_conv_block_table_equals_sglangs(monkeypatch):
    stock, ours = gdn_pair(monkeypatch)
    served = none = 0
    rng = np.random.default_rng(1)
    try:
        for _ in range(60):
            n = int(rng.integers(1, 12))
            lens = [int(x) for x in rng.choice([1, 1, 1, 3, 8, 9, 100, 700], n)]
            prefix = [int(x) for x in rng.integers(0, 2, n) * 40]
            mode = ForwardMode.MIXED if rng.integers(0, 2) else ForwardMode.EXTEND
            stock.init_forward_metadata(forward_batch(lens, prefix, mode))
            want = stock.forward_metadata.conv_block_table
            with monkeypatch.context() as patch:
                patch.setattr(gdn_backend.GDNAttnBackend, "_init_prefill_conv_block_table", _raise("conv table"))
                ours.init_forward_metadata(forward_batch(lens, prefix, mode))
            got = ours.forward_metadata.conv_block_table
            if want is None:
                none += 1
                assert got is None
            else:
                served += 1
                assert got is ours.chunkmeta.conv_blocks.block_table
                assert_same(got, want, f"conv_block_table {lens}")
                assert [tuple(r) for r in got.tolist()] == reference.sglang_conv_block_table(lens)
    finally:
        ours.chunkmeta.close()
    assert served > 10 and none > 10 and ours.chunkmeta.counts["conv"] == served


@pytest.mark.parametrize("error", sorted(FAILURES))
def test_gdn_failed_build_gives_sglangs_metadata(monkeypatch, caplog, error):
    """GDN's exact build raises: the forward's metadata is SGLang's own (its conv_block_table
    included), FLA derives the chunk tables; one warning, counted; the next forward is chunkmeta's."""
    stock, ours = gdn_pair(monkeypatch)
    chunks, tables_made = ours.chunkmeta, []
    ragged = ([1] * 8 + [700], [0] * 8 + [40], ForwardMode.MIXED)  # SGLang builds a conv_block_table
    try:
        failing(monkeypatch, chunks.steps, "build", [FAILURES[error](n) for n in (2, 7)])
        with caplog.at_level(logging.WARNING, logger="chunkmeta"):
            for lens, prefix, mode in (ragged, ([70, 5, 3], [0, 0, 0], ForwardMode.EXTEND)):
                stock.init_forward_metadata(forward_batch(lens, prefix, mode))
                ours.init_forward_metadata(forward_batch(lens, prefix, mode))
                assert chunks.tables is None and chunks.conv_blocks is None
                assert_same(ours.forward_metadata, stock.forward_metadata)
                tables_made.append(stock.forward_metadata.conv_block_table is not None)
        assert tables_made == [True, False]
        warned = chunkmeta_warnings(caplog)
        assert len(warned) == 1 and error in warned[0] and "FLA derives" in warned[0], warned
        stats = chunks.stats()
        assert stats["fallback"] == stats["build_failed"] == 2 and stats["exact"] == stats["conv"] == 0
        assert list(stats["fallback_causes"].values()) == [2]
        stock.init_forward_metadata(forward_batch(*ragged))
        with monkeypatch.context() as patch:
            patch.setattr(gdn_backend.GDNAttnBackend, "_init_prefill_conv_block_table", _raise("conv table"))
            ours.init_forward_metadata(forward_batch(*ragged))
        assert chunks.tables.layout == "exact" and chunks.counts["conv"] == 1
        assert ours.forward_metadata.conv_block_table is chunks.conv_blocks.block_table
        assert_same(ours.forward_metadata.conv_block_table, stock.forward_metadata.conv_block_table)
    finally:
        chunks.close()


SETUP_FAILURES = {  # failure -> (environment, a fill that fails to warm up, what the warning names)
    "max_num_seqs": (
        {"CHUNKMETA_SGLANG_MAX_NUM_SEQS": "0"},
        None,
        "CHUNKMETA_SGLANG_MAX_NUM_SEQS='0': must be a positive int (or unset, to size from the server args)",
    ),
    "max_num_tokens": (
        {"CHUNKMETA_SGLANG_MAX_NUM_TOKENS": "lots"},
        None,
        "CHUNKMETA_SGLANG_MAX_NUM_TOKENS='lots': must be a positive int",
    ),
    "warm_up": ({}, RuntimeError("NVRTC: compilation failed"), "RuntimeError: NVRTC: compilation failed"),
}
STOCK_BACKENDS = {"kda": kda_backend.KDAAttnBackend, "gdn": gdn_backend.GDNAttnBackend, "mamba2": STOCK_MAMBA2}


@pytest.mark.parametrize(
    "kind, failure",
    # Mamba2's builder warms up on its first extend, not here: test_mamba2_failed_warm_up_keeps_prepare_mixed
    [(k, f) for k in sorted(STOCK_BACKENDS) for f in sorted(SETUP_FAILURES) if (k, f) != ("mamba2", "warm_up")],
)
def test_backend_chunkmeta_cannot_set_up_keeps_sglangs_path(monkeypatch, caplog, kind, failure):
    """chunkmeta's backend made by SGLang's own constructor with a sizing variable it refuses or a
    fill that fails its warm-up: the backend is made (SGLang starts), has no chunkmeta, says so in
    one warning naming the variable and CHUNKMETA_SGLANG=0, and its forwards are SGLang's own."""
    environment, error, named = SETUP_FAILURES[failure]
    stock_cls = STOCK_BACKENDS[kind]
    cls = sg.chunkmeta_backend(stock_cls, kind=kind, fla_package=FLA if kind != "mamba2" else None)
    with caplog.at_level(logging.WARNING, logger="chunkmeta"):
        with monkeypatch.context() as patch:
            for name, value in environment.items():
                patch.setenv(name, value)
            if error is not None:
                failing(patch, StepTablesBuilder, "build", [error])
            ours = construct(cls)
    warned = chunkmeta_warnings(caplog)
    assert len(warned) == 1, warned
    assert warned[0].startswith(f"chunkmeta: {cls.__name__} keeps SGLang's own ") and named in warned[0], warned
    assert "CHUNKMETA_SGLANG=0 turns chunkmeta off" in warned[0]
    assert ours.chunkmeta is None
    stock = construct(stock_cls)
    for lens, prefix, mode in CASES[:3]:
        stock.init_forward_metadata(forward_batch(lens, prefix, mode))
        ours.init_forward_metadata(forward_batch(lens, prefix, mode))
        assert_same(ours.forward_metadata, stock.forward_metadata)


def test_conv_table_rule_is_sglangs():
    """The grid ratio chunkmeta's rule copies is the one SGLang's rule reads."""
    import inspect

    source = inspect.getsource(gdn_backend.GDNAttnBackend._init_prefill_conv_block_table)
    assert f"<= {sg.tables.CONV_TABLE_GRID_RATIO} * sum(" in " ".join(source.split())


def test_gdn_without_host_lengths_keeps_sglangs_table_rule(monkeypatch):
    stock, ours = gdn_pair(monkeypatch)
    try:
        ours.init_forward_metadata(forward_batch([1, 1, 700], [0, 0, 0], host=False))
        assert ours.forward_metadata.conv_block_table is None and ours.chunkmeta.tables.layout == "bounded"
    finally:
        ours.chunkmeta.close()


def test_gdn_track_conv_indices_equal_sglangs(monkeypatch):
    stock, ours = gdn_pair(monkeypatch)
    lens, prefix, track = [300, 5, 130], [64, 0, 10], [64 + 256, None, 10 + 128]
    try:
        stock.init_forward_metadata(forward_batch(lens, prefix, track=track))
        with monkeypatch.context() as patch:
            patch.setattr(hlab.MambaAttnBackendBase, "_init_track_conv_indices", _raise("_init_track_conv_indices"))
            with SyncCounter() as syncs:
                ours.init_forward_metadata(forward_batch(lens, prefix, track=track))
        for name in ("track_conv_indices", "mamba_track_mask_indices", "conv_states_mask_indices"):
            assert_same(getattr(ours.forward_metadata, name), getattr(stock.forward_metadata, name), name)
        assert syncs.count == 0, syncs.by_op
    finally:
        ours.chunkmeta.close()


def test_chunk_fwd_o_is_served_for_every_t(monkeypatch):
    """GDN's chunk_fwd_o asks for BT = min(64, max(16, next_pow2(T))): every T gets chunkmeta's
    table (a router hit), equal to FLA's own at that BT."""
    from sglang.kernels.ops.attention.fla import chunk_o, utils

    monkeypatch.setattr(utils, "custom_device_ctx", lambda index: contextlib.nullcontext())
    fwd_o = KernelRecorder(chunk_o.chunk_fwd_kernel_o)
    monkeypatch.setattr(chunk_o, "chunk_fwd_kernel_o", fwd_o)
    obj = backend("gdn")
    router = obj.chunkmeta.router
    rng = np.random.default_rng(2)
    try:
        for total in range(1, 140):
            cuts = np.sort(rng.choice(np.arange(1, total), size=min(int(rng.integers(0, 4)), total - 1), replace=False))
            lens = np.diff([0, *cuts.tolist(), total]).tolist()
            obj.init_forward_metadata(forward_batch(lens, [0] * len(lens)))
            qsl = obj.forward_metadata.query_start_loc
            x = torch.zeros(1, total, 1, 16)
            misses = router.misses
            chunk_o.chunk_fwd_o(x, x, x, torch.zeros(1, 1, 1, 16, 16), cu_seqlens=qsl)
            bt = min(64, max(16, 1 << (total - 1).bit_length()))
            ref = reference.chunk_metadata([0, *np.cumsum(lens).tolist()], bt)
            assert router.misses == misses, total
            assert [tuple(r) for r in fwd_o.calls[-1]["chunk_indices"].tolist()] == ref.chunk_indices, total
    finally:
        obj.chunkmeta.close()


def test_fla_package_is_sglangs():
    assert sg.find_fla("sglang") == FLA
