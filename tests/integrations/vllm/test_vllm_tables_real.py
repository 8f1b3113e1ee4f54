"""Every step table the vLLM adapter serves, against vLLM 0.33.0's own builders (CPU; `make test-vllm`).

Real builders (GDN with the triton and flashinfer prefill backends, Kimi-K3 NVIDIA, Mamba1,
Mamba2, ShortConv) built from real VllmConfigs (tiny Qwen3-Next and Mamba2 configs written
offline) on decode-first, prefill-only, CUDA-graph-padded, spec-decode and chunked-prefill
(partial first chunk) batches: each table equals the stock builder's, with vLLM's own table
functions made to raise while chunkmeta builds. The router over vLLM's vendored FLA / KDA
modules answers for the step's own tensors without vLLM's derivation and falls through for any
other tensor.
"""

import contextlib
import functools
import importlib
import importlib.util
import logging
import os

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test-vllm installs it)", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM picks its platform

import vllm_real_batches
from checks import must_not_run
from chunkmeta.integrations import vllm as adapter
from chunkmeta.integrations.vllm import routing

gdn_attn = pytest.importorskip("vllm.v1.attention.backends.gdn_attn")
from vllm.v1.attention.backends import mamba1_attn, mamba2_attn, mamba_attn, short_conv_attn
from vllm.v1.attention.backends import utils as vllm_utils
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import MambaSpec

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, MAMBA_CHUNK = 16, 8192, 64
LAYERS = ["model.layers.0.mixer"]
INDEX = routing.INDEX_MODULE
CONV_KEYS = {"tot", "mlist", "mlist_len", "offsetlist", "batch_ptr", "token_chunk_offset_ptr"}  # causal_conv1d_fn's

# (query_lens, context_lens, num_decode_draft_tokens or None); rows in the runner's order
BATCHES = {
    "decode_first": ([1, 1, 1, 70, 130, 64, 65], [9, 20, 0, 0, 7, 0, 300], None),
    "prefill_only": ([300, 64, 1, 63], [0, 0, 0, 0], None),
    "padded": ([1, 1, 70, 130, 0, 0], [10, 20, 0, 5, 0, 0], None),
    "chunked_prefill": ([1, 1, 500, 37, 200], [40, 9, 100, 27, 64], None),  # partial first chunks
    "spec": ([3, 3, 1, 100, 1, 0, 0], [10, 20, 30, 0, 0, 0, 0], [2, 2, -1, -1, -1, -1, -1]),
}


def spec_for(kind):
    return MambaSpec(block_size=16, shapes=((4, 8), (2, 8, 8)), dtypes=(torch.bfloat16, torch.float32), mamba_type=kind)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    from vllm.config import VllmConfig

    def model(config, name):
        return vllm_real_batches.model_config(config, str(tmp_path_factory.mktemp(name)), seed=0)

    qwen = model(vllm_real_batches.tiny_qwen3_next(), "qwen3_next")
    mamba = model(vllm_real_batches.tiny_mamba2(MAMBA_CHUNK), "mamba2")

    def scheduler():
        return vllm_real_batches.scheduler_config(MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS)

    speculative = vllm_real_batches.ngram_speculative(qwen)
    return {
        "gdn": VllmConfig(model_config=qwen, scheduler_config=scheduler()),
        "gdn_spec": VllmConfig(model_config=qwen, scheduler_config=scheduler(), speculative_config=speculative),
        "mamba": VllmConfig(model_config=mamba, scheduler_config=scheduler()),
    }


@pytest.fixture(autouse=True)
def clean_install():
    adapter.uninstall()
    adapter.install()
    yield
    adapter.uninstall()


def build(builder, case):
    return vllm_real_batches.build(builder, case, DEVICE)


raiser = functools.partial(must_not_run, "vLLM")


@pytest.fixture
def vllm_tables_forbidden(monkeypatch):
    """A context in which every vLLM function that derives one of these tables raises."""

    @contextlib.contextmanager
    def forbid():
        with monkeypatch.context() as patch:
            index = importlib.import_module(INDEX)
            patch.setattr(index, "prepare_lens", raiser("prepare_lens (FLA chunk tables)"))
            patch.setattr(vllm_utils, "np_to_pinned_tensor", raiser("compute_causal_conv1d_metadata"))
            patch.setattr(
                mamba_attn.BaseMambaAttentionMetadataBuilder,
                "_compute_chunk_metadata",
                staticmethod(raiser("_compute_chunk_metadata (SSD tables)")),
            )
            yield

    return forbid


