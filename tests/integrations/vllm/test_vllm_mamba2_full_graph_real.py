"""``CHUNKMETA_VLLM_FULL_GRAPH`` for Mamba2 hybrids: vLLM 0.33.0's ``Mamba2AttentionMetadataBuilder``
and ``MambaMixer2`` made ready for mixed steps in FULL CUDA graphs, against the real vLLM on CPU
(`make test-vllm`).

The builder: ``ALWAYS`` for a model whose Mamba2 layers are ``MambaMixer2`` (not with speculative
decoding, ReplaySSM or another SSU backend); a mixed capture makes a ``Mamba2StepInputs`` bucket
where vLLM's capture builder asserts decode sizes; every step of that shape is staged into the
same tensors with the stock builder's state indices and decode count, and the stock builder's
SSD chunk tables on the prefill rows (vLLM's ``_compute_chunk_metadata``, decode rows one chunk
each ahead of them); another KV-cache group's view has its own state indices; align mode stages
checkpoint offsets and blocks; a failed stage keeps chunkmeta's eager tables. The layer:
``conv_ssm_forward`` takes the graph-safe path for a bucket's steps, vLLM's own otherwise. The
forward's routing: ``test_mamba2_mixed_forward.py``.
"""

import dataclasses
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
from chunkmeta.errors import ChunkMetaError
from chunkmeta.integrations import vllm as adapter
from chunkmeta.integrations.vllm import full_graph, mixed_step

mamba2_attn = pytest.importorskip("vllm.v1.attention.backends.mamba2_attn")
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import MambaSpec

DEVICE = torch.device("cpu")
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, CHUNK = 16, 8192, 64
SPEC = MambaSpec(
    block_size=16,
    shapes=((4, 8), (2, 8, 8)),
    dtypes=(torch.bfloat16, torch.float32),
    mamba_type=MambaAttentionBackendEnum.MAMBA2,
)
LAYERS = ["model.layers.0.mixer"]
BUCKET_TOKENS = 256
Builder = mamba2_attn.Mamba2AttentionMetadataBuilder


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    from vllm.config import VllmConfig

    def config(architecture, **kwargs):
        hf_config = vllm_real_batches.tiny_mamba2(CHUNK)
        hf_config.architectures = [architecture]
        model = vllm_real_batches.model_config(hf_config, str(tmp_path_factory.mktemp(architecture)), seed=0)
        scheduler = vllm_real_batches.scheduler_config(MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS)
        made = VllmConfig(model_config=model, scheduler_config=scheduler, **kwargs)
        made.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
        return made

    return {"mamba2": config("Mamba2ForCausalLM"), "other": config("JambaForCausalLM")}


@pytest.fixture(autouse=True)
def clean_install():
    adapter.uninstall()
    yield
    adapter.uninstall()


@pytest.fixture
def full_cls(monkeypatch):
    monkeypatch.setenv(full_graph.FULL_GRAPH_ENV, "1")
    adapter.install(adapter.load_vllm_api())
    return adapter.chunkmeta_builder_class(Builder, reuse_block_table=True)


def padded_metadata(query_lens, context_lens, num_reqs_padded, num_tokens_padded):
    return vllm_real_batches.full_padded_metadata(query_lens, context_lens, num_reqs_padded, num_tokens_padded, DEVICE)


def capture_metadata(tokens, reqs, uniform=False):
    return vllm_real_batches.capture_metadata(tokens, reqs, DEVICE, uniform)


def vllm_rows(metadata):
    return torch.cat([metadata.state_indices_tensor_d[:, 0], metadata.state_indices_tensor_p]).tolist()


