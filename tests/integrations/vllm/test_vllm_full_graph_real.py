"""``CHUNKMETA_VLLM_FULL_GRAPH``: vLLM 0.33.0's GDN builder and Kimi-Linear layer made ready for
mixed steps in FULL CUDA graphs, against the real vLLM on CPU (`make test-vllm`).

The builder: ``ALWAYS`` support, one bucket per captured batch shape, every step of that shape
staged into the same tensors (shapes and addresses independent of the batch), values equal to
the stock builder's on the same padded batches (vLLM's FULL padding: trailing zero-length
requests on the null block, ``num_actual_tokens`` the bucket); steps of no bucket's shape and
failures keep vLLM's path, with one warning. The layer: ``_forward`` takes the graph-safe path
for a bucket's steps, vLLM's own otherwise. The forward's arithmetic against vLLM's eager path:
``test_vllm_full_graph_smoke.py``.
"""

import importlib
import importlib.util
import logging
import os
import types

import numpy as np
import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test-vllm installs it)", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM picks its platform

import vllm_real_batches
from chunkmeta import reference
from chunkmeta.errors import ChunkMetaError
from chunkmeta.integrations import vllm as adapter
from chunkmeta.integrations.vllm import breakable, full_graph, graph_dispatch, mixed_step

gdn_attn = pytest.importorskip("vllm.v1.attention.backends.gdn_attn")
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import MambaSpec

DEVICE = torch.device("cpu")
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS = 16, 8192
SPEC = MambaSpec(
    block_size=16,
    shapes=((4, 8), (2, 8, 8)),
    dtypes=(torch.bfloat16, torch.float32),
    mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
)
LAYERS = ["model.layers.0.linear_attn"]
BUCKET_TOKENS = 128  # a capture size above max_num_seqs: vLLM's key is (128, min(128, 16))


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    from vllm.config import VllmConfig

    def model(architecture):
        hf_config = vllm_real_batches.tiny_qwen3_next()
        hf_config.architectures = [architecture]  # what a checkpoint's config.json names
        return vllm_real_batches.model_config(hf_config, str(tmp_path_factory.mktemp(architecture)), seed=0)

    def config(model, **kwargs):
        scheduler = vllm_real_batches.scheduler_config(MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS)
        made = VllmConfig(model_config=model, scheduler_config=scheduler, **kwargs)
        made.compilation_config.cudagraph_mode = CUDAGraphMode.FULL  # the mode the opt-in is for
        return made

    qwen = model("Qwen3NextForCausalLM")
    return {
        False: config(qwen),
        True: config(qwen, speculative_config=vllm_real_batches.ngram_speculative(qwen)),
        "other": config(model("Qwen3NextModel")),  # a GDN-family model whose layers are not patched
    }


@pytest.fixture(autouse=True)
def clean_install():
    adapter.uninstall()
    yield
    adapter.uninstall()


@pytest.fixture
def full_cls(monkeypatch):
    """The chunkmeta GDN builder with the opt-in set, wired as the plugin wires it (the conv
    stand-in in ``gdn_attn``, the layer patches when their modules are imported)."""
    monkeypatch.setenv(full_graph.FULL_GRAPH_ENV, "1")
    adapter.install(adapter.load_vllm_api())
    return adapter.chunkmeta_builder_class(gdn_attn.GDNAttentionMetadataBuilder, reuse_block_table=True)


def padded_metadata(query_lens, context_lens, num_reqs_padded, num_tokens_padded):
    return vllm_real_batches.full_padded_metadata(query_lens, context_lens, num_reqs_padded, num_tokens_padded, DEVICE)


def capture_metadata(tokens, reqs, uniform=False):
    return vllm_real_batches.capture_metadata(tokens, reqs, DEVICE, uniform)


def test_off_by_default(configs, monkeypatch):
    monkeypatch.delenv(full_graph.FULL_GRAPH_ENV, raising=False)
    cls = adapter.chunkmeta_builder_class(gdn_attn.GDNAttentionMetadataBuilder, reuse_block_table=True)
    assert not issubclass(cls, full_graph.FullGraphBuilderMixin)
    assert cls.get_cudagraph_support(configs[False], SPEC) == AttentionCGSupport.UNIFORM_BATCH
    adapter.install(adapter.load_vllm_api())
    for name, layer, method in (
        (full_graph.KIMI_LAYER_MODULE, full_graph.KIMI_LAYER, "_forward"),
        (full_graph.QWEN_LAYER_MODULE, full_graph.QWEN_LAYER, "_forward_core"),
        (graph_dispatch.V1_RUNNER_MODULE, graph_dispatch.RUNNER, "initialize_metadata_builders"),
        (graph_dispatch.MRV2_RUNNER_MODULE, graph_dispatch.RUNNER, "initialize_kv_cache"),
        (graph_dispatch.CAPTURE_MODULE, graph_dispatch.CAPTURE_MANAGER, "capture"),
    ):
        patched = getattr(importlib.import_module(name), layer).__dict__[method]
        assert "chunkmeta" not in getattr(patched, "__wrapped__", patched).__qualname__


def test_support_is_always_for_patched_layers_only(configs, full_cls, caplog):
    assert issubclass(full_cls, full_graph.FullGraphBuilderMixin)
    assert full_cls.get_cudagraph_support(configs[False], SPEC) == AttentionCGSupport.ALWAYS
    # spec decode's multi-query path is not in the graph-safe forward; a model whose layers are
    # not patched would have its host branches frozen by a capture: vLLM's own level for both
    for other in (True, "other"):
        assert full_cls.get_cudagraph_support(configs[other], SPEC) == AttentionCGSupport.UNIFORM_BATCH
        with caplog.at_level(logging.WARNING, logger="vllm.chunkmeta"):
            builder = full_cls(SPEC, LAYERS, configs[other], DEVICE)
        assert any("mixed steps stay on vLLM's path" in r.getMessage() for r in caplog.records)
        if other == "other":  # (spec decode: vLLM's own capture builder asserts decode sizes)
            capture = builder.build_for_cudagraph_capture(capture_metadata(MAX_NUM_SEQS, MAX_NUM_SEQS))
            assert not hasattr(capture, "chunkmeta_mixed") and builder.chunkmeta_buckets == {}


def test_decode_routines_keep_vllms_capture_and_kernels(configs, full_cls, monkeypatch):
    """Under FULL_AND_PIECEWISE (vLLM's default) the decode routine's FULL captures and its
    decode-only batches are vLLM's (its decode kernels), mixed captures (the keys
    ``add_mixed_full_keys`` adds) and batches with a prefill a bucket's."""
    monkeypatch.setattr(configs[False].compilation_config, "cudagraph_mode", CUDAGraphMode.FULL_AND_PIECEWISE)
    builder = full_cls(SPEC, LAYERS, configs[False], DEVICE)
    decode = builder.build_for_cudagraph_capture(capture_metadata(MAX_NUM_SEQS, MAX_NUM_SEQS, uniform=True))
    assert not hasattr(decode, "chunkmeta_mixed") and builder.chunkmeta_buckets == {}
    # a mixed capture of the same shape (one-token requests, as vLLM spreads a small size) is a bucket
    bucket = builder.build_for_cudagraph_capture(capture_metadata(MAX_NUM_SEQS, MAX_NUM_SEQS)).chunkmeta_mixed
    assert builder.chunkmeta_buckets == {(MAX_NUM_SEQS, MAX_NUM_SEQS): bucket}
    steps = builder.chunkmeta_mixed_steps
    decodes = builder.build(0, padded_metadata([1] * 5, [40, 41, 42, 43, 44], MAX_NUM_SEQS, MAX_NUM_SEQS))
    want = gdn_attn.GDNAttentionMetadataBuilder(SPEC, LAYERS, configs[False], DEVICE).build(
        0, padded_metadata([1] * 5, [40, 41, 42, 43, 44], MAX_NUM_SEQS, MAX_NUM_SEQS)
    )
    assert not hasattr(decodes, "chunkmeta_mixed") and builder.chunkmeta_mixed_steps == steps
    assert torch.equal(decodes.non_spec_state_indices_tensor, want.non_spec_state_indices_tensor)
    mixed = builder.build(0, padded_metadata([1, 1, 7], [40, 41, 0], MAX_NUM_SEQS, MAX_NUM_SEQS))
    assert mixed.chunkmeta_mixed is bucket and builder.chunkmeta_mixed_steps == steps + 1


@pytest.fixture
def piecewise_config(configs):
    """configs[False] as vLLM's default mode needs it: FULL_AND_PIECEWISE, attention split out of
    the compiled graph, capture sizes on both sides of max_num_seqs (16)."""
    from vllm.config.compilation import CompilationMode

    cc = configs[False].compilation_config
    saved = (cc.cudagraph_mode, cc.mode, cc.splitting_ops, cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size)
    cc.cudagraph_mode, cc.mode, cc.splitting_ops = (
        CUDAGraphMode.FULL_AND_PIECEWISE,
        CompilationMode.VLLM_COMPILE,
        list(cc._attention_ops),
    )
    cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = [1, 2, 4, 8, 16, 32, 64, 128], 128
    yield configs[False]
    cc.cudagraph_mode, cc.mode, cc.splitting_ops, cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = saved