def pair(stock_cls, config, resolve=None, monkeypatch=None, kind=MambaAttentionBackendEnum.GDN_ATTN):
    ours_cls = adapter.chunkmeta_builder_class(stock_cls)
    spec = spec_for(kind)
    return stock_cls(spec, LAYERS, config, DEVICE), ours_cls(spec, LAYERS, config, DEVICE)


def assert_equal(got, want, name):
    assert got is not None and want is not None, name
    assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name


def assert_same_conv(got, want):
    mine, theirs = got.nums_dict[8], want.nums_dict[8]
    tot = theirs["tot"]
    assert mine["tot"] == tot and mine["mlist_len"] == theirs["mlist_len"] and CONV_KEYS <= mine.keys()
    assert mine["batch_ptr"] is got.batch_ptr and mine["token_chunk_offset_ptr"] is got.token_chunk_offset_ptr
    assert_equal(got.batch_ptr[:tot], want.batch_ptr[:tot], "batch_ptr")
    assert_equal(got.token_chunk_offset_ptr[:tot], want.token_chunk_offset_ptr[:tot], "token_chunk_offset_ptr")


def assert_same_fla(got, want):
    if want.chunk_indices is None:
        assert got.chunk_indices is None and got.chunk_offsets is None
        return
    assert_equal(got.chunk_indices, want.chunk_indices, "chunk_indices")
    assert_equal(got.chunk_offsets, want.chunk_offsets, "chunk_offsets")


def assert_same_ssd(got, want):
    for name in ("cu_chunk_seqlen_p", "seq_idx_p", "last_chunk_indices_p"):
        assert_equal(getattr(got, name), getattr(want, name), name)
    assert (got.checkpoint_chunk_idx is None) == (want.checkpoint_chunk_idx is None)
    if want.checkpoint_chunk_idx is not None:
        assert_equal(got.checkpoint_chunk_idx, want.checkpoint_chunk_idx, "checkpoint_chunk_idx")


def stock_then_ours(stock, ours, case, forbid):
    want = build(stock, case)
    with forbid():
        got = build(ours, case)
    return got, want


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("name", sorted(BATCHES))
def test_gdn_tables_equal_vllms(configs, name, backend, monkeypatch, vllm_tables_forbidden):
    case = BATCHES[name]
    config = configs["gdn_spec" if case[2] is not None else "gdn"]
    if backend != "triton":
        from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn

        resolve = qwen_gdn_linear_attn._resolve_gdn_prefill_backend
        monkeypatch.setattr(qwen_gdn_linear_attn, "_resolve_gdn_prefill_backend", lambda c: (resolve(c)[0], backend))
    stock, ours = pair(gdn_attn.GDNAttentionMetadataBuilder, config)
    assert stock.gdn_prefill_backend == ours.gdn_prefill_backend == backend
    got, want = stock_then_ours(stock, ours, case, vllm_tables_forbidden)
    assert_same_fla(got, want)
    assert_same_conv(got, want)
    assert torch.equal(got.non_spec_query_start_loc, want.non_spec_query_start_loc)
    stats = ours.chunkmeta_stats()
    assert stats["builds"] == 1 and stats["fallbacks"] == 0
    assert stats["served"] == ({"fla": 1, "conv": 1} if backend == "triton" else {"conv": 1})


