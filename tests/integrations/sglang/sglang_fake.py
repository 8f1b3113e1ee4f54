"""A small, faithful model of the SGLang interfaces chunkmeta's SGLang adapter touches.

The CPU tests (tests/integrations/sglang/test_sglang.py) and the GPU tests run the adapter against this model: SGLang
itself is not installed in ``make test`` (nor installable on the GPU machine). Each section names the
SGLang file it mirrors (paths inside the ``sglang`` package, 0.5.23 unless noted) and each class or
function the SGLang class or function, reduced to the linear-attention metadata path: method names
and signatures are SGLang's, bodies are written from reading those files, not copied.
``tests/integrations/sglang/test_sglang_real.py`` checks the adapter against the real classes where
SGLang is installed (``make test-sglang``).

``register(root, version)`` puts a module tree with SGLang's module paths under ``root`` into
``sys.modules``, so ``chunkmeta.integrations.sglang.install(package=root)`` finds the classes where it
finds SGLang's::

    {root}                                                  __version__
    {root}.srt.model_executor.forward_batch_info            ForwardMode, ForwardBatch
    {root}.srt.layers.attention.base_attn_backend           AttentionBackend
    {root}.srt.layers.attention.hybrid_linear_attn_backend  MambaAttnBackendBase
    {root}.srt.layers.attention.linear.kda_backend          KDAAttnBackend, KDAKernelDispatcher
    {root}.srt.layers.attention.linear.gdn_backend          GDNAttnBackend, GDNKernelDispatcher
    {fla}.index, .kda, .chunk, .chunk_delta_h, .chunk_o     vendored FLA: helpers and entry points

``{fla}`` is ``{root}.kernels.ops.attention.fla`` (>= 0.5.16) or ``{root}.srt.layers.attention.fla``.
Versions modelled: ``"0.5.23"`` (split graph hooks, ``logical_forward_mode``, ``chunk_kda`` takes
``chunk_indices``/``chunk_offsets``, KDA prefill-graph tables), ``"0.5.21"`` (split hooks, neither of
those), ``"0.5.12"`` (legacy capture/replay hooks, FLA under ``srt/layers/attention/fla``, no
``logical_num_tokens``).

The FLA "kernels" compute no attention: they return a ``KernelRun`` recording the tables they ran on,
and the vendored ``prepare_chunk_indices`` counts its host read (the ``.tolist()`` sync) in
``tree.state["fla_syncs"]``.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import IntEnum, auto

import torch

VERSIONS = ("0.5.23", "0.5.21", "0.5.12")


# -- srt/model_executor/forward_batch_info.py ----------------------------------------------------


class ForwardMode(IntEnum):
    """``ForwardMode`` (an IntEnum built with auto(): its integer values moved between releases)."""

    EXTEND = auto()
    DECODE = auto()
    MIXED = auto()
    IDLE = auto()
    TARGET_VERIFY = auto()
    DRAFT_EXTEND_V2 = auto()
    PREBUILT = auto()
    SPLIT_PREFILL = auto()
    DLLM_EXTEND = auto()

    def is_prefill(self, include_draft_extend_v2: bool = False):
        return self.is_extend(include_draft_extend_v2=include_draft_extend_v2)

    def is_extend(self, include_draft_extend_v2: bool = False):
        # TARGET_VERIFY counts as an extend in SGLang.
        return self in (
            ForwardMode.EXTEND,
            ForwardMode.MIXED,
            ForwardMode.TARGET_VERIFY,
            ForwardMode.SPLIT_PREFILL,
            ForwardMode.DLLM_EXTEND,
        ) or (include_draft_extend_v2 and self == ForwardMode.DRAFT_EXTEND_V2)

    def is_decode(self):
        return self == ForwardMode.DECODE

    def is_mixed(self):
        return self == ForwardMode.MIXED

    def is_idle(self):
        return self == ForwardMode.IDLE

    def is_decode_or_idle(self):
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def is_target_verify(self):
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend_v2(self):
        return self == ForwardMode.DRAFT_EXTEND_V2

    def is_split_prefill(self):
        return self == ForwardMode.SPLIT_PREFILL

    def is_dllm_extend(self):
        return self == ForwardMode.DLLM_EXTEND

    def is_prebuilt(self):
        return self == ForwardMode.PREBUILT

    def is_extend_without_speculative(self):
        return self.is_extend() and not self.is_target_verify()

    def is_cuda_graph(self):
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE, ForwardMode.DLLM_EXTEND)


@dataclass
class ForwardBatch:
    """``ForwardBatch``: the fields the linear-attention backends read."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor | None = None
    extend_num_tokens: int | None = None
    extend_seq_lens: torch.Tensor | None = None
    extend_prefix_lens: torch.Tensor | None = None
    extend_start_loc: torch.Tensor | None = None
    extend_prefix_lens_cpu: list[int] | None = None
    extend_seq_lens_cpu: list[int] | None = None
    spec_info: object | None = None
    tbo_parent_token_range: tuple | None = None
    global_num_token_non_padded_cpu: int | None = None
    mamba_track_mask: torch.Tensor | None = None
    mamba_track_indices: torch.Tensor | None = None
    _original_batch_size: int | None = None
    _original_forward_mode: ForwardMode | None = None

    @property
    def logical_forward_mode(self) -> ForwardMode:
        """0.5.23: DP padding may relabel a decode batch EXTEND; the rows still decode."""
        original = self._original_forward_mode
        if original is not None and original.is_decode() and self.forward_mode.is_extend():
            return original
        return self.forward_mode


