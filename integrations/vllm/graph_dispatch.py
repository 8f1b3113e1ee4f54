"""Which steps replay a mixed FULL CUDA graph: the graphs chunkmeta adds to vLLM's model runners,
and the decision per step, taken where vLLM takes it (its dispatch, before any ``build()``).

Under ``FULL_AND_PIECEWISE`` (vLLM's default) vLLM captures FULL graphs for decode-only batches
and piecewise ones for mixed batches. With ``CHUNKMETA_VLLM_FULL_GRAPH=1`` chunkmeta adds FULL
graphs for mixed batches of every capture size ``N > 1``, beside vLLM's decode graphs:

* Model Runner V2 (vLLM 0.33.0's default, ``v1/worker/gpu``): descriptors ``(FULL, N, R)`` for
  ``R`` in ``request_buckets(N, max_num_seqs)`` (powers of two from 8, then vLLM's own
  ``min(N, max_num_seqs)``), placed after vLLM's FULL decode descriptors and before the piecewise
  ones in the manager's ordered candidates, so a batch of ``r`` requests replays the graph of
  the smallest ``R >= r``: at most twice its rows, where vLLM's key alone pads every mixed batch
  to ``min(N, max_num_seqs)`` rows, each carrying a recurrent state through every layer.
* V1 (``v1/worker/gpu_model_runner.py``, deprecated): vLLM's own keys ``(N, min(N,
  max_num_seqs))`` (its dispatcher is not told the request count).

The decision: ``MixedDispatch`` wraps the runner's dispatch. When vLLM picks a mixed FULL graph
(``mixed_shape``) every chunkmeta builder must be able to stage that step
(``FullGraphBuilderMixin.cannot_stage``); if one cannot, the step takes the graph vLLM would
take without chunkmeta's (MRV2: the next compatible candidate; V1: piecewise), one warning per
cause, counted. The builders read the decision in ``build()``: they stage exactly the steps
dispatched to a mixed graph, so no graph replays inputs that were not staged for it.
"""

from __future__ import annotations

import functools
from itertools import product

from chunkmeta.integrations.vllm.interface import logger

MRV2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
V1_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
RUNNER = "GPUModelRunner"
SMALLEST_REQUEST_BUCKET = 8  # below it a padded row costs less than another captured graph


def request_buckets(num_tokens: int, max_num_reqs: int) -> list[int]:
    """The request capacities of the mixed graphs of ``num_tokens`` tokens, ascending: powers of
    two from ``SMALLEST_REQUEST_BUCKET`` below vLLM's ``min(num_tokens, max_num_reqs)``, then it."""
    top = min(num_tokens, max_num_reqs)
    out, r = [], SMALLEST_REQUEST_BUCKET
    while r < top:
        out.append(r)
        r *= 2
    return [*out, top]


class MixedDispatch:
    """The mixed FULL graph vLLM's dispatch chose for the step in flight (``current``: its
    ``(num_tokens, num_reqs)``, None for any other graph or none), shared by the runner's
    chunkmeta builders; the steps turned away from a mixed graph, by cause."""

    def __init__(self, builders):
        self.builders = list(builders)
        self.current: tuple[int, int] | None = None
        self.refused: set[tuple[int, int]] = set()  # graphs captured by vLLM's path (no bucket)
        self.turned_away: dict[str, int] = {}
        for builder in self.builders:
            builder._chunkmeta_dispatch = self

    def decide(self, shape: tuple[int, int] | None) -> bool:
        """Record vLLM's choice for this step: ``shape`` of a mixed FULL graph, or None. False
        when it cannot be staged (the caller then dispatches the step elsewhere)."""
        self.current = None
        if shape is None:
            return True
        why = self.cannot_stage(shape)
        if why is not None:
            self._turn_away(why)
            return False
        self.current = shape
        return True

    def cannot_stage(self, shape: tuple[int, int]) -> str | None:
        """Why a step of a mixed graph of ``shape`` cannot be staged, or None. Host-only checks,
        every one a ``stage()`` would fail on for any batch of that graph."""
        for builder in self.builders:
            if not builder._mixed_active():
                return "a chunkmeta builder serves no mixed step"
        if shape in self.refused or not any(shape in b.chunkmeta_buckets for b in self.builders):
            return "a mixed graph captured on vLLM's path (chunkmeta had no bucket for it)"
        return None

    def refuse(self, shape: tuple[int, int]) -> None:
        """No step goes to the mixed graph of ``shape`` (its capture took vLLM's path)."""
        self.refused.add(shape)

    def _turn_away(self, why: str) -> None:
        count = self.turned_away[why] = self.turned_away.get(why, 0) + 1
        if count == 1:
            logger.warning("chunkmeta: a step stays off the mixed-step graphs: %s", why)


