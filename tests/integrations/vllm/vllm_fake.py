"""A faithful model of the vLLM 0.33.0 interfaces the vLLM adapter touches (no vLLM import).

Each class mirrors one vLLM class: the same constructor and hook signatures, and the same batch
semantics for what reaches ``_build_chunk_metadata`` (which rows form the prefill slice, its
rebasing, trailing zero-length padding rows, spec-decode reclassification, which prefill
backends call the hook). Everything else a real builder does (state indices, conv1d metadata,
checkpoints, CUDA-graph staging) is left out. Written from vLLM's source: each section names the
file it mirrors (paths inside the ``vllm`` package, 0.33.0 wheel) and each class or function the
vLLM class or function, with its line there; no vLLM code is copied.

vLLM's default path is modelled by FLA's own host helpers (fla-core 0.6.0
``prepare_chunk_indices`` / ``prepare_chunk_offsets``, ``fla/ops/utils/index.py``, on the CPU copy, then a copy to the
device), which is what vLLM's vendored FLA computes for every slice vLLM produces (they differ
only on interior zero-length sequences, which vLLM never produces: its padding rows trail).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from chunkmeta import reference
from chunkmeta.integrations.vllm import VllmApi

FLA_CHUNK_SIZE = 64  # vllm/third_party/flash_linear_attention/ops/utils.py
GARBAGE = -(2**31)  # stands in for the uninitialised tail rows of CuteDSL's new_empty tables


def fla_host_tables(cu_seqlens_cpu: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA's host helpers on the CPU copy (what vLLM's default hook computes before its H2D copy)."""
    from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets

    return prepare_chunk_indices(cu_seqlens_cpu, chunk_size), prepare_chunk_offsets(cu_seqlens_cpu, chunk_size)


# -- vllm/model_executor/layers/mamba/ops/gdn_chunk_cutedsl/__init__.py ----------------------


def upper_bound_chunks(num_seqs: int, total_tokens: int, chunk_size: int) -> int:
    """``_upper_bound_chunks``: the worst case, N-1 one-token sequences and one long one."""
    return (num_seqs - 1) + -(-(total_tokens - (num_seqs - 1)) // chunk_size)


def prepare_metadata_cutedsl(cu_seqlens: torch.Tensor, total_tokens: int, chunk_size: int = 64):
    """``prepare_metadata_cutedsl``: int32 ``[UB, 2]`` indices (rows past NT never written) and
    int32 ``[N+1]`` offsets whose last entry is NT. Modelled on the host, true sequence indices."""
    num_seqs = cu_seqlens.numel() - 1
    ub = upper_bound_chunks(num_seqs, total_tokens, chunk_size)
    ref = reference.chunk_metadata(cu_seqlens.cpu().tolist(), chunk_size)
    indices = torch.full((ub, 2), GARBAGE, dtype=torch.int32)
    if ref.num_chunks:
        indices[: ref.num_chunks] = torch.tensor(ref.chunk_indices, dtype=torch.int32)
    offsets = torch.tensor(ref.chunk_offsets, dtype=torch.int32)
    return indices.to(cu_seqlens.device), offsets.to(cu_seqlens.device)


# -- vllm/v1/attention/backend.py -------------------------------------------------------------


@dataclasses.dataclass
class CommonAttentionMetadata:
    """``CommonAttentionMetadata`` (l.390): the fields GDN's build() reads for the split."""

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    seq_lens_cpu_upper_bound: torch.Tensor | None = None
    is_prefilling: torch.Tensor | None = None

    def replace(self, **changes) -> CommonAttentionMetadata:
        return dataclasses.replace(self, **changes)


class AttentionMetadataBuilder:
    """``AttentionMetadataBuilder`` (l.592): the base constructor stores its four arguments."""

    supports_update_block_table: bool = False

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device):
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vllm_config = vllm_config
        self.device = device


# -- vllm/v1/attention/backends/utils.py --------------------------------------------------------