def extend_batch(
    lens, *, device="cpu", mode=ForwardMode.EXTEND, prefix_lens=None, host_lens=True, num_tokens=None, tbo_child=False
) -> ForwardBatch:
    """A batch as ``ForwardBatch.init_new`` makes it for an extend (main path: H2D from host lists,
    ``*_cpu`` mirrors set; ``host_lens=False``: the gpu_only path, mirrors left None), with
    ``extend_start_loc`` the exclusive cumsum of the lengths (``compute_position``).

    ``num_tokens`` > sum(lens) is DP padding of an EXTEND/MIXED rank (``_pad_inputs_to_size``):
    the token count and ``input_ids`` are padded, the lengths and the batch size are not.
    ``tbo_child``: a two-batch-overlap child (``tbo_parent_token_range`` set).
    """
    lens = [int(n) for n in lens]
    bs = len(lens)
    prefix_lens = [0] * bs if prefix_lens is None else list(prefix_lens)
    total = sum(lens)
    padded = total if num_tokens is None else num_tokens
    seq_lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    start = torch.zeros(bs, dtype=torch.int32, device=device)
    if bs > 1:
        start[1:] = torch.cumsum(seq_lens_t[:-1], 0)
    return ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=torch.zeros(padded, dtype=torch.int64, device=device),
        req_pool_indices=torch.arange(bs, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(
            [p + n for p, n in zip(prefix_lens, lens, strict=True)], dtype=torch.int64, device=device
        ),
        seq_lens_cpu=torch.tensor([p + n for p, n in zip(prefix_lens, lens, strict=True)], dtype=torch.int64),
        extend_num_tokens=padded,
        extend_seq_lens=seq_lens_t,
        extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=device),
        extend_start_loc=start,
        extend_prefix_lens_cpu=list(prefix_lens) if host_lens else None,
        extend_seq_lens_cpu=list(lens) if host_lens else None,
        tbo_parent_token_range=(0, total) if tbo_child else None,
        global_num_token_non_padded_cpu=total,
    )


def mixed_batch(prefill_lens, num_decodes, *, device="cpu", **kw) -> ForwardBatch:
    """MIXED (``ScheduleBatch.mix_with_running``, srt/managers/schedule_batch.py): the prefill rows
    first, then every running decode as a one-token extend appended at the end."""
    return extend_batch(
        list(prefill_lens) + [1] * num_decodes,
        device=device,
        mode=ForwardMode.MIXED,
        prefix_lens=[0] * len(prefill_lens) + [100] * num_decodes,
        **kw,
    )