def mixed_full_eligible(vllm_config, attn_groups, builders) -> str | None:
    """Why a runner gets no mixed FULL graph from chunkmeta, or None. Every group's builder must
    support ``ALWAYS`` and every chunkmeta builder serve mixed steps; one data parallel rank
    (ranks pad to the largest batch after agreeing on a mode: a decode rank would find no graph
    of a mixed size), no micro-batching (its graphs are keyed by token count alone), no
    KV-sharing fast prefill (it dispatches a second, logits-sized batch inside a step)."""
    from vllm.v1.attention.backend import AttentionCGSupport

    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size > 1 or parallel.use_ubatching:
        return "data parallelism or micro-batching"
    if getattr(vllm_config.cache_config, "kv_sharing_fast_prefill", False):
        return "KV-sharing fast prefill"
    if not builders or not all(b._mixed_active() for b in builders):
        return "a GDN-family builder that serves no mixed step"
    for group in attn_groups:
        support = group.backend.get_builder_cls().get_cudagraph_support(vllm_config, group.kv_cache_spec)
        if support != AttentionCGSupport.ALWAYS:
            return f"{group.backend.get_name()} supports {support.name} CUDA graphs, not ALWAYS"
    return None


def _chunkmeta_builders(attn_groups) -> list:
    from chunkmeta.integrations.vllm.full_graph import FullGraphBuilderMixin

    return [b for group in attn_groups for b in group.metadata_builders if isinstance(b, FullGraphBuilderMixin)]


# -- Model Runner V2 -------------------------------------------------------------------------------


def mrv2_mixed_shape(desc) -> tuple[int, int] | None:
    """``(num_tokens, num_reqs)`` of a mixed FULL descriptor (vLLM's under ``cudagraph_mode=FULL``
    or chunkmeta's), None for any other (decode, piecewise, none)."""
    from vllm.config.compilation import CUDAGraphMode

    if desc.cg_mode != CUDAGraphMode.FULL or desc.uniform_token_count is not None or desc.max_query_len is not None:
        return None
    return desc.num_tokens, desc.num_reqs


