"""The vLLM adapter against the real vLLM 0.33.0, on CPU (`make test-vllm`; skipped without vLLM).

Real classes, a real VllmConfig (a tiny Qwen3-Next config written to a temp dir, fully offline;
a real ngram SpeculativeConfig for spec decode) and real CommonAttentionMetadata: the chunkmeta
builders' build() gives the stock builder's chunk tables on decode-first, prefill-only,
CUDA-graph-padded and spec-decode batches; the hook's signature is vLLM's; the plugin entry
point is discoverable and works through vLLM's own plugin loader; the ROCm Kimi-K3 builder is
wired (its stock build() cannot run on CPU: its Triton kernel is a placeholder without Triton).
"""

import importlib.util
import inspect
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test-vllm installs it)", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM picks its platform

import vllm_real_batches
from checks import must_not_run
from chunkmeta.integrations import vllm as adapter

gdn_attn = pytest.importorskip("vllm.v1.attention.backends.gdn_attn")
kimi_rocm = pytest.importorskip("vllm.models.kimi_k3.amd.kda_metadata")
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import MambaSpec

DEVICE = torch.device("cpu")
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, BLOCK_SIZE = 16, 8192, 16
SPEC = MambaSpec(
    block_size=BLOCK_SIZE,
    shapes=((4, 8), (2, 8, 8)),
    dtypes=(torch.bfloat16, torch.float32),
    mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
)
LAYERS = ["model.layers.0.linear_attn"]

