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
KIMI_ROCM_BUILDER = "KimiK3ROCmKDAMetadataBuilder"
KIMI_NVIDIA_MODULE = "vllm.models.kimi_k3.nvidia.kda_metadata"
KIMI_NVIDIA_BACKEND = "KimiK3KDAAttentionBackend"
MAMBA2_BUILDER = "Mamba2AttentionMetadataBuilder"
# backends of the Mamba family, (module, backend class): their builders derive from
# BaseMambaAttentionMetadataBuilder (v1/attention/backends/mamba_attn.py)
MAMBA_BACKENDS = (
    ("vllm.v1.attention.backends.mamba1_attn", "Mamba1AttentionBackend"),
    ("vllm.v1.attention.backends.mamba2_attn", "Mamba2AttentionBackend"),
    ("vllm.v1.attention.backends.short_conv_attn", "ShortConvAttentionBackend"),
)
GDN_MODULE = "vllm.v1.attention.backends.gdn_attn"
GDN_BACKEND = "GDNAttentionBackend"
GDN_BUILDER = "GDNAttentionMetadataBuilder"
# the modules whose build() calls compute_causal_conv1d_metadata by name
CONV_MODULES = (GDN_MODULE, "vllm.v1.attention.backends.mamba_attn")
CONV_FUNCTION = "compute_causal_conv1d_metadata"
CONV_PARAMS = ("query_start_loc_p_cpu", "device")
HOOK = "_build_chunk_metadata"
HOOK_PARAMS = ("self", "prefill_query_start_loc", "prefill_query_start_loc_cpu", "device")
SSD_HOOK = "_build_chunk_metadata_tensors"
SSD_HOOK_PARAMS = ("self", "chunk_size", "common", "common_attn_metadata", "checkpoint_offsets_p")
INIT_PARAMS = ("self", "kv_cache_spec", "layer_names", "vllm_config", "device")
# build() as the chunkmeta builders take it (their decode-only steps pass these on as given)
GDN_BUILD_PARAMS = (
    "self",
    "common_prefix_len",
    "common_attn_metadata",
    "num_accepted_tokens",
    "num_decode_draft_tokens_cpu",
    "fast_build",
)
MAMBA_BUILD_PARAMS = ("self", "common_prefix_len", "common_attn_metadata", "fast_build")  # then keywords only


def is_gdn_family(builder: type) -> bool:
    """A GDN-family builder (GDN, Kimi-K3): it has the FLA hook; the Mamba family has none."""
    return hasattr(builder, HOOK)


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
    mamba_backends: tuple[type, ...] = ()
    conv_modules: tuple = ()  # modules whose compute_causal_conv1d_metadata chunkmeta answers
    kimi_nvidia_module: str | None = None  # wired when vLLM imports it (backend and conv call)

    def backends(self) -> tuple[type, ...]:
        return tuple(b for b in (self.gdn_backend, self.kimi_rocm_backend) if b is not None)


@attrs.frozen
class VllmModules:
    """Where the classes and functions the adapter patches live, by module name: what
    ``install()`` wires when vLLM imports each module (tests name stand-ins). ``gdn`` holds
    ``GDNAttentionBackend`` and ``GDNAttentionMetadataBuilder``; ``conv``: modules whose
    ``compute_causal_conv1d_metadata`` chunkmeta answers; ``mamba``: ``(module, backend class)``
    of the Mamba family; the Kimi-K3 modules hold their backends (NVIDIA's also calls the conv
    function by name)."""

    gdn: str = GDN_MODULE
    conv: tuple[str, ...] = CONV_MODULES
    mamba: tuple[tuple[str, str], ...] = MAMBA_BACKENDS
    kimi_rocm: str | None = KIMI_ROCM_MODULE
    kimi_nvidia: str | None = KIMI_NVIDIA_MODULE


MODULES = VllmModules()


def vllm_version() -> str | None:
    return distribution_version("vllm")


