"""The SGLang adapter against the installed SGLang (``make test-sglang``; skipped without SGLang).

On CPU, with tests/integrations/sglang/sglang_cpu_stubs.py standing in for torchvision: the hook generation and every
overridden method's signature against SGLang's own classes; install()/uninstall() on SGLang's module
attributes and the plugin entry point as SGLang's loader sees it; and SGLang's own metadata code
(MambaAttnBackendBase / GDNAttnBackend / KDAAttnBackend.init_forward_metadata on a hand-built
ForwardBatch) with chunkmeta's tables checked against chunkmeta.reference, then carried by SGLang's
real kernel dispatcher to chunk_kda (KDA) and by the router through SGLang's real GDN forward code to
its kernels (GDN), whose Triton kernels are replaced by recorders.
"""

import contextlib
import importlib.util
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (make test-sglang builds a venv with it)", allow_module_level=True)

import sglang_cpu_stubs

sglang_cpu_stubs.install()  # before any SGLang import: its config modules import torchvision

import sglang
from sglang.srt.layers.attention.linear import gdn_backend, kda_backend
from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from chunkmeta import layout, reference
from chunkmeta.integrations import plugin
from chunkmeta.integrations import sglang as sg

FLA = "sglang.kernels.ops.attention.fla"
STOCK = {"kda": kda_backend.KDAAttnBackend, "gdn": gdn_backend.GDNAttnBackend}


def version():
    return plugin.release(sg.package_version("sglang"))


def test_installed_version_is_supported():
    low, high = sg.SUPPORTED_VERSIONS
    assert low <= version()[:3] <= high, sglang.__version__


def parameters(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_hooks_and_signatures_match_sglang(kind):
    base = STOCK[kind]
    cls = sg.chunkmeta_backend(base, kind=kind, fla_package=FLA)
    expected = "split" if version() >= (0, 5, 13) else "legacy"
    assert sg.hook_generation(base) == expected == cls.chunkmeta_hooks
    names = [
        name
        for mixin in cls.__mro__[1:]
        if mixin.__module__ == sg.backends.__name__
        for name, value in vars(mixin).items()
        if inspect.isfunction(value)
    ]
    checked = [name for name in names if hasattr(base, name)]
    for name in checked:
        assert parameters(getattr(cls, name)) == parameters(getattr(base, name)), name
    hooks = {"init_forward_metadata", "__init__"} | (
        {"init_forward_metadata_out_graph", "init_forward_metadata_in_graph"}
        if expected == "split"
        else {"init_forward_metadata_capture_cuda_graph", "init_forward_metadata_replay_cuda_graph"}
    )
    assert hooks <= set(checked)
    if kind == "kda" and version() >= (0, 5, 22):
        assert cls._chunkmeta_kwargs
        assert {"init_prefill_graph_metadata", "refresh_prefill_graph_metadata"} <= set(checked)
        # the dispatcher's extend forwards keyword arguments, and the Triton kernel hands them to chunk_kda
        assert "kwargs" in inspect.signature(kda_backend.KDAKernelDispatcher.extend).parameters
        assert sg.chunk_kda_takes_tables(FLA)


def test_padding_rows_are_sglangs_own():
    """chunkmeta's bounded and graph tables pad with the row SGLang's own KDA prefill graph uses."""
    if version() < (0, 5, 22):
        pytest.skip("SGLang's KDA prefill graph (and its padding row) came in 0.5.22")
    from sglang.srt.layers.attention.linear import kda_prefill_graph

    assert layout.padding_row(sg.PAD, 16) == (0, kda_prefill_graph._PAD_CHUNK)


def test_capacity_from_sglang_server_args():
    from types import SimpleNamespace

    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path="unused")  # unresolved: chunked_prefill_size is still None
    runner = SimpleNamespace(
        server_args=server_args,
        req_to_token_pool=Pool(),
        max_running_requests=None,
        model_config=SimpleNamespace(context_len=8192),
    )
    seqs, tokens = sg.backend_capacity(runner)
    assert seqs == Pool.size and tokens == max(server_args.max_prefill_tokens, 8192) + seqs
    server_args.chunked_prefill_size, server_args.max_running_requests = 4096, 48
    assert sg.backend_capacity(runner) == (48, max(server_args.max_prefill_tokens, 4096) + 48)
    # the runner fields the sizing reads exist where SGLang sets them
    source = inspect.getsource(ModelRunner)
    assert "self.max_running_requests =" in source and "self.req_to_token_pool =" in source