def add_mixed_full_descs(manager, vllm_config, builders) -> int:
    """Under ``FULL_AND_PIECEWISE``, MRV2 descriptors ``(FULL, N, R)`` for mixed batches (module
    docstring), each bucket made first: a bucket that cannot be made leaves vLLM's descriptors
    as they were (raises). Returns the descriptors added."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    if manager.cudagraph_mode != CUDAGraphMode.FULL_AND_PIECEWISE:
        return 0
    full = manager._capture_descs.get(CUDAGraphMode.FULL, [])
    sizes = sorted({d.num_tokens for d in manager._capture_descs.get(CUDAGraphMode.PIECEWISE, ()) if d.num_tokens > 1})
    added = [
        desc
        for loras, n in product(manager.lora_capture_cases, sizes)
        for r in request_buckets(n, manager.max_num_reqs)
        if (desc := BatchExecutionDescriptor(CUDAGraphMode.FULL, n, r, num_active_loras=loras)) not in full
    ]
    for builder, desc in product(builders, added):
        builder.chunkmeta_bucket(desc.num_tokens, desc.num_reqs)
    # candidates: a batch of i tokens tries the FULL descriptors of the smallest size >= i first
    # (vLLM's decode ones, which take only decode batches), then these, smallest R first, then
    # the piecewise ones
    for (i, loras), candidates in manager._candidates.items():
        size = next((n for n in sizes if n >= i), None)
        ours = [d for d in added if d.num_tokens == size and d.num_active_loras == loras]
        if ours:
            at = next((k for k, d in enumerate(candidates) if d.cg_mode != CUDAGraphMode.FULL), len(candidates))
            candidates[at:at] = ours
    manager._capture_descs[CUDAGraphMode.FULL] = sorted([*full, *added], key=lambda d: d.num_tokens, reverse=True)
    return len(added)


def mrv2_dispatch(manager, record: MixedDispatch) -> None:
    """Wrap ``manager.dispatch`` (this instance): vLLM's choice, recorded; a mixed FULL graph a
    builder cannot stage gives way to the next compatible candidate that is not one."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor, _is_compatible

    original = manager.dispatch

    @functools.wraps(original)
    def dispatch(num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len=None, num_ubatches=1):
        desc = original(num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len, num_ubatches)
        if record.decide(mrv2_mixed_shape(desc)):
            return desc
        loras = manager._resolve_effective_loras(num_active_loras)
        for other in manager._candidates.get((num_tokens, loras), ()):
            if mrv2_mixed_shape(other) is None and _is_compatible(
                other, num_reqs, num_tokens, uniform_token_count, loras, max_query_len, num_ubatches
            ):
                return other
        return BatchExecutionDescriptor(
            CUDAGraphMode.NONE, num_tokens, num_reqs, num_active_loras=loras, num_ubatches=num_ubatches
        )

    manager.dispatch = dispatch