def test_support_is_always_for_mamba2_mixers_only(configs, full_cls, monkeypatch, caplog):
    assert issubclass(full_cls, full_graph.Mamba2FullGraphMixin)
    assert full_cls.get_cudagraph_support(configs["mamba2"], SPEC) == AttentionCGSupport.ALWAYS
    assert Builder.get_cudagraph_support(configs["mamba2"], SPEC) == AttentionCGSupport.UNIFORM_BATCH
    assert full_cls.get_cudagraph_support(configs["other"], SPEC) == AttentionCGSupport.UNIFORM_BATCH
    with caplog.at_level(logging.WARNING, logger="vllm.chunkmeta"):
        full_cls(SPEC, LAYERS, configs["other"], DEVICE)
    assert any("no graph-safe Mamba2 layer" in r.getMessage() for r in caplog.records)
    config = configs["mamba2"]
    with monkeypatch.context() as m:
        m.setattr(config.cache_config, "use_replayssm", True)
        assert "ReplaySSM" in full_graph.graph_unsafe(config, "mamba2")
    with monkeypatch.context() as m:
        m.setattr(config.mamba_config, "backend", types.SimpleNamespace(value="flashinfer"))
        assert "'flashinfer'" in full_graph.graph_unsafe(config, "mamba2")
    # the GDN family's rule is not the Mamba2 one
    assert "no graph-safe layer" in full_graph.graph_unsafe(config, "gdn")
    monkeypatch.delenv(full_graph.FULL_GRAPH_ENV)  # off: chunkmeta's eager tables alone
    off = adapter.chunkmeta_builder_class(Builder, reuse_block_table=True)
    assert not issubclass(off, full_graph.FullGraphBuilderMixin)


def test_a_mixed_capture_makes_a_bucket(configs, full_cls):
    with pytest.raises(AssertionError):
        Builder(SPEC, LAYERS, configs["mamba2"], DEVICE).build_for_cudagraph_capture(
            capture_metadata(BUCKET_TOKENS, MAX_NUM_SEQS)
        )
    builder = full_cls(SPEC, LAYERS, configs["mamba2"], DEVICE)
    bucket = builder.build_for_cudagraph_capture(capture_metadata(BUCKET_TOKENS, MAX_NUM_SEQS)).chunkmeta_mixed
    assert isinstance(bucket, mixed_step.Mamba2StepInputs)
    # prefix caching (vLLM's default) puts Mamba state in align mode: the bucket has checkpoints
    assert bucket.checkpoints == (configs["mamba2"].cache_config.mamba_cache_mode == "align")
    assert (bucket.num_tokens, bucket.num_reqs, bucket.chunk_size) == (BUCKET_TOKENS, MAX_NUM_SEQS, CHUNK)
    assert builder.chunkmeta_stats()["mixed_buckets"] == [(BUCKET_TOKENS, MAX_NUM_SEQS)]


def test_the_levels_follow_the_environment(configs, full_cls, monkeypatch):
    def bucket():
        builder = full_cls(SPEC, LAYERS, configs["mamba2"], DEVICE)
        return builder.build_for_cudagraph_capture(capture_metadata(BUCKET_TOKENS, MAX_NUM_SEQS)).chunkmeta_mixed

    monkeypatch.delenv(full_graph.LEVELS_ENV, raising=False)  # off by default: the bucket's capacity alone
    assert bucket().levels == ((MAX_NUM_SEQS, bucket().seq_idx.shape[0]),)
    monkeypatch.setenv(full_graph.LEVELS_ENV, "1")
    assert [r for r, _ in bucket().levels] == [1, 2, 4, 8, 16]


def test_a_bucket_over_the_ssd_state_budget_is_not_made(configs, full_cls, monkeypatch, caplog):
    state_bytes = 4 * int(np.prod(SPEC.shapes[1]))  # the SSD's states are float32
    builder = full_cls(SPEC, LAYERS, configs["mamba2"], DEVICE)
    bucket = builder.chunkmeta_bucket(BUCKET_TOKENS, MAX_NUM_SEQS)  # the default budget holds it
    # the chunk states twice; the initial states gathered then masked, and with checkpoints the final states
    rows = 2 * bucket.seq_idx.shape[0] + (3 if bucket.checkpoints else 2) * MAX_NUM_SEQS
    assert bucket.ssd_state_rows() == rows and rows * state_bytes <= full_graph.MAMBA2_GRAPH_MIB << 20
    monkeypatch.setenv(full_graph.MAMBA2_GRAPH_MIB_ENV, "0")
    builder = full_cls(SPEC, LAYERS, configs["mamba2"], DEVICE)
    with pytest.raises(ChunkMetaError, match=full_graph.MAMBA2_GRAPH_MIB_ENV):
        builder.chunkmeta_bucket(BUCKET_TOKENS, MAX_NUM_SEQS)
    # its capture takes vLLM's eager build: no bucket, no step ever staged for that graph
    metadata = builder.build_for_cudagraph_capture(capture_metadata(BUCKET_TOKENS, MAX_NUM_SEQS))
    assert getattr(metadata, "chunkmeta_mixed", None) is None
    assert builder.chunkmeta_stats()["mixed_buckets"] == []
    monkeypatch.setenv(full_graph.MAMBA2_GRAPH_MIB_ENV, "many")
    with caplog.at_level(logging.WARNING, logger="vllm.chunkmeta"):
        assert full_cls(SPEC, LAYERS, configs["mamba2"], DEVICE).chunkmeta_bucket(BUCKET_TOKENS, MAX_NUM_SEQS)
    assert any("'many' is not a whole number of MiB" in r.getMessage() for r in caplog.records)