def test_which_models_are_graph_safe(configs, monkeypatch):
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn

    def config(architecture):
        return types.SimpleNamespace(model_config=types.SimpleNamespace(architectures=[architecture]))

    assert full_graph.graph_unsafe(config("KimiLinearForCausalLM")) is None
    assert "no graph-safe layer" in full_graph.graph_unsafe(config("KimiK3ForCausalLM"))
    assert full_graph.graph_unsafe(configs[False]) is None  # Qwen3-Next, FLA-triton on this platform
    monkeypatch.setattr(qwen_gdn_linear_attn, "_resolve_gdn_prefill_backend", lambda c: ("auto", "flashinfer"))
    assert "'flashinfer'" in full_graph.graph_unsafe(configs[False])
    # ROCm with AITER: the layer's forward_hip never reaches the patched _forward_core
    monkeypatch.setattr(qwen_gdn_linear_attn, "GDN_AITER_TRITON_AVAILABLE", True)
    assert "AITER" in full_graph.graph_unsafe(configs[False])


def test_capture_sizes_over_the_decode_limit_are_accepted(configs, full_cls):
    stock = gdn_attn.GDNAttentionMetadataBuilder(SPEC, LAYERS, configs[False], DEVICE)
    with pytest.raises(AssertionError, match="decode-only full CUDAGraph"):
        stock.build_for_cudagraph_capture(capture_metadata(BUCKET_TOKENS, MAX_NUM_SEQS))
    builder = full_cls(SPEC, LAYERS, configs[False], DEVICE)
    metadata = builder.build_for_cudagraph_capture(capture_metadata(BUCKET_TOKENS, MAX_NUM_SEQS))
    bucket = metadata.chunkmeta_mixed
    assert isinstance(bucket, mixed_step.MixedStepInputs)
    assert (bucket.num_tokens, bucket.num_reqs) == (BUCKET_TOKENS, MAX_NUM_SEQS)
    assert builder.chunkmeta_stats()["mixed_buckets"] == [(BUCKET_TOKENS, MAX_NUM_SEQS)]


def _snapshot(bucket):
    tensors = {
        "cu_seqlens": bucket.cu_seqlens,
        "chunk_indices": bucket.chunk_indices,
        "chunk_offsets": bucket.chunk_offsets,
        "state_indices": bucket.state_indices,
        "has_initial_state": bucket.has_initial_state,
        "batch_ptr": bucket.conv.batch_ptr,
        "token_chunk_offset_ptr": bucket.conv.token_chunk_offset_ptr,
    }
    return {name: (t.shape, t.dtype, t.data_ptr()) for name, t in tensors.items()}, bucket.conv.nums_dict[8]["tot"]


def test_steps_of_a_bucket_stage_fixed_tensors_with_the_stock_values(configs, full_cls):
    from vllm.third_party.flash_linear_attention.ops.index import prepare_chunk_indices, prepare_chunk_offsets

    builder = full_cls(SPEC, LAYERS, configs[False], DEVICE)
    stock = gdn_attn.GDNAttentionMetadataBuilder(SPEC, LAYERS, configs[False], DEVICE)
    bucket = builder.build_for_cudagraph_capture(capture_metadata(BUCKET_TOKENS, MAX_NUM_SEQS)).chunkmeta_mixed
    shapes = _snapshot(bucket)
    rng = np.random.default_rng(7)
    prefill_steps = 0
    for _ in range(40):
        query, context = vllm_real_batches.random_mixed(rng, MAX_NUM_SEQS, BUCKET_TOKENS)
        m = padded_metadata(query, context, MAX_NUM_SEQS, BUCKET_TOKENS)
        got = builder.build(0, m)
        want = stock.build(0, padded_metadata(query, context, MAX_NUM_SEQS, BUCKET_TOKENS))
        assert got.chunkmeta_mixed is bucket
        assert _snapshot(bucket) == shapes  # what a captured graph reads: never moved, never resized
        # the bucket's fill is the step's one: no eager tables (vLLM's host ones skipped too)
        assert got.chunk_indices is None and got.batch_ptr is None
        n = MAX_NUM_SEQS
        qsl = m.query_start_loc_cpu
        assert torch.equal(bucket.cu_seqlens, qsl)
        # FLA's tables over every row, as vLLM's vendored helpers derive them, then tail rows
        indices, offsets = prepare_chunk_indices(qsl, 64), prepare_chunk_offsets(qsl, 64)
        rows = indices.shape[0]
        assert torch.equal(bucket.chunk_indices[:rows], indices)
        assert (bucket.chunk_indices[rows:] == torch.tensor([n, 0], dtype=torch.int32)).all()
        assert torch.equal(bucket.chunk_offsets[: n + 1], offsets)
        ref = reference.chunk_metadata(qsl.tolist(), 64)
        assert [tuple(r) for r in bucket.chunk_indices[:rows].tolist()] == [tuple(r) for r in ref.chunk_indices]
        # the stock builder's state indices (padded rows: the null block) and initial-state flags
        assert torch.equal(bucket.state_indices, want.non_spec_state_indices_tensor)
        assert not bucket.has_initial_state[len(query) :].any()
        if want.num_prefills > 0:
            prefill_steps += 1
            assert torch.equal(bucket.has_initial_state, want.has_initial_state)
            tot = want.nums_dict[8]["tot"]
            assert torch.equal(bucket.conv.batch_ptr[:tot], want.batch_ptr[:tot])
            assert torch.equal(bucket.conv.token_chunk_offset_ptr[:tot], want.token_chunk_offset_ptr[:tot])
            assert (bucket.conv.batch_ptr[tot:] == -1).all()
    assert prefill_steps > 30
    assert builder.chunkmeta_stats()["mixed_fallbacks"] == {}


def test_decode_only_steps_of_a_bucket_are_staged_too(configs, full_cls):
    builder = full_cls(SPEC, LAYERS, configs[False], DEVICE)
    bucket = builder.build_for_cudagraph_capture(capture_metadata(BUCKET_TOKENS, MAX_NUM_SEQS)).chunkmeta_mixed
    m = padded_metadata([1] * 5, [40, 41, 42, 43, 44], MAX_NUM_SEQS, BUCKET_TOKENS)
    got = builder.build(0, m)
    assert got.chunkmeta_mixed is bucket and got.num_prefills == 0  # vLLM's metadata is its own
    assert bucket.has_initial_state.tolist() == [True] * 5 + [False] * (MAX_NUM_SEQS - 5)
    assert bucket.chunk_indices[:5].tolist() == [[i, 0] for i in range(5)]


def test_steps_of_no_bucket_keep_vllms_path(configs, full_cls):
    builder = full_cls(SPEC, LAYERS, configs[False], DEVICE)
    plain = builder.build(0, vllm_real_batches.common_metadata([1, 70], [9, 0], DEVICE))
    assert not hasattr(plain, "chunkmeta_mixed")  # nothing captured yet
    builder.build_for_cudagraph_capture(capture_metadata(BUCKET_TOKENS, MAX_NUM_SEQS))
    over = padded_metadata([1, 300], [9, 0], MAX_NUM_SEQS, 512)  # over the bucket: eager, vLLM's
    assert not hasattr(builder.build(0, over), "chunkmeta_mixed")
    eager = vllm_real_batches.common_metadata([1, 70], [9, 0], DEVICE)  # an unpadded step
    assert not hasattr(builder.build(0, eager), "chunkmeta_mixed")


def test_a_failed_stage_keeps_vllms_path_with_one_warning(configs, full_cls, monkeypatch, caplog):
    builder = full_cls(SPEC, LAYERS, configs[False], DEVICE)
    builder.build_for_cudagraph_capture(capture_metadata(BUCKET_TOKENS, MAX_NUM_SEQS))

    def refuse(self, *args, **kwargs):
        raise ChunkMetaError("refused for the test")

    monkeypatch.setattr(mixed_step.MixedStepInputs, "stage", refuse)
    with caplog.at_level(logging.WARNING, logger="vllm.chunkmeta"):
        for _ in range(3):
            m = padded_metadata([1, 70], [9, 0], MAX_NUM_SEQS, BUCKET_TOKENS)
            got = builder.build(0, m)
            assert not hasattr(got, "chunkmeta_mixed") and got.num_prefills == 1
            # vLLM's eager path gets its tables after all: chunkmeta's eager build, as off a bucket
            want = gdn_attn.GDNAttentionMetadataBuilder(SPEC, LAYERS, configs[False], DEVICE).build(0, m)
            assert torch.equal(got.chunk_indices, want.chunk_indices) and got.nums_dict[8]["tot"] > 0
    warnings = [r for r in caplog.records if "mixed step stays on vLLM's path" in r.getMessage()]
    assert len(warnings) == 1 and full_graph.FULL_GRAPH_ENV in warnings[0].getMessage()
    assert list(builder.chunkmeta_stats()["mixed_fallbacks"].values()) == [3]


def test_a_bucket_refuses_batches_over_it():
    bucket = mixed_step.MixedStepInputs(64, 4, DEVICE)
    before = bucket.state_indices.clone()
    for qsl in ([0, 10, 20, 30, 40, 50], [0, 30, 65]):
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        n = len(qsl) - 1
        with pytest.raises(ChunkMetaError, match="over this mixed-step bucket"):
            bucket.stage(qsl_t, qsl_t, torch.ones(n, dtype=torch.int32), torch.ones(n, dtype=torch.int32))
    assert torch.equal(bucket.state_indices, before) and bucket.staged is None


