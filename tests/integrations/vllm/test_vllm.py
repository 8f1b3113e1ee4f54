"""The vLLM adapter against a faithful model of vLLM 0.33.0's builders (tests/integrations/vllm/vllm_fake.py).

CPU (in `make test`; never imports vLLM): the chunkmeta builders give exactly what vLLM's default
hook gives (FLA's host helpers on the CPU copy) on decode-first, prefill-only, spec-decode and
CUDA-graph-padded batches, and random ones; CuteDSL's layout; the ROCm Kimi-K3 drop-in and
wiring; install/uninstall; the plugin's opt-in. GPU (`-m gpu`): the same on CUDA, with the hook
under `torch.cuda.set_sync_debug_mode("error")`. The real vLLM runs in tests/integrations/vllm/test_vllm_real.py
(`make test-vllm`).
"""

import importlib
import logging
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import vllm_fake as fake
from checks import no_sync
from chunkmeta import ChunkMetaError
from chunkmeta.integrations import vllm as adapter
from chunkmeta.integrations.plugin import ImportHook
from chunkmeta.step_builder import StepTablesBuilder
from chunkmeta.workloads import random_decode_first

pytest.importorskip("fla")

ROOT = Path(__file__).resolve().parents[3]

# (query_lens, context_lens, num_decode_draft_tokens or None); rows in the runner's order
BATCHES = {
    # decodes first, then a one-token prompt (a short extend: a prefill) and prefills around
    # multiples of 64
    "decode_first": ([1, 1, 1, 1, 70, 130, 64, 65, 128], [9, 20, 5, 0, 0, 7, 0, 0, 300], None),
    "prefill_only": ([300, 64, 1, 63], [0, 0, 0, 0], None),
    "single_prompt": ([4000], [0], None),
    "chunked_prefill_resume": ([1, 1, 512], [3, 4, 1024], None),
    # CUDA-graph padding: zero-length rows after the real ones stay in the slice
    "padded": ([1, 1, 70, 130, 0, 0], [10, 20, 0, 5, 0, 0], None),
    "prefill_only_padded": ([200, 0, 0, 0], [0, 0, 0, 0], None),
    # spec decode: non-spec decodes become one-token prefills, padding rows stay in the slice
    "spec": ([3, 3, 1, 100, 1, 0, 0], [10, 20, 30, 0, 0, 0, 0], [2, 2, -1, -1, -1, -1, -1]),
    "spec_one_prefill": ([3, 64, 0], [10, 0, 0], [2, -1, -1]),
    "spec_decodes_as_prefills": ([3, 1, 1, 0], [10, 20, 30, 0], [2, -1, -1, -1]),
}
NO_PREFILL = {
    "decodes": ([1, 1, 1], [5, 6, 7], None),
    "decodes_padded": ([1, 1, 0, 0], [5, 6, 0, 0], None),
    "spec_only": ([3, 3, 0], [5, 6, 0], [2, 2, -1]),
}


@pytest.fixture(autouse=True)
def clean_install():
    adapter.uninstall()
    yield
    adapter.uninstall()


def steps(builder) -> int:
    """Builds chunkmeta served to vLLM (its warm-up build at construction not counted)."""
    return builder.chunkmeta.builds - 1


def make(builder_cls, device="cpu", **config):
    num_spec = 2 if config.pop("spec", False) else 0
    cfg = fake.vllm_config(num_speculative_tokens=num_spec, **config)
    return builder_cls(fake.KV_CACHE_SPEC, fake.LAYERS, cfg, torch.device(device))


def cm_class(base=fake.GDNAttentionMetadataBuilder):
    return adapter.chunkmeta_builder_class(base, reuse_block_table=base is fake.GDNAttentionMetadataBuilder)


def build(builder, case, device="cpu"):
    query_lens, context_lens, drafts = case
    m = fake.batch(query_lens, context_lens, device)
    if drafts is None:
        return builder.build(0, m)
    accepted = torch.ones(len(query_lens), dtype=torch.int32, device=device)
    return builder.build(0, m, accepted, torch.tensor(drafts, dtype=torch.int32))


def assert_same_tables(got, want):
    """Exactly vLLM's: dtypes, shapes (exact NT) and values, on the same device."""
    for g, w in ((got.chunk_indices, want.chunk_indices), (got.chunk_offsets, want.chunk_offsets)):
        assert g.dtype == w.dtype and g.shape == w.shape and g.device == w.device
        assert torch.equal(g.cpu(), w.cpu())
    assert got.chunk_indices.dtype == torch.int32 and got.chunk_offsets.dtype == torch.int64
    assert got.chunk_indices.is_contiguous() and got.chunk_offsets.is_contiguous()


def assert_same_step(got, want):
    assert (got.num_prefills, got.num_decodes, got.num_spec_decodes) == (
        want.num_prefills,
        want.num_decodes,
        want.num_spec_decodes,
    )
    assert torch.equal(got.prefill_query_start_loc.cpu(), want.prefill_query_start_loc.cpu())
    assert_same_tables(got, want)