@pytest.fixture
def mrv2(configs, monkeypatch):
    """The Mamba2 config read as Model Runner V2's (vLLM 0.33.0's default; here V1 without Triton)."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert configs["mamba2"].use_v2_model_runner
    return configs["mamba2"]


@pytest.mark.parametrize("mode", ["none", "align"])
def test_under_mrv2_a_bucket_holds_few_ssd_rows_and_its_capture_stages_them(mrv2, full_cls, monkeypatch, mode):
    monkeypatch.setattr(mrv2.cache_config, "mamba_cache_mode", mode)
    # vLLM's capture batch: every row a prefill of BUCKET_TOKENS / MAX_NUM_SEQS tokens
    builder = full_cls(SPEC, LAYERS, mrv2, DEVICE)
    bucket = builder.build_for_cudagraph_capture(capture_metadata(BUCKET_TOKENS, MAX_NUM_SEQS)).chunkmeta_mixed
    p = full_graph.MAMBA2_SSD_ROWS
    assert bucket.ssd_rows == p and [r for r, _ in bucket.levels] == [p] and bucket.checkpoints == (mode == "align")
    assert bucket.levels[0][1] < bucket.seq_idx.shape[0]  # the SSD stops short of the chunk capacity
    # the capture staged a step of the same shape with p prefills: the rows before them one token each
    assert bucket.first_ssd_row == MAX_NUM_SEQS - p
    assert bucket.decode_rows.tolist() == [True] * (MAX_NUM_SEQS - p) + [False] * p
    assert bucket.cu_seqlens[-1].item() == BUCKET_TOKENS
    # a step within its rows is staged; one over them is refused, nothing staged
    ok = builder.build(0, padded_metadata([1] * 5 + [40, 30], [9] * 5 + [0, 7], MAX_NUM_SEQS, BUCKET_TOKENS))
    assert ok.chunkmeta_mixed is bucket and bucket.first_ssd_row == 5
    over = padded_metadata([1] * 5 + [40, 30, 20], [9] * 5 + [0, 7, 0], MAX_NUM_SEQS, BUCKET_TOKENS)
    assert getattr(builder.build(0, over), "chunkmeta_mixed", None) is None  # no runner hook: eager tables
    assert any("over this bucket's 2" in cause for cause in builder.chunkmeta_stats()["mixed_fallbacks"])
    monkeypatch.setenv(full_graph.MAMBA2_SSD_ROWS_ENV, "0")  # every row
    every = full_cls(SPEC, LAYERS, mrv2, DEVICE).chunkmeta_bucket(BUCKET_TOKENS, MAX_NUM_SEQS)
    assert every.ssd_rows == MAX_NUM_SEQS


def test_under_v1_a_bucket_holds_every_ssd_row(configs, full_cls):
    # V1's dummy runs dispatch outside execute_model: no step to count, so no cap to check
    assert not configs["mamba2"].use_v2_model_runner
    builder = full_cls(SPEC, LAYERS, configs["mamba2"], DEVICE)
    assert builder.chunkmeta_bucket(BUCKET_TOKENS, MAX_NUM_SEQS).ssd_rows == MAX_NUM_SEQS
    assert builder.chunkmeta_refuses((BUCKET_TOKENS, MAX_NUM_SEQS), None) is None


def test_the_dispatch_sends_a_step_of_more_prefills_elsewhere(mrv2, full_cls, monkeypatch):
    from chunkmeta.integrations.vllm import graph_dispatch

    builder = full_cls(SPEC, LAYERS, mrv2, DEVICE)
    shape = (BUCKET_TOKENS, MAX_NUM_SEQS)
    builder.chunkmeta_bucket(*shape)
    record = graph_dispatch.MixedDispatch([builder])
    p = full_graph.MAMBA2_SSD_ROWS
    decodes = {f"d{i}": 1 for i in range(9)}
    computed = dict.fromkeys(decodes, 50)
    record.step = graph_dispatch.StepRows({**decodes, "p0": 60, "p1": 30}, {**computed, "p0": 0, "p1": 7})
    assert p == 2 and record.decide(shape) and record.current == shape
    record.step = graph_dispatch.StepRows({**decodes, "p0": 60, "p1": 30, "p2": 9}, computed)
    assert not record.decide(shape) and record.current is None
    assert any("SSD rows" in why for why in record.turned_away)
    # a one-token first chunk of a prompt is a prefill, and vLLM's sort puts it among the
    # one-token rows: every row after it is one too (3 here, and the decode after it)
    record.step = graph_dispatch.StepRows({"d0": 1, "new": 1, "d1": 1, "p0": 40}, {"d0": 5, "new": 0, "d1": 5})
    assert full_graph.mamba2_prefill_rows(record.step) == 3 and not record.decide(shape)
    # a one-token chunk over a cached prefix is a decode row
    record.step = graph_dispatch.StepRows({"d0": 1, "tail": 1, "d1": 1, "p0": 40}, {"d0": 5, "tail": 9, "d1": 5})
    assert full_graph.mamba2_prefill_rows(record.step) == 1 and record.decide(shape)
    record.step = None  # a step nobody counted: fail closed
    assert not record.decide(shape)
    # the runner's execute_model records each step while it runs (wrapped once, the latest record)
    seen = []
    runner = types.SimpleNamespace(execute_model=lambda *a, **kw: seen.append(record.step))
    graph_dispatch.record_steps(runner, record)
    graph_dispatch.record_steps(runner, record)
    output = types.SimpleNamespace(
        num_scheduled_tokens={"a": 1, "b": 7},
        scheduled_new_reqs=[types.SimpleNamespace(req_id="b", num_computed_tokens=0)],
        scheduled_cached_reqs=types.SimpleNamespace(req_ids=["a"], num_computed_tokens=[12]),
    )
    runner.execute_model(output, dummy_run=True)
    runner.execute_model(scheduler_output=output)  # however the worker passes it
    assert seen == [graph_dispatch.StepRows({"a": 1, "b": 7}, {"b": 0, "a": 12})] * 2 and record.step is None
    # counted only where read: a step nobody asks about pays nothing
    counted = []
    monkeypatch.setattr(graph_dispatch.StepRows, "of", classmethod(lambda cls, out: counted.append(out)))
    runner.execute_model = lambda *a, **kw: None
    runner._chunkmeta_steps_recorded = False
    graph_dispatch.record_steps(runner, record)
    runner.execute_model(output)
    assert counted == []


def test_the_prefill_rows_counted_at_dispatch_are_the_stock_builders(mrv2):
    from vllm.v1.worker.gpu.model_runner import sort_batch_req_ids

    from chunkmeta.integrations.vllm import graph_dispatch

    stock = Builder(SPEC, LAYERS, mrv2, DEVICE)
    rng = np.random.default_rng(21)
    kinds = {"decode": 0, "one_token_prompt": 0, "prompt": 0}
    for _ in range(60):
        scheduled, computed = {}, {}
        for i in range(int(rng.integers(1, 10))):
            kind = rng.choice(list(kinds))
            kinds[kind] += 1
            rid = f"r{i}"
            scheduled[rid] = 1 if kind != "prompt" else int(rng.integers(1, 30))
            computed[rid] = int(rng.integers(1, 400)) if kind == "decode" or rng.random() < 0.5 else 0
        order = sort_batch_req_ids(scheduled, {}, 1)  # MRV2's row order
        metadata = vllm_real_batches.common_metadata(
            [scheduled[r] for r in order], [computed[r] for r in order], DEVICE
        )
        want = stock.build(0, metadata).num_prefills
        assert full_graph.mamba2_prefill_rows(graph_dispatch.StepRows(scheduled, computed)) == want
    assert min(kinds.values()) > 20


def test_steps_of_a_bucket_stage_the_stock_builders_values(configs, full_cls):
    builder = full_cls(SPEC, LAYERS, configs["mamba2"], DEVICE)
    stock = Builder(SPEC, LAYERS, configs["mamba2"], DEVICE)
    bucket = builder.build_for_cudagraph_capture(capture_metadata(BUCKET_TOKENS, MAX_NUM_SEQS)).chunkmeta_mixed
    fields = lambda: [(t.shape, t.data_ptr()) for t in (bucket.ssd_cu_chunk_seqlens, bucket.seq_idx,  # noqa: E731
                                                        bucket.state_indices, bucket.ssd_state_indices)]  # fmt: skip
    fixed = fields()
    rng = np.random.default_rng(3)
    mixed = 0
    for _ in range(40):
        query, context = vllm_real_batches.random_mixed(rng, MAX_NUM_SEQS, BUCKET_TOKENS)
        got = builder.build(0, padded_metadata(query, context, MAX_NUM_SEQS, BUCKET_TOKENS))
        want = stock.build(0, padded_metadata(query, context, MAX_NUM_SEQS, BUCKET_TOKENS))
        assert got.chunkmeta_mixed is bucket
        assert fields() == fixed
        assert got.cu_chunk_seqlen_p is None  # no eager tables: the bucket's fill is the step's
        d, n = want.num_decodes, MAX_NUM_SEQS
        assert bucket.state_indices.tolist() == vllm_rows(want)
        assert bucket.decode_rows.tolist() == [True] * d + [False] * (n - d)
        qsl = padded_metadata(query, context, n, BUCKET_TOKENS).query_start_loc_cpu.tolist()
        assert bucket.cu_seqlens.tolist() == qsl
        assert bucket.has_initial_state.tolist() == [c > 0 for c in context] + [False] * (n - len(query))
        # the SSD rows are vLLM's prefill rows (decodes through the SSU), padding rows after them
        assert bucket.ssd_state_indices.tolist() == vllm_rows(want)[d:] + [mixed_step.NULL_BLOCK_ID] * d
        assert bucket.ssd_cu_seqlens.tolist() == qsl[d:] + [qsl[-1]] * d
        if want.num_prefills and want.cu_chunk_seqlen_p is not None:
            mixed += d > 0
            # vLLM's prefill chunk tables, in tokens of the whole step (decode tokens ahead)
            k = want.seq_idx_p.shape[0]
            assert (bucket.ssd_cu_chunk_seqlens[: k + 1] - want.num_decode_tokens).tolist() == (
                want.cu_chunk_seqlen_p.tolist()
            )
            assert bucket.seq_idx[:k].tolist() == want.seq_idx_p.tolist()
            p = want.num_prefills
            assert bucket.last_chunk_indices[:p].tolist() == want.last_chunk_indices_p.tolist()
            assert bucket.ssd_has_initial[:p].tolist() == want.has_initial_states_p.tolist()
    assert mixed > 10
    assert builder.chunkmeta_stats()["mixed_fallbacks"] == {}


def test_v1_builds_every_group_itself(configs, full_cls):
    """V1 captures each KV-cache group on its own builder (its own buckets): reusing group 1's
    metadata would leave the others' graphs on never-restaged buckets (MRV2 reuses at capture
    too: the view below)."""
    config = configs["mamba2"]
    assert not config.use_v2_model_runner  # vllm_real_batches drives V1
    assert Builder(SPEC, LAYERS, config, DEVICE).supports_update_block_table  # vLLM's own: reuse
    assert not full_cls(SPEC, LAYERS, config, DEVICE).supports_update_block_table


def test_another_groups_view_has_its_own_state_indices(configs, full_cls):
    ours, other = (full_cls(SPEC, LAYERS, configs["mamba2"], DEVICE) for _ in range(2))
    bucket = ours.build_for_cudagraph_capture(capture_metadata(BUCKET_TOKENS, MAX_NUM_SEQS)).chunkmeta_mixed
    m = padded_metadata([1, 1, 70, 30], [9, 5, 0, 12], MAX_NUM_SEQS, BUCKET_TOKENS)
    metadata = ours.build(0, m)
    table = m.block_table_tensor + 1000  # another group's blocks
    table[4:] = mixed_step.NULL_BLOCK_ID
    view = other.update_block_table(metadata, table, m.slot_mapping).chunkmeta_mixed
    assert isinstance(view, mixed_step.GroupInputs) and view.bucket is bucket
    assert view.state_indices.tolist() == vllm_rows(Builder(SPEC, LAYERS, configs["mamba2"], DEVICE).update_block_table(
        Builder(SPEC, LAYERS, configs["mamba2"], DEVICE).build(0, m), table, m.slot_mapping))  # fmt: skip
    assert view.state_indices.tolist() != bucket.state_indices.tolist()
    # its SSD rows: the prefill rows' indices in this group's blocks, padding after them
    assert view.ssd_state_indices.tolist() == view.state_indices.tolist()[2:] + [mixed_step.NULL_BLOCK_ID] * 2
    assert view.ssd_state_indices.tolist() != bucket.ssd_state_indices.tolist()
    assert view.ssd_cu_chunk_seqlens is bucket.ssd_cu_chunk_seqlens


def test_align_mode_stages_checkpoint_offsets_and_blocks(configs, full_cls, monkeypatch):
    from vllm.model_executor.layers.mamba.checkpoint import MambaPrefillCheckpointMetadata

    config = configs["mamba2"]
    monkeypatch.setattr(config.cache_config, "mamba_cache_mode", "align")
    offsets, blocks = [130, 0, 77], [41, 0, 43]  # the prefill rows' (500, 37, 200 new tokens); 0: none

    def checkpoints(self, m, rows):
        if len(rows) != len(offsets):  # the capture's batch: no checkpoint (vLLM's None)
            return None
        return MambaPrefillCheckpointMetadata(
            torch.tensor(offsets, dtype=torch.int32), torch.tensor(blocks, dtype=torch.int32), offsets=offsets
        )

    builder, stock = full_cls(SPEC, LAYERS, config, DEVICE), Builder(SPEC, LAYERS, config, DEVICE)
    for made in (builder, stock):
        monkeypatch.setattr(made.checkpoint_builder, "build", checkpoints.__get__(made.checkpoint_builder))
    bucket = builder.build_for_cudagraph_capture(capture_metadata(1024, 5)).chunkmeta_mixed
    assert bucket.checkpoints
    query, context = [1, 1, 500, 37, 200], [40, 9, 100, 27, 64]
    got = builder.build(0, padded_metadata(query, context, 5, 1024))
    want = stock.build(0, padded_metadata(query, context, 5, 1024))
    assert got.chunkmeta_mixed is bucket and want.num_decodes == 2
    null2 = [mixed_step.NULL_BLOCK_ID] * 2  # the SSD rows are the prefill rows, then padding
    assert bucket.ssd_checkpoint_offsets.tolist() == [*offsets, 0, 0]
    assert bucket.ssd_checkpoint_state_indices.tolist() == blocks + null2
    # the chunk each checkpoint ends, as vLLM's tables name it
    marks = bucket.checkpoint_chunk_idx[:3].tolist()
    assert [mark for mark, offset in zip(marks, offsets, strict=True) if offset] == [
        mark for mark, offset in zip(want.checkpoint_chunk_idx.tolist(), offsets, strict=True) if offset
    ]
    # another group's checkpoint blocks: vLLM regathers them from that group's block table
    other = full_cls(SPEC, LAYERS, config, DEVICE)
    regathered = dataclasses.replace(got.checkpoint_meta, state_indices=torch.tensor([51, 0, 53], dtype=torch.int32))
    monkeypatch.setattr(type(got.checkpoint_meta), "regather_state_indices", lambda self, table: regathered)
    m = padded_metadata(query, context, 5, 1024)
    view = other.update_block_table(got, m.block_table_tensor, m.slot_mapping).chunkmeta_mixed
    assert view.ssd_checkpoint_state_indices.tolist() == [51, 0, 53] + null2
    assert bucket.ssd_checkpoint_state_indices.tolist() == blocks + null2


def test_a_failed_stage_keeps_chunkmetas_eager_tables_with_one_warning(configs, full_cls, monkeypatch, caplog):
    builder = full_cls(SPEC, LAYERS, configs["mamba2"], DEVICE)
    builder.build_for_cudagraph_capture(capture_metadata(BUCKET_TOKENS, MAX_NUM_SEQS))

    def refuse(self, *args, **kwargs):
        raise ChunkMetaError("refused for the test")

    monkeypatch.setattr(mixed_step.Mamba2StepInputs, "stage", refuse)
    with caplog.at_level(logging.WARNING, logger="vllm.chunkmeta"):
        for _ in range(3):
            m = padded_metadata([1, 70], [9, 0], MAX_NUM_SEQS, BUCKET_TOKENS)
            got = builder.build(0, m)
            want = Builder(SPEC, LAYERS, configs["mamba2"], DEVICE).build(0, m)
            assert not hasattr(got, "chunkmeta_mixed")
            assert torch.equal(got.cu_chunk_seqlen_p, want.cu_chunk_seqlen_p)
            assert torch.equal(got.seq_idx_p, want.seq_idx_p)
    warnings = [r for r in caplog.records if "mixed step stays on vLLM's path" in r.getMessage()]
    assert len(warnings) == 1
    assert list(builder.chunkmeta_stats()["mixed_fallbacks"].values()) == [3]


def test_the_mixer_takes_the_graph_safe_path_for_a_bucket_only(configs, full_cls, monkeypatch):
    from vllm.forward_context import override_forward_context

    module = importlib.import_module(full_graph.MAMBA2_LAYER_MODULE)  # wired by full_cls's install()
    forward = getattr(module, full_graph.MAMBA2_LAYER).__dict__["conv_ssm_forward"]
    assert forward.__qualname__ == f"chunkmeta.{full_graph.MAMBA2_LAYER}.conv_ssm_forward"
    calls = []
    monkeypatch.setattr(full_graph, "mamba2_mixed_forward", lambda ops, inputs, **kw: calls.append((ops, inputs, kw)))
    builder = full_cls(SPEC, LAYERS, configs["mamba2"], DEVICE)
    bucket = builder.build_for_cudagraph_capture(capture_metadata(BUCKET_TOKENS, MAX_NUM_SEQS)).chunkmeta_mixed
    heads, head_dim, groups, state = 4, 8, 2, 16
    conv_dim = heads * head_dim + 2 * groups * state
    layer = types.SimpleNamespace(
        prefix=LAYERS[0], tped_intermediate_size=heads * head_dim, tped_conv_size=conv_dim, tped_dt_size=heads,
        kv_cache=(torch.zeros(5, 3, conv_dim), torch.zeros(5, heads, head_dim, state)),
        conv_weights=torch.zeros(conv_dim, 4), conv1d=types.SimpleNamespace(bias=None), activation="silu",
        A=torch.zeros(heads), D=torch.zeros(heads), dt_bias=torch.zeros(heads), num_heads=heads, tp_size=1,
        head_dim=head_dim, n_groups=groups, conv_kernel_size=4, is_blackwell=False,
    )  # fmt: skip
    projected = torch.randn(BUCKET_TOKENS + 8, heads * head_dim + conv_dim + heads)
    output = torch.zeros(BUCKET_TOKENS + 8, heads * head_dim)
    metadata = builder.build(0, padded_metadata([1, 70], [9, 0], MAX_NUM_SEQS, BUCKET_TOKENS))
    with override_forward_context(types.SimpleNamespace(attn_metadata={layer.prefix: metadata})):
        forward(layer, projected, output)
    ((ops, inputs, kw),) = calls
    assert inputs is bucket and isinstance(ops, mixed_step.Mamba2Ops)
    assert kw["hidden_states_B_C"].shape == (BUCKET_TOKENS, conv_dim) and kw["dt"].shape == (BUCKET_TOKENS, heads)
    assert kw["output"].shape == (BUCKET_TOKENS, heads * head_dim) and kw["state_len"] == 3
    assert kw["conv_state"].shape[-2:] == (conv_dim, 3)  # (..., dim, width - 1), as the conv kernels take it
    # a step with no bucket: vLLM's own method (here it stops on the stand-in layer)
    with override_forward_context(types.SimpleNamespace(attn_metadata={layer.prefix: dataclasses.replace(metadata)})):
        with pytest.raises(AttributeError):
            forward(layer, projected, output)
    assert len(calls) == 1