def _stand_in_layer(tokens, heads=2, head_dim=8):
    projection = heads * head_dim
    return types.SimpleNamespace(
        prefix="model.layers.0.linear_attn",
        kv_cache=(torch.zeros(5, 3 * projection, 3), torch.zeros(5, heads, head_dim, head_dim)),
        conv1d=types.SimpleNamespace(weight=torch.randn(3 * projection, 1, 4)),
        local_projection_size=projection,
        A_log=torch.zeros(heads),
        dt_bias=torch.zeros(projection),
        gate_lower_bound=None,
        head_dim=head_dim,
        o_norm=lambda x, g: x * 2,
    )


def _record(monkeypatch, forward: str, heads_dim: tuple) -> list:
    """``full_graph.<forward>`` replaced by a recorder of its calls that returns ones
    ``[1, tokens, *heads_dim]``."""
    calls = []

    def recorded(ops, inputs, **kwargs):
        calls.append((inputs, kwargs))
        return torch.ones(1, kwargs["mixed_qkv"].shape[0], *heads_dim)

    monkeypatch.setattr(full_graph, forward, recorded)
    return calls


def test_kimi_layer_takes_the_graph_safe_path_for_a_bucket_only(configs, full_cls, monkeypatch):
    from vllm.forward_context import override_forward_context

    module = importlib.import_module(full_graph.KIMI_LAYER_MODULE)  # wired by full_cls's install()
    layer_cls = getattr(module, full_graph.KIMI_LAYER)
    forward = layer_cls.__dict__["_forward"]
    assert forward.__qualname__ == f"chunkmeta.{full_graph.KIMI_LAYER}._forward"  # not decorated: breakable.py
    calls = _record(monkeypatch, "kda_mixed_forward", (2, 8))
    builder = full_cls(SPEC, LAYERS, configs[False], DEVICE)
    bucket = builder.build_for_cudagraph_capture(capture_metadata(BUCKET_TOKENS, MAX_NUM_SEQS)).chunkmeta_mixed
    layer = _stand_in_layer(BUCKET_TOKENS)
    args = dict(
        mixed_qkv=torch.randn(BUCKET_TOKENS, 48),
        g1=torch.randn(1, BUCKET_TOKENS, 2, 8),
        g2=torch.randn(BUCKET_TOKENS, 2, 8),
        beta=torch.randn(1, BUCKET_TOKENS, 2),
        core_attn_out=torch.zeros(1, BUCKET_TOKENS, 2, 8),
    )
    metadata = builder.build(0, padded_metadata([1, 70], [9, 0], MAX_NUM_SEQS, BUCKET_TOKENS))
    with override_forward_context(types.SimpleNamespace(attn_metadata={layer.prefix: metadata})):
        forward(layer, **args)
    ((inputs, kwargs),) = calls
    assert inputs is bucket and kwargs["mixed_qkv"].shape[0] == BUCKET_TOKENS and kwargs["lower_bound"] is None
    assert torch.equal(args["core_attn_out"], torch.full_like(args["core_attn_out"], 2.0))  # o_norm(out)
    # without a bucket on the metadata (here: no metadata for this layer) vLLM's own _forward runs
    with override_forward_context(types.SimpleNamespace(attn_metadata={})):
        assert forward(layer, **args) is None
    assert len(calls) == 1


def test_qwen_layer_takes_the_graph_safe_path_with_fla_triton_only(configs, full_cls, monkeypatch):
    from vllm.forward_context import override_forward_context

    module = importlib.import_module(full_graph.QWEN_LAYER_MODULE)  # wired by full_cls's install()
    forward_core = getattr(module, full_graph.QWEN_LAYER).__dict__["_forward_core"]
    assert forward_core.__qualname__ == f"chunkmeta.{full_graph.QWEN_LAYER}._forward_core"
    calls = _record(monkeypatch, "gdn_mixed_forward", (4, 8))
    builder = full_cls(SPEC, LAYERS, configs[False], DEVICE)
    bucket = builder.build_for_cudagraph_capture(capture_metadata(BUCKET_TOKENS, MAX_NUM_SEQS)).chunkmeta_mixed
    layer = types.SimpleNamespace(
        prefix="model.layers.0.linear_attn",
        kv_cache=(torch.zeros(5, 64, 3), torch.zeros(5, 4, 8, 8)),
        conv1d=types.SimpleNamespace(weight=torch.randn(64, 1, 4), bias=None),
        activation="silu",
        chunk_gated_delta_rule=types.SimpleNamespace(gdn_prefill_backend="triton"),
        A_log=torch.zeros(4),
        dt_bias=torch.zeros(4),
        num_k_heads=4,
        tp_size=2,
        head_k_dim=8,
        head_v_dim=8,
    )
    out = torch.zeros(BUCKET_TOKENS, 4, 8)
    args = (torch.randn(BUCKET_TOKENS, 64), torch.randn(BUCKET_TOKENS, 4), torch.randn(BUCKET_TOKENS, 4), out)
    metadata = builder.build(0, padded_metadata([1, 70], [9, 0], MAX_NUM_SEQS, BUCKET_TOKENS))
    with override_forward_context(types.SimpleNamespace(attn_metadata={layer.prefix: metadata})):
        forward_core(layer, *args)
        (inputs, kwargs) = calls[0]
        assert inputs is bucket and kwargs["num_k_heads"] == 2 and kwargs["mixed_qkv"].shape[0] == BUCKET_TOKENS
        assert torch.equal(out, torch.ones_like(out))
        # another prefill backend: vLLM's own _forward_core (here it stops at its first host
        # branch on these stand-ins), never the graph-safe path
        layer.chunk_gated_delta_rule.gdn_prefill_backend = "flashinfer"
        with pytest.raises(AttributeError):
            forward_core(layer, *args)
    assert len(calls) == 1


# -- the runner: FULL keys for mixed batches beside vLLM's decode graphs ---------------------------


def _start_runner(config, builders, monkeypatch=None, groups=None):
    """vLLM's runner start-up as far as the dispatcher's keys go, on what it reads of its runner:
    its real ``_check_and_update_cudagraph_mode`` (the mode, vLLM's keys), then its
    ``initialize_metadata_builders`` (patched by ``install()``) making one builder per attention
    group of ``builders``' classes (an instance, or a class made here)."""
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker import gpu_model_runner

    runner_cls = gpu_model_runner.GPUModelRunner
    groups = []
    for i, made in enumerate(builders):
        cls = made if isinstance(made, type) else type(made)
        group = types.SimpleNamespace(
            backend=type(f"Backend{i}", (), {"get_builder_cls": staticmethod(lambda c=cls: c)}),
            kv_cache_spec=SPEC,
            metadata_builders=[],
        )
        group.create_metadata_builders = lambda *a, g=group, m=made, **k: g.metadata_builders.append(
            m(SPEC, LAYERS, config, DEVICE) if isinstance(m, type) else m
        )
        groups.append(group)
    runner = types.SimpleNamespace(
        vllm_config=config,
        compilation_config=config.compilation_config,
        parallel_config=config.parallel_config,
        cudagraph_dispatcher=CudagraphDispatcher(config),
        uniform_decode_query_len=1,
        kv_cache_config=None,
        max_num_reqs=MAX_NUM_SEQS,
        speculative_config=None,
        attn_groups=[[g] for g in groups],
        calculate_reorder_batch_threshold=lambda: None,
        device=DEVICE,
    )
    runner_cls._check_and_update_cudagraph_mode(runner, [{g.backend} for g in groups], groups)
    runner_cls.initialize_metadata_builders(runner, types.SimpleNamespace(kv_cache_groups=groups), [None] * len(groups))
    return runner


def _keys(runner):
    return {
        (k.num_tokens, k.num_reqs, k.uniform) for k in runner.cudagraph_dispatcher.cudagraph_keys[CUDAGraphMode.FULL]
    }


def test_the_runner_adds_full_keys_for_mixed_batches_beside_vllms_decode_graphs(piecewise_config, full_cls):
    from vllm.v1.worker import gpu_model_runner

    patched = gpu_model_runner.GPUModelRunner.initialize_metadata_builders  # vLLM's, patched by install()
    assert patched.__qualname__.startswith("chunkmeta.")
    runner = _start_runner(piecewise_config, [full_cls])
    d = runner.cudagraph_dispatcher
    assert d.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE  # vLLM settled it; chunkmeta added keys
    # N = 1: a mixed batch of one token is a decode, vLLM's decode graph serves it
    mixed = {(s, min(s, MAX_NUM_SEQS), False) for s in (2, 4, 8, 16, 32, 64, 128)}
    assert mixed <= _keys(runner)
    assert {(s, s, True) for s in (1, 2, 4, 8, 16)} <= _keys(runner)  # vLLM's decode keys, kept
    # every mixed key's bucket made before its key: no mixed capture reaches vLLM's decode capture
    (builder,) = runner.attn_groups[0][0].metadata_builders
    assert set(builder.chunkmeta_buckets) == {(t, r) for t, r, _ in mixed}
    mode, key = d.dispatch(num_tokens=20, uniform_decode=False)  # a mixed batch: a bucket's graph
    assert (mode, key.num_tokens, key.num_reqs, key.uniform) == (CUDAGraphMode.FULL, 32, MAX_NUM_SEQS, False)
    mode, key = d.dispatch(num_tokens=5, uniform_decode=True)  # decodes: vLLM's decode graph
    assert (mode, key.num_tokens, key.num_reqs, key.uniform) == (CUDAGraphMode.FULL, 8, 8, True)


