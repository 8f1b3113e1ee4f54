"""The vLLM names the adapter touches, resolved once, and the checks that they are the ones it was
written against (vLLM 0.33.0)."""

from __future__ import annotations

import inspect
import logging
import sys

import attrs

from chunkmeta.errors import ChunkMetaError
from chunkmeta.integrations.plugin import VersionGate, distribution_version

# Under vLLM's "vllm" logger, so that inside vLLM these lines appear in vLLM's log, in its format
# and at its level (VLLM_LOGGING_LEVEL).
logger = logging.getLogger("vllm.chunkmeta")

SUPPORTED_VLLM = ("0.33.0",)
ENV_VAR = "CHUNKMETA_VLLM"
GATE = VersionGate(
    "vLLM",
    SUPPORTED_VLLM[0],
    SUPPORTED_VLLM[-1],
    fix=f"install vllm=={SUPPORTED_VLLM[-1]}, or pass allow_untested=True ({ENV_VAR}=force for the plugin) to try it.",
)

KIMI_ROCM_MODULE = "vllm.models.kimi_k3.amd.kda_metadata"
KIMI_ROCM_BACKEND = "KimiK3ROCmKDABackend"
HOOK = "_build_chunk_metadata"
HOOK_PARAMS = ("self", "prefill_query_start_loc", "prefill_query_start_loc_cpu", "device")
INIT_PARAMS = ("self", "kv_cache_spec", "layer_names", "vllm_config", "device")


@attrs.frozen
class VllmApi:
    """The vLLM classes the adapter patches, resolved once (tests pass a model of them).

    ``gdn_backend`` / ``gdn_builder``: ``GDNAttentionBackend`` / ``GDNAttentionMetadataBuilder``
    (``vllm/v1/attention/backends/gdn_attn.py``). ``kimi_rocm_backend``: ``KimiK3ROCmKDABackend``
    (``vllm/models/kimi_k3/amd/kda_metadata.py``) if its module is imported already; otherwise
    ``kimi_rocm_module`` names that module, and ``install()`` wires the backend when vLLM imports it.
    """

    version: str
    gdn_backend: type
    gdn_builder: type
    kimi_rocm_backend: type | None = None
    kimi_rocm_module: str | None = None

    def backends(self) -> tuple[type, ...]:
        return tuple(b for b in (self.gdn_backend, self.kimi_rocm_backend) if b is not None)


def vllm_version() -> str | None:
    return distribution_version("vllm")


def load_vllm_api() -> VllmApi:
    """The running vLLM's classes. Imports ``gdn_attn`` (safe in any vLLM process), never the
    Kimi-K3 ROCm module: it imports vLLM's FLA utils, which query the GPU at import
    (``torch.cuda.get_device_name``), and that must not happen in vLLM's API-server and
    engine-core processes, which start workers afterwards."""
    version = vllm_version()
    if version is None:
        raise ChunkMetaError("chunkmeta.integrations.vllm needs vLLM: pip install 'chunkmeta[vllm]' (vllm==0.33.0).")
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend, GDNAttentionMetadataBuilder

    kimi = getattr(sys.modules.get(KIMI_ROCM_MODULE), KIMI_ROCM_BACKEND, None)
    return VllmApi(
        version, GDNAttentionBackend, GDNAttentionMetadataBuilder, kimi, None if kimi is not None else KIMI_ROCM_MODULE
    )


def is_supported_version(version: str) -> bool:
    """A release chunkmeta is tested against; local tags (``+rocm...``, ``+cu130``) are ignored."""
    return GATE.is_tested(version)


def _param_names(function) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return None


def check_api(api: VllmApi) -> list[str]:
    """What in ``api`` differs from the interface the adapter is written against (empty: none)."""
    problems = []
    hook = getattr(api.gdn_builder, HOOK, None)
    if hook is None:
        problems.append(f"{api.gdn_builder.__name__} has no {HOOK} hook")
    elif _param_names(hook) != HOOK_PARAMS:
        problems.append(f"{api.gdn_builder.__name__}.{HOOK}{_param_names(hook)} is not {HOOK}{HOOK_PARAMS}")
    init = _param_names(api.gdn_builder.__init__)
    if init is None or init[: len(INIT_PARAMS)] != INIT_PARAMS:
        problems.append(f"{api.gdn_builder.__name__}.__init__{init} does not start with {INIT_PARAMS}")
    problems += [p for backend in api.backends() for p in check_backend(backend, api.gdn_builder)]
    return problems


def check_backend(backend: type, gdn_builder: type) -> list[str]:
    """Problems with ``backend`` as a GDN-family backend whose builder chunkmeta can wrap."""
    getter = getattr(backend, "get_builder_cls", None)
    builder = getter() if callable(getter) else None
    if isinstance(builder, type) and issubclass(builder, gdn_builder):
        return []
    return [f"{backend.__name__}.get_builder_cls() returns {builder!r}, not a {gdn_builder.__name__}"]