def test_kimi_k3_nvidia_is_wired_with_conv():
    kda_metadata = importlib.import_module("vllm.models.kimi_k3.nvidia.kda_metadata")
    cls = kda_metadata.KimiK3KDAAttentionBackend.get_builder_cls()
    assert issubclass(cls, adapter.GdnFamilyMixin) and cls._chunkmeta_serves == adapter.Serves(fla=True, conv=True)
    assert kda_metadata.compute_causal_conv1d_metadata.__wrapped__ is vllm_utils.compute_causal_conv1d_metadata
    adapter.uninstall()
    assert kda_metadata.compute_causal_conv1d_metadata is vllm_utils.compute_causal_conv1d_metadata


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Kimi-K3 NVIDIA's build() asserts CUDA tensors")
def test_kimi_k3_nvidia_tables_equal_vllms(configs, vllm_tables_forbidden):
    kda_metadata = importlib.import_module("vllm.models.kimi_k3.nvidia.kda_metadata")
    for key in ("gdn", "gdn_spec"):
        stock, ours = pair(kda_metadata.KimiK3KDAMetadataBuilder, configs[key])
        for name, case in BATCHES.items():
            if (case[2] is not None) != (key == "gdn_spec"):
                continue
            got, want = stock_then_ours(stock, ours, case, vllm_tables_forbidden)
            assert got.chunk_indices is None and want.chunk_indices is None  # K3 NVIDIA builds none
            assert_same_conv(got, want)
            route = ours._chunkmeta_routes.get("batch")
            assert route.cu_seqlens is got.non_spec_query_start_loc, name


MAMBA = {
    "mamba2": (mamba2_attn.Mamba2AttentionMetadataBuilder, MambaAttentionBackendEnum.MAMBA2),
    "mamba1": (mamba1_attn.Mamba1AttentionMetadataBuilder, MambaAttentionBackendEnum.MAMBA1),
    "short_conv": (short_conv_attn.ShortConvAttentionMetadataBuilder, MambaAttentionBackendEnum.SHORT_CONV),
}


@pytest.mark.parametrize("family", sorted(MAMBA))
@pytest.mark.parametrize("name", [n for n in sorted(BATCHES) if BATCHES[n][2] is None])
def test_mamba_family_tables_equal_vllms(configs, family, name, vllm_tables_forbidden):
    stock_cls, kind = MAMBA[family]
    stock, ours = pair(stock_cls, configs["mamba"], kind=kind)
    got, want = stock_then_ours(stock, ours, BATCHES[name], vllm_tables_forbidden)
    assert want.num_prefills > 0
    assert_same_conv(got, want)
    if family == "mamba2":
        assert_same_ssd(got, want)
        assert got.prep_initial_states == want.prep_initial_states
    served = ours.chunkmeta_stats()["served"]
    assert served == ({"conv": 1, "ssd": 1} if family == "mamba2" else {"conv": 1})


def test_mamba2_checkpoint_chunks_equal_vllms(configs, monkeypatch, vllm_tables_forbidden):
    """Align mode: a checkpoint offset adds a chunk boundary; checkpoint_chunk_idx names it."""
    from vllm.model_executor.layers.mamba.checkpoint import MambaPrefillCheckpointMetadata

    case = BATCHES["chunked_prefill"]
    offsets = [130, 0, 77]  # per prefill row (500, 37, 200 new tokens); 0: none

    def checkpoints(self, m, rows):
        return MambaPrefillCheckpointMetadata(
            torch.tensor(offsets, dtype=torch.int32), torch.zeros(len(rows), dtype=torch.int32), offsets=offsets
        )

    stock, ours = pair(
        mamba2_attn.Mamba2AttentionMetadataBuilder, configs["mamba"], kind=MambaAttentionBackendEnum.MAMBA2
    )
    for builder in (stock, ours):
        monkeypatch.setattr(builder.checkpoint_builder, "build", checkpoints.__get__(builder.checkpoint_builder))
    got, want = stock_then_ours(stock, ours, case, vllm_tables_forbidden)
    assert want.checkpoint_chunk_idx is not None
    assert_same_ssd(got, want)