def test_no_mixed_keys_where_a_mixed_batch_could_miss_its_graph(configs, piecewise_config, full_cls, monkeypatch):
    decode_only = {(s, s, True) for s in (1, 2, 4, 8, 16)}
    stock = gdn_attn.GDNAttentionMetadataBuilder  # UNIFORM_BATCH: an MLA backend like FlashMLA, say
    for builders in ([full_cls, stock], [stock]):
        assert _keys(_start_runner(piecewise_config, builders)) == decode_only
    # a chunkmeta builder that serves no mixed step (its step builder failed): its captures would
    # be vLLM's decode-only ones
    inactive = full_cls(SPEC, LAYERS, piecewise_config, DEVICE)
    inactive.chunkmeta = None
    assert _keys(_start_runner(piecewise_config, [inactive])) == decode_only
    # data parallel ranks (a decode rank padded to a mixed rank's size finds no FULL key) and
    # micro-batching (ubatched graphs keyed by token count alone)
    for name, value in (("data_parallel_size", 2), ("enable_dbo", True)):
        with monkeypatch.context() as m:
            m.setattr(piecewise_config.parallel_config, name, value)
            assert _keys(_start_runner(piecewise_config, [full_cls])) == decode_only
    # speculative decoding: no graph-safe forward
    runner = _start_runner(piecewise_config, [stock])
    groups = [g for gs in runner.attn_groups for g in gs]
    assert graph_dispatch.add_mixed_full_keys(runner.cudagraph_dispatcher, configs[True], groups, pytest.fail) == set()


def test_a_bucket_it_cannot_make_leaves_out_its_key_with_one_warning(piecewise_config, full_cls, monkeypatch, caplog):
    decode_only = {(s, s, True) for s in (1, 2, 4, 8, 16)}
    mixed = {(s, min(s, MAX_NUM_SEQS), False) for s in (2, 4, 8, 16, 32, 128)}  # not 64's

    def refuse(self, num_tokens, num_reqs):  # a bucket it cannot make, midway through the keys
        if num_tokens == 64:
            raise ChunkMetaError("no bucket for the test")
        return original(self, num_tokens, num_reqs)

    original = full_graph.FullGraphBuilderMixin.chunkmeta_bucket
    monkeypatch.setattr(full_graph.FullGraphBuilderMixin, "chunkmeta_bucket", refuse)
    with caplog.at_level(logging.WARNING, logger="vllm.chunkmeta"):
        runner = _start_runner(piecewise_config, [full_cls])
    # that size's mixed batches piecewise, the other sizes' in their graphs
    assert _keys(runner) == decode_only | mixed
    warnings = [r for r in caplog.records if "no bucket for the test" in r.getMessage()]
    assert len(warnings) == 1 and "stays off the mixed-step graphs" in warnings[0].getMessage()


# -- Model Runner V2 (vLLM 0.33.0's default): request buckets, the dispatch decision -------------


@pytest.fixture
def make_manager(monkeypatch):
    """MRV2's real ``CudaGraphManager`` (its real candidate lists) for a config and mode, on what
    it reads of a distributed setup and a CUDA graph pool, which this CPU machine lacks."""
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu import cudagraph_utils

    ranks = types.SimpleNamespace(is_first_rank=True, is_last_rank=True)
    monkeypatch.setattr(cudagraph_utils, "get_pp_group", lambda: ranks)
    monkeypatch.setattr(type(current_platform), "get_global_graph_pool", lambda self: None)

    def make(config, mode=CUDAGraphMode.FULL_AND_PIECEWISE):
        manager = cudagraph_utils.CudaGraphManager(config, DEVICE, mode, decode_query_len=1)
        manager._graphs_captured = True  # dispatch answers only after capture
        return manager

    return make


@pytest.fixture
def mrv2_manager(piecewise_config, make_manager):
    return make_manager(piecewise_config)


def _mrv2_dispatch(manager, num_reqs, num_tokens, *, decode=False, prefill=True):
    """MRV2's dispatch of a batch as ``execute_model`` asks (model_runner.py:1799-1848)."""
    desc = manager.dispatch(
        num_reqs, num_tokens, 1 if decode else None, 0, max_query_len=None if prefill else num_tokens // num_reqs
    )
    return desc.cg_mode, desc.num_tokens, desc.num_reqs


def _mrv2_wired(config, manager, builders):
    record = graph_dispatch.MixedDispatch(builders)
    record.added = graph_dispatch.add_mixed_full_descs(manager, config, builders, record._turn_away)
    graph_dispatch.mrv2_dispatch(manager, record)
    return record.added, record


def test_mrv2_mixed_batches_replay_the_graph_of_their_request_bucket(piecewise_config, full_cls, mrv2_manager):
    builder = full_cls(SPEC, LAYERS, piecewise_config, DEVICE)
    added, record = _mrv2_wired(piecewise_config, mrv2_manager, [builder])
    shapes = {(n, r) for n in (2, 4, 8, 16, 32, 64, 128) for r in graph_dispatch.request_buckets(n, MAX_NUM_SEQS)}
    assert graph_dispatch.request_buckets(128, MAX_NUM_SEQS) == [8, 16]  # vLLM's key is (128, 16)
    assert added == shapes == set(builder.chunkmeta_buckets)  # every bucket made up front
    full = CUDAGraphMode.FULL
    # a mixed batch: the smallest request bucket that holds it, not vLLM's min(N, max_num_seqs)
    assert _mrv2_dispatch(mrv2_manager, 3, 20) == (full, 32, 8) and record.current == (32, 8)
    assert _mrv2_dispatch(mrv2_manager, 12, 20) == (full, 32, 16) and record.current == (32, 16)
    # decodes keep vLLM's decode graph; a one-token batch holding a fresh prompt (which no decode
    # graph takes: model_runner.py:1356-1368) the smallest mixed one; over every capture size, eager
    assert _mrv2_dispatch(mrv2_manager, 5, 5, decode=True, prefill=False) == (full, 8, 8)
    assert record.current is None
    assert _mrv2_dispatch(mrv2_manager, 1, 1) == (full, 2, 2) and record.current == (2, 2)
    assert _mrv2_dispatch(mrv2_manager, 3, 200)[0] == CUDAGraphMode.NONE
    # every added graph is captured, after vLLM's decode graphs of its size in the candidates
    captured = {(d.num_tokens, d.num_reqs) for d in mrv2_manager._capture_descs[full] if d.uniform_token_count is None}
    assert captured == shapes
    # captured largest first, the mixed graphs of a size before vLLM's decode one and most requests
    # first: vLLM's memory profile samples the first two FULL graphs (the heaviest)
    order = [(d.num_tokens, d.num_reqs, d.uniform_token_count is None) for d in mrv2_manager._capture_descs[full]]
    assert order[:2] == [(128, 16, True), (128, 8, True)]
    assert order == sorted(order, key=lambda o: (o[0], o[2], o[1]), reverse=True)


def test_mrv2_a_bucket_it_cannot_make_leaves_out_its_descriptor(piecewise_config, full_cls, mrv2_manager, monkeypatch):
    original = full_graph.FullGraphBuilderMixin.chunkmeta_bucket

    def refuse(self, num_tokens, num_reqs):  # e.g. over a memory budget
        if (num_tokens, num_reqs) == (32, 16):
            raise ChunkMetaError("no bucket for the test")
        return original(self, num_tokens, num_reqs)

    monkeypatch.setattr(full_graph.FullGraphBuilderMixin, "chunkmeta_bucket", refuse)
    builder = full_cls(SPEC, LAYERS, piecewise_config, DEVICE)
    added, record = _mrv2_wired(piecewise_config, mrv2_manager, [builder])
    assert (32, 8) in added and (32, 16) not in added and (64, 16) in added
    # 12 requests at 20 tokens: no 32-token graph holds them, the next size's does
    assert _mrv2_dispatch(mrv2_manager, 3, 20) == (CUDAGraphMode.FULL, 32, 8)
    assert _mrv2_dispatch(mrv2_manager, 12, 20)[:2] != (CUDAGraphMode.FULL, 32)


def test_mrv2_a_step_is_staged_exactly_when_dispatched_to_a_mixed_graph(piecewise_config, full_cls, mrv2_manager):
    builder = full_cls(SPEC, LAYERS, piecewise_config, DEVICE)
    _, record = _mrv2_wired(piecewise_config, mrv2_manager, [builder])
    bucket = builder.chunkmeta_buckets[32, 8]
    steps = builder.chunkmeta_mixed_steps
    _mrv2_dispatch(mrv2_manager, 3, 20)
    staged = builder.build(0, padded_metadata([1, 7, 12], [40, 0, 0], 8, 32))
    assert staged.chunkmeta_mixed is bucket and builder.chunkmeta_mixed_steps == steps + 1
    assert staged.chunk_indices is None  # the bucket's fill was the step's one launch
    # the same shape dispatched elsewhere (an eager batch, say): chunkmeta's eager tables
    _mrv2_dispatch(mrv2_manager, 40, 200)
    eager = builder.build(0, padded_metadata([1, 7, 12], [40, 0, 0], 8, 32))
    assert not hasattr(eager, "chunkmeta_mixed") and eager.chunk_indices is not None
    assert builder.chunkmeta_mixed_steps == steps + 1