def decode_batch(bs, *, device="cpu", mode=ForwardMode.DECODE, relabelled=False, draft_token_num=None):
    """DECODE / IDLE / TARGET_VERIFY. ``relabelled``: a decode rank that DP padding relabels EXTEND
    (``prepare_mlp_sync_batch``: one-token extends, ``_original_forward_mode = DECODE``)."""
    tokens = bs * (draft_token_num or 1)
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=torch.zeros(tokens, dtype=torch.int64, device=device),
        req_pool_indices=torch.arange(bs, dtype=torch.int64, device=device),
        seq_lens=torch.full((bs,), 50, dtype=torch.int64, device=device),
        seq_lens_cpu=torch.full((bs,), 50, dtype=torch.int64),
    )
    if draft_token_num is not None:
        fb.spec_info = types.SimpleNamespace(draft_token_num=draft_token_num, ragged_verify_layout=None)
    if relabelled:
        ext = extend_batch([1] * bs, device=device)
        for name in (
            "extend_num_tokens",
            "extend_seq_lens",
            "extend_prefix_lens",
            "extend_start_loc",
            "extend_seq_lens_cpu",
            "extend_prefix_lens_cpu",
        ):
            setattr(fb, name, getattr(ext, name))
        fb.forward_mode, fb._original_forward_mode = ForwardMode.EXTEND, ForwardMode.DECODE
    return fb


# -- srt/layers/attention/mamba/mamba2_metadata.py -------------------------------------------------


@dataclass(kw_only=True)
class ForwardMetadata:
    """``ForwardMetadata``: per forward, shared by every layer, mutable."""

    query_start_loc: torch.Tensor | None
    mamba_cache_indices: torch.Tensor
    logical_num_tokens: int | None = None
    has_mamba_track_mask: bool = False


# -- srt/model_executor/model_runner.py, srt/mem_cache/memory_pool.py -------------------------------


class ReqToTokenPool:
    """``HybridReqToTokenPool``: request row -> mamba slot (slot 0 is reserved for padded rows)."""

    def __init__(self, size: int, device):
        self.size = size
        self.device = device

    def get_mamba_indices(self, req_pool_indices):
        return (req_pool_indices + 1).to(torch.int32)

    def translate_mamba_indices(self, mamba_indices):
        return mamba_indices


def model_runner(
    device="cpu", *, max_running_requests=16, chunked_prefill_size=2048, max_prefill_tokens=4096, context_len=32768
):
    """The ``ModelRunner`` fields the backends (and chunkmeta's sizing) read."""
    server_args = types.SimpleNamespace(
        max_running_requests=max_running_requests,
        chunked_prefill_size=chunked_prefill_size,
        max_prefill_tokens=max_prefill_tokens,
        context_length=None,
        speculative_eagle_topk=None,
        enable_mis=False,
    )
    return types.SimpleNamespace(
        device=device,
        server_args=server_args,
        max_running_requests=max_running_requests,
        req_to_token_pool=ReqToTokenPool(max_running_requests, device),
        model_config=types.SimpleNamespace(context_len=context_len),
    )


# -- the vendored FLA ({fla}: kernels/ops/attention/fla/, srt/layers/attention/fla/ before 0.5.16) --


@dataclass
class KernelRun:
    """What a chunked FLA forward ran on (stands in for its output)."""

    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    output_chunk_indices: torch.Tensor | None = None  # GDN's chunk_fwd_o table
    output_chunk_size: int = 64
    extra: dict = field(default_factory=dict)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# -- building a tree -------------------------------------------------------------------------------


def _module(name: str, package: bool = False) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []
    sys.modules[name] = module
    return module


def _modules(path: str) -> types.ModuleType:
    """Create ``path`` and its parent packages (as packages), and link each into its parent."""
    parts = path.split(".")
    module = None
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        module = sys.modules.get(name) or _module(name, package=i < len(parts))
        if i > 1:
            setattr(sys.modules[".".join(parts[: i - 1])], parts[i - 1], module)
    return module


def unregister(root: str) -> None:
    for name in [n for n in sys.modules if n == root or n.startswith(root + ".")]:
        del sys.modules[name]


