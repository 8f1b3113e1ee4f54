"""The FLA router over vLLM's vendored FLA / KDA ops, keyed by the tensors a builder just made.

Kimi-Linear / AliceAI, Kimi-K3 (NVIDIA, triton), GLM5-next (triton), OLMo-Hybrid and
Bailing-MoE-V3 call the vendored ops with ``cu_seqlens=non_spec_query_start_loc`` and no tables;
those ops (and ``solve_tril`` inside them) call ``prepare_chunk_indices``, whose ``.tolist()``
syncs once per step (hidden from ``VLLM_GPU_SYNC_CHECK`` by ``gpu_sync_allowed()``). Every module
that binds the helpers by name (census §1.5) gets ``chunkmeta.integrations.fla``'s one
``FlaRouter``; it answers only for the ``prefill_query_start_loc`` / ``non_spec_query_start_loc``
objects of a chunkmeta builder's latest step (identity), with tables whose ring slot is still that
step's (generation), and falls through to vLLM's function for any other tensor.
"""

from __future__ import annotations

import threading
import weakref

import attrs
import torch

from chunkmeta.integrations.fla.router import FlaPatch, FlaRouter
from chunkmeta.metadata import ChunkMetadata

INDEX_MODULE = "vllm.third_party.flash_linear_attention.ops.index"
# Every module of vLLM 0.33.0 that binds prepare_chunk_indices / prepare_chunk_offsets by name
# (`from ...index import`): each holds its own reference, so each is patched separately.
# gdn_attn imports them inside _build_chunk_metadata, which chunkmeta's builders replace.
ROUTED_MODULES = (
    INDEX_MODULE,
    "vllm.third_party.flash_linear_attention.ops.chunk_delta_h",
    "vllm.third_party.flash_linear_attention.ops.cumsum",
    "vllm.third_party.flash_linear_attention.ops.wy_fast",
    "vllm.third_party.flash_linear_attention.ops.solve_tril",
    "vllm.third_party.flash_linear_attention.ops.chunk_o",
    "vllm.third_party.flash_linear_attention.ops.chunk_scaled_dot_kkt",
    "vllm.third_party.flash_linear_attention.ops.kda",
    "vllm.models.kimi_k3.nvidia.ops.third_party.kda.chunk",
    "vllm.models.kimi_k3.nvidia.ops.third_party.kda.chunk_intra",
    "vllm.models.kimi_k3.amd.ops.third_party.kda.chunk",
    "vllm.models.kimi_k3.amd.ops.third_party.kda.chunk_intra",
    "vllm.models.kimi_k3.amd.ops.kda_chunk",
    "vllm.models.glm5next.nvidia.ops.third_party.kda.kernels",
    "vllm.models.glm5next.amd.ops.third_party.kda.kernels",
)

_ROUTER: FlaRouter | None = None
_ROUTER_LOCK = threading.Lock()


def router() -> FlaRouter:
    """The process-wide router over vLLM's vendored FLA (installed for the rest of the process on
    first use; it imports only ``index``, never a model's op package, whose ``__init__`` imports
    the whole model)."""
    global _ROUTER
    with _ROUTER_LOCK:
        if _ROUTER is None:
            _ROUTER = FlaRouter("vllm.third_party.flash_linear_attention", INDEX_MODULE, modules=ROUTED_MODULES)
        _ROUTER.ensure_installed()
        return _ROUTER


def restore() -> None:
    """Put vLLM's helpers back in every routed module and disarm the router's import hooks
    (``uninstall()``). Builders alive keep their tables; their routes stay registered but no
    wrapper asks them, so the vendored ops derive theirs as vLLM does, until a builder made
    after a new ``install()`` installs the router again (then they answer again)."""
    with _ROUTER_LOCK:
        if _ROUTER is not None:
            _ROUTER.restore()


@attrs.frozen(slots=True)
class Route:
    """One of a step's vLLM ``cu_seqlens`` tensors and chunkmeta's FLA tables for it: the fields
    ``FlaRouter`` reads (``cu_seqlens`` is vLLM's object, matched by identity)."""

    cu_seqlens: torch.Tensor
    metadata: ChunkMetadata

    @property
    def chunk_size(self) -> int:
        return self.metadata.chunk_size

    @property
    def padding(self) -> str | None:
        return self.metadata.padding

    def check_live(self) -> ChunkMetadata:
        return self.metadata.check_live()


class StepRoutes:
    """A builder's routes for its latest step, as router services (one per routed tensor).

    ``set`` replaces them at every build (None: the step routes nothing), so a tensor of an
    earlier step never matches. The router holds this object only through the services, which
    stop answering once the builder that owns it is gone."""

    KEYS = ("prefill", "batch")

    def __init__(self):
        self._routes: dict[str, Route | None] = dict.fromkeys(self.KEYS)
        self._empty = True  # clear() of routes already clear costs one attribute read
        rtr = router()
        self._patches = [FlaPatch(_Service(self, key), rtr).install() for key in self.KEYS]
        weakref.finalize(self, _uninstall, self._patches)

    def set(self, routes: dict[str, Route | None]) -> None:
        for key in self.KEYS:
            self._routes[key] = routes.get(key)
        self._empty = not any(self._routes.values())

    def clear(self) -> None:
        if self._empty:
            return
        for key in self.KEYS:
            self._routes[key] = None
        self._empty = True

    def get(self, key: str) -> Route | None:
        return self._routes[key]


def _uninstall(patches) -> None:
    for patch in patches:
        patch.uninstall()


class _Service:
    __slots__ = ("_owner", "key")

    def __init__(self, owner: StepRoutes, key: str):
        self._owner = weakref.ref(owner)
        self.key = key

    @property
    def current(self) -> Route | None:
        owner = self._owner()
        return None if owner is None else owner.get(self.key)

    @property
    def in_step(self) -> bool:
        return self.current is not None