def test_forward_mode_helpers():
    with_tables = {
        ForwardMode.EXTEND,
        ForwardMode.MIXED,
        ForwardMode.SPLIT_PREFILL,
        ForwardMode.DLLM_EXTEND,
        ForwardMode.DRAFT_EXTEND_V2,
    }
    for mode in ForwardMode:
        assert sg.needs_chunk_tables(mode) == (mode in with_tables), mode


def test_install_uninstall_and_the_plugin_entry_point(monkeypatch):
    try:
        classes = sg.install()
        assert kda_backend.KDAAttnBackend is classes["kda"] and gdn_backend.GDNAttnBackend is classes["gdn"]
        assert sg.install() == classes
        # what attn_backend_wrapper does, inside its body
        from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend

        assert KDAAttnBackend is classes["kda"] and classes["kda"].chunkmeta_base is STOCK["kda"]
        assert classes["gdn"]._chunkmeta_router.package == FLA
    finally:
        sg.uninstall()
    assert kda_backend.KDAAttnBackend is STOCK["kda"] and gdn_backend.GDNAttnBackend is STOCK["gdn"]

    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    plugins = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert plugins["chunkmeta"][0] is sg.sglang_plugin
    monkeypatch.setenv("CHUNKMETA_SGLANG", "1")
    try:
        plugins["chunkmeta"][0]()
        assert kda_backend.KDAAttnBackend.__module__ == sg.backends.__name__
    finally:
        sg.uninstall()


# -- SGLang's own metadata code with chunkmeta's tables --------------------------------------------


CONV_LEN = 3  # the conv state's width - 1 (a kernel of 4)


class Pool:
    """The req_to_token_pool calls the metadata path makes (slot 0 is the padding slot), and the
    conv state whose shape the backends' __init__ reads (no ReplaySSM ring)."""

    size = 16
    mamba_pool = SimpleNamespace(
        enable_linear_replayssm=False, mamba_cache=SimpleNamespace(conv=[torch.zeros(size + 1, 8, CONV_LEN)])
    )

    def get_mamba_indices(self, req_pool_indices):
        return (req_pool_indices + 1).to(torch.int32)

    def translate_mamba_indices(self, indices):
        return indices


def model_runner(mamba_chunk_size=64, **server_args):
    """A stand-in ModelRunner with the fields SGLang's KDA / GDN / Mamba2 ``__init__`` and
    chunkmeta's sizing read (Triton kernels, a 16-request pool, unresolved ServerArgs)."""
    from sglang.srt.server_args import ServerArgs

    triton = LinearAttnKernelBackend.TRITON
    return SimpleNamespace(
        server_args=ServerArgs(model_path="unused", **server_args),
        device="cpu",
        is_draft_worker=False,
        req_to_token_pool=Pool(),
        token_to_kv_pool=None,
        max_running_requests=None,
        model_config=SimpleNamespace(
            context_len=8192, hf_text_config=SimpleNamespace(mamba_chunk_size=mamba_chunk_size)
        ),
        linear_attn_backends=SimpleNamespace(decode=triton, prefill=triton, verify=triton),
    )


def construct(cls, runner=None):
    """``cls(runner)``, SGLang's own constructor (and chunkmeta's ``__init__`` hook in it), under a
    runtime context of the runner's server args, which the scheduler publishes before it builds
    the model runner (the backends read it through get_spec() / get_exec())."""
    from sglang.srt.runtime_context import ParallelContext, RuntimeContext, use_context

    runner = runner or model_runner()
    context = RuntimeContext(parallel=ParallelContext())
    context.set_server_args(runner.server_args)
    with use_context(context):
        return cls(runner)