def split_decodes_and_prefills(m: CommonAttentionMetadata) -> tuple[int, int, int, int]:
    """``split_decodes_and_prefills(m, decode_threshold=1, treat_short_extends_as_decodes=False)``
    (l.837) on a batch ordered decode -> short extend -> long extend -> prefill."""
    qsl = m.query_start_loc_cpu
    query_lens = qsl[1:] - qsl[:-1]
    if int(query_lens[0]) > 1:
        return 0, m.num_reqs, 0, m.num_actual_tokens
    is_prefill = (query_lens > 1) | m.is_prefilling
    if not bool(is_prefill.any()):
        return m.num_reqs, 0, m.num_actual_tokens, 0
    first_prefill = int(is_prefill.int().argmax())
    num_decode_tokens = int(qsl[first_prefill])
    return first_prefill, m.num_reqs - first_prefill, num_decode_tokens, m.num_actual_tokens - num_decode_tokens


# -- vllm/v1/attention/backends/gdn_attn.py ------------------------------------------------------


def resolve_gdn_prefill_backend(vllm_config) -> str:
    """``_resolve_gdn_prefill_backend`` (model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py
    l.148), reduced to the config
    string; "auto" resolves to "triton" (what it gives on CPU and off SM90/SM10x/ROCm-FlyDSL)."""
    backend = vllm_config.additional_config.get("gdn_prefill_backend", "auto")
    return "triton" if backend == "auto" else backend


@dataclasses.dataclass
class GDNAttentionMetadata:
    """``GDNAttentionMetadata``: the fields the prefill path reads."""

    num_prefills: int
    num_decodes: int
    num_spec_decodes: int
    prefill_query_start_loc: torch.Tensor | None = None
    chunk_indices: torch.Tensor | None = None
    chunk_offsets: torch.Tensor | None = None
    checkpoint: object | None = None