# -- the GDN builder ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_gdn_builder_matches_vllm_default(name):
    case = BATCHES[name]
    spec = case[2] is not None
    stock, ours = make(fake.GDNAttentionMetadataBuilder, spec=spec), make(cm_class(), spec=spec)
    got, want = build(ours, case), build(stock, case)
    assert_same_step(got, want)
    assert ours.hook_calls == 1 and steps(ours) == 1 and ours.chunkmeta_fallbacks == 0
    assert want.prefill_query_start_loc[0] == 0  # vLLM hands over a rebased slice


def test_slices_reach_the_hook_as_vllm_makes_them():
    """The shapes the hook must handle: rebased after the decodes, padding rows and one-token
    prefills left in."""
    ours = make(cm_class(), spec=True)
    assert build(ours, BATCHES["padded"]).prefill_query_start_loc.tolist() == [0, 70, 200, 200, 200]
    assert build(ours, BATCHES["spec"]).prefill_query_start_loc.tolist() == [0, 1, 101, 102, 102, 102]
    md = build(ours, BATCHES["spec"])
    assert md.chunk_indices.tolist() == [[0, 0], [1, 0], [1, 1], [2, 0]]
    assert md.chunk_offsets.tolist() == [0, 1, 3, 4, 4, 4]


@pytest.mark.parametrize("name", sorted(NO_PREFILL))
def test_no_prefill_never_reaches_chunkmeta(name):
    case = NO_PREFILL[name]
    ours = make(cm_class(), spec=case[2] is not None)
    md = build(ours, case)
    assert md.num_prefills == 0 and md.chunk_indices is None and md.chunk_offsets is None
    assert ours.hook_calls == 0 and steps(ours) == 0


# No row over one token, and still a prefill: a first one-token chunk of a prompt (vLLM's
# is_prefilling). build() lets such steps through to vLLM's as decode-only, and an overridden
# point then turns them into chunkmeta steps.
ONE_TOKEN_PROMPTS = {
    "beside_decodes": ([1, 1, 0], [5, 0, 0], None),
    "alone": ([1, 1], [0, 0], None),
}


@pytest.mark.parametrize("name", sorted(ONE_TOKEN_PROMPTS))
def test_one_token_prompts_are_chunkmeta_steps(name):
    case = ONE_TOKEN_PROMPTS[name]
    stock, ours = make(fake.GDNAttentionMetadataBuilder), make(cm_class())
    got, want = build(ours, case), build(stock, case)
    assert want.num_prefills > 0
    assert_same_step(got, want)
    # the hook is reached twice: vLLM's decode-only attempt, which stops there, then the step
    assert ours.hook_calls == 2 and steps(ours) == 1 and ours.chunkmeta_fallbacks == 0
    assert ours.chunkmeta_stats()["served"]["fla"] == 1


def random_case(rng, spec: bool):
    """A runner-shaped random step: decodes (or spec decodes) first, prefills, then padding
    (at most 26 rows and 4096 tokens)."""
    batch = random_decode_first(rng, max_seqs=24, max_tokens=4096)
    lengths = np.diff(batch.query_start_loc).tolist()
    decodes, prefills = lengths[: batch.first_seq], [n for n in lengths[batch.first_seq :] if n > 0]
    if not prefills:
        prefills = [int(rng.integers(1, 300))]
    padding = [0] * int(rng.integers(0, 3))
    context = [int(rng.integers(1, 100)) for _ in decodes] + [int(rng.integers(0, 2)) * 50 for _ in prefills]
    if not spec:
        return decodes + prefills + padding, context + [0] * len(padding), None
    drafts = [int(rng.integers(-1, 3)) for _ in decodes]
    query = [d + 1 if d >= 0 else 1 for d in drafts] + prefills + padding
    return query, context + [0] * len(padding), drafts + [-1] * (len(prefills) + len(padding))


@pytest.mark.parametrize("spec", [False, True], ids=["decode_first", "spec"])
def test_random_steps_match_vllm_default(spec):
    rng = np.random.default_rng(7 + spec)
    stock = make(fake.GDNAttentionMetadataBuilder, spec=spec, max_num_seqs=32)
    ours = make(cm_class(), spec=spec, max_num_seqs=32)
    short = 0
    for _ in range(60):
        case = random_case(rng, spec)
        got, want = build(ours, case), build(stock, case)
        assert_same_step(got, want)
        short += max(case[0]) <= 1
    # every step with a prefill is chunkmeta's, one-token prompts among one-token rows included
    assert stock.hook_calls == 60 and steps(ours) == 60 and (short > 0 or spec)  # spec rows draft 3 tokens