def register(root: str, version: str = "0.5.23") -> types.SimpleNamespace:
    """Build the module tree of one SGLang version under ``root`` (replacing any earlier one)."""
    if version not in VERSIONS:
        raise ValueError(f"version={version!r}: one of {VERSIONS}")
    vt = tuple(int(p) for p in version.split("."))
    split_hooks = vt >= (0, 5, 13)
    has_logical_num_tokens = vt >= (0, 5, 21)
    has_logical_mode = vt >= (0, 5, 23)
    kda_takes_tables = vt >= (0, 5, 22)
    fla_name = f"{root}.kernels.ops.attention.fla" if vt >= (0, 5, 16) else f"{root}.srt.layers.attention.fla"
    state = {"fla_syncs": 0, "base_syncs": 0}

    unregister(root)
    top = _modules(root)
    top.__version__ = version

    # -- vendored FLA ------------------------------------------------------------------------
    index = _modules(fla_name + ".index")

    def tensor_cache(fn):
        """``tensor_cache`` ({fla}/utils.py): the last 4 calls, keyed on argument identity."""
        entries = []

        def cached(*args):
            for i, (last, result) in enumerate(entries):
                if len(last) == len(args) and all(a is b for a, b in zip(args, last, strict=True)):
                    entries.append(entries.pop(i))
                    return result
            result = fn(*args)
            entries.append((args, result))
            del entries[:-4]
            return result

        return cached

    @tensor_cache
    def prepare_chunk_indices(cu_seqlens, chunk_size):
        """``prepare_chunk_indices`` ({fla}/index.py): [NT, 2] (seq, chunk) in cu_seqlens' dtype, from a
        host read of the chunk counts (FLA's .tolist(): one sync). Its sequence ids count only
        sequences with rows, so an empty sequence before a non-empty one shifts them (SGLang's copy;
        chunkmeta keeps true ids)."""
        counts = ((cu_seqlens[1:] - cu_seqlens[:-1] + chunk_size - 1) // chunk_size).tolist()
        state["fla_syncs"] += 1
        rows, seq = [], -1
        for n in counts:
            if n:
                seq += 1
            rows.extend((seq, t) for t in range(n))
        return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2).to(cu_seqlens)

    @tensor_cache
    def prepare_chunk_offsets(cu_seqlens, chunk_size):
        """``prepare_chunk_offsets`` ({fla}/index.py): exclusive prefix sum of the chunk counts, on the
        device (int64: cumsum)."""
        counts = (cu_seqlens[1:] - cu_seqlens[:-1] + chunk_size - 1) // chunk_size
        return torch.cat([cu_seqlens.new_zeros(1), counts]).cumsum(-1)

    index.prepare_chunk_indices = prepare_chunk_indices
    index.prepare_chunk_offsets = prepare_chunk_offsets

    def helpers(name):  # a module that did `from .index import prepare_chunk_indices, ...`
        module = _modules(f"{fla_name}.{name}")
        module.prepare_chunk_indices = prepare_chunk_indices
        module.prepare_chunk_offsets = prepare_chunk_offsets
        return module

    fla_kda, fla_chunk, fla_delta_h, fla_chunk_o = (helpers(n) for n in ("kda", "chunk", "chunk_delta_h", "chunk_o"))

    def _kda_run(cu_seqlens, chunk_indices, chunk_offsets):
        # chunk_kda_fwd ({fla}/kda.py): derive the tables once, only if none was passed.
        if chunk_indices is None:
            chunk_indices = fla_kda.prepare_chunk_indices(cu_seqlens, 64)
        if chunk_offsets is None:  # chunk_gated_delta_rule_fwd_h derives it
            chunk_offsets = fla_delta_h.prepare_chunk_offsets(cu_seqlens, 64)
        return KernelRun(cu_seqlens, chunk_indices, chunk_offsets)

    if kda_takes_tables:

        def chunk_kda(
            q,
            k,
            v,
            g,
            beta,
            scale=None,
            initial_state=None,
            initial_state_indices=None,
            use_qk_l2norm_in_kernel=False,
            cu_seqlens=None,
            A_log=None,
            dt_bias=None,
            lower_bound=None,
            output_intermediate_states=False,
            track_state=None,
            track_chunk_idx=None,
            beta_is_raw=False,
            chunk_indices=None,
            chunk_offsets=None,
            **kwargs,
        ):
            return _kda_run(cu_seqlens, chunk_indices, chunk_offsets)
    else:

        def chunk_kda(
            q,
            k,
            v,
            g,
            beta,
            scale=None,
            initial_state=None,
            initial_state_indices=None,
            use_qk_l2norm_in_kernel=False,
            cu_seqlens=None,
            **kwargs,
        ):
            return _kda_run(cu_seqlens, None, None)  # chunk_indices= would vanish into **kwargs

    fla_kda.chunk_kda = chunk_kda

    def chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=None,
        initial_state=None,
        initial_state_indices=None,
        cu_seqlens=None,
        head_first=False,
        use_qk_l2norm_in_kernel=False,
        inplace_update=True,
    ):
        """``chunk_gated_delta_rule`` ({fla}/chunk.py; no chunk_indices parameter in any SGLang release):
        the forward derives the 64-token table, chunk_delta_h.py its offsets, and ``chunk_fwd_o``
        ({fla}/chunk_o.py) a table at
        BT = min(64, max(16, next_pow2(T))) for the T tokens it is given."""
        chunk_indices = fla_chunk.prepare_chunk_indices(cu_seqlens, 64)
        chunk_offsets = fla_delta_h.prepare_chunk_offsets(cu_seqlens, 64)
        bt = min(64, max(16, _next_pow2(q.shape[1])))
        output_indices = fla_chunk_o.prepare_chunk_indices(cu_seqlens, bt)
        return KernelRun(cu_seqlens, chunk_indices, chunk_offsets, output_indices, bt)

    fla_chunk.chunk_gated_delta_rule = chunk_gated_delta_rule

    # -- srt/layers/attention/base_attn_backend.py -------------------------------------------
    if split_hooks:

        class AttentionBackend(ABC):  # noqa: B024  SGLang's is an ABC whose methods all have defaults
            """>= 0.5.13 (PR #26735): the 3-method contract; the legacy capture/replay are gone."""

            forward_metadata = None

            def init_forward_metadata(self, forward_batch):
                self.init_forward_metadata_out_graph(forward_batch)
                self.init_forward_metadata_in_graph(forward_batch)

            def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):  # noqa: B027
                """Host side, outside ``graph.capture()``; replay updates static buffers in place."""

            def init_forward_metadata_in_graph(self, forward_batch):  # noqa: B027  a no-op default, as SGLang's
                """Captured, static-shape GPU work; replayed with the graph."""

            def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
                raise NotImplementedError()

            def get_cuda_graph_seq_len_fill_value(self):
                raise NotImplementedError()
    else:

        class AttentionBackend(ABC):
            """<= 0.5.12: abstract eager init plus the legacy graph hooks."""

            @abstractmethod
            def init_forward_metadata(self, forward_batch):
                raise NotImplementedError()

            def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
                raise NotImplementedError()

            def init_forward_metadata_capture_cuda_graph(
                self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens, forward_mode, spec_info
            ):
                raise NotImplementedError()

            def init_forward_metadata_replay_cuda_graph(
                self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens, forward_mode, spec_info, seq_lens_cpu
            ):
                raise NotImplementedError()

            def get_cuda_graph_seq_len_fill_value(self):
                raise NotImplementedError()

    # -- srt/layers/attention/hybrid_linear_attn_backend.py -----------------------------------
    class MambaAttnBackendBase(AttentionBackend):
        """``MambaAttnBackendBase``: one ``ForwardMetadata`` per forward; the device
        ``query_start_loc`` of an extend is made from ``extend_start_loc`` without a host read.

        ``graph_extends`` (default False, as in every release up to 0.5.23, whose graph hooks raise
        for extends) models a base that serves extends in its split graph hooks: the per-bs static
        ``query_start_loc`` is filled in place from the batch's device ``extend_start_loc`` /
        ``extend_seq_lens``, like the decode path fills it.
        """

        graph_extends = False

        def __init__(self, model_runner):
            super().__init__()
            self.device = model_runner.device
            self.req_to_token_pool = model_runner.req_to_token_pool
            self.forward_metadata = None
            self.query_start_loc_list = []
            self.state_indices_list = []
            self.cached_cuda_graph_decode_query_start_loc = None
            self.cached_cuda_graph_verify_query_start_loc = None

        def _mode(self, forward_batch):
            return forward_batch.logical_forward_mode if has_logical_mode else forward_batch.forward_mode

        def _forward_metadata(self, forward_batch):
            bs = forward_batch.batch_size
            mode = self._mode(forward_batch)
            cache_indices = self.req_to_token_pool.get_mamba_indices(forward_batch.req_pool_indices)
            logical_num_tokens = None
            if mode.is_decode_or_idle():
                query_start_loc = torch.arange(0, bs + 1, dtype=torch.int32, device=self.device)
            elif mode.is_extend(include_draft_extend_v2=True):
                if forward_batch.forward_mode.is_draft_extend_v2() and (
                    forward_batch.extend_start_loc is None or forward_batch.extend_seq_lens is None
                ):
                    query_start_loc = None  # the draft runs only full-attention layers
                elif forward_batch.forward_mode.is_target_verify():
                    query_start_loc = torch.arange(
                        0,
                        forward_batch.input_ids.shape[0] + 1,
                        step=forward_batch.spec_info.draft_token_num,
                        dtype=torch.int32,
                        device=self.device,
                    )
                else:
                    query_start_loc = torch.empty((bs + 1,), dtype=torch.int32, device=self.device)
                    query_start_loc[:bs] = forward_batch.extend_start_loc
                    query_start_loc[bs] = forward_batch.extend_start_loc[-1] + forward_batch.extend_seq_lens[-1]
                    if has_logical_num_tokens:
                        lens = forward_batch.extend_seq_lens_cpu
                        if lens is not None and len(lens) == bs and forward_batch.tbo_parent_token_range is None:
                            logical_num_tokens = sum(lens)
                        else:
                            state["base_syncs"] += 1  # SGLang reads the device count itself here
                            logical_num_tokens = int(query_start_loc[-1])
            else:
                raise ValueError(f"Invalid forward mode: {forward_batch.forward_mode=}")
            return ForwardMetadata(
                query_start_loc=query_start_loc,
                mamba_cache_indices=cache_indices,
                logical_num_tokens=logical_num_tokens,
            )

        def init_forward_metadata(self, forward_batch):
            self.forward_metadata = self._forward_metadata(forward_batch)

        def get_cuda_graph_seq_len_fill_value(self):
            return 1

        def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
            draft_token_num = max_num_tokens // max_bs
            for i in range(max_bs):
                self.state_indices_list.append(torch.full((i + 1,), -1, dtype=torch.int32, device=self.device))
                self.query_start_loc_list.append(torch.zeros((i + 2,), dtype=torch.int32, device=self.device))
            self.cached_cuda_graph_decode_query_start_loc = torch.arange(
                0, max_bs + 1, dtype=torch.int32, device=self.device
            )
            self.cached_cuda_graph_verify_query_start_loc = torch.arange(
                0, max_bs * draft_token_num + 1, step=draft_token_num, dtype=torch.int32, device=self.device
            )

        def _replay_metadata(self, bs, req_pool_indices, forward_mode, spec_info, num_padding=0, forward_batch=None):
            """Static per-bs buffers, updated in place (captured pointers stay valid)."""
            mamba_indices = self.req_to_token_pool.get_mamba_indices(req_pool_indices)
            if num_padding:
                mamba_indices[bs - num_padding :] = -1
            self.state_indices_list[bs - 1][: len(mamba_indices)].copy_(mamba_indices)
            qsl = self.query_start_loc_list[bs - 1]
            real = bs - num_padding
            if forward_mode.is_decode_or_idle():
                qsl[: real + 1].copy_(self.cached_cuda_graph_decode_query_start_loc[: real + 1])
                qsl[real + 1 :].fill_(real)  # padded rows: zero-length sequences
            elif forward_mode.is_target_verify():
                qsl.copy_(self.cached_cuda_graph_verify_query_start_loc[: bs + 1])
            elif self.graph_extends and forward_mode.is_extend() and forward_batch is not None:
                start, lens = forward_batch.extend_start_loc, forward_batch.extend_seq_lens
                qsl[:bs].copy_(start[:bs])
                torch.add(start[bs - 1 : bs], lens[bs - 1 : bs], out=qsl[bs:])
            else:
                raise ValueError(f"Invalid forward mode: {forward_mode=}")
            return ForwardMetadata(query_start_loc=qsl, mamba_cache_indices=self.state_indices_list[bs - 1])

        if split_hooks:

            def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
                self.forward_metadata = self._replay_metadata(
                    forward_batch.batch_size,
                    forward_batch.req_pool_indices,
                    forward_batch.forward_mode,
                    forward_batch.spec_info,
                    num_padding=0 if in_capture else getattr(forward_batch, "num_padding", 0),
                    forward_batch=forward_batch,
                )
        else:

            def init_forward_metadata_capture_cuda_graph(
                self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens, forward_mode, spec_info
            ):
                self.forward_metadata = self._replay_metadata(bs, req_pool_indices, forward_mode, spec_info)

            def init_forward_metadata_replay_cuda_graph(
                self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens, forward_mode, spec_info, seq_lens_cpu
            ):
                num_padding = 0
                if seq_lens_cpu is not None:
                    num_padding = int(torch.count_nonzero(seq_lens_cpu == self.get_cuda_graph_seq_len_fill_value()))
                self.forward_metadata = self._replay_metadata(
                    bs, req_pool_indices, forward_mode, spec_info, num_padding
                )

    # -- srt/layers/attention/linear/kernels/kda_triton.py, gdn_triton.py ----------------------
    class TritonKDAKernel:
        def extend(
            self,
            q,
            k,
            v,
            g,
            beta,
            *,
            ssm_states,
            cache_indices,
            query_start_loc,
            A_log=None,
            dt_bias=None,
            lower_bound=None,
            beta_is_raw=False,
            return_intermediate_states=False,
            **kwargs,
        ):
            tables = (
                dict(chunk_indices=kwargs.get("chunk_indices"), chunk_offsets=kwargs.get("chunk_offsets"))
                if kda_takes_tables
                else {}
            )
            return fla_kda.chunk_kda(
                q=q,
                k=k,
                v=v,
                g=g,
                beta=beta,
                initial_state=ssm_states,
                initial_state_indices=cache_indices,
                use_qk_l2norm_in_kernel=True,
                cu_seqlens=query_start_loc,
                **tables,
            )

    class TritonGDNKernel:
        def extend(
            self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, inplace_update=True, **kwargs
        ):
            return fla_chunk.chunk_gated_delta_rule(
                q=q,
                k=k,
                v=v,
                g=g,
                beta=beta,
                initial_state=ssm_states,
                cu_seqlens=query_start_loc,
                head_first=False,
                use_qk_l2norm_in_kernel=True,
                initial_state_indices=cache_indices,
                inplace_update=inplace_update,
            )

    # -- srt/layers/attention/linear/kda_backend.py --------------------------------------------
    class KDAKernelDispatcher:
        """Picks a kernel per mode; ``extend`` forwards its keyword arguments unchanged."""

        def __init__(self):
            self.extend_kernel = TritonKDAKernel()

        def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, **kwargs):
            return self.extend_kernel.extend(
                q,
                k,
                v,
                g,
                beta,
                ssm_states=ssm_states,
                cache_indices=cache_indices,
                query_start_loc=query_start_loc,
                **kwargs,
            )

    class KDAAttnBackend(MambaAttnBackendBase):
        prefill_graph_metadata = None

        def __init__(self, model_runner):
            super().__init__(model_runner)
            self.kernel_dispatcher = KDAKernelDispatcher()

        def init_forward_metadata(self, forward_batch):
            self.prefill_graph_metadata = None  # an eager forward never runs on a graph bucket's tables
            super().init_forward_metadata(forward_batch)

        def forward_extend(self, layer, forward_batch, mixed_qkv, a, b, **kwargs):
            if forward_batch.forward_mode.is_target_verify():
                return None  # recurrent verify kernels: no chunk tables
            q = mixed_qkv.reshape(1, -1, 1, 1)
            if self.prefill_graph_metadata is not None:  # kda_prefill_graph.kda_extend_in_graph
                meta = self.prefill_graph_metadata
                return self.kernel_dispatcher.extend(
                    q=q,
                    k=q,
                    v=q,
                    g=a,
                    beta=b,
                    ssm_states=None,
                    cache_indices=meta.cache_indices,
                    query_start_loc=meta.cu_seqlens,
                    extend_seq_lens_cpu=None,
                    chunk_indices=meta.chunk_indices,
                    chunk_offsets=meta.chunk_offsets,
                )
            fm = self.forward_metadata
            return self.kernel_dispatcher.extend(
                q=q,
                k=q,
                v=q,
                g=a,
                beta=b,
                ssm_states=None,
                cache_indices=fm.mamba_cache_indices,
                query_start_loc=fm.query_start_loc,
                beta_is_raw=True,
                extend_seq_lens_cpu=forward_batch.extend_seq_lens_cpu,
                layer_id=layer,
            )

        if kda_takes_tables:  # srt/layers/attention/linear/kda_prefill_graph.py: host-filled static tables

            def init_prefill_graph_metadata(self, forward_batch):
                meta = _host_prefill_tables(forward_batch, self.device)
                self.prefill_graph_metadata = meta
                return meta

            def refresh_prefill_graph_metadata(self, meta, forward_batch):
                self.prefill_graph_metadata = meta

    # -- srt/layers/attention/linear/gdn_backend.py --------------------------------------------
    class GDNKernelDispatcher:
        def __init__(self):
            self.extend_kernel = TritonGDNKernel()

        def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, **kwargs):
            return self.extend_kernel.extend(
                q,
                k,
                v,
                g,
                beta,
                ssm_states=ssm_states,
                cache_indices=cache_indices,
                query_start_loc=query_start_loc,
                **kwargs,
            )

    class GDNAttnBackend(MambaAttnBackendBase):
        def __init__(self, model_runner):
            super().__init__(model_runner)
            self.kernel_dispatcher = GDNKernelDispatcher()

        if split_hooks:

            def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
                super().init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)

        def init_forward_metadata(self, forward_batch):
            super().init_forward_metadata(forward_batch)

        def forward_extend(self, layer, forward_batch, mixed_qkv, a, b, **kwargs):
            if forward_batch.forward_mode.is_target_verify():
                return None
            q = mixed_qkv.reshape(1, -1, 1, 1)
            fm = self.forward_metadata
            return self.kernel_dispatcher.extend(
                q=q,
                k=q,
                v=q,
                g=a,
                beta=b,
                ssm_states=None,
                cache_indices=fm.mamba_cache_indices,
                query_start_loc=fm.query_start_loc,
                layer_id=layer,
            )

    # -- publish the tree under SGLang's module paths ------------------------------------------
    fbi = _modules(f"{root}.srt.model_executor.forward_batch_info")
    fbi.ForwardMode, fbi.ForwardBatch = ForwardMode, ForwardBatch
    _modules(f"{root}.srt.layers.attention.base_attn_backend").AttentionBackend = AttentionBackend
    _modules(f"{root}.srt.layers.attention.mamba.mamba2_metadata").ForwardMetadata = ForwardMetadata
    hybrid = _modules(f"{root}.srt.layers.attention.hybrid_linear_attn_backend")
    hybrid.MambaAttnBackendBase = MambaAttnBackendBase
    kda_mod = _modules(f"{root}.srt.layers.attention.linear.kda_backend")
    kda_mod.KDAAttnBackend, kda_mod.KDAKernelDispatcher = KDAAttnBackend, KDAKernelDispatcher
    gdn_mod = _modules(f"{root}.srt.layers.attention.linear.gdn_backend")
    gdn_mod.GDNAttnBackend, gdn_mod.GDNKernelDispatcher = GDNAttnBackend, GDNKernelDispatcher
    for name, cls in (
        ("AttentionBackend", AttentionBackend),
        ("MambaAttnBackendBase", MambaAttnBackendBase),
        ("KDAAttnBackend", KDAAttnBackend),
        ("GDNAttnBackend", GDNAttnBackend),
    ):
        cls.__module__ = {
            "AttentionBackend": f"{root}.srt.layers.attention.base_attn_backend",
            "MambaAttnBackendBase": hybrid.__name__,
            "KDAAttnBackend": kda_mod.__name__,
            "GDNAttnBackend": gdn_mod.__name__,
        }[name]
    return types.SimpleNamespace(
        root=root,
        version=version,
        fla=fla_name,
        split_hooks=split_hooks,
        kda_takes_tables=kda_takes_tables,
        state=state,
        AttentionBackend=AttentionBackend,
        MambaAttnBackendBase=MambaAttnBackendBase,
        KDAAttnBackend=KDAAttnBackend,
        GDNAttnBackend=GDNAttnBackend,
        kda_module=kda_mod,
        gdn_module=gdn_mod,
        fla_index=index,
        fla_kda=fla_kda,
        fla_chunk=fla_chunk,
    )


def _host_prefill_tables(forward_batch, device):
    """``KDAPrefillGraphMetadata`` (srt/layers/attention/linear/kda_prefill_graph.py, 0.5.22): tables
    written on the host from ``extend_seq_lens_cpu`` and copied over, padding rows (0, 1 << 20)."""
    lens = list(forward_batch.extend_seq_lens_cpu)
    cu = [0]
    rows = []
    for i, n in enumerate(lens):
        cu.append(cu[-1] + n)
        rows.extend((i, t) for t in range(-(-n // 64)))
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + -(-n // 64))
    rows.append((0, 1 << 20))
    return types.SimpleNamespace(
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=device),
        chunk_indices=torch.tensor(rows, dtype=torch.int32, device=device),
        chunk_offsets=torch.tensor(offsets, dtype=torch.int32, device=device),
        cache_indices=torch.arange(len(lens), dtype=torch.int32, device=device),
    )