def mrv2_mixed_graphs(original):
    """MRV2's ``GPUModelRunner.initialize_kv_cache`` (it makes the builders and the graph manager,
    nothing captured yet), then chunkmeta's mixed descriptors and the dispatch decision."""

    @functools.wraps(original)
    def initialize_kv_cache(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        manager = getattr(self, "cudagraph_manager", None)
        groups = [g for gs in self.attn_groups for g in gs]
        builders = _chunkmeta_builders(groups)
        if manager is None or not builders:
            return result
        why = mixed_full_eligible(self.vllm_config, groups, builders)
        if why is None and manager.ubatch_runner is not None:
            why = "micro-batching"
        try:
            added = 0 if why else add_mixed_full_descs(manager, self.vllm_config, builders)
        except Exception as exc:  # noqa: BLE001  vLLM's descriptors as it made them: mixed batches piecewise
            why = f"{type(exc).__name__}: {exc}"
        if why:
            logger.warning("chunkmeta: no mixed-step graphs (%s)", why)
            builders = []  # every step takes vLLM's path; a mixed FULL graph of vLLM's is turned away
        else:
            logger.info("chunkmeta: %d FULL CUDA graphs for mixed batches beside vLLM's", added)
        mrv2_dispatch(manager, MixedDispatch(builders) if builders else _Refusing(groups))
        return result

    initialize_kv_cache.__qualname__ = f"chunkmeta.{RUNNER}.initialize_kv_cache"
    return initialize_kv_cache


class _Refusing(MixedDispatch):
    """The decision where chunkmeta serves no mixed graph: a mixed FULL graph of vLLM's own
    (``cudagraph_mode=FULL``) whose capture chunkmeta's builders would have made is turned away."""

    def __init__(self, groups):
        super().__init__(_chunkmeta_builders(groups))

    def decide(self, shape):
        self.current = None
        if shape is None or not self.builders:
            return True
        self._turn_away("the mixed-step graphs are off for this runner")
        return False


# -- V1 --------------------------------------------------------------------------------------------


def v1_mixed_shape(mode, key) -> tuple[int, int] | None:
    from vllm.config.compilation import CUDAGraphMode

    return (key.num_tokens, key.num_reqs) if mode == CUDAGraphMode.FULL and not key.uniform else None


def add_mixed_full_keys(dispatcher, vllm_config, attn_groups) -> int:
    """Under ``FULL_AND_PIECEWISE``, V1 FULL keys for mixed batches, the ones
    ``cudagraph_mode=FULL`` would have (vLLM's ``_create_padded_batch_descriptor``: ``(size,
    min(size, max_num_seqs))``, not uniform); the dispatcher checks FULL keys before piecewise
    ones (cudagraph_dispatcher.py:315-320). All or nothing (``mixed_full_eligible``, every
    key's bucket made before any key is added). Returns the keys added."""
    from vllm.config.compilation import CUDAGraphMode

    if dispatcher.cudagraph_mode != CUDAGraphMode.FULL_AND_PIECEWISE:
        return 0
    builders = _chunkmeta_builders(attn_groups)
    why = mixed_full_eligible(vllm_config, attn_groups, builders)
    if why is not None:
        logger.info("chunkmeta: mixed batches stay piecewise: %s", why)
        return 0
    sizes = [s for s in vllm_config.compilation_config.cudagraph_capture_sizes or () if s > 1]
    keys = {
        dispatcher._create_padded_batch_descriptor(size, False, loras > 0, loras)
        for size, loras in product(sizes, dispatcher._get_lora_cases())
    } - dispatcher.cudagraph_keys[CUDAGraphMode.FULL]
    for builder, key in product(builders, keys):
        builder.chunkmeta_bucket(key.num_tokens, key.num_reqs)
    for key in keys:
        dispatcher.add_cudagraph_key(CUDAGraphMode.FULL, key)
    logger.info("chunkmeta: %d FULL CUDA graph keys for mixed batches beside vLLM's FULL decode graphs", len(keys))
    return len(keys)


def v1_dispatch(dispatcher, record: MixedDispatch) -> None:
    """Wrap ``dispatcher.dispatch`` (this instance): vLLM's choice, recorded; a mixed FULL key a
    builder cannot stage gives way to vLLM's dispatch without FULL graphs."""
    from vllm.config.compilation import CUDAGraphMode

    original = dispatcher.dispatch

    @functools.wraps(original)
    def dispatch(num_tokens, uniform_decode=False, has_lora=False, num_active_loras=0, valid_modes=None, **kwargs):
        mode, key = original(num_tokens, uniform_decode, has_lora, num_active_loras, valid_modes, **kwargs)
        if record.decide(v1_mixed_shape(mode, key)):
            return mode, key
        invalid = {*(kwargs.pop("invalid_modes", None) or ()), CUDAGraphMode.FULL}
        return original(num_tokens, uniform_decode, has_lora, num_active_loras, valid_modes, invalid_modes=invalid)

    dispatcher.dispatch = dispatch


def v1_mixed_graphs(original):
    """V1's ``GPUModelRunner.initialize_metadata_builders`` (vLLM has settled the mode and its
    keys, and made the builders), then ``add_mixed_full_keys`` and the dispatch decision; a
    failure keeps vLLM's keys, with one warning."""

    @functools.wraps(original)
    def initialize_metadata_builders(self, *args, **kwargs):
        original(self, *args, **kwargs)
        groups = [g for gs in self.attn_groups for g in gs]
        builders = _chunkmeta_builders(groups)
        if not builders:
            return
        try:
            add_mixed_full_keys(self.cudagraph_dispatcher, self.vllm_config, groups)
            record = MixedDispatch(builders)
        except Exception as exc:  # noqa: BLE001  vLLM's keys as it made them: mixed batches piecewise
            logger.warning("chunkmeta: no FULL graphs for mixed batches (%s: %s)", type(exc).__name__, exc)
            record = _Refusing(groups)
        v1_dispatch(self.cudagraph_dispatcher, record)

    initialize_metadata_builders.__qualname__ = f"chunkmeta.{RUNNER}.initialize_metadata_builders"
    return initialize_metadata_builders