def backend(kind, runner=None):
    """chunkmeta's subclass of SGLang's backend, made by SGLang's ``__init__`` (``construct``):
    chunkmeta is attached and sized there, as in a server."""
    obj = construct(sg.chunkmeta_backend(STOCK[kind], kind=kind, fla_package=FLA), runner)
    assert isinstance(obj.chunkmeta, sg.BackendChunkMeta)
    return obj


@pytest.fixture
def made():
    backends = []
    yield backends
    for obj in backends:
        obj.chunkmeta.close()


def forward_batch(lens, mode=ForwardMode.EXTEND, host_lens=True, num_tokens=None):
    """A ForwardBatch as ForwardBatch.init_new fills it for an extend (the fields the path reads)."""
    bs, total = len(lens), sum(lens)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    start = torch.zeros(bs, dtype=torch.int32)
    start[1:] = torch.cumsum(lens_t[:-1], 0)
    padded = num_tokens or total
    return ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=torch.zeros(padded, dtype=torch.int64),
        req_pool_indices=torch.arange(bs),
        seq_lens=lens_t.long(),
        out_cache_loc=torch.zeros(padded, dtype=torch.int64),
        seq_lens_sum=total,
        extend_num_tokens=padded,
        extend_seq_lens=lens_t,
        extend_prefix_lens=torch.zeros(bs, dtype=torch.int32),
        extend_start_loc=start,
        extend_seq_lens_cpu=list(lens) if host_lens else None,
        extend_prefix_lens_cpu=[0] * bs if host_lens else None,
    )


def decode_batch(bs=3):
    """A DECODE ForwardBatch of ``bs`` requests of 9 tokens each."""
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=bs,
        input_ids=torch.zeros(bs, dtype=torch.int64),
        req_pool_indices=torch.arange(bs),
        seq_lens=torch.full((bs,), 9),
        out_cache_loc=torch.zeros(bs, dtype=torch.int64),
        seq_lens_sum=9 * bs,
    )


def rows(t):
    return [tuple(r) for r in t.tolist()]


def check(tables, lens, kind):
    ref = reference.chunk_metadata([0] + torch.tensor(lens).cumsum(0).tolist(), 64)
    assert tables.layout == kind
    assert tables.query_start_loc.tolist() == ref.cu_seqlens
    got = rows(tables.chunk_indices)
    assert got[: ref.num_chunks] == ref.chunk_indices
    assert got[ref.num_chunks :] == [(0, layout.PAST_END_CHUNK)] * (len(got) - ref.num_chunks)
    assert tables.chunk_offsets.tolist()[: len(lens) + 1] == ref.chunk_offsets


CASES = [
    ([5, 70, 1, 1], ForwardMode.MIXED),
    ([128, 257], ForwardMode.EXTEND),
    ([1, 64, 65, 129], ForwardMode.EXTEND),
    ([70, 5, 0], ForwardMode.EXTEND),
]


@pytest.mark.parametrize("kind", ["kda", "gdn"])
def test_sglang_metadata_path_gives_exact_and_bounded_tables(made, kind):
    obj = backend(kind)
    made.append(obj)
    for lens, mode in CASES:
        obj.init_forward_metadata(forward_batch(lens, mode, num_tokens=sum(lens) + 30))  # DP-padded tokens
        assert obj.forward_metadata.query_start_loc is obj.chunkmeta.tables.query_start_loc
        check(obj.chunkmeta.tables, lens, "exact")
        obj.init_forward_metadata(forward_batch(lens, mode, host_lens=False))  # gpu_only: no host lengths
        check(obj.chunkmeta.tables, lens, "bounded")
        assert obj.chunkmeta.tables.num_rows == layout.chunk_row_bound(len(lens), sum(lens), 64)
    decode = decode_batch()
    obj.init_forward_metadata(decode)
    assert obj.chunkmeta.tables is None and obj.forward_metadata.query_start_loc.tolist() == [0, 1, 2, 3]