def test_tables_stay_intact_for_ring_depth_minus_one_builds():
    """A step's tables are views of a ring slot: later steps must not overwrite them before the
    ring wraps (async scheduling builds step k+1 while step k runs)."""
    ours = make(cm_class())
    first = build(ours, BATCHES["decode_first"])
    kept = first.chunk_indices.clone(), first.chunk_offsets.clone()
    for _ in range(adapter.RING_DEPTH - 1):
        build(ours, BATCHES["single_prompt"])
    assert torch.equal(first.chunk_indices, kept[0]) and torch.equal(first.chunk_offsets, kept[1])


def test_builder_sized_from_the_scheduler_config():
    ours = make(cm_class(), max_num_seqs=48, max_num_batched_tokens=16384)
    assert isinstance(ours.chunkmeta, StepTablesBuilder)
    cap = ours.chunkmeta.capacity
    assert (cap.seqs, cap.tokens, cap.rows) == (48, 16384, 16384 // 64 + 48)
    specs = ours.chunkmeta.specs
    assert specs["fla"].chunk_size == specs["fla_batch"].chunk_size == adapter.FLA_CHUNK_SIZE == fake.FLA_CHUNK_SIZE
    assert (specs["fla"].rows, specs["fla_batch"].rows, specs["conv"].block_m) == ("prefill", "batch", 8)
    assert ours.chunkmeta.ring.arena.shape[0] == adapter.RING_DEPTH and ours.chunkmeta.device == torch.device("cpu")
    # everything else is the stock builder's
    assert ours.gdn_prefill_backend == "triton" and ours.decode_cudagraph_max_bs == 48


def test_batch_beyond_the_limits_falls_back_to_vllm(caplog):
    """chunkmeta validates before writing anything, so a step it cannot hold is served exactly
    by vLLM's own path (with one warning) instead of failing the step."""
    ours = make(cm_class(), max_num_seqs=4)
    stock = make(fake.GDNAttentionMetadataBuilder, max_num_seqs=4)
    case = ([70, 1, 2, 3, 4, 5], [0] * 6, None)  # 6 prefills > max_num_seqs
    with caplog.at_level(logging.DEBUG, logger=adapter.logger.name):
        assert_same_step(build(ours, case), build(stock, case))
        assert_same_step(build(ours, case), build(stock, case))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "max_num_seqs" in warnings[0].getMessage()
    assert ours.chunkmeta_fallbacks == 2 and steps(ours) == 0
    assert_same_step(build(ours, BATCHES["padded"]), build(stock, BATCHES["padded"]))
    assert steps(ours) == 1


def test_a_serve_that_raises_falls_back_to_vllm(monkeypatch, caplog):
    """Any exception of chunkmeta's serve (a Triton compile or launch failure for a new input, say),
    not only ChunkMetaError, gives vLLM's own tables from the recorded arguments: one warning per
    cause, counted, the exception's type in the cause."""
    ours, stock = make(cm_class()), make(fake.GDNAttentionMetadataBuilder)

    def broken(*args, **kwargs):
        raise RuntimeError("triton: no kernel for int64 at 12 rows")

    monkeypatch.setattr(ours.chunkmeta, "build", broken)
    with caplog.at_level(logging.DEBUG, logger=adapter.logger.name):
        for name in ("decode_first", "padded", "spec"):
            assert_same_step(build(ours, BATCHES[name]), build(stock, BATCHES[name]))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "RuntimeError: triton: no kernel" in warnings[0].getMessage()
    stats = ours.chunkmeta_stats()
    assert stats["fallbacks"] == 3 and stats["served"] == {}
    assert stats["fallback_causes"] == {"RuntimeError: triton: no kernel for intN at N rows": 3}


def test_warm_up_at_construction(monkeypatch, caplog):
    """The fill compiles when vLLM creates the builder, not in the first request's step; a fill
    that fails there leaves the builder on vLLM's own path."""
    assert make(cm_class()).chunkmeta.builds == 1

    def broken(builder):
        raise RuntimeError("no Triton backend for this device")

    monkeypatch.setattr(adapter.tables, "warm_up", broken)
    with caplog.at_level(logging.WARNING, logger=adapter.logger.name):
        ours = make(cm_class())
    assert ours.chunkmeta is None and "RuntimeError: no Triton backend" in caplog.text
    assert_same_step(build(ours, BATCHES["spec"]), build(make(fake.GDNAttentionMetadataBuilder), BATCHES["spec"]))


def test_limits_chunkmeta_cannot_hold_keep_vllms_path(caplog):
    with caplog.at_level(logging.WARNING, logger=adapter.logger.name):
        ours = make(cm_class(), max_num_seqs=1 << 17)
    assert ours.chunkmeta is None and "max_num_seqs" in caplog.text
    assert_same_step(
        build(ours, BATCHES["decode_first"]), build(make(fake.GDNAttentionMetadataBuilder), BATCHES["decode_first"])
    )


# -- prefill backends ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["decode_first", "padded", "spec", "single_prompt"])
def test_cutedsl_layout(name):
    """CuteDSL reads int32 tables: rows [0, NT) and the real NT in chunk_offsets[-1]; it sizes
    its workspaces from the row count, any UB >= NT. chunkmeta gives UB = NT."""
    case = BATCHES[name]
    spec = case[2] is not None
    stock = make(fake.GDNAttentionMetadataBuilder, gdn_prefill_backend="cutedsl", spec=spec)
    ours = make(cm_class(), gdn_prefill_backend="cutedsl", spec=spec)
    got, want = build(ours, case), build(stock, case)
    assert got.chunk_indices.dtype == got.chunk_offsets.dtype == torch.int32
    assert ours.chunkmeta.specs["fla"].offsets_dtype == torch.int32  # written int32 by the fill: no cast per step
    assert torch.equal(got.chunk_offsets, want.chunk_offsets)  # int32 [N+1], last entry NT
    nt = int(want.chunk_offsets[-1])
    assert got.chunk_indices.shape == (nt, 2) and nt <= want.chunk_indices.shape[0]
    assert torch.equal(got.chunk_indices, want.chunk_indices[:nt])
    assert got.chunk_indices.is_contiguous() and got.chunk_offsets.is_contiguous()


def test_cutedsl_upper_bound_is_vllms_worst_case():
    """The model's UB is vLLM's: N-1 one-token sequences plus one long one."""
    assert fake.upper_bound_chunks(4, 200, 64) == 3 + 4
    assert fake.upper_bound_chunks(1, 64, 64) == 1


@pytest.mark.parametrize("backend", ["flashinfer", "aiter_flydsl"])
def test_backends_without_the_hook(backend):
    """FlashInfer and AITER FlyDSL never call the hook: chunkmeta builds no FLA tables for it (the
    conv tables and the router's are still served), and under AITER (where vLLM refuses a builder
    that overrides the hook) it stands aside instead."""
    if backend == "aiter_flydsl":

        class Override(fake.GDNAttentionMetadataBuilder):
            def _build_chunk_metadata(self, *args):
                raise AssertionError

        with pytest.raises(RuntimeError, match="aiter_flydsl"):  # the model keeps vLLM's check
            make(Override, gdn_prefill_backend=backend)
        with pytest.raises(RuntimeError, match="aiter_flydsl"):  # and applies it to Kimi-K3's own hook
            make(cm_class(fake.KimiK3ROCmKDAMetadataBuilder), gdn_prefill_backend=backend)
    ours = make(cm_class(), gdn_prefill_backend=backend)
    md = build(ours, BATCHES["decode_first"])
    assert md.num_prefills == 6 and md.chunk_indices is None and ours.hook_calls == 0
    assert ours.chunkmeta_stats()["builds"] == 0  # the model's build() asks for no table


def test_mrv2_reuse_stays_off_on_cpu_like_vllm():
    """MRV2's metadata reuse needs CUDA (same rule as the stock builder); on CUDA the GPU test
    checks it is restored for the GDN builder and not for Kimi-K3's."""
    for cls in (fake.GDNAttentionMetadataBuilder, cm_class()):
        assert make(cls, use_v2_model_runner=True).supports_update_block_table is False
    # the rule itself, for a CUDA device (the model's buffers cannot be allocated there on CPU)
    ours = make(cm_class(), use_v2_model_runner=True)
    ours._restore_block_table_reuse(ours.vllm_config, torch.device("cuda"))
    assert ours.supports_update_block_table is True and ours.mamba_aligned_state_indices is None
    v1 = make(cm_class())
    v1._restore_block_table_reuse(v1.vllm_config, torch.device("cuda"))
    assert v1.supports_update_block_table is False


# -- ROCm Kimi-K3 ----------------------------------------------------------------------------


@pytest.mark.parametrize("cu", [[0, 100, 100, 230], [0, 1, 65, 129, 1129, 1129], [0, 64], [0, 0, 0], [0]])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_prepare_chunk_metadata_device_is_a_drop_in(cu, dtype):
    cu_cpu = torch.tensor(cu, dtype=dtype)
    got = adapter.prepare_chunk_metadata_device(cu_cpu.clone(), cu_cpu, 64)
    want = fake.prepare_chunk_metadata_device(cu_cpu.clone(), cu_cpu, 64)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
    assert got[0].dtype == dtype and got[1].dtype == torch.int64


def test_prepare_chunk_metadata_device_chunk_size_and_errors():
    cu = torch.tensor([0, 33, 40, 100], dtype=torch.int32)
    for g, w in zip(
        adapter.prepare_chunk_metadata_device(cu, cu.clone(), 32),
        fake.prepare_chunk_metadata_device(cu, cu.clone(), 32),
        strict=True,
    ):
        assert torch.equal(g, w)
    with pytest.raises(ChunkMetaError, match="chunk_size=48"):
        adapter.prepare_chunk_metadata_device(cu, cu.clone(), 48)
    with pytest.raises(ChunkMetaError, match=r"cu_seqlens_cpu is decreasing at index 2"):
        adapter.prepare_chunk_metadata_device(cu, torch.tensor([0, 33, 30, 100], dtype=torch.int32), 64)
    with pytest.raises(ChunkMetaError, match="cu_seqlens has 3 entries but cu_seqlens_cpu has 4"):
        adapter.prepare_chunk_metadata_device(cu[:3], cu, 64)


def test_kimi_k3_rocm_wiring():
    """The Kimi-K3 ROCm layer hard-codes its backend; install() patches that backend's builder:
    Kimi-K3's own build() still runs, its chunk tables come from chunkmeta."""
    adapter.install(fake.api())
    builder_cls = fake.KimiK3ROCmKDABackend.get_builder_cls()
    assert issubclass(builder_cls, fake.KimiK3ROCmKDAMetadataBuilder)
    assert issubclass(builder_cls, adapter.ChunkmetaBuilderMixin)
    assert adapter.wrapped_builder(builder_cls) is fake.KimiK3ROCmKDAMetadataBuilder
    assert fake.KimiK3ROCmKDABackend.get_name() == "KIMI_K3_KDA_ROCM"
    stock = make(fake.KimiK3ROCmKDAMetadataBuilder, spec=True)
    ours = make(builder_cls, spec=True)
    for name in ("decode_first", "padded", "spec"):
        got, want = build(ours, BATCHES[name]), build(stock, BATCHES[name])
        assert_same_step(got, want)
        assert got.checkpoint == "kimi-k3-rocm"
    assert steps(ours) == 3
    assert ours.supports_update_block_table is False  # per-group checkpoint state: never reused


KIMI_MODEL_MODULE = """
import vllm_fake as fake


class KimiK3ROCmKDABackend(fake.GDNAttentionBackend):
    @staticmethod
    def get_builder_cls():
        return {builder}
"""


def kimi_module(tmp_path, monkeypatch, name, builder="fake.KimiK3ROCmKDAMetadataBuilder"):
    """An importable stand-in for vllm/models/kimi_k3/amd/kda_metadata.py, not imported yet."""
    (tmp_path / f"{name}.py").write_text(KIMI_MODEL_MODULE.format(builder=builder))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return adapter.VllmApi("0.33.0", fake.GDNAttentionBackend, fake.GDNAttentionMetadataBuilder, kimi_rocm_module=name)


def test_kimi_k3_rocm_is_wired_when_vllm_imports_it(tmp_path, monkeypatch):
    """install() never imports the Kimi-K3 ROCm module (its FLA import queries the GPU, which
    vLLM's API-server and engine-core processes must not touch): it patches the backend when
    vLLM imports the module, or at once if it is imported already."""
    name = "cm_kimi_rocm_model"
    api = kimi_module(tmp_path, monkeypatch, name)
    adapter.install(api)
    assert name not in sys.modules and adapter.pending() == (name,)
    module = importlib.import_module(name)
    cls = module.KimiK3ROCmKDABackend.get_builder_cls()
    assert adapter.wrapped_builder(cls) is fake.KimiK3ROCmKDAMetadataBuilder
    assert adapter.pending() == () and module.KimiK3ROCmKDABackend in adapter.installed()
    assert not [f for f in sys.meta_path if isinstance(f, ImportHook)]
    adapter.uninstall()
    assert module.KimiK3ROCmKDABackend.get_builder_cls() is fake.KimiK3ROCmKDAMetadataBuilder

    adapter.install(api)  # imported already: wired at once
    assert module.KimiK3ROCmKDABackend.get_builder_cls() is cls and adapter.pending() == ()
    adapter.uninstall()
    del sys.modules[name]
    adapter.install(api)
    adapter.uninstall()  # before the import: nothing stays armed
    assert not [f for f in sys.meta_path if isinstance(f, ImportHook)]
    module = importlib.import_module(name)
    assert module.KimiK3ROCmKDABackend.get_builder_cls() is fake.KimiK3ROCmKDAMetadataBuilder


def test_failed_kimi_k3_wiring_never_breaks_the_import(tmp_path, monkeypatch, caplog):
    name = "cm_kimi_rocm_changed"
    adapter.install(kimi_module(tmp_path, monkeypatch, name, builder="object"))
    with caplog.at_level(logging.WARNING, logger=adapter.logger.name):
        module = importlib.import_module(name)
    assert module.KimiK3ROCmKDABackend.get_builder_cls() is object
    assert "wiring cm_kimi_rocm_changed failed" in caplog.text and "not a GDNAttentionMetadataBuilder" in caplog.text
    assert set(adapter.installed()) == {fake.GDNAttentionBackend}


# -- install / uninstall ---------------------------------------------------------------------


def own_getter(backend):
    return backend.__dict__.get("get_builder_cls")


def test_install_is_idempotent_and_uninstall_restores():
    originals = {b: own_getter(b) for b in (fake.GDNAttentionBackend, fake.KimiK3ROCmKDABackend)}
    first = adapter.install(fake.api())
    assert adapter.install(fake.api()) == first  # a second install changes nothing
    gdn_cls = fake.GDNAttentionBackend.get_builder_cls()
    assert first == (gdn_cls, fake.KimiK3ROCmKDABackend.get_builder_cls())
    assert adapter.wrapped_builder(gdn_cls) is fake.GDNAttentionMetadataBuilder
    assert sum(c is adapter.ChunkmetaBuilderMixin for c in gdn_cls.__mro__) == 1
    assert fake.GDNAttentionBackend.get_name() == "GDN_ATTN"  # the backend keeps its identity
    assert adapter.installed() == {fake.GDNAttentionBackend: gdn_cls, fake.KimiK3ROCmKDABackend: first[1]}
    assert_same_step(
        build(make(gdn_cls), BATCHES["padded"]), build(make(fake.GDNAttentionMetadataBuilder), BATCHES["padded"])
    )

    adapter.uninstall()
    adapter.uninstall()
    assert {b: own_getter(b) for b in originals} == originals
    assert fake.GDNAttentionBackend.get_builder_cls() is fake.GDNAttentionMetadataBuilder
    assert fake.KimiK3ROCmKDABackend.get_builder_cls() is fake.KimiK3ROCmKDAMetadataBuilder
    assert adapter.installed() == {}
    assert adapter.install(fake.api()) == first  # reinstall: the same classes (vLLM keys groups by type)


def conv_module(name):
    module = types.ModuleType(name)

    def compute_causal_conv1d_metadata(query_start_loc_p_cpu, *, device):
        return None, None, None

    module.compute_causal_conv1d_metadata = compute_causal_conv1d_metadata
    return module


def test_install_that_fails_undoes_what_it_applied(monkeypatch):
    """A Kimi-K3 NVIDIA module imported already is wired inside install(); if its interface
    differs install() raises, and what that call applied (conv stand-ins, get_builder_cls, the
    import hook it armed) is undone; an earlier install's patches stay."""
    conv = conv_module("cm_conv_module")
    kimi = types.ModuleType("cm_kimi_nvidia_changed")
    kimi.KimiK3KDAAttentionBackend = type("KimiK3KDAAttentionBackend", (), {})  # no get_builder_cls
    monkeypatch.setitem(sys.modules, kimi.__name__, kimi)
    original_conv = conv.compute_causal_conv1d_metadata
    gdn_getter = own_getter(fake.GDNAttentionBackend)
    api = adapter.VllmApi(
        "0.33.0",
        fake.GDNAttentionBackend,
        fake.GDNAttentionMetadataBuilder,
        kimi_rocm_module="cm_kimi_rocm_never_imported",
        conv_modules=(conv,),
        kimi_nvidia_module=kimi.__name__,
    )
    with pytest.raises(ChunkMetaError, match="KimiK3KDAAttentionBackend.get_builder_cls"):
        adapter.install(api)
    assert adapter.installed() == {} and adapter.pending() == ()
    assert conv.compute_causal_conv1d_metadata is original_conv
    assert own_getter(fake.GDNAttentionBackend) is gdn_getter
    assert not [f for f in sys.meta_path if isinstance(f, ImportHook)]

    first = adapter.install(fake.api())  # an earlier call's patches survive a later failing call
    with pytest.raises(ChunkMetaError):
        adapter.install(api)
    assert adapter.installed() == dict(zip((fake.GDNAttentionBackend, fake.KimiK3ROCmKDABackend), first, strict=True))
    assert conv.compute_causal_conv1d_metadata is original_conv and adapter.pending() == ()
    adapter.uninstall()
    assert own_getter(fake.GDNAttentionBackend) is gdn_getter


def test_install_on_a_backend_that_inherits_get_builder_cls():
    class Inheriting(fake.GDNAttentionBackend):
        pass

    api = adapter.VllmApi("0.33.0", Inheriting, fake.GDNAttentionMetadataBuilder)
    adapter.install(api)
    assert issubclass(Inheriting.get_builder_cls(), adapter.ChunkmetaBuilderMixin)
    assert fake.GDNAttentionBackend.get_builder_cls() is fake.GDNAttentionMetadataBuilder
    adapter.uninstall()
    assert "get_builder_cls" not in Inheriting.__dict__
    assert Inheriting.get_builder_cls() is fake.GDNAttentionMetadataBuilder


def test_uninstall_leaves_a_later_patch_alone(caplog):
    original = own_getter(fake.GDNAttentionBackend)
    adapter.install(fake.api())
    later = staticmethod(lambda: fake.GDNAttentionMetadataBuilder)
    fake.GDNAttentionBackend.get_builder_cls = later
    try:
        with caplog.at_level(logging.WARNING, logger=adapter.logger.name):
            adapter.uninstall()
        assert own_getter(fake.GDNAttentionBackend) is later and "replaced after install" in caplog.text
        assert fake.KimiK3ROCmKDABackend.get_builder_cls() is fake.KimiK3ROCmKDAMetadataBuilder
    finally:
        fake.GDNAttentionBackend.get_builder_cls = original


def test_install_refuses_untested_or_changed_vllm():
    with pytest.raises(ChunkMetaError, match=r"vLLM 0\.34\.0 is untested .* allow_untested=True"):
        adapter.install(fake.api("0.34.0"))
    assert adapter.installed() == {}
    assert adapter.install(fake.api("0.34.0"), allow_untested=True)
    adapter.uninstall()
    assert adapter.is_supported_version("0.33.0+rocm700") and not adapter.is_supported_version("0.33.1")

    class Renamed(fake.GDNAttentionMetadataBuilder):
        def _build_chunk_metadata(self, cu_seqlens, cu_seqlens_cpu, device):
            return super()._build_chunk_metadata(cu_seqlens, cu_seqlens_cpu, device)

    class Backend(fake.GDNAttentionBackend):
        @staticmethod
        def get_builder_cls():
            return Renamed

    changed = adapter.VllmApi("0.33.0", Backend, Renamed)
    with pytest.raises(ChunkMetaError, match="_build_chunk_metadata.*is not"):
        adapter.install(changed)
    assert adapter.check_api(fake.api()) == []


# -- the plugin --------------------------------------------------------------------------------


# the model's modules as the plugin finds them (all imported already: wired at once)
FAKE_MODULES = adapter.VllmModules(gdn="vllm_fake", conv=(), mamba=(), kimi_rocm="vllm_fake", kimi_nvidia=None)


@pytest.fixture
def plugin_env(monkeypatch):
    """register() with the model standing in for the running vLLM's modules and version."""
    monkeypatch.setattr(adapter.interface, "MODULES", FAKE_MODULES)
    monkeypatch.setattr(adapter.interface, "vllm_version", lambda: "0.33.0")
    monkeypatch.delenv(adapter.ENV_VAR, raising=False)
    return monkeypatch


@pytest.mark.parametrize("value", [None, "", "0", "false", "OFF", "no"])
def test_plugin_is_a_no_op_unless_opted_in(plugin_env, value):
    monkeypatch = plugin_env
    if value is not None:
        monkeypatch.setenv(adapter.ENV_VAR, value)
    adapter.register()
    assert adapter.installed() == {} and adapter.pending() == ()
    assert fake.GDNAttentionBackend.get_builder_cls() is fake.GDNAttentionMetadataBuilder


@pytest.mark.parametrize("value", ["1", "true", " Yes ", "on"])
def test_plugin_installs_when_opted_in(plugin_env, value):
    monkeypatch = plugin_env
    monkeypatch.setenv(adapter.ENV_VAR, value)
    adapter.register()
    adapter.register()  # vLLM loads plugins in every process, and tests may load twice
    assert set(adapter.installed()) == {fake.GDNAttentionBackend, fake.KimiK3ROCmKDABackend}
    assert issubclass(fake.GDNAttentionBackend.get_builder_cls(), adapter.ChunkmetaBuilderMixin)


def test_plugin_wires_a_module_when_vllm_imports_it(plugin_env, tmp_path):
    """The plugin imports no vLLM module: a module not imported yet is wired right after vLLM's
    own import of it."""
    monkeypatch = plugin_env
    name = "cm_vllm_gdn_attn"
    (tmp_path / f"{name}.py").write_text(
        "from vllm_fake import GDNAttentionBackend, GDNAttentionMetadataBuilder  # noqa: F401\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    modules = adapter.VllmModules(gdn=name, conv=(), mamba=(), kimi_rocm=None, kimi_nvidia=None)
    monkeypatch.setattr(adapter.interface, "MODULES", modules)
    monkeypatch.setenv(adapter.ENV_VAR, "1")
    adapter.register()
    assert name not in sys.modules and adapter.pending() == (name,) and adapter.installed() == {}
    assert fake.GDNAttentionBackend.get_builder_cls() is fake.GDNAttentionMetadataBuilder
    module = importlib.import_module(name)
    assert issubclass(module.GDNAttentionBackend.get_builder_cls(), adapter.ChunkmetaBuilderMixin)
    assert adapter.pending() == () and set(adapter.installed()) == {fake.GDNAttentionBackend}


def test_plugin_warns_instead_of_failing(plugin_env, caplog):
    monkeypatch = plugin_env
    caplog.set_level(logging.WARNING, logger=adapter.logger.name)
    monkeypatch.setenv(adapter.ENV_VAR, "maybe")
    adapter.register()
    assert "CHUNKMETA_VLLM='maybe' is not understood" in caplog.text

    monkeypatch.setenv(adapter.ENV_VAR, "1")
    monkeypatch.setattr(adapter.interface, "vllm_version", lambda: "0.35.0")
    adapter.register()
    assert "vLLM 0.35.0 is untested" in caplog.text and adapter.installed() == {} and adapter.pending() == ()
    monkeypatch.setenv(adapter.ENV_VAR, "force")
    adapter.register()
    assert fake.GDNAttentionBackend in adapter.installed()
    adapter.uninstall()

    changed = adapter.VllmModules(gdn="vllm_fake", conv=("vllm_fake",), mamba=(), kimi_rocm=None, kimi_nvidia=None)
    monkeypatch.setattr(adapter.interface, "MODULES", changed)  # no compute_causal_conv1d_metadata there
    adapter.register()
    assert "compute_causal_conv1d_metadata is not" in caplog.text and adapter.installed() == {}
    assert fake.GDNAttentionBackend.get_builder_cls() is fake.GDNAttentionMetadataBuilder


def test_plugin_without_vllm_installed_only_warns(monkeypatch, caplog):
    monkeypatch.setenv(adapter.ENV_VAR, "1")
    monkeypatch.setattr(adapter.interface, "vllm_version", lambda: None)
    with caplog.at_level(logging.WARNING, logger=adapter.logger.name):
        adapter.register()
    assert "pip install 'chunkmeta[vllm]'" in caplog.text and adapter.installed() == {}


def test_plugin_entry_point_and_extra_in_pyproject():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["vllm.general_plugins"]["chunkmeta"]
    assert target == "chunkmeta.integrations.vllm:register"
    module, _, name = target.partition(":")
    assert getattr(importlib.import_module(module), name) is adapter.register
    assert "vllm==0.33.0" in project["optional-dependencies"]["vllm"]


def test_adapter_never_imports_vllm():
    assert not [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]


# -- GPU ------------------------------------------------------------------------------------------


def hook_without_sync(builder):
    """Run the builder's hook (only the hook: the model's build() is not sync-free) under the
    sync check, after one warm-up build that compiles the kernel."""
    build(builder, BATCHES["single_prompt"], "cuda")
    hook = builder._build_chunk_metadata

    def guarded(*args):
        with no_sync():
            return hook(*args)

    builder._build_chunk_metadata = guarded
    return builder


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cutedsl"])
def test_gpu_hook_matches_vllm_default_without_sync(backend):
    for spec in (False, True):
        kwargs = dict(gdn_prefill_backend=backend, spec=spec, max_num_seqs=32)
        stock = make(fake.GDNAttentionMetadataBuilder, "cuda", **kwargs)
        ours = hook_without_sync(make(cm_class(), "cuda", **kwargs))
        assert ours.chunkmeta.backend == "triton"
        rng = np.random.default_rng(11 + spec)
        cases = [c for c in BATCHES.values() if (c[2] is not None) == spec]
        cases += [random_case(rng, spec) for _ in range(200)]
        for case in cases:
            got, want = build(ours, case, "cuda"), build(stock, case, "cuda")
            if want.num_prefills == 0:  # the hook is not called without prefills
                assert got.num_prefills == 0 and got.chunk_indices is None
                continue
            if backend == "triton":
                assert_same_step(got, want)
            else:
                nt = int(want.chunk_offsets[-1])
                assert got.chunk_indices.dtype == got.chunk_offsets.dtype == torch.int32
                assert torch.equal(got.chunk_offsets, want.chunk_offsets)
                assert torch.equal(got.chunk_indices, want.chunk_indices[:nt])
            assert got.chunk_indices.device.type == "cuda"


@pytest.mark.gpu
def test_gpu_kimi_k3_and_drop_in_without_sync():
    stock = make(fake.KimiK3ROCmKDAMetadataBuilder, "cuda", spec=True)
    ours = hook_without_sync(make(cm_class(fake.KimiK3ROCmKDAMetadataBuilder), "cuda", spec=True))
    for case in BATCHES.values():
        assert_same_step(build(ours, case, "cuda"), build(stock, case, "cuda"))
    cu_cpu = torch.tensor([0, 1, 65, 129, 1129, 1129], dtype=torch.int32)
    cu = cu_cpu.cuda()
    adapter.prepare_chunk_metadata_device(cu, cu_cpu, 64)  # compiles
    with no_sync():
        got = adapter.prepare_chunk_metadata_device(cu, cu_cpu, 64)
    for g, w in zip(got, fake.prepare_chunk_metadata_device(cu, cu_cpu, 64), strict=True):
        assert g.dtype == w.dtype and g.device == w.device and torch.equal(g, w)


@pytest.mark.gpu
def test_gpu_mrv2_metadata_reuse_matches_the_stock_builder():
    assert make(fake.GDNAttentionMetadataBuilder, "cuda", use_v2_model_runner=True).supports_update_block_table
    ours = make(cm_class(), "cuda", use_v2_model_runner=True)
    assert ours.supports_update_block_table and ours.mamba_aligned_state_indices is None
    assert not make(cm_class(), "cuda").supports_update_block_table  # V1 runner: off, like the stock builder
    kimi = make(cm_class(fake.KimiK3ROCmKDAMetadataBuilder), "cuda", use_v2_model_runner=True)
    assert not kimi.supports_update_block_table
