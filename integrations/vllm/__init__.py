"""vLLM adapter: chunkmeta behind vLLM's GDN / KDA chunk-metadata hook (vLLM 0.33.0).

Where vLLM builds the tables: ``GDNAttentionMetadataBuilder.build()``
(``vllm/v1/attention/backends/gdn_attn.py``) calls ``_build_chunk_metadata`` once per step with
prefills. Qwen3-Next / Qwen3.5 (GDN) and Kimi-Linear (KDA) use the stock builder; ROCm Kimi-K3
has its own (``vllm/models/kimi_k3/amd/kda_metadata.py``).

* ``ChunkmetaBuilderMixin`` (``builders``): put in front of a vLLM GDN-family builder, it answers
  the hook from one persistent ``ChunkMetadataBuilder`` per vLLM builder, sized from the scheduler
  config (``max_num_seqs``, ``max_num_batched_tokens``, chunk size 64). The tables are exactly
  vLLM's (int32 ``[NT, 2]``, int64 ``[N+1]``); for ``gdn_prefill_backend="cutedsl"`` they are in
  CuteDSL's layout. A step chunkmeta cannot hold is served by vLLM's own path, with one warning.
* ``prepare_chunk_metadata_device(cu_seqlens, cu_seqlens_cpu, chunk_size)`` (``kimi_k3``): a
  drop-in for the ROCm Kimi-K3 helper (same signature, dtypes and fresh tensors).
* ``install()`` / ``uninstall()`` (``wiring``): patch ``get_builder_cls`` of ``GDNAttentionBackend``
  and of ``KimiK3ROCmKDABackend`` to return the mixed-in builders.
* ``register()`` (``wiring``): the ``vllm.general_plugins`` entry point; a no-op unless
  ``CHUNKMETA_VLLM=1``.

Modules: ``interface`` (the vLLM names, the version gate and interface checks), ``builders``,
``kimi_k3``, ``wiring``; the opt-in, version gate, patches and import hooks are
``chunkmeta.integrations.plugin``'s. Nothing here imports vLLM at import time:
``interface.load_vllm_api()`` does, inside ``install()``.
"""

from chunkmeta.integrations.vllm.builders import (
    CUTEDSL,
    FLA_CHUNK_SIZE,
    HOOKLESS_BACKENDS,
    RING_DEPTH,
    ChunkmetaBuilderMixin,
    builder_for_config,
    chunkmeta_builder_class,
    cutedsl_layout,
    warm_up,
    wrapped_builder,
)
from chunkmeta.integrations.vllm.interface import (
    ENV_VAR,
    GATE,
    HOOK,
    HOOK_PARAMS,
    INIT_PARAMS,
    KIMI_ROCM_BACKEND,
    KIMI_ROCM_MODULE,
    SUPPORTED_VLLM,
    VllmApi,
    check_api,
    is_supported_version,
    load_vllm_api,
    logger,
    vllm_version,
)
from chunkmeta.integrations.vllm.kimi_k3 import prepare_chunk_metadata_device
from chunkmeta.integrations.vllm.wiring import install, installed, opt_in, pending, register, uninstall

__all__ = [
    "CUTEDSL",
    "ENV_VAR",
    "FLA_CHUNK_SIZE",
    "GATE",
    "HOOK",
    "HOOKLESS_BACKENDS",
    "HOOK_PARAMS",
    "INIT_PARAMS",
    "KIMI_ROCM_BACKEND",
    "KIMI_ROCM_MODULE",
    "RING_DEPTH",
    "SUPPORTED_VLLM",
    "ChunkmetaBuilderMixin",
    "VllmApi",
    "builder_for_config",
    "check_api",
    "chunkmeta_builder_class",
    "cutedsl_layout",
    "install",
    "installed",
    "is_supported_version",
    "load_vllm_api",
    "logger",
    "opt_in",
    "pending",
    "prepare_chunk_metadata_device",
    "register",
    "uninstall",
    "vllm_version",
    "warm_up",
    "wrapped_builder",
]