# (query_lens, context_lens, num_decode_draft_tokens or None); rows in the runner's order
BATCHES = {
    "decode_first": ([1, 1, 1, 70, 130, 64, 65], [9, 20, 0, 0, 7, 0, 300], None),
    "prefill_only": ([300, 64, 1, 63], [0, 0, 0, 0], None),
    "padded": ([1, 1, 70, 130, 0, 0], [10, 20, 0, 5, 0, 0], None),
    "spec": ([3, 3, 1, 100, 1, 0, 0], [10, 20, 30, 0, 0, 0, 0], [2, 2, -1, -1, -1, -1, -1]),
    "spec_decodes_as_prefills": ([3, 1, 1, 0], [10, 20, 30, 0], [2, -1, -1, -1]),
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """Real VllmConfigs: a tiny Qwen3-Next model (offline), without and with ngram spec decode."""
    from vllm.config import VllmConfig

    model = vllm_real_batches.model_config(
        vllm_real_batches.tiny_qwen3_next(), str(tmp_path_factory.mktemp("qwen3_next")), seed=0
    )
    speculative = vllm_real_batches.ngram_speculative(model)
    scheduler = vllm_real_batches.scheduler_config
    return {
        False: VllmConfig(model_config=model, scheduler_config=scheduler(MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS)),
        True: VllmConfig(
            model_config=model,
            scheduler_config=scheduler(MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS),
            speculative_config=speculative,
        ),
    }


@pytest.fixture(autouse=True)
def clean_install():
    adapter.uninstall()
    yield
    adapter.uninstall()


def build(builder, case):
    return vllm_real_batches.build(builder, case, DEVICE)


def make(builder_cls, configs, spec=False):
    return builder_cls(SPEC, LAYERS, configs[spec], DEVICE)


def assert_same_tables(got, want):
    assert (got.num_prefills, got.num_decodes, got.num_spec_decodes) == (
        want.num_prefills,
        want.num_decodes,
        want.num_spec_decodes,
    )
    assert torch.equal(got.prefill_query_start_loc, want.prefill_query_start_loc)
    for g, w in ((got.chunk_indices, want.chunk_indices), (got.chunk_offsets, want.chunk_offsets)):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
    assert got.chunk_indices.dtype == torch.int32 and got.chunk_offsets.dtype == torch.int64


def test_interface_is_the_one_the_adapter_patches():
    api = adapter.load_vllm_api()
    assert api.version.split("+")[0] == "0.33.0" and adapter.is_supported_version(api.version)
    assert api.gdn_builder is gdn_attn.GDNAttentionMetadataBuilder
    assert api.kimi_rocm_backend is kimi_rocm.KimiK3ROCmKDABackend
    assert adapter.check_api(api) == []
    hook = tuple(inspect.signature(gdn_attn.GDNAttentionMetadataBuilder._build_chunk_metadata).parameters)
    assert hook == adapter.HOOK_PARAMS
    assert tuple(inspect.signature(adapter.GdnFamilyMixin._build_chunk_metadata).parameters) == hook
    assert tuple(inspect.signature(kimi_rocm.KimiK3ROCmKDAMetadataBuilder._build_chunk_metadata).parameters) == hook
    assert (
        inspect.signature(adapter.prepare_chunk_metadata_device).parameters.keys()
        == inspect.signature(kimi_rocm.prepare_chunk_metadata_device).parameters.keys()
    )
    from vllm.third_party.flash_linear_attention.ops.utils import FLA_CHUNK_SIZE

    assert FLA_CHUNK_SIZE == adapter.FLA_CHUNK_SIZE


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_real_builder_matches_vllm_default(configs, name):
    case = BATCHES[name]
    spec = case[2] is not None
    (cls,) = adapter.install()[:1]
    assert gdn_attn.GDNAttentionBackend.get_builder_cls() is cls
    stock, ours = make(gdn_attn.GDNAttentionMetadataBuilder, configs, spec), make(cls, configs, spec)
    assert ours.gdn_prefill_backend == "triton" and ours.chunkmeta.builds == 1  # the warm-up
    got, want = build(ours, case), build(stock, case)
    assert_same_tables(got, want)
    assert ours.chunkmeta.builds == 2 and ours.chunkmeta_fallbacks == 0
    cap = ours.chunkmeta.capacity
    assert (cap.seqs, cap.tokens) == (MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS)


def random_case(rng, spec):
    """A runner-shaped step: decodes (spec decodes: 3 tokens) first, prefills, padding rows."""
    decodes = [1] * int(rng.integers(0, 6))
    prefills = [int(n) for n in rng.integers(1, 700, int(rng.integers(1, 6)))]
    padding = [0] * int(rng.integers(0, 3))
    context = [int(rng.integers(1, 100)) for _ in decodes] + [int(rng.integers(0, 2)) * 50 for _ in prefills]
    context += [0] * len(padding)
    if not spec:
        return decodes + prefills + padding, context, None
    drafts = [int(rng.integers(-1, 3)) for _ in decodes]
    query = [d + 1 if d >= 0 else 1 for d in drafts] + prefills + padding
    return query, context, drafts + [-1] * (len(prefills) + len(padding))


@pytest.mark.parametrize("spec", [False, True], ids=["decode_first", "spec"])
def test_real_builder_on_random_steps(configs, spec):
    import numpy as np

    rng = np.random.default_rng(3 + spec)
    cls = adapter.chunkmeta_builder_class(gdn_attn.GDNAttentionMetadataBuilder, reuse_block_table=True)
    stock, ours = make(gdn_attn.GDNAttentionMetadataBuilder, configs, spec), make(cls, configs, spec)
    for _ in range(40):
        case = random_case(rng, spec)
        assert_same_tables(build(ours, case), build(stock, case))
    assert ours.chunkmeta.builds == 1 + 40 and ours.chunkmeta_fallbacks == 0


def test_decode_only_steps_skip_the_hook(configs, monkeypatch):
    """A step with no row over one token goes straight to vLLM's build(): none of chunkmeta's
    per-step work (here made to raise) runs; spec decodes (three-token rows) take the recording
    path, which asks for no table either. A one-token prompt among such rows is a prefill to
    vLLM: its build() reaches an overridden point, which stops it, and the step runs as a
    chunkmeta step with vLLM's tables bit for bit."""
    from chunkmeta.integrations.vllm import builders

    cls = adapter.chunkmeta_builder_class(gdn_attn.GDNAttentionMetadataBuilder, reuse_block_table=True)
    ours, stock = make(cls, configs, spec=True), make(gdn_attn.GDNAttentionMetadataBuilder, configs, spec=True)
    with monkeypatch.context() as patch:
        patch.setattr(builders, "StepRequest", must_not_run("chunkmeta", "a chunkmeta step"))
        md = build(ours, ([1, 1, 0], [5, 6, 0], None))
        assert md.num_prefills == 0 and md.chunk_indices is None
    md = build(ours, ([3, 3, 0], [5, 6, 0], [2, 2, -1]))
    assert md.num_prefills == 0 and md.chunk_indices is None
    assert ours.chunkmeta.builds == 1  # the warm-up only
    fresh = ([1, 1, 1], [5, 6, 0], None)  # the last row is a one-token prompt: a prefill
    got, want = build(ours, fresh), build(stock, fresh)
    assert got.num_prefills == want.num_prefills == 1
    assert_same_tables(got, want)
    assert ours.chunkmeta.builds == 2 and ours.chunkmeta_stats()["served"]["fla"] == 1


def test_cutedsl_layout_on_the_real_builder(configs, monkeypatch):
    """CuteDSL needs SM10x (on CPU vLLM resolves it to triton): the real builder resolves it to
    cutedsl here, so the adapter sizes its builder from the attribute the real builder sets (int32
    chunk_offsets written by the fill); the stock builder keeps triton, whose tables are the same."""
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn

    stock = make(gdn_attn.GDNAttentionMetadataBuilder, configs)
    resolve = qwen_gdn_linear_attn._resolve_gdn_prefill_backend
    monkeypatch.setattr(qwen_gdn_linear_attn, "_resolve_gdn_prefill_backend", lambda c: (resolve(c)[0], "cutedsl"))
    cls = adapter.chunkmeta_builder_class(gdn_attn.GDNAttentionMetadataBuilder, reuse_block_table=True)
    ours = make(cls, configs)
    assert ours.gdn_prefill_backend == "cutedsl" and ours.chunkmeta.specs["fla"].offsets_dtype == torch.int32
    got, want = build(ours, BATCHES["padded"]), build(stock, BATCHES["padded"])
    assert got.chunk_indices.dtype == got.chunk_offsets.dtype == torch.int32
    assert torch.equal(got.chunk_offsets, want.chunk_offsets.to(torch.int32))
    assert torch.equal(got.chunk_indices, want.chunk_indices)
    assert int(got.chunk_offsets[-1]) == got.chunk_indices.shape[0]


def test_aiter_override_check_stands_aside():
    """vLLM refuses hook overrides under aiter_flydsl; the chunkmeta GDN builder passes that check
    (it stands aside), while Kimi-K3's own override keeps being refused as in stock vLLM."""
    ours = adapter.chunkmeta_builder_class(gdn_attn.GDNAttentionMetadataBuilder, reuse_block_table=True)
    ours._check_chunk_metadata_override(ours, "aiter_flydsl")
    kimi = adapter.chunkmeta_builder_class(kimi_rocm.KimiK3ROCmKDAMetadataBuilder)
    with pytest.raises(RuntimeError, match="aiter_flydsl"):
        kimi._check_chunk_metadata_override(kimi, "aiter_flydsl")


def test_kimi_k3_rocm_wiring(configs):
    adapter.install()
    cls = kimi_rocm.KimiK3ROCmKDABackend.get_builder_cls()
    assert issubclass(cls, kimi_rocm.KimiK3ROCmKDAMetadataBuilder) and issubclass(cls, adapter.ChunkmetaBuilderMixin)
    assert kimi_rocm.KimiK3ROCmKDABackend.get_name() == "KIMI_K3_KDA_ROCM"
    stock_gdn = make(gdn_attn.GDNAttentionMetadataBuilder, configs, spec=True)
    ours = make(cls, configs, spec=True)
    for name in ("decode_first", "padded", "spec"):
        assert_same_tables(build(ours, BATCHES[name]), build(stock_gdn, BATCHES[name]))
    assert ours.chunkmeta.builds == 1 + 3
    adapter.uninstall()
    assert kimi_rocm.KimiK3ROCmKDABackend.get_builder_cls() is kimi_rocm.KimiK3ROCmKDAMetadataBuilder
    assert gdn_attn.GDNAttentionBackend.get_builder_cls() is gdn_attn.GDNAttentionMetadataBuilder


def test_drop_in_matches_on_cpu():
    cu = torch.tensor([0, 100, 100, 230, 231], dtype=torch.int32)
    indices, offsets = adapter.prepare_chunk_metadata_device(cu, cu.clone(), 64)
    assert indices.tolist() == [[0, 0], [0, 1], [2, 0], [2, 1], [2, 2], [3, 0]] and indices.dtype == torch.int32
    assert offsets.tolist() == [0, 2, 2, 5, 6] and offsets.dtype == torch.int64


def test_plugin_entry_point_is_discoverable():
    (plugin,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "chunkmeta"]
    assert plugin.value == "chunkmeta.integrations.vllm:register"
    assert plugin.load() is adapter.register


@pytest.mark.parametrize("opt_in", [None, "1"])
def test_plugin_through_vllms_loader(monkeypatch, opt_in):
    """vLLM's own loader (vllm.plugins.load_general_plugins, run once per process) calls the
    plugin: it patches the backends only when opted in."""
    import vllm.plugins

    monkeypatch.setenv("VLLM_PLUGINS", "chunkmeta")
    if opt_in is None:
        monkeypatch.delenv(adapter.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(adapter.ENV_VAR, opt_in)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    patched = issubclass(gdn_attn.GDNAttentionBackend.get_builder_cls(), adapter.ChunkmetaBuilderMixin)
    assert patched == (opt_in is not None)
    assert issubclass(kimi_rocm.KimiK3ROCmKDABackend.get_builder_cls(), adapter.ChunkmetaBuilderMixin) == patched


def test_plugin_on_an_untested_vllm_warns_and_leaves_vllm_alone(monkeypatch):
    monkeypatch.setenv(adapter.ENV_VAR, "1")
    monkeypatch.setattr(adapter.interface, "vllm_version", lambda: "0.34.0")
    adapter.register()  # must not raise: vLLM calls plugins without a guard
    assert adapter.installed() == {}
    assert gdn_attn.GDNAttentionBackend.get_builder_cls() is gdn_attn.GDNAttentionMetadataBuilder


FRESH_PROCESS = textwrap.dedent("""
    import sys
    from vllm.plugins import load_general_plugins
    from chunkmeta.integrations import vllm as adapter

    load_general_plugins()
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend

    assert issubclass(GDNAttentionBackend.get_builder_cls(), adapter.ChunkmetaBuilderMixin)
    assert {adapter.KIMI_ROCM_MODULE, adapter.KIMI_NVIDIA_MODULE} <= set(adapter.pending()), adapter.pending()
    assert adapter.KIMI_ROCM_MODULE not in sys.modules and adapter.KIMI_NVIDIA_MODULE not in sys.modules
    assert "vllm.third_party.flash_linear_attention.ops.utils" not in sys.modules
    import torch

    assert not torch.cuda.is_initialized()
    import vllm.models.kimi_k3.amd.kda_metadata as kimi

    assert issubclass(kimi.KimiK3ROCmKDABackend.get_builder_cls(), adapter.ChunkmetaBuilderMixin)
    assert adapter.KIMI_ROCM_MODULE not in adapter.pending()
    import vllm.models.kimi_k3.nvidia.kda_metadata as kimi_nvidia

    assert issubclass(kimi_nvidia.KimiK3KDAAttentionBackend.get_builder_cls(), adapter.GdnFamilyMixin)
    assert adapter.KIMI_NVIDIA_MODULE not in adapter.pending()
    print("ok")
""")


def test_plugin_in_a_fresh_process_never_probes_the_gpu():
    """As in a vLLM process that starts workers afterwards (API server, engine core): the plugin
    patches the GDN backend without importing the Kimi-K3 ROCm module or vLLM's FLA utils (which
    query the GPU at import); the Kimi-K3 backend is wired when vLLM imports its module."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", CHUNKMETA_VLLM="1")
    env.pop("VLLM_PLUGINS", None)
    run = subprocess.run([sys.executable, "-c", FRESH_PROCESS], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout.strip().endswith("ok")


def vllm_plugin_imports(opted_in):
    from engine_imports import plugin_imports

    return plugin_imports(
        package="vllm",
        loader_module="vllm.plugins",
        load="vllm.plugins.load_general_plugins()",
        env_var=adapter.ENV_VAR,
        opted_in=opted_in,
        env={"VLLM_TARGET_DEVICE": "cpu", "VLLM_PLUGINS": "chunkmeta"},
        after_load="""
            import torch
            from chunkmeta.integrations import vllm as adapter

            extra = {"pending": list(adapter.pending()), "cuda": torch.cuda.is_initialized()}
            # what vLLM's attention-group setup imports
            from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend
            from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionBackend

            extra["wired"] = [
                issubclass(b.get_builder_cls(), adapter.ChunkmetaBuilderMixin)
                for b in (GDNAttentionBackend, Mamba2AttentionBackend)
            ]
        """,
    )


def test_plugin_imports_no_vllm_module_in_a_fresh_process():
    """vLLM calls its plugins in the API server, the engine core and every worker: with
    CHUNKMETA_VLLM=1 the plugin adds no vLLM module to what load_general_plugins() imports by
    itself (the backends are patched when vLLM imports their modules), and still wires them."""
    baseline, off = vllm_plugin_imports(opted_in=False)
    new, on = vllm_plugin_imports(opted_in=True)
    assert sorted(set(new) - set(baseline)) == [], f"{len(set(new) - set(baseline))} vLLM modules imported"
    assert off == {"pending": [], "cuda": False, "wired": [False, False]}
    assert on["wired"] == [True, True] and adapter.KIMI_NVIDIA_MODULE in on["pending"] and not on["cuda"], on