def test_mrv2_a_step_that_cannot_be_staged_takes_vllms_path(piecewise_config, full_cls, mrv2_manager, caplog):
    """Fail closed, decided at dispatch: a builder that cannot stage the step (here: off) sends
    every step to vLLM's piecewise graph, one warning, counted; nothing is staged, so no bucket
    (and no state a replay would write) changes."""
    builder = full_cls(SPEC, LAYERS, piecewise_config, DEVICE)
    _, record = _mrv2_wired(piecewise_config, mrv2_manager, [builder])
    bucket = builder.chunkmeta_buckets[32, 8]
    before = _snapshot(bucket), bucket.state_indices.clone(), bucket.staged
    builder._chunkmeta_unsafe = "refused for the test"
    with caplog.at_level(logging.WARNING, logger="vllm.chunkmeta"):
        for _ in range(3):
            assert _mrv2_dispatch(mrv2_manager, 3, 20) == (CUDAGraphMode.PIECEWISE, 32, None)
            got = builder.build(0, vllm_real_batches.common_metadata([1, 7, 12], [40, 0, 0], DEVICE))
            assert not hasattr(got, "chunkmeta_mixed")
    assert (_snapshot(bucket), bucket.staged) == (before[0], before[2]) and torch.equal(bucket.state_indices, before[1])
    assert sum(record.turned_away.values()) == 3
    assert len([r for r in caplog.records if "stays off the mixed-step graphs" in r.getMessage()]) == 1
    # a graph whose capture took vLLM's path (no bucket) is turned away the same way
    builder._chunkmeta_unsafe = None
    record.refuse((32, 16))
    assert _mrv2_dispatch(mrv2_manager, 12, 20) == (CUDAGraphMode.PIECEWISE, 32, None)
    assert _mrv2_dispatch(mrv2_manager, 3, 20) == (CUDAGraphMode.FULL, 32, 8)


def test_mrv2_a_stage_that_fails_after_dispatch_raises(piecewise_config, full_cls, mrv2_manager, monkeypatch):
    """The last line: a step vLLM will replay in a mixed graph that cannot be staged after all
    stops the step (the graph would replay another step's inputs), where no runner hook decides
    it falls back to chunkmeta's eager tables (test_a_failed_stage_keeps_vllms_path_with_one_warning)."""
    builder = full_cls(SPEC, LAYERS, piecewise_config, DEVICE)
    _mrv2_wired(piecewise_config, mrv2_manager, [builder])

    def refuse(self, *args, **kwargs):
        raise ChunkMetaError("refused for the test")

    monkeypatch.setattr(mixed_step.MixedStepInputs, "stage", refuse)
    _mrv2_dispatch(mrv2_manager, 3, 20)
    with pytest.raises(ChunkMetaError, match="refused for the test"):
        builder.build(0, padded_metadata([1, 7, 12], [40, 0, 0], 8, 32))


def test_mrv2_other_groups_get_the_bucket_with_their_own_state_indices(piecewise_config, full_cls, mrv2_manager):
    """MRV2 builds one GDN group's metadata and hands it to the others through
    ``update_block_table`` (attn_utils.py:552-560), whose ``dataclasses.replace`` would drop the
    bucket: each group gets a view with the batch's tables and its own state indices."""
    first, second = (full_cls(SPEC, LAYERS, piecewise_config, DEVICE) for _ in range(2))
    _mrv2_wired(piecewise_config, mrv2_manager, [first, second])
    _mrv2_dispatch(mrv2_manager, 3, 20)
    m = padded_metadata([1, 7, 12], [40, 0, 0], 8, 32)
    staged = first.build(0, m)
    bucket = staged.chunkmeta_mixed
    theirs = torch.zeros_like(m.block_table_tensor)
    theirs[:3, 0] = torch.tensor([31, 32, 33])  # the second group's blocks; padded rows: the null block
    # prefix caching's align mode (vLLM's default) reads the group's aligned indices, set per step
    # by the runner (mamba_hybrid.py:304-318), instead of the block table
    second.mamba_aligned_state_indices = theirs
    views = []
    for _ in range(2):
        out = second.update_block_table(staged, theirs, m.slot_mapping)
        views.append(out.chunkmeta_mixed)
        assert out.chunkmeta_mixed.state_indices.tolist() == [31, 32, 33] + [0] * 5
        assert out.chunkmeta_mixed.cu_seqlens is bucket.cu_seqlens and out.chunkmeta_mixed.conv is bucket.conv
    assert views[0] is views[1]  # one view per bucket: fixed addresses for the graph
    assert bucket.state_indices.tolist() == staged.non_spec_state_indices_tensor.tolist()  # the first group's
    unstaged = first.build(0, vllm_real_batches.common_metadata([1, 7], [40, 0], DEVICE))
    assert not hasattr(second.update_block_table(unstaged, theirs[:2], m.slot_mapping[:8]), "chunkmeta_mixed")


def test_v1_a_mixed_key_that_cannot_be_staged_takes_vllms_piecewise_graph(piecewise_config, full_cls):
    runner = _start_runner(piecewise_config, [full_cls])
    d = runner.cudagraph_dispatcher
    (builder,) = runner.attn_groups[0][0].metadata_builders
    record = builder._chunkmeta_dispatch
    mode, key = d.dispatch(num_tokens=20, uniform_decode=False)
    assert (mode, key.num_tokens, key.num_reqs) == (CUDAGraphMode.FULL, 32, MAX_NUM_SEQS)
    assert record.current == (32, MAX_NUM_SEQS)
    record.refuse((32, MAX_NUM_SEQS))
    mode, key = d.dispatch(num_tokens=20, uniform_decode=False)
    assert mode == CUDAGraphMode.PIECEWISE and record.current is None
    mode, key = d.dispatch(num_tokens=5, uniform_decode=True)  # decodes: vLLM's decode graph, undecided
    assert (mode, key.uniform) == (CUDAGraphMode.FULL, True) and record.current is None


def test_mrv2_decode_batches_keep_vllms_path_where_it_has_no_decode_graph(
    piecewise_config, full_cls, make_manager, monkeypatch
):
    """Capture sizes that skip max_num_seqs (16 here): vLLM has no decode graph of 24 tokens
    (cudagraph_utils.py:325-331), so a 10-request decode batch is piecewise, not a mixed graph."""
    monkeypatch.setattr(piecewise_config.compilation_config, "cudagraph_capture_sizes", [1, 2, 4, 8, 24, 32])
    manager = make_manager(piecewise_config)
    builder = full_cls(SPEC, LAYERS, piecewise_config, DEVICE)
    _, record = _mrv2_wired(piecewise_config, manager, [builder])
    assert _mrv2_dispatch(manager, 10, 10, decode=True, prefill=False) == (CUDAGraphMode.PIECEWISE, 24, None)
    assert record.current is None and record.turned_away == {}  # vLLM's choice, nothing to warn about
    assert _mrv2_dispatch(manager, 10, 20) == (CUDAGraphMode.FULL, 24, 16)  # a mixed one still replays


def test_a_capture_that_cannot_be_staged_is_never_replayed(piecewise_config, full_cls, mrv2_manager, monkeypatch):
    builder = full_cls(SPEC, LAYERS, piecewise_config, DEVICE)
    _, record = _mrv2_wired(piecewise_config, mrv2_manager, [builder])

    def refuse(self, *args, **kwargs):
        raise ChunkMetaError("refused for the test")

    with monkeypatch.context() as m:
        m.setattr(mixed_step.MixedStepInputs, "stage", refuse)
        # vLLM's own capture builder would assert a decode-sized batch here: the eager build
        captured = builder.build_for_cudagraph_capture(capture_metadata(128, 16))
    assert not hasattr(captured, "chunkmeta_mixed") and captured.chunk_indices is not None
    assert (128, 16) in record.refused and (128, 16) not in builder.chunkmeta_buckets
    assert _mrv2_dispatch(mrv2_manager, 12, 100) == (CUDAGraphMode.PIECEWISE, 128, None)
    assert _mrv2_dispatch(mrv2_manager, 3, 100) == (CUDAGraphMode.FULL, 128, 8)  # the others replay
    # vLLM captures a descriptor twice (a warm-up, then the capture): after a warm-up that could
    # not stage, the capture takes the same path, no bucket made again
    again = builder.build_for_cudagraph_capture(capture_metadata(128, 16))
    assert not hasattr(again, "chunkmeta_mixed") and (128, 16) not in builder.chunkmeta_buckets


def test_mrv2_a_build_of_another_shape_than_the_full_graph_dispatched_raises(piecewise_config, full_cls, mrv2_manager):
    """Fail closed: inside a step (MRV2's execute_model), a FULL mixed graph replays whatever its
    bucket holds, so a build that cannot be staged into it raises rather than taking eager tables."""
    builder = full_cls(SPEC, LAYERS, piecewise_config, DEVICE)
    _, record = _mrv2_wired(piecewise_config, mrv2_manager, [builder])
    record.begin_step(object())
    assert _mrv2_dispatch(mrv2_manager, 3, 20) == (CUDAGraphMode.FULL, 32, 8)
    with pytest.raises(ChunkMetaError, match="would replay another step's inputs"):
        builder.build(0, padded_metadata([1, 7, 12], [40, 0, 0], 16, 32))
    assert builder.build(0, padded_metadata([1, 7, 12], [40, 0, 0], 8, 32)).chunkmeta_mixed is not None
    record.end_step()  # outside a step (V1's dummy runs, say) such a build takes the eager tables
    eager = builder.build(0, padded_metadata([1, 7, 12], [40, 0, 0], 16, 32))
    assert not hasattr(eager, "chunkmeta_mixed") and eager.chunk_indices is not None