class GDNAttentionMetadataBuilder(AttentionMetadataBuilder):
    """``GDNAttentionMetadataBuilder`` (l.134)."""

    reorder_batch_threshold: int = 1

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.gdn_prefill_backend = resolve_gdn_prefill_backend(vllm_config)
        self._check_chunk_metadata_override(type(self), self.gdn_prefill_backend)
        spec = vllm_config.speculative_config
        self.num_spec = spec.num_speculative_tokens if spec else 0
        self.use_spec_decode = self.num_spec > 0
        self.supports_update_block_table = (
            vllm_config.use_v2_model_runner and device.type == "cuda" and type(self) is GDNAttentionMetadataBuilder
        )
        if self.supports_update_block_table:
            self.mamba_aligned_state_indices = None
        self.decode_cudagraph_max_bs = vllm_config.scheduler_config.max_num_seqs * (self.num_spec + 1)
        # the persistent decode buffers live on the builder's device
        self.non_spec_query_start_loc = torch.empty(self.decode_cudagraph_max_bs + 1, dtype=torch.int32, device=device)
        self.hook_calls = 0  # test instrumentation: times build() called the hook

    @staticmethod
    def _check_chunk_metadata_override(builder_cls, backend: str) -> None:
        """Raise RuntimeError for a hook override under "aiter_flydsl" (l.246)."""
        if backend != "aiter_flydsl":
            return
        if builder_cls._build_chunk_metadata is GDNAttentionMetadataBuilder._build_chunk_metadata:
            return
        raise RuntimeError(
            f"{builder_cls.__name__} builds its own FLA chunk metadata, which the "
            "'aiter_flydsl' GDN prefill backend does not use."
        )

    def _build_chunk_metadata(
        self, prefill_query_start_loc: torch.Tensor, prefill_query_start_loc_cpu: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The default hook (l.271): CuteDSL's device layout, or FLA's host helpers + H2D copy."""
        if self.gdn_prefill_backend == "cutedsl":
            total_tokens = int(prefill_query_start_loc_cpu[-1].item())
            return prepare_metadata_cutedsl(prefill_query_start_loc, total_tokens, FLA_CHUNK_SIZE)
        chunk_indices, chunk_offsets = fla_host_tables(prefill_query_start_loc_cpu, FLA_CHUNK_SIZE)
        return chunk_indices.to(device), chunk_offsets.to(device)  # async_tensor_h2d

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        num_accepted_tokens: torch.Tensor | None = None,
        num_decode_draft_tokens_cpu: torch.Tensor | None = None,
        fast_build: bool = False,
    ) -> GDNAttentionMetadata:
        """``build`` (l.313), down to the prefill slice and the hook call."""
        m = common_attn_metadata
        query_start_loc, query_start_loc_cpu = m.query_start_loc, m.query_start_loc_cpu
        spec_masks_cpu = None
        num_spec_decodes = 0
        if self.use_spec_decode and num_decode_draft_tokens_cpu is not None:
            spec_masks_cpu = num_decode_draft_tokens_cpu >= 0
            num_spec_decodes = int(spec_masks_cpu.sum())
            if num_spec_decodes == 0:
                spec_masks_cpu = None

        if spec_masks_cpu is None:
            assert m.seq_lens_cpu_upper_bound is not None
            query_lens_cpu = query_start_loc_cpu.diff()
            no_prior_state = (query_lens_cpu > 0) & (m.seq_lens_cpu_upper_bound <= query_lens_cpu)
            if m.is_prefilling is not None:
                no_prior_state &= m.is_prefilling
            else:
                no_prior_state = torch.zeros_like(no_prior_state)
            num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
                m.replace(is_prefilling=no_prior_state)
            )
            if num_prefills:  # exclude trailing padding rows from the count (not from the slice)
                num_prefills -= int((query_lens_cpu[num_decodes:] == 0).sum())
            non_spec_qsl, non_spec_qsl_cpu = query_start_loc, query_start_loc_cpu
        else:
            assert num_accepted_tokens is not None
            query_lens = query_start_loc[1:] - query_start_loc[:-1]
            query_lens_cpu = query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]
            non_spec_masks_cpu = ~spec_masks_cpu
            non_spec_lens_cpu = query_lens_cpu[non_spec_masks_cpu]
            num_decodes = int((non_spec_lens_cpu == 1).sum())
            num_zero_len = int((non_spec_lens_cpu == 0).sum())
            num_prefills = non_spec_lens_cpu.size(0) - num_decodes - num_zero_len
            num_decode_tokens = num_decodes
            if num_decodes > 0 and num_spec_decodes > 0:
                # non-spec decodes become one-token prefills when spec decodes exist
                num_prefills += num_decodes
                num_decodes = num_decode_tokens = 0
            if num_prefills == 0 and num_decodes == 0:
                non_spec_qsl = non_spec_qsl_cpu = None
            else:
                n = query_lens.size(0) - num_spec_decodes
                non_spec_qsl = torch.zeros(n + 1, dtype=torch.int32, device=query_start_loc.device)
                torch.cumsum(query_lens[non_spec_masks_cpu], dim=0, out=non_spec_qsl[1:])
                non_spec_qsl_cpu = torch.zeros(n + 1, dtype=torch.int32)
                torch.cumsum(non_spec_lens_cpu, dim=0, out=non_spec_qsl_cpu[1:])

        metadata = GDNAttentionMetadata(num_prefills, num_decodes, num_spec_decodes)
        if num_prefills > 0:
            if spec_masks_cpu is None and num_decodes > 0:
                prefill_qsl = non_spec_qsl[num_decodes:] - num_decode_tokens
                prefill_qsl_cpu = non_spec_qsl_cpu[num_decodes:] - num_decode_tokens
            else:
                prefill_qsl, prefill_qsl_cpu = non_spec_qsl, non_spec_qsl_cpu
            metadata.prefill_query_start_loc = prefill_qsl
            if self.gdn_prefill_backend == "aiter_flydsl":
                pass  # AITER's own varlen metadata; the hook is not called
            elif self.gdn_prefill_backend != "flashinfer":
                self.hook_calls += 1
                metadata.chunk_indices, metadata.chunk_offsets = self._build_chunk_metadata(
                    prefill_qsl, prefill_qsl_cpu, query_start_loc.device
                )
        return metadata


class GDNAttentionBackend:
    """``GDNAttentionBackend`` (l.74)."""

    @staticmethod
    def get_name() -> str:
        return "GDN_ATTN"

    @staticmethod
    def get_builder_cls() -> type[GDNAttentionMetadataBuilder]:
        return GDNAttentionMetadataBuilder


# -- vllm/models/kimi_k3/amd/kda_metadata.py --------------------------------------------------


def prepare_chunk_metadata_device(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor, chunk_size: int):
    """``prepare_chunk_metadata_device`` (l.69): exact NT counted on the host, fresh tensors,
    ``chunk_indices`` in ``cu_seqlens``' dtype, int64 ``chunk_offsets``, true sequence indices."""
    ref = reference.chunk_metadata(cu_seqlens_cpu.tolist(), chunk_size)
    indices = torch.tensor(ref.chunk_indices, dtype=cu_seqlens.dtype).reshape(-1, 2)
    offsets = torch.tensor(ref.chunk_offsets, dtype=torch.int64)
    return indices.to(cu_seqlens.device), offsets.to(cu_seqlens.device)


class KimiK3ROCmKDAMetadataBuilder(GDNAttentionMetadataBuilder):
    """``KimiK3ROCmKDAMetadataBuilder`` (l.105): its own hook and a build() that post-processes."""

    def build(
        self,
        common_prefix_len,
        common_attn_metadata,
        num_accepted_tokens=None,
        num_decode_draft_tokens_cpu=None,
        fast_build=False,
    ):
        metadata = super().build(
            common_prefix_len, common_attn_metadata, num_accepted_tokens, num_decode_draft_tokens_cpu, fast_build
        )
        if metadata.num_prefills:  # stands for its checkpoint rows rebuilt on the prefill slice
            metadata = dataclasses.replace(metadata, checkpoint="kimi-k3-rocm")
        return metadata

    def _build_chunk_metadata(self, prefill_query_start_loc, prefill_query_start_loc_cpu, device):
        return prepare_chunk_metadata_device(prefill_query_start_loc, prefill_query_start_loc_cpu, FLA_CHUNK_SIZE)


class KimiK3ROCmKDABackend(GDNAttentionBackend):
    """``KimiK3ROCmKDABackend`` (l.183), hard-coded by the Kimi-K3 ROCm layer."""

    @staticmethod
    def get_name() -> str:
        return "KIMI_K3_KDA_ROCM"

    @staticmethod
    def get_builder_cls() -> type[KimiK3ROCmKDAMetadataBuilder]:
        return KimiK3ROCmKDAMetadataBuilder


# -- configs and batches ------------------------------------------------------------------------


def api(version: str = "0.33.0") -> VllmApi:
    return VllmApi(version, GDNAttentionBackend, GDNAttentionMetadataBuilder, KimiK3ROCmKDABackend)


def vllm_config(
    *,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 8192,
    gdn_prefill_backend: str = "auto",
    num_speculative_tokens: int = 0,
    use_v2_model_runner: bool = False,
):
    """The ``VllmConfig`` fields the GDN builder and the adapter read."""
    spec = SimpleNamespace(num_speculative_tokens=num_speculative_tokens) if num_speculative_tokens else None
    return SimpleNamespace(
        additional_config={"gdn_prefill_backend": gdn_prefill_backend},
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        speculative_config=spec,
        use_v2_model_runner=use_v2_model_runner,
    )


KV_CACHE_SPEC = SimpleNamespace(block_size=16)  # the builders above only store it
LAYERS = ["model.layers.0.linear_attn"]


def batch(query_lens, context_lens, device="cpu") -> CommonAttentionMetadata:
    """A step as the runner hands it over: rows in the runner's order; ``context_lens[i] == 0``
    marks a request's first chunk (``is_prefilling``); trailing rows with ``query_len == 0``
    are CUDA-graph padding (their ``query_start_loc`` entries repeat the real total)."""
    lens = torch.tensor(query_lens, dtype=torch.int32)
    qsl_cpu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl_cpu[1:] = torch.cumsum(lens, 0)
    seq_lens = torch.tensor([q + c for q, c in zip(query_lens, context_lens, strict=True)], dtype=torch.int32)
    is_prefilling = torch.tensor([c == 0 and q > 0 for q, c in zip(query_lens, context_lens, strict=True)])
    return CommonAttentionMetadata(
        query_start_loc=qsl_cpu.to(device),
        query_start_loc_cpu=qsl_cpu,
        num_reqs=len(query_lens),
        num_actual_tokens=int(qsl_cpu[-1]),
        max_query_len=max(query_lens),
        seq_lens_cpu_upper_bound=seq_lens,
        is_prefilling=is_prefilling,
    )