def test_a_mamba_builder_without_conv_tables(configs):
    """A builder with needs_causal_conv1d_metadata False (vLLM 0.33.0's PleShortConv; here a
    Mamba2 one) gets no conv tables from chunkmeta; if vLLM called the conv function all the
    same, the stand-in answers with vLLM's, and the step's SSD tables are still chunkmeta's."""

    class NoConv(mamba2_attn.Mamba2AttentionMetadataBuilder):
        needs_causal_conv1d_metadata = False

    stock, ours = pair(NoConv, configs["mamba"], kind=MambaAttentionBackendEnum.MAMBA2)
    assert type(ours)._chunkmeta_serves == adapter.Serves(conv=True, ssd=True)
    assert ours._chunkmeta_serves == adapter.Serves(ssd=True) and "conv" not in ours.chunkmeta.specs
    case = BATCHES["chunked_prefill"]
    got, want = build(ours, case), build(stock, case)
    assert_same_ssd(got, want) and got.nums_dict is None
    stock.needs_causal_conv1d_metadata = ours.needs_causal_conv1d_metadata = True
    got, want = build(ours, case), build(stock, case)
    assert_same_ssd(got, want)
    assert_same_conv(got, want)
    stats = ours.chunkmeta_stats()
    assert stats["served"] == {"ssd": 2} and stats["fallbacks"] == 0


def test_a_serve_that_raises_gives_vllms_tables(configs, monkeypatch, caplog):
    """Any exception of the build (here a RuntimeError, as a Triton compile or launch failure
    raises) gives vLLM's conv and SSD tables from the recorded arguments: one warning, counted."""
    stock, ours = pair(
        mamba2_attn.Mamba2AttentionMetadataBuilder, configs["mamba"], kind=MambaAttentionBackendEnum.MAMBA2
    )

    def broken(*args, **kwargs):
        raise RuntimeError("triton compile failed for bfloat16")

    monkeypatch.setattr(ours.chunkmeta, "build", broken)
    with caplog.at_level(logging.WARNING, logger="vllm.chunkmeta"):
        for name in ("decode_first", "chunked_prefill"):
            got, want = build(ours, BATCHES[name]), build(stock, BATCHES[name])
            assert_same_conv(got, want)
            assert_same_ssd(got, want)
    warnings = [r for r in caplog.records if "vLLM's own step tables" in r.getMessage()]
    assert len(warnings) == 1 and "RuntimeError" in warnings[0].getMessage()
    stats = ours.chunkmeta_stats()
    assert stats["fallbacks"] == 2 and stats["served"] == {}
    assert stats["fallback_causes"] == {"RuntimeError: triton compile failed for bfloatN": 2}


def test_a_wrong_table_is_caught(configs):
    stock, ours = pair(
        mamba2_attn.Mamba2AttentionMetadataBuilder, configs["mamba"], kind=MambaAttentionBackendEnum.MAMBA2
    )
    case = BATCHES["chunked_prefill"]
    got, want = build(ours, case), build(stock, case)
    assert_same_ssd(got, want)
    with torch.inference_mode():  # where vLLM's steps run: the tables are inference tensors
        got.seq_idx_p[-1] += 1
    with pytest.raises(AssertionError, match="seq_idx_p"):
        assert_same_ssd(got, want)
    with torch.inference_mode():
        got.batch_ptr[0] += 1
    with pytest.raises(AssertionError, match="batch_ptr"):
        assert_same_conv(got, want)


def test_over_capacity_falls_back_once_per_cause(configs, caplog):
    stock, ours = pair(gdn_attn.GDNAttentionMetadataBuilder, configs["gdn"])
    big = ([1] * 3 + [40] * (MAX_NUM_SEQS + 1), [5] * 3 + [0] * (MAX_NUM_SEQS + 1), None)
    with caplog.at_level(logging.WARNING, logger="vllm.chunkmeta"):
        for _ in range(3):
            got, want = build(ours, big), build(stock, big)
            assert_same_fla(got, want)
            assert_same_conv(got, want)
    warnings = [r for r in caplog.records if "vLLM's own step tables" in r.getMessage()]
    assert len(warnings) == 1
    stats = ours.chunkmeta_stats()
    assert stats["fallbacks"] == 3 and list(stats["fallback_causes"].values()) == [3]
    assert adapter.stats()["fallbacks"] >= 3
    assert ours._chunkmeta_routes.get("batch") is None  # a fallen-back step routes nothing


def loaded_routed_modules():
    out = []
    for name in routing.ROUTED_MODULES:
        try:
            out.append(importlib.import_module(name))
        except ImportError:  # GLM5-next's op package imports torchvision, absent from the CPU venv
            continue
    return out