def test_mrv2_under_full_vllms_mixed_graphs_each_get_a_bucket_or_are_not_captured(
    piecewise_config, full_cls, make_manager, monkeypatch
):
    """``cudagraph_mode=FULL`` (one routine): vLLM's own mixed descriptors, every bucket made
    before capture; where chunkmeta cannot stage them (a builder off) they leave the capture list
    and the candidates, and their steps run eagerly (vLLM's capture builder asserts a
    decode-sized batch, so capturing them on vLLM's path would stop the engine's start)."""
    monkeypatch.setattr(piecewise_config.compilation_config, "cudagraph_mode", CUDAGraphMode.FULL)
    for active in (True, False):
        manager = make_manager(piecewise_config, CUDAGraphMode.FULL)
        builder = full_cls(SPEC, LAYERS, piecewise_config, DEVICE)
        if not active:
            builder._chunkmeta_unsafe = "off for the test"
        record = graph_dispatch.MixedDispatch([builder])
        removed = graph_dispatch.keep_stageable_descs(manager, record)
        graph_dispatch.mrv2_dispatch(manager, record)
        shapes = {(n, min(n, MAX_NUM_SEQS)) for n in (1, 2, 4, 8, 16, 32, 64, 128)}
        captured = {(d.num_tokens, d.num_reqs) for d in manager._capture_descs.get(CUDAGraphMode.FULL, ())}
        if active:
            assert removed == 0 and captured == shapes == set(builder.chunkmeta_buckets)
            assert _mrv2_dispatch(manager, 5, 5, decode=True, prefill=False) == (CUDAGraphMode.FULL, 8, 8)
            assert record.current == (8, 8)  # one routine: decodes replay the mixed graph, staged
        else:
            assert removed == len(shapes) and captured == set()
            assert _mrv2_dispatch(manager, 3, 20)[0] == CUDAGraphMode.NONE and record.current is None


def test_request_buckets_can_be_turned_off_for_vllms_keys_alone(piecewise_config, full_cls, mrv2_manager, monkeypatch):
    """``CHUNKMETA_VLLM_REQUEST_BUCKETS=0``: the mixed graphs at vLLM's own request capacity only
    (what the engine benchmark's ``chunkmeta_graphs_vllm_keys`` measures the buckets against)."""
    env = graph_dispatch.REQUEST_BUCKETS_ENV
    assert graph_dispatch.request_buckets(256, 128, environ={}) == [8, 16, 32, 64, 128]
    assert graph_dispatch.request_buckets(256, 128, environ={env: "0"}) == [128]
    assert graph_dispatch.request_buckets(4, 128, environ={}) == [4]
    monkeypatch.setenv(env, "0")
    builder = full_cls(SPEC, LAYERS, piecewise_config, DEVICE)
    added, _ = _mrv2_wired(piecewise_config, mrv2_manager, [builder])
    assert added == {(n, min(n, MAX_NUM_SEQS)) for n in (2, 4, 8, 16, 32, 64, 128)}
    assert _mrv2_dispatch(mrv2_manager, 3, 20) == (CUDAGraphMode.FULL, 32, MAX_NUM_SEQS)


def test_mrv2_capture_times_each_graph_where_start_up_asked(piecewise_config, full_cls, mrv2_manager, monkeypatch):
    from vllm.v1.worker.gpu import cudagraph_utils

    builder = full_cls(SPEC, LAYERS, piecewise_config, DEVICE)
    added, record = _mrv2_wired(piecewise_config, mrv2_manager, [builder])
    patched = cudagraph_utils.CudaGraphManager.__dict__["capture"]  # vLLM's loop, wrapped by install()
    assert patched.__qualname__ == f"chunkmeta.{graph_dispatch.CAPTURE_MANAGER}.capture"
    descs = [d for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL) for d in mrv2_manager._capture_descs[mode]]
    free = iter(range(10**9, 0, -1000))  # each read 1,000 bytes fewer: every graph "takes" 1,000
    monkeypatch.setattr(graph_dispatch, "_free_bytes", lambda device: next(free))

    def loop(self, create_forward_fn, progress_bar_desc="Capturing CUDA graphs"):
        # the shape of vLLM's loop (cudagraph_utils.py:461-511): per descriptor a warm-up
        # forward, then a fresh one captured; no CUDA graph on this CPU machine
        for desc in descs:
            create_forward_fn(desc, warmup=True)(CUDAGraphMode.NONE)
            create_forward_fn(desc, warmup=False)(desc.cg_mode)

    forwards = []
    timed = graph_dispatch.mrv2_capture(loop)
    timed(mrv2_manager, lambda desc, warmup: lambda mode: forwards.append((desc, warmup)))
    assert record.captures == [] and len(forwards) == 2 * len(descs)  # no record: vLLM's loop alone
    mrv2_manager._chunkmeta_record = record
    timed(mrv2_manager, lambda desc, warmup: lambda mode: None)
    assert record.captures == []  # not asked (a CPU device): no timing
    mrv2_manager._chunkmeta_timed = True
    timed(mrv2_manager, lambda desc, warmup: lambda mode: None)
    assert [(c["num_tokens"], c["num_reqs"], c["mode"]) for c in record.captures] == [
        (d.num_tokens, d.num_reqs, d.cg_mode.name) for d in descs
    ]
    assert all(c["bytes"] == 1000 and c["seconds"] >= 0 for c in record.captures)
    ours = {(c["num_tokens"], c["num_reqs"]) for c in record.captures if c["chunkmeta"]}
    assert ours == added  # chunkmeta's mixed graphs marked, vLLM's decode and piecewise ones not
    assert builder.chunkmeta_stats()["graph_captures"] == record.captures
    # a capture that fails keeps what it measured, the failing graph's included
    calls = []

    def failing(self, create_forward_fn, progress_bar_desc=""):
        calls.append(create_forward_fn(descs[0], warmup=True))
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError, match="capture failed"):
        graph_dispatch.mrv2_capture(failing)(mrv2_manager, lambda desc, warmup: None)
    assert [c["num_tokens"] for c in record.captures] == [descs[0].num_tokens]

    # a failed capture whose measurement fails too (a CUDA error fails the synchronize): the
    # capture's own error is raised, and the graphs measured before it are kept
    def broken(device):
        raise RuntimeError("CUDA error")

    monkeypatch.setattr(graph_dispatch, "_free_bytes", lambda device: 0)

    def fails_late(self, create_forward_fn, progress_bar_desc=""):
        create_forward_fn(descs[0], warmup=True)
        create_forward_fn(descs[1], warmup=True)
        monkeypatch.setattr(graph_dispatch, "_free_bytes", broken)
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError, match="capture failed"):
        graph_dispatch.mrv2_capture(fails_late)(mrv2_manager, lambda desc, warmup: None)
    assert [c["num_tokens"] for c in record.captures] == [descs[0].num_tokens]


# -- Kimi-Linear under vLLM's breakable graphs (MRV2): the KDA inside, MLA a break, fail closed ---


@pytest.fixture
def kimi_config(tmp_path, monkeypatch):
    """Kimi-Linear's config as vLLM 0.33.0 sets it up by default: breakable CUDA graphs (the env
    flag its config sets, restored after the test), no torch.compile, FULL_AND_PIECEWISE, capture
    sizes on both sides of max_num_seqs (16)."""
    from vllm.config import VllmConfig
    from vllm.config.compilation import CompilationMode

    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")  # config/vllm.py:842-851 sets it for Kimi-Linear
    monkeypatch.setenv(breakable.BREAKABLE_ENV, "1")  # chunkmeta's own switch for the path
    hf_config = vllm_real_batches.tiny_qwen3_next()
    hf_config.architectures = ["KimiLinearForCausalLM"]
    model = vllm_real_batches.model_config(hf_config, str(tmp_path), seed=0)
    config = VllmConfig(
        model_config=model, scheduler_config=vllm_real_batches.scheduler_config(MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS)
    )
    cc = config.compilation_config
    cc.cudagraph_mode, cc.mode = CUDAGraphMode.FULL_AND_PIECEWISE, CompilationMode.NONE
    cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = [1, 2, 4, 8, 16, 32, 64, 128], 128
    return config


class FakeGraph:
    """``torch.cuda.CUDAGraph`` on this CPU machine: captures nothing, counts its replays."""

    replays = 0

    def capture_begin(self, pool=None):
        pass

    def capture_end(self):
        pass

    def replay(self):
        FakeGraph.replays += 1


@pytest.fixture
def breakable_capture(monkeypatch):
    """vLLM's real ``BreakableCUDAGraphCapture`` / ``Wrapper`` on CPU: fake graphs, identity weak
    refs (a compiled op), no pool, no garbage collection between captures."""
    import contextlib
    import gc

    from vllm.compilation import breakable_cudagraph

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(breakable_cudagraph, "weak_ref_tensor", lambda t: t)
    monkeypatch.setattr(breakable_cudagraph, "weak_ref_tensors", lambda t: t)
    monkeypatch.setattr(breakable_cudagraph, "capture_pool", lambda pool, config: contextlib.nullcontext(None))
    FakeGraph.replays = 0
    enabled = gc.isenabled()
    gc.disable()
    yield breakable_cudagraph
    if enabled:
        gc.enable()


def _breakable_wired(config, manager, builders):
    record = graph_dispatch.MixedDispatch(builders)
    graph_dispatch._breakable_buckets(config, manager, builders, record)
    graph_dispatch.mrv2_dispatch(manager, record)
    return record