def test_kda_dispatcher_carries_the_tables_to_chunk_kda(made, monkeypatch):
    if version() < (0, 5, 22):
        pytest.skip("chunk_kda takes chunk_indices/chunk_offsets from SGLang 0.5.22")
    from sglang.srt.layers.attention.linear.kernels import kda_triton

    seen = {}
    monkeypatch.setattr(kda_triton, "chunk_kda", lambda **kw: seen.update(kw) or "out")
    obj = backend("kda")
    made.append(obj)
    lens = [300, 1, 64]
    obj.init_forward_metadata(forward_batch(lens))
    fm = obj.forward_metadata
    q = torch.zeros(1, sum(lens), 2, 8)
    assert (
        obj.kernel_dispatcher.extend(
            q=q,
            k=q,
            v=q,
            g=q,
            beta=q[..., 0],
            ssm_states=None,
            cache_indices=fm.mamba_cache_indices,
            query_start_loc=fm.query_start_loc,
            beta_is_raw=True,
            extend_seq_lens_cpu=lens,
        )
        == "out"
    )
    tables = obj.chunkmeta.tables
    assert seen["chunk_indices"] is tables.chunk_indices and seen["chunk_offsets"] is tables.chunk_offsets
    assert seen["cu_seqlens"] is fm.query_start_loc
    check(tables, lens, "exact")