def test_router_answers_for_the_steps_tensors_only(configs, monkeypatch):
    modules = loaded_routed_modules()
    assert len(modules) >= 13
    stock, ours = pair(gdn_attn.GDNAttentionMetadataBuilder, configs["gdn"])
    rtr = routing.router()
    assert set(rtr.patched()) >= {m.__name__ for m in modules if hasattr(m, "prepare_chunk_indices")}
    case = BATCHES["decode_first"]
    md = build(ours, case)
    prefill, batch = md.prefill_query_start_loc, md.non_spec_query_start_loc
    assert prefill is not batch
    want_prefill = gdn_attn.GDNAttentionMetadataBuilder._build_chunk_metadata(stock, prefill, prefill.cpu(), DEVICE)
    index = importlib.import_module(INDEX)
    original = rtr._originals["prepare_chunk_indices"]
    want_batch = (original(batch.clone(), 64), rtr._originals["prepare_chunk_offsets"](batch.clone(), 64))
    with monkeypatch.context() as patch:
        patch.setattr(index, "prepare_lens", raiser("prepare_lens"))
        for module in modules:
            for name, (qsl, want) in {"prefill": (prefill, want_prefill), "batch": (batch, want_batch)}.items():
                if hasattr(module, "prepare_chunk_indices"):
                    assert_equal(module.prepare_chunk_indices(qsl, 64), want[0], f"{module.__name__} {name}")
                if hasattr(module, "prepare_chunk_offsets"):
                    assert_equal(module.prepare_chunk_offsets(qsl, 64), want[1], f"{module.__name__} {name}")
    # any other tensor, an equal copy included, falls through to vLLM's function
    hits = rtr.hits
    for module in modules:
        if hasattr(module, "prepare_chunk_indices"):
            assert_equal(module.prepare_chunk_indices(batch.clone(), 64), want_batch[0], module.__name__)
    assert rtr.hits == hits
    # the next step's build retires this step's tensors
    build(ours, BATCHES["prefill_only"])
    with monkeypatch.context() as patch:
        patch.setattr(index, "prepare_lens", raiser("prepare_lens"))
        with pytest.raises(AssertionError, match="prepare_lens"):
            index.prepare_chunk_indices(batch, 64)


def test_router_patches_a_module_imported_later(monkeypatch):
    """Modules not imported yet get the router when the engine imports them."""
    import sys

    name = "vllm.models.kimi_k3.amd.ops.third_party.kda.chunk_intra"
    rtr = routing.router()
    monkeypatch.delitem(sys.modules, name)
    rtr.restore()
    rtr.ensure_installed()
    module = importlib.import_module(name)
    assert module.prepare_chunk_indices.__func__ is type(rtr)._chunk_indices


def wrapper_bindings(rtr, modules):
    wrappers = {"prepare_chunk_indices": rtr._chunk_indices, "prepare_chunk_offsets": rtr._chunk_offsets}
    return [(m.__name__, name) for m in modules for name, w in wrappers.items() if getattr(m, name, None) == w]


def test_uninstall_restores_the_router(configs, monkeypatch):
    """uninstall() gives every routed module vLLM's helpers back and disarms the router's import
    hooks; a builder made before keeps building its step (its ops' calls fall through to vLLM's
    helpers), and answers again once an install() and a new builder bring the router back; its
    end then leaves that install alone."""
    import gc
    import sys

    from chunkmeta.integrations.plugin import ImportHook

    modules = loaded_routed_modules()
    stock, ours = pair(gdn_attn.GDNAttentionMetadataBuilder, configs["gdn"])
    rtr = routing.router()
    index = importlib.import_module(INDEX)
    originals = dict(rtr._originals)
    bound = wrapper_bindings(rtr, modules)
    assert len(bound) >= 10
    adapter.uninstall()
    assert wrapper_bindings(rtr, modules) == [] and rtr.patched() == ()
    for module_name, name in bound:
        assert getattr(sys.modules[module_name], name) is originals[name], (module_name, name)
    assert not [f for f in sys.meta_path if isinstance(f, ImportHook)]

    case = BATCHES["decode_first"]
    got, want = build(ours, case), build(stock, case)
    assert_same_fla(got, want)  # the FLA hook is the builder's own; conv is vLLM's again (stand-in gone)
    assert_same_conv(got, want)
    hits = rtr.hits
    batch = got.non_spec_query_start_loc
    assert_equal(index.prepare_chunk_indices(batch, 64), originals["prepare_chunk_indices"](batch.clone(), 64), "fall")
    assert rtr.hits == hits

    adapter.install()
    _, newer = pair(gdn_attn.GDNAttentionMetadataBuilder, configs["gdn"])
    assert wrapper_bindings(rtr, modules) == bound
    md = build(ours, case)
    index.prepare_chunk_indices(md.non_spec_query_start_loc, 64)
    assert rtr.hits == hits + 1  # the earlier builder's routes answer again
    del ours, md
    gc.collect()
    assert wrapper_bindings(rtr, modules) == bound  # its finalizer left the new install alone
    md = build(newer, case)
    index.prepare_chunk_indices(md.non_spec_query_start_loc, 64)
    assert rtr.hits == hits + 2