def test_breakable_graphs_get_a_bucket_per_request_bucket_and_the_steps_dispatched_to_them(
    kimi_config, full_cls, make_manager
):
    manager = make_manager(kimi_config)
    assert manager.use_breakable_cg
    builder = full_cls(SPEC, LAYERS, kimi_config, DEVICE)
    record = _breakable_wired(kimi_config, manager, [builder])
    sizes = (1, 2, 4, 8, 16, 32, 64, 128)
    shapes = {(n, r) for n in sizes for r in graph_dispatch.request_buckets(n, MAX_NUM_SEQS)}
    assert record.breakable == shapes == set(builder.chunkmeta_buckets) and not record.added
    assert (32, 8) in shapes and (32, 16) in shapes  # vLLM's capture has min(32, 16) rows
    # the smaller request buckets are captured (largest first, most requests first in a size),
    # never dispatched: vLLM's own descriptor stands for them
    piecewise = manager._capture_descs[CUDAGraphMode.PIECEWISE]
    assert [(d.num_tokens, d.num_reqs) for d in piecewise if d.num_reqs is not None] == [
        (n, r) for n, r in sorted(shapes, reverse=True) if r < min(n, MAX_NUM_SEQS)
    ]
    assert [d.num_tokens for d in piecewise] == sorted((d.num_tokens for d in piecewise), reverse=True)
    assert all(d.num_reqs is None for c in manager._candidates.values() for d in c if d.cg_mode.name == "PIECEWISE")
    # a mixed batch: vLLM's piecewise graph of its size, recorded with the smallest request
    # bucket holding its rows
    assert _mrv2_dispatch(manager, 3, 20) == (CUDAGraphMode.PIECEWISE, 32, None) and record.current == (32, 8)
    assert _mrv2_dispatch(manager, 12, 20)[:2] == (CUDAGraphMode.PIECEWISE, 32) and record.current == (32, 16)
    # the step's metadata is unpadded (model_runner.py:1462): staged into the bucket, its rows padded
    _mrv2_dispatch(manager, 3, 20)
    staged = builder.build(0, vllm_real_batches.common_metadata([1, 7, 12], [40, 0, 0], DEVICE))
    bucket = builder.chunkmeta_buckets[32, 8]
    assert staged.chunkmeta_mixed is bucket and record.fully_staged()
    assert bucket.cu_seqlens.tolist() == [0, 1, 8, 20] + [20] * 5
    assert bucket.has_initial_state.tolist() == [True] + [False] * 7
    # a build the graph cannot hold (no such build follows a dispatch today): not staged
    over = builder.build(0, vllm_real_batches.common_metadata([1, 7, 32], [40, 0, 0], DEVICE))
    assert not hasattr(over, "chunkmeta_mixed")
    # a refused graph: the next request bucket of the size; none left: eager
    record.refuse((32, 8))
    assert _mrv2_dispatch(manager, 3, 20)[:2] == (CUDAGraphMode.PIECEWISE, 32) and record.current == (32, 16)
    record.refuse((32, 16))
    assert _mrv2_dispatch(manager, 3, 20)[0] == CUDAGraphMode.NONE and record.current is None
    # decodes keep vLLM's FULL decode graph; over every capture size, eager: nothing staged
    assert _mrv2_dispatch(manager, 5, 5, decode=True, prefill=False) == (CUDAGraphMode.FULL, 8, 8)
    assert record.current is None and not record.fully_staged()
    assert _mrv2_dispatch(manager, 3, 200)[0] == CUDAGraphMode.NONE
    eager = builder.build(0, vllm_real_batches.common_metadata([1, 7, 12], [40, 0, 0], DEVICE))
    assert not hasattr(eager, "chunkmeta_mixed") and eager.chunk_indices is not None


def test_a_size_without_its_top_breakable_bucket_keeps_vllms_graph(kimi_config, full_cls, make_manager, monkeypatch):
    """vLLM captures each size with min(N, max_num_seqs) rows: where that bucket cannot be made,
    the size keeps vLLM's breaking graph, its smaller buckets dropped (none captured)."""
    original = full_graph.FullGraphBuilderMixin.chunkmeta_bucket

    def refuse(self, num_tokens, num_reqs):
        if (num_tokens, num_reqs) == (32, 16):
            raise ChunkMetaError("no bucket for the test")
        return original(self, num_tokens, num_reqs)

    monkeypatch.setattr(full_graph.FullGraphBuilderMixin, "chunkmeta_bucket", refuse)
    manager = make_manager(kimi_config)
    builder = full_cls(SPEC, LAYERS, kimi_config, DEVICE)
    record = _breakable_wired(kimi_config, manager, [builder])
    assert not {s for s in record.breakable if s[0] == 32} and (64, 8) in record.breakable
    assert (32, 8) not in builder.chunkmeta_buckets
    assert not [d for d in manager._capture_descs[CUDAGraphMode.PIECEWISE] if d.num_tokens == 32 and d.num_reqs]
    assert _mrv2_dispatch(manager, 3, 20) == (CUDAGraphMode.PIECEWISE, 32, None) and record.current is None
    assert _mrv2_dispatch(manager, 3, 40) == (CUDAGraphMode.PIECEWISE, 64, None) and record.current == (64, 8)


def test_no_breakable_buckets_for_other_models_or_set_ups(configs, kimi_config, full_cls, make_manager, monkeypatch):
    manager = make_manager(kimi_config)
    builder = full_cls(SPEC, LAYERS, kimi_config, DEVICE)
    assert breakable.breakable_refusal(kimi_config, manager, [builder]) is None
    assert breakable.BREAKABLE_ENV in breakable.breakable_refusal(kimi_config, manager, [builder], environ={})
    qwen = full_cls(SPEC, LAYERS, configs[False], DEVICE)
    assert "architectures" in breakable.breakable_refusal(configs[False], manager, [qwen])
    manager.lora_capture_cases = [0, 1]
    assert "LoRA" in breakable.breakable_refusal(kimi_config, manager, [builder])
    manager.lora_capture_cases, manager.use_breakable_cg = [0], False
    record = _breakable_wired(kimi_config, manager, [builder])
    assert not record.breakable and not builder.chunkmeta_buckets
    assert _mrv2_dispatch(manager, 3, 20) == (CUDAGraphMode.PIECEWISE, 32, None) and record.current is None


def test_the_start_up_picks_breakable_graphs_where_mla_keeps_mixed_steps_off_full_graphs(
    kimi_config, full_cls, make_manager
):
    """MRV2's start-up (``initialize_kv_cache``, wrapped): an MLA group below ``ALWAYS`` (every
    SM90 MLA backend) rules out chunkmeta's FULL mixed graphs; the breakable ones get buckets."""
    manager = make_manager(kimi_config)
    builder = full_cls(SPEC, LAYERS, kimi_config, DEVICE)
    kda = types.SimpleNamespace(
        backend=types.SimpleNamespace(get_builder_cls=lambda: type(builder), __name__="GDNAttentionBackend"),
        kv_cache_spec=SPEC,
        metadata_builders=[builder],
    )

    class MlaBuilder:
        @classmethod
        def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
            return AttentionCGSupport.UNIFORM_BATCH

    mla = types.SimpleNamespace(
        backend=types.SimpleNamespace(get_builder_cls=lambda: MlaBuilder, __name__="FlashAttnMLABackend"),
        kv_cache_spec=SPEC,
        metadata_builders=[MlaBuilder()],
    )
    runner = types.SimpleNamespace(
        cudagraph_manager=manager, attn_groups=[[kda], [mla]], vllm_config=kimi_config, execute_model=lambda *a: None
    )
    graph_dispatch.mrv2_mixed_graphs(lambda self, *a, **k: "started")(runner)
    record = manager._chunkmeta_record
    assert not record.added and record.breakable == set(builder.chunkmeta_buckets) and len(record.breakable) == 12
    assert builder._chunkmeta_dispatch is record and manager._chunkmeta_timed is False
    # a step's decision ends with its execute_model: a build after it stages nothing
    record.current = (32, 16)
    runner.execute_model(None)
    assert record.current is None


def _gated(config, full_cls, make_manager, breakable_capture, monkeypatch, builders=1):
    """An MRV2 manager with breakable buckets in ``builders`` chunkmeta builders (each its own
    KV-cache group, as on CPU, where vLLM's GDN builder reuses no metadata) and its gated runner
    around ``_kimi_model`` with one KDA layer per builder."""

    manager = make_manager(config)
    made = [full_cls(SPEC, LAYERS, config, DEVICE) for _ in range(builders)]
    record = _breakable_wired(config, manager, made)  # the runner gated (breakable.gate)
    model, layers, calls, counts = _kimi_model(monkeypatch, breakable_capture, builders)
    manager.init_breakable_cg_runner(model)
    return manager, made, record, manager.breakable_cg_runner, layers, calls, counts


def _kimi_model(monkeypatch, breakable_capture, num_layers=1):
    """A stand-in model for the breakable runner: Kimi-Linear KDA layers (chunkmeta's patched
    ``_forward``, its graph-safe forward recorded) and one MLA-like break, each call counted; its
    tokens the forward context's (the graph's size)."""
    from vllm.forward_context import get_forward_context

    module = importlib.import_module(full_graph.KIMI_LAYER_MODULE)
    forward = getattr(module, full_graph.KIMI_LAYER).__dict__["_forward"]
    calls = _record(monkeypatch, "kda_mixed_forward", (2, 8))
    layers = [_stand_in_layer(32) for _ in range(num_layers)]
    for i, layer in enumerate(layers):
        layer.prefix = f"model.layers.{i}.linear_attn"
    counts = {"model": 0, "mla": 0}

    @breakable_capture.eager_break_during_capture
    def mla(out):
        counts["mla"] += 1

    def model():
        counts["model"] += 1
        tokens = get_forward_context().batch_descriptor.num_tokens
        out = torch.zeros(1, tokens, 2, 8)
        for layer in layers:
            forward(layer, mixed_qkv=torch.randn(tokens, 48), g1=torch.randn(1, tokens, 2, 8),
                    g2=torch.randn(tokens, 2, 8), beta=torch.randn(1, tokens, 2), core_attn_out=out)  # fmt: skip
        mla(out)
        return out

    return model, layers, calls, counts