class KernelRecorder:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` records its arguments by name."""

    def __init__(self, kernel):
        self.arg_names = kernel.arg_names  # the JITFunction's parameters, for positional launches
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append({**dict(zip(self.arg_names, args, strict=False)), **kwargs})


def test_gdn_forward_code_gets_the_tables_through_the_router(made, monkeypatch):
    from sglang.kernels.ops.attention.fla import chunk, chunk_delta_h, chunk_o, utils

    # CPU only: FLA's input_guard enters a device context that torch.cpu lacks
    monkeypatch.setattr(utils, "custom_device_ctx", lambda index: contextlib.nullcontext())
    recorded = {}

    def cumsum(g, **kwargs):
        recorded["cumsum"] = kwargs
        return g

    def intra(k, v, g, beta, **kwargs):
        recorded["intra"] = kwargs
        return k, v, None  # w, u, A

    monkeypatch.setattr(chunk, "l2norm_fwd", lambda x: x)
    monkeypatch.setattr(chunk, "chunk_local_cumsum", cumsum)
    monkeypatch.setattr(chunk, "chunk_gated_delta_rule_fwd_intra", intra)
    fwd_h = KernelRecorder(chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64)
    fwd_o = KernelRecorder(chunk_o.chunk_fwd_kernel_o)
    monkeypatch.setattr(chunk_delta_h, "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", fwd_h)
    monkeypatch.setattr(chunk_o, "chunk_fwd_kernel_o", fwd_o)
    obj = backend("gdn")
    made.append(obj)
    router = obj.chunkmeta.router
    for lens in ([300, 1, 64], [5, 7, 1]):  # T >= 64, and T < 64 (chunk_fwd_o asks for BT = 16)
        recorded.clear()
        obj.init_forward_metadata(forward_batch(lens))
        fm, tables = obj.forward_metadata, obj.chunkmeta.tables
        x = torch.zeros(1, sum(lens), 2, 16, dtype=torch.bfloat16)  # the forward refuses float32
        gates = torch.zeros(1, sum(lens), 2, dtype=torch.bfloat16)
        hits, misses = router.hits, router.misses
        obj.kernel_dispatcher.extend(
            q=x,
            k=x,
            v=x,
            g=gates,
            beta=gates,
            ssm_states=torch.zeros(4, 2, 16, 16),
            cache_indices=fm.mamba_cache_indices,
            query_start_loc=fm.query_start_loc,
        )
        assert recorded["cumsum"]["chunk_indices"] is tables.chunk_indices
        assert recorded["intra"]["chunk_indices"] is tables.chunk_indices
        assert fwd_h.calls[-1]["chunk_offsets"] is tables.chunk_offsets
        assert fwd_o.calls[-1]["chunk_indices"] is tables.chunk_indices  # chunk_fwd_o's own BT table too
        assert router.hits - hits == 3 and router.misses == misses
        check(tables, lens, "exact")
    # a call that is not ours runs SGLang's own helper, with its own signature
    other = torch.tensor([0, 3, 70], dtype=torch.int32)
    assert rows(chunk.prepare_chunk_indices(other, 64)) == [(0, 0), (1, 0), (1, 1)]


def test_kda_forward_code_gets_the_tables_through_the_router(made, monkeypatch):
    """KDA without injected tables (ROCm, and SGLang < 0.5.22): SGLang's real chunk_kda derives them
    through the vendored helpers, which the router answers."""
    from sglang.kernels.ops.attention.fla import chunk_delta_h, kda, utils

    monkeypatch.setattr(torch.version, "hip", "7.2.0", raising=False)
    monkeypatch.setattr(utils, "custom_device_ctx", lambda index: contextlib.nullcontext())
    recorded = {}

    def cumsum(g, **kwargs):
        recorded["cumsum"] = kwargs
        return g

    def intra(q, k, v, gk, beta, **kwargs):
        recorded["intra"] = kwargs
        return k, v, None, k, None, None  # w, u, _, kg, Aqk, _

    def output(**kwargs):
        recorded["output"] = kwargs
        return kwargs["v"]

    monkeypatch.setattr(kda, "l2norm_fwd", lambda x: x)
    monkeypatch.setattr(kda, "chunk_local_cumsum", cumsum)
    monkeypatch.setattr(kda, "chunk_kda_fwd_intra", intra)
    monkeypatch.setattr(kda, "chunk_gla_fwd_o_gk", output)
    fwd_h = KernelRecorder(chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64)
    monkeypatch.setattr(chunk_delta_h, "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", fwd_h)
    obj = backend("kda")
    made.append(obj)
    assert not type(obj)._chunkmeta_kwargs
    lens = [300, 1, 64]
    obj.init_forward_metadata(forward_batch(lens))
    fm, tables = obj.forward_metadata, obj.chunkmeta.tables
    q = torch.zeros(1, sum(lens), 2, 16)
    hits = obj.chunkmeta.router.hits
    obj.kernel_dispatcher.extend(
        q=q,
        k=q,
        v=q,
        g=q,
        beta=q[..., 0],
        ssm_states=torch.zeros(4, 2, 16, 16),
        cache_indices=fm.mamba_cache_indices,
        query_start_loc=fm.query_start_loc,
    )
    assert recorded["cumsum"]["chunk_indices"] is tables.chunk_indices
    assert recorded["intra"]["chunk_indices"] is tables.chunk_indices
    assert recorded["output"]["chunk_indices"] is tables.chunk_indices
    assert fwd_h.calls[-1]["chunk_offsets"] is tables.chunk_offsets
    assert obj.chunkmeta.router.hits - hits == 2 and obj.chunkmeta.counts["kwargs"] == 0


def test_sglang_graph_hooks_pass_through():
    """0.5.23's base serves only decode/verify in its graph hooks; chunkmeta adds nothing there."""
    obj = backend("kda")
    try:
        obj.pad_slot_id, obj.state_indices_list, obj.query_start_loc_list = -1, [], []
        obj.replayssm_write_pos_list = obj.replayssm_force_flush_list = None
        obj.retrieve_next_token_list, obj.retrieve_next_sibling_list, obj.retrieve_parent_token_list = [], [], []
        obj._fused_state_indices_ok, obj._graph_seq_len_fill_value = False, 1
        obj.mamba_track_indices_buf = None
        obj.cached_cuda_graph_decode_query_start_loc = torch.arange(0, 5, dtype=torch.int32)
        obj.query_start_loc_list = [torch.zeros(i + 2, dtype=torch.int32) for i in range(4)]
        obj.state_indices_list = [torch.full((i + 1,), -1, dtype=torch.int32) for i in range(4)]
        decode = decode_batch()
        obj.init_forward_metadata(forward_batch([100, 5]))
        obj.init_forward_metadata_out_graph(decode, in_capture=True)
        obj.init_forward_metadata_in_graph(decode)
        assert obj.chunkmeta.tables is None
        assert obj.forward_metadata.query_start_loc is obj.query_start_loc_list[2]
        with pytest.raises(ValueError, match="Invalid forward mode"):
            obj.init_forward_metadata_out_graph(forward_batch([100, 5]), in_capture=True)
    finally:
        obj.chunkmeta.close()


# -- the plugin in a fresh SGLang process --------------------------------------------------------

SGLANG_TESTS = str(Path(__file__).parent)


def sglang_plugin_imports(opted_in):
    from engine_imports import plugin_imports

    return plugin_imports(
        package="sglang",
        loader_module="sglang.srt.plugins",
        load="sglang.srt.plugins.load_plugins()",
        env_var="CHUNKMETA_SGLANG",
        opted_in=opted_in,
        env={"SGLANG_PLUGINS": "chunkmeta"},
        # the tests' torchvision stand-in, as in this process (no sglang module of its own)
        prelude=f"sys.path.insert(0, {SGLANG_TESTS!r})\nimport sglang_cpu_stubs\nsglang_cpu_stubs.install()",
        after_load="""
            import torch
            from chunkmeta.integrations import sglang as sg

            extra = {"pending": list(getattr(sg, "pending", tuple)()), "cuda": torch.cuda.is_initialized()}
            # what SGLang's backend selection imports (attention_registry.py, inside the function)
            from sglang.srt.layers.attention.hybrid_linear_attn_backend import Mamba2AttnBackend
            from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
            from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend

            classes = (KDAAttnBackend, GDNAttnBackend, Mamba2AttnBackend)
            extra["wired"] = [c.__module__ == sg.backends.__name__ for c in classes]
        """,
    )


def test_plugin_imports_no_sglang_module_in_a_fresh_process():
    """SGLang calls load_plugins() in its engine, detokenizer and every scheduler process: with
    CHUNKMETA_SGLANG=1 the plugin adds no SGLang module to what the loader imports by itself (its
    patches wait for SGLang's own import of the backend modules), and it still wires every
    backend once SGLang imports them."""
    baseline, off = sglang_plugin_imports(opted_in=False)
    new, on = sglang_plugin_imports(opted_in=True)
    assert sorted(set(new) - set(baseline)) == [], f"{len(set(new) - set(baseline))} SGLang modules imported"
    assert off["wired"] == [False, False, False] and off["pending"] == []
    assert on["wired"] == [True, True, True] and on["pending"] and not on["cuda"], on


@pytest.mark.parametrize(
    "lens, same",
    [([70, 5, 0, 0], True), ([300, 1, 64], True), ([5, 0, 65], False), ([0, 64], False)],
    ids=["trailing_empty", "no_empty", "empty_inside", "empty_first"],
)
def test_exact_tables_against_sglangs_vendored_helpers(made, lens, same):
    """The exact tables are the vendored prepare_chunk_indices / _offsets' own while zero-length
    rows trail (DP padding); an empty row before a non-empty one makes the vendored helper
    renumber the sequences after it, and chunkmeta keeps the cu_seqlens index (docs/sglang.md)."""
    from sglang.kernels.ops.attention.fla import index

    obj = backend("gdn")
    made.append(obj)
    obj.init_forward_metadata(forward_batch(lens))
    tables = obj.chunkmeta.tables
    qsl = tables.query_start_loc.clone()  # a fresh object: the vendored helpers' cache keys on identity
    vendored = index.prepare_chunk_indices(qsl, 64)
    assert torch.equal(tables.chunk_offsets, index.prepare_chunk_offsets(qsl, 64))
    assert torch.equal(tables.chunk_indices, vendored) == same
    check(tables, lens, "exact")  # the contract: row (i, t) with i the cu_seqlens index
    offsets = tables.chunk_offsets.tolist()
    assert [offsets[i] + t for i, t in rows(tables.chunk_indices)] == list(range(tables.num_rows))