# -- a builder chunkmeta cannot be set up for: vLLM's own, one warning -------------------------


def scheduler_over_capacity(config):
    """``config`` with vLLM's --max-num-seqs past what one chunkmeta build holds (1 << 16)."""
    from vllm.config import VllmConfig

    scheduler = vllm_real_batches.scheduler_config(1 << 20, 1 << 20)
    return VllmConfig(model_config=config.model_config, scheduler_config=scheduler)


SETUP_FAILURES = {
    # (a vLLM setting chunkmeta cannot hold, what the warning names), (a fill that fails to warm up)
    "sizing": (scheduler_over_capacity, None, "--max-num-seqs"),
    "warm_up": (lambda config: config, RuntimeError("NVRTC: compilation failed"), "NVRTC"),
}


@pytest.mark.parametrize("failure", sorted(SETUP_FAILURES))
@pytest.mark.parametrize(
    "backend, config, kind",
    [
        (gdn_attn.GDNAttentionBackend, "gdn", MambaAttentionBackendEnum.GDN_ATTN),
        (mamba2_attn.Mamba2AttentionBackend, "mamba", MambaAttentionBackendEnum.MAMBA2),
    ],
    ids=["gdn", "mamba2"],
)
def test_builder_chunkmeta_cannot_set_up_keeps_vllms_path(configs, monkeypatch, caplog, failure, backend, config, kind):
    """The builder class vLLM gets from the patched backend, made by vLLM's own constructor with a
    setting chunkmeta cannot hold or a fill that fails to warm up: the builder is made (vLLM
    starts), keeps vLLM's own tables on every step, and says so once, naming the setting and
    CHUNKMETA_VLLM=0."""
    make_config, error, named = SETUP_FAILURES[failure]
    vllm_config = make_config(configs[config])
    if error is not None:
        from chunkmeta.step_builder import StepTablesBuilder

        real = StepTablesBuilder.build
        pending = [error]

        def build_once_failing(self, *args, **kwargs):
            if pending:
                raise pending.pop()
            return real(self, *args, **kwargs)

        monkeypatch.setattr(StepTablesBuilder, "build", build_once_failing)
    cls = backend.get_builder_cls()
    assert issubclass(cls, adapter.ChunkmetaBuilderMixin)
    stock_cls = adapter.wrapped_builder(cls)
    with caplog.at_level(logging.WARNING, logger="vllm.chunkmeta"):
        ours = cls(spec_for(kind), LAYERS, vllm_config, DEVICE)
    stock = stock_cls(spec_for(kind), LAYERS, vllm_config, DEVICE)
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("vllm.chunkmeta")]
    assert len(warned) == 1 and named in warned[0] and "CHUNKMETA_VLLM=0" in warned[0], warned
    assert f"{cls.__name__} keeps vLLM's own step tables" in warned[0]
    assert ours.chunkmeta is None and not ours.chunkmeta_stats()["active"]
    for name in ("decode_first", "chunked_prefill"):
        got, want = build(ours, BATCHES[name]), build(stock, BATCHES[name])
        assert_same_conv(got, want)
        if config == "gdn":
            assert_same_fla(got, want)
        else:
            assert_same_ssd(got, want)