def _run_piecewise(runner, num_tokens, attn_metadata):
    """The runner as MRV2's ``run_pw_graph`` calls it, in a step's forward context."""
    from vllm.forward_context import BatchDescriptor, override_forward_context

    context = types.SimpleNamespace(
        attn_metadata=attn_metadata,
        batch_descriptor=BatchDescriptor(num_tokens=num_tokens),
        cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE,
    )
    with override_forward_context(context):
        return runner()


def test_a_breakable_graph_holds_the_kda_and_replays_only_staged_steps(
    kimi_config, full_cls, make_manager, breakable_capture, monkeypatch, caplog
):
    manager, (builder,), record, runner, (layer,), calls, counts = _gated(
        kimi_config, full_cls, make_manager, breakable_capture, monkeypatch
    )
    # capture (cudagraph_utils.py:469-481), per descriptor of 32 tokens (vLLM's, then the
    # capture-only one of 8 rows): its inputs built, then the runner called
    for desc in [d for d in manager._capture_descs[CUDAGraphMode.PIECEWISE] if d.num_tokens == 32]:
        record.prepare_capture(graph_dispatch.mrv2_breakable_shape(manager, desc, record))
        rows = record.current[1]
        metadata = builder.build(0, capture_metadata(32, rows))
        assert metadata.chunkmeta_mixed is builder.chunkmeta_buckets[32, rows]
        _run_piecewise(runner, 32, {layer.prefix: metadata})
    # one graph per bucket, keyed by its rows; each holds the KDA: the MLA break is its only one
    entries = {key[1]: entry for key, entry in runner.entries.items()}
    assert sorted(entries) == [8, 16] and [entries[r].chunkmeta_shape for r in (8, 16)] == [(32, 8), (32, 16)]
    assert all(e.capture.num_eager_breaks == 1 for e in entries.values()) and counts["mla"] == 2
    assert [c[0] for c in calls] == [builder.chunkmeta_buckets[32, r] for r in (16, 8)]
    # a staged step of 3 requests replays the 8-row graph: its segments and the MLA break, no model call
    _mrv2_dispatch(manager, 3, 20)
    step = builder.build(0, vllm_real_batches.common_metadata([1, 7, 12], [40, 0, 0], DEVICE))
    models, replays = counts["model"], FakeGraph.replays
    _run_piecewise(runner, 32, {layer.prefix: step})
    assert counts["model"] == models and FakeGraph.replays == replays + 2 and counts["mla"] == 3
    assert len(runner.entries) == 2  # no capture while serving
    # a step dispatched to the graph but not staged (its build did not run, or failed: no
    # bucket on its metadata, here none at all): the model runs eagerly, vLLM's KDA path,
    # counted, one warning; nothing replayed
    with caplog.at_level(logging.WARNING, logger="vllm"):
        for _ in range(2):
            _mrv2_dispatch(manager, 3, 20)
            _run_piecewise(runner, 32, {})
    assert counts["model"] == models + 2 and FakeGraph.replays == replays + 2 and len(calls) == 2
    assert record.turned_away[breakable.UNSTAGED] == 2
    assert sum(breakable.UNSTAGED in r.getMessage() for r in caplog.records) == 1


def test_a_step_or_capture_one_builder_did_not_stage_never_replays_a_breakable_graph(
    kimi_config, full_cls, make_manager, breakable_capture, monkeypatch
):
    """Two builders (two KV-cache groups of KDA layers). A step only the first staged runs
    eagerly: its layers on their bucket over the graph's tokens, the other's on vLLM's path. A
    capture only the first staged holds that layer's KDA and breaks at the other's: the graph is
    refused and never replayed; with every graph of its size refused, its steps run eagerly."""
    manager, (first, second), record, runner, layers, calls, counts = _gated(
        kimi_config, full_cls, make_manager, breakable_capture, monkeypatch, builders=2
    )
    stage, fails = type(second)._stage, set()  # the buckets the second builder cannot stage

    def stage_first_only(self, bucket, *args, **kwargs):
        if self is second and (bucket.num_tokens, bucket.num_reqs) in fails:
            raise ChunkMetaError("no stage for the test")
        return stage(self, bucket, *args, **kwargs)

    monkeypatch.setattr(type(second), "_stage", stage_first_only)
    record.prepare_capture((32, 8))
    staged = {b: b.build(0, capture_metadata(32, 8)) for b in (first, second)}
    assert record.fully_staged()
    _run_piecewise(runner, 32, {layer.prefix: staged[b] for layer, b in zip(layers, (first, second), strict=True)})
    assert runner.entries[next(iter(runner.entries))].capture.num_eager_breaks == 1 and len(calls) == 2
    # a 20-token step at 32 the second builder fails to stage
    fails.add((32, 8))
    _mrv2_dispatch(manager, 3, 20)
    step = first.build(0, vllm_real_batches.common_metadata([1, 7, 12], [40, 0, 0], DEVICE))
    eager = second.build(0, vllm_real_batches.common_metadata([1, 7, 12], [40, 0, 0], DEVICE))
    assert step.chunkmeta_mixed is first.chunkmeta_buckets[32, 8] and not hasattr(eager, "chunkmeta_mixed")
    assert eager.chunk_indices is not None and not record.fully_staged()  # chunkmeta's eager tables
    models, replays = counts["model"], FakeGraph.replays
    _run_piecewise(runner, 32, {layers[0].prefix: step})  # (the second layer's vLLM path: no metadata here)
    assert counts["model"] == models + 1 and FakeGraph.replays == replays
    assert calls[-1][0] is first.chunkmeta_buckets[32, 8] and calls[-1][1]["mixed_qkv"].shape[0] == 32
    # the captures of 64 tokens, both request buckets, only the first builder staged
    fails.update({(64, 8), (64, 16)})
    for rows in (16, 8):
        record.prepare_capture((64, rows))
        staged = {b: b.build(0, capture_metadata(64, rows)) for b in (first, second)}
        assert hasattr(staged[first], "chunkmeta_mixed") and not hasattr(staged[second], "chunkmeta_mixed")
        _run_piecewise(runner, 64, {layers[0].prefix: staged[first]})
    held = [e for e in runner.entries.values() if e.batch_descriptor.num_tokens == 64]
    assert sorted(e.chunkmeta_shape for e in held) == [(64, 8), (64, 16)] and {(64, 8), (64, 16)} <= record.refused
    assert all(e.capture.num_eager_breaks == 2 for e in held)  # the second KDA layer's and the MLA one
    # its steps: turned away at dispatch, nothing staged, eager (the runner never called)
    assert _mrv2_dispatch(manager, 3, 40)[0] == CUDAGraphMode.NONE and record.current is None
    step = first.build(0, vllm_real_batches.common_metadata([1, 7, 32], [40, 0, 0], DEVICE))
    assert not hasattr(step, "chunkmeta_mixed") and step.chunk_indices is not None


def test_a_group_view_that_fails_in_a_breakable_step_gets_vllms_tables(
    kimi_config, full_cls, make_manager, monkeypatch, caplog
):
    """MRV2 hands group 1's staged metadata to the other KV-cache groups (``update_block_table``);
    where a group's view cannot be staged, the step is not fully staged (the gated replay runs it
    eagerly) and that group's metadata gets the tables vLLM's path reads, which the staged build
    left out."""
    manager = make_manager(kimi_config)
    first, second = (full_cls(SPEC, LAYERS, kimi_config, DEVICE) for _ in range(2))
    record = _breakable_wired(kimi_config, manager, [first, second])
    _mrv2_dispatch(manager, 3, 20)
    m = vllm_real_batches.common_metadata([1, 7, 12], [40, 0, 0], DEVICE)
    staged = first.build(0, m)
    assert staged.chunkmeta_mixed is first.chunkmeta_buckets[32, 8] and staged.batch_ptr is None
    second.mamba_aligned_state_indices = m.block_table_tensor  # align mode (prefix caching): set per step
    out = second.update_block_table(staged, m.block_table_tensor, m.slot_mapping)
    assert out.chunkmeta_mixed.bucket is staged.chunkmeta_mixed and record.fully_staged()

    def refuse(self, view, metadata):
        raise ChunkMetaError("no view for the test")

    monkeypatch.setattr(type(second), "_stage_view", refuse)
    _mrv2_dispatch(manager, 3, 20)
    staged = first.build(0, m)
    with caplog.at_level(logging.WARNING, logger="vllm"):
        out = second.update_block_table(staged, m.block_table_tensor, m.slot_mapping)
    assert not hasattr(out, "chunkmeta_mixed") and not record.fully_staged()
    want = reference.causal_conv1d_metadata([0, 1, 8, 20])
    assert out.batch_ptr[: want.tot].tolist() == want.batch_ptr and out.nums_dict[8]["tot"] == want.tot
    assert any("no view for the test" in r.getMessage() for r in caplog.records)