def load_vllm_api() -> VllmApi:
    """The running vLLM's classes, imported now (``gdn_attn``, the Mamba-family backends): for a
    caller that wants them resolved at once (``install(load_vllm_api())``, the tests). The plugin
    never calls it (``install()`` waits for vLLM's own imports). Never imports the Kimi-K3 ROCm
    module: it imports vLLM's FLA utils, which query the GPU at import
    (``torch.cuda.get_device_name``)."""
    version = vllm_version()
    if version is None:
        raise ChunkMetaError("chunkmeta.integrations.vllm needs vLLM: pip install 'chunkmeta[vllm]' (vllm==0.33.0).")
    import importlib

    from vllm.v1.attention.backends.gdn_attn import GDNAttentionBackend, GDNAttentionMetadataBuilder

    kimi = getattr(sys.modules.get(KIMI_ROCM_MODULE), KIMI_ROCM_BACKEND, None)
    mamba = tuple(getattr(importlib.import_module(module), name) for module, name in MAMBA_BACKENDS)
    return VllmApi(
        version,
        GDNAttentionBackend,
        GDNAttentionMetadataBuilder,
        kimi,
        None if kimi is not None else KIMI_ROCM_MODULE,
        mamba_backends=mamba,
        conv_modules=tuple(importlib.import_module(name) for name in CONV_MODULES),
        kimi_nvidia_module=KIMI_NVIDIA_MODULE,
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
    problems += check_build(api.gdn_builder, GDN_BUILD_PARAMS)
    init = _param_names(api.gdn_builder.__init__)
    if init is None or init[: len(INIT_PARAMS)] != INIT_PARAMS:
        problems.append(f"{api.gdn_builder.__name__}.__init__{init} does not start with {INIT_PARAMS}")
    problems += [p for backend in api.backends() for p in check_backend(backend, api.gdn_builder)]
    problems += [p for backend in api.mamba_backends for p in check_mamba_backend(backend)]
    problems += [p for module in api.conv_modules for p in check_conv_module(module)]
    return problems


def check_mamba_backend(backend: type) -> list[str]:
    """Problems with ``backend`` as a Mamba-family backend whose builder chunkmeta can wrap."""
    builder = backend.get_builder_cls()
    ssd = getattr(builder, SSD_HOOK, None)
    if ssd is None or _param_names(ssd) != SSD_HOOK_PARAMS:
        return [f"{builder.__name__}.{SSD_HOOK} is not {SSD_HOOK}{SSD_HOOK_PARAMS}"]
    return check_build(builder, MAMBA_BUILD_PARAMS)


def check_build(builder: type, params: tuple[str, ...]) -> list[str]:
    """Problems with ``builder.build`` as the chunkmeta builder's build() calls it: ``params``
    first, anything after them keyword-only."""
    try:
        found = list(inspect.signature(builder.build).parameters.values())
    except (AttributeError, TypeError, ValueError):
        found = None
    keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD)
    if (
        found is None
        or tuple(p.name for p in found[: len(params)]) != params
        or any(p.kind not in keyword for p in found[len(params) :])
    ):
        shown = None if found is None else tuple(p.name for p in found)
        return [f"{builder.__name__}.build{shown} is not build{params} (then keywords only)"]
    return []


def check_conv_module(module) -> list[str]:
    """Problems with ``module``'s ``compute_causal_conv1d_metadata`` as the one chunkmeta answers."""
    function = getattr(module, CONV_FUNCTION, None)
    function = getattr(function, "__wrapped__", function)
    if function is None or _param_names(function) != CONV_PARAMS:
        return [f"{module.__name__}.{CONV_FUNCTION} is not {CONV_FUNCTION}{CONV_PARAMS}"]
    return []


def check_backend(backend: type, gdn_builder: type) -> list[str]:
    """Problems with ``backend`` as a GDN-family backend whose builder chunkmeta can wrap."""
    getter = getattr(backend, "get_builder_cls", None)
    builder = getter() if callable(getter) else None
    if isinstance(builder, type) and issubclass(builder, gdn_builder):
        return check_build(builder, GDN_BUILD_PARAMS)
    return [f"{backend.__name__}.get_builder_cls() returns {builder!r}, not a {gdn_builder.__name__}"]
