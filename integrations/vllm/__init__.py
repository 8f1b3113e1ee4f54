"""vLLM adapter: chunkmeta makes every per-step prefill table of vLLM 0.33.0's hybrid builders.

One ``StepTablesBuilder`` per vLLM metadata builder, one device launch per step, no sync and no
host-to-device copy of a table (``tables``):

* GDN family (``GDNAttentionMetadataBuilder``: Qwen3-Next / Qwen3.5, OLMo-Hybrid, Kimi-Linear,
  GLM5-next, Bailing-V3; Kimi-K3's NVIDIA and ROCm builders): the FLA ``chunk_indices`` /
  ``chunk_offsets`` of ``_build_chunk_metadata`` (CuteDSL's layout for ``cutedsl``), and the
  causal-conv1d tables (``nums_dict``, ``batch_ptr``, ``token_chunk_offset_ptr``) with every
  prefill backend, FlashInfer included (ROCm Kimi-K3 keeps vLLM's conv tables).
* Mamba family (Mamba1, Mamba2, ShortConv): the conv tables of the prefill rows; Mamba2's SSD
  tables (``cu_chunk_seqlen_p``, ``seq_idx_p``, ``last_chunk_indices_p``, ``checkpoint_chunk_idx``).
* ``routing``: ``chunkmeta.integrations.fla``'s ``FlaRouter`` over every vLLM module that binds
  ``prepare_chunk_indices`` / ``prepare_chunk_offsets``: calls with a GDN-family builder's
  latest ``prefill_query_start_loc`` / ``non_spec_query_start_loc`` get its tables (the in-forward
  sync of Kimi-Linear, Kimi-K3 triton, GLM5-next, OLMo-Hybrid and Bailing-V3 is gone); any other
  tensor falls through to vLLM's function.

``builders``: the mixins (``chunkmeta_builder_class(base)``) overriding vLLM's build at each
table's own point; a step chunkmeta cannot build is served by vLLM's own functions with one
warning per cause (``stats()``). ``install()`` / ``uninstall()`` (``wiring``) patch the
backends' ``get_builder_cls`` and ``compute_causal_conv1d_metadata`` where it is called;
``register()`` is the ``vllm.general_plugins`` entry point, a no-op unless ``CHUNKMETA_VLLM=1``.
``prepare_chunk_metadata_device`` (``kimi_k3``): a drop-in for the ROCm Kimi-K3 helper.
``full_graph`` / ``mixed_step`` (opt-in, ``CHUNKMETA_VLLM_FULL_GRAPH=1``): mixed prefill+decode
steps of Kimi-Linear and Qwen3-Next / Qwen3.5 in FULL CUDA graphs: capacity-shaped per-bucket
inputs, graph-safe KDA / GDN forwards, the builder's ``ALWAYS`` support and the layer patches. Nothing
here imports vLLM, at import time or in ``install()``: each module is wired when vLLM imports it
(``interface.VllmModules``); ``interface.load_vllm_api()`` imports the classes for a caller that
wants them now.
"""

from chunkmeta.integrations.vllm.builders import (
    HOOKLESS_BACKENDS,
    ChunkmetaBuilderMixin,
    GdnFamilyMixin,
    MambaFamilyMixin,
    chunkmeta_builder_class,
    conv_metadata,
    serves_for,
    stats,
    wrapped_builder,
)
from chunkmeta.integrations.vllm.interface import (
    ENV_VAR,
    GATE,
    HOOK,
    HOOK_PARAMS,
    INIT_PARAMS,
    KIMI_NVIDIA_BACKEND,
    KIMI_NVIDIA_MODULE,
    KIMI_ROCM_BACKEND,
    KIMI_ROCM_MODULE,
    SUPPORTED_VLLM,
    VllmApi,
    VllmModules,
    check_api,
    is_supported_version,
    load_vllm_api,
    logger,
    vllm_version,
)
from chunkmeta.integrations.vllm.kimi_k3 import prepare_chunk_metadata_device
from chunkmeta.integrations.vllm.tables import (
    CONV_BLOCK_M,
    CUTEDSL,
    FLA_CHUNK_SIZE,
    RING_DEPTH,
    Serves,
    conv_fields,
    fla_fields,
    specs,
    ssd_fields,
    step_builder,
    warm_up,
)
from chunkmeta.integrations.vllm.wiring import install, installed, opt_in, pending, register, uninstall

__all__ = [
    "CONV_BLOCK_M",
    "CUTEDSL",
    "ENV_VAR",
    "FLA_CHUNK_SIZE",
    "GATE",
    "HOOK",
    "HOOKLESS_BACKENDS",
    "HOOK_PARAMS",
    "INIT_PARAMS",
    "KIMI_NVIDIA_BACKEND",
    "KIMI_NVIDIA_MODULE",
    "KIMI_ROCM_BACKEND",
    "KIMI_ROCM_MODULE",
    "RING_DEPTH",
    "SUPPORTED_VLLM",
    "ChunkmetaBuilderMixin",
    "GdnFamilyMixin",
    "MambaFamilyMixin",
    "Serves",
    "VllmApi",
    "VllmModules",
    "check_api",
    "chunkmeta_builder_class",
    "conv_fields",
    "conv_metadata",
    "fla_fields",
    "install",
    "installed",
    "is_supported_version",
    "load_vllm_api",
    "logger",
    "opt_in",
    "pending",
    "prepare_chunk_metadata_device",
    "register",
    "serves_for",
    "specs",
    "ssd_fields",
    "stats",
    "step_builder",
    "uninstall",
    "vllm_version",
    "warm_up",
    "wrapped_builder",
]
