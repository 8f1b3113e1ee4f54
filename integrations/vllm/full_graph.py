"""Opt-in (``CHUNKMETA_VLLM_FULL_GRAPH=1``, with ``CHUNKMETA_VLLM=1``): vLLM captures mixed
prefill+decode steps of Kimi-Linear's KDA and Qwen3-Next / Qwen3.5's GDN layers in FULL CUDA
graphs.

* ``FullGraphBuilderMixin`` goes in front of a GDN-family chunkmeta builder:
  ``get_cudagraph_support`` says ``ALWAYS`` for a model whose layers are patched here
  (``graph_unsafe``: Kimi-Linear; Qwen3-Next / Qwen3.5 with the FLA-triton prefill backend; no
  speculative decoding), vLLM's own level otherwise (vLLM keeps a user's ``cudagraph_mode=FULL``
  only if every KV-cache group's builder says ``ALWAYS``: config/compilation.py:1394-1419);
  ``build_for_cudagraph_capture`` stages the bucket (``MixedStepInputs``) of a captured mixed
  batch shape ``(num_actual_tokens, num_reqs)`` without the stock decode-size assert
  (gdn_attn.py:799-808); ``build`` stages the steps vLLM's dispatch sent to a mixed graph
  (``graph_dispatch`` records that decision) into their bucket (one fill launch, the runner's
  values copied in) and hands it to the layers as ``metadata.chunkmeta_mixed``;
  ``update_block_table`` gives the other KV-cache groups a view with their own state indices.
* Which graphs are mixed: under ``cudagraph_mode=FULL`` (one routine) vLLM's own, which every
  batch replays, decode-only ones too (they then run the chunked path). Under
  ``FULL_AND_PIECEWISE`` (vLLM's default) the ones ``graph_dispatch`` adds beside vLLM's FULL
  decode graphs: batches with a prefill replay a bucket's graph, decode-only ones keep vLLM's
  decode kernels and capture (``FullGraphBuilderMixin._vllm_decode_routine``).
* ``kimi_forward`` / ``qwen_forward_core``: ``KimiGatedDeltaNetAttention._forward`` and
  ``QwenGatedDeltaNetAttention._forward_core`` taking the graph-safe non-spec path
  (``mixed_step``) whenever their metadata carries a bucket; anything else is vLLM's own method.

Steps dispatched elsewhere (larger than every capture size, turned away, eager runs) keep
chunkmeta's eager tables or vLLM's path. The GEMMs, norms and the other groups' attention are
vLLM's to capture: the whole model needs every group ``ALWAYS`` (Kimi-Linear's MLA:
FlashInfer-MLA is, FlashMLA and Triton-MLA are not: docs/vllm.md).
"""

from __future__ import annotations

import functools
import itertools
import math
import os

import torch

from chunkmeta.errors import ChunkMetaError
from chunkmeta.integrations import plugin
from chunkmeta.integrations.vllm.interface import ENV_VAR, logger
from chunkmeta.integrations.vllm.mixed_step import (
    MAMBA2_DECODES,
    NULL_BLOCK_ID,
    GdnOps,
    GroupInputs,
    KdaOps,
    Mamba2Ops,
    Mamba2StepInputs,
    MixedStepInputs,
    SharedFill,
    gdn_mixed_forward,
    if_nodes_capture,
    kda_mixed_forward,
    mamba2_mixed_forward,
)

FULL_GRAPH_ENV = "CHUNKMETA_VLLM_FULL_GRAPH"
KIMI_LAYER_MODULE = "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn"
KIMI_LAYER = "KimiGatedDeltaNetAttention"
QWEN_LAYER_MODULE = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"
QWEN_LAYER = "QwenGatedDeltaNetAttention"
# The models whose linear-attention layers this module patches (vLLM's architecture names). A
# GDN-family builder of any other model (Kimi-K3, GLM5-next, OLMo-Hybrid, Bailing-V3) keeps
# vLLM's support level: its unpatched layers branch on host counts, which a capture would freeze.
KIMI_ARCHITECTURES = frozenset({"KimiLinearForCausalLM"})
QWEN_ARCHITECTURES = frozenset(
    {
        "Qwen3NextForCausalLM",
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
    }
)
FLA_TRITON = "triton"  # the one GDN prefill backend gdn_mixed_forward runs (vLLM's active backend name)
MAMBA2_LAYER_MODULE = "vllm.model_executor.layers.mamba.mamba_mixer2"
MAMBA2_LAYER = "MambaMixer2"
# Models whose Mamba2 layers are MambaMixer2 (model_executor/models/registry.py:110-217)
MAMBA2_ARCHITECTURES = frozenset(
    {
        "NemotronHForCausalLM",
        "NemotronHPuzzleForCausalLM",
        "GraniteMoeHybridForCausalLM",
        "FalconH1ForCausalLM",
        "Mamba2ForCausalLM",
        "Zamba2ForCausalLM",
    }
)
MAMBA2_DECODES_ENV = "CHUNKMETA_VLLM_MAMBA2_DECODES"  # mamba2_mixed_forward's decodes ("ssu", "ssd")
# "1": a bucket's state-carrying kernels run on levels of rows and chunks, one CUDA graph IF
# node each (mixed_step.MixedStepInputs); off by default until measured on a GPU: torch gives
# each IF body its own stream, so the caching allocator cannot reuse one body's temporaries in
# the next, and a graph's memory may grow with layers x levels
LEVELS_ENV = "CHUNKMETA_VLLM_LEVELS"
# A Mamba2 bucket's SSD at capacity allocates float32 states: its chunk rows twice (vLLM's
# chunk-state and state-passing outputs, ssd_combined.py:103-126) and its rows' initial states
# twice (gathered, then masked), 5 MiB each at Nemotron-Nano-9B-v2's mixer. A 256-token graph
# of 128 requests then needs ~3 GiB in one layer, which vLLM did not count when it sized the KV
# cache (H100: out of memory in capture, vllm_engine@2026-12-07T08:39:39Z). A bucket over the
# budget (MiB) is not made: its graph is not captured and its steps stay on vLLM's path.
MAMBA2_GRAPH_MIB_ENV = "CHUNKMETA_VLLM_MAMBA2_GRAPH_MIB"
MAMBA2_GRAPH_MIB = 512
# Under Model Runner V2, a Mamba2 graph's SSD holds this many prefill rows (its chunk rows the
# tables' bound for them), not the graph's every row: without levels the SSD runs over the whole
# chunk capacity, and each padding chunk stores a full state and reads it back. A step with more
# prefill rows, counted as vLLM's builder will (mamba2_prefill_rows), is dispatched to vLLM's path
# (MixedDispatch.decide); "0": every row (V1, whose dummy runs dispatch without a step to read,
# always).
MAMBA2_SSD_ROWS_ENV = "CHUNKMETA_VLLM_MAMBA2_SSD_ROWS"
MAMBA2_SSD_ROWS = 2
MAMBA_SSU_TRITON = "triton"  # the SSU backend mamba2_mixed_forward calls (config/mamba.py:25-40)


def opted_in(environ=None) -> bool:
    return plugin.opt_in(FULL_GRAPH_ENV, logger, environ=environ) is not None


def graph_unsafe(vllm_config, family: str = "gdn") -> str | None:
    """Why a model's mixed steps cannot be captured with this module's layers of ``family``
    (``"gdn"``: KDA / GDN; ``"mamba2"``: ``MambaMixer2``), or None."""
    if getattr(vllm_config, "speculative_config", None) is not None:
        return "speculative decoding (its multi-query path is not in the graph-safe forward)"
    model = getattr(vllm_config, "model_config", None)
    architectures = set(getattr(model, "architectures", None) or ())
    if family == "mamba2":
        return _mamba2_unsafe(vllm_config, architectures)
    if architectures & KIMI_ARCHITECTURES:
        return None
    if architectures & QWEN_ARCHITECTURES:
        from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as qwen

        if getattr(qwen, "GDN_AITER_TRITON_AVAILABLE", False):
            # ROCm with AITER: forward_hip goes to _forward_core_rocm, which serves a batch of
            # no prefill on its own decode kernel before the patched _forward_core is reached
            # (qwen_gdn_linear_attn.py:1104, 1529-1541): a capture would freeze that path
            return "ROCm's AITER GDN path (its layer never reaches the graph-safe forward)"
        backend = qwen._resolve_gdn_prefill_backend(vllm_config)[1]
        if backend != FLA_TRITON:
            return (
                f"GDN prefill backend {backend!r}: only FLA-triton's is graph-safe here "
                "(additional_config={'gdn_prefill_backend': 'triton'})"
            )
        return None
    return f"architectures {sorted(architectures)}: no graph-safe layer for them"


def _mamba2_unsafe(vllm_config, architectures: set) -> str | None:
    if not architectures & MAMBA2_ARCHITECTURES:
        return f"architectures {sorted(architectures)}: no graph-safe Mamba2 layer for them"
    if getattr(getattr(vllm_config, "cache_config", None), "use_replayssm", False):
        return "ReplaySSM (its ring-buffer decode is not in the graph-safe forward)"
    backend = getattr(getattr(vllm_config, "mamba_config", None), "backend", None)
    name = getattr(backend, "value", backend)
    if name is not None and name != MAMBA_SSU_TRITON:
        return f"Mamba SSU backend {name!r}: only vLLM's Triton one is in the graph-safe forward"
    return None


def _shared_fill(vllm_config) -> SharedFill | None:
    """The fill of a builder's buckets: the largest mixed graph's capacity, vLLM's largest capture
    size and ``min(it, max_num_seqs)`` requests (V1's and MRV2's keys: graph_dispatch), or None
    without capture sizes (each bucket then fills its own tables)."""
    sizes = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_capture_sizes", None) or ()
    max_num_seqs = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_seqs", None)
    if not sizes or not isinstance(max_num_seqs, int):
        return None
    return SharedFill(max(sizes), min(max(sizes), max_num_seqs))


class FullGraphBuilderMixin:
    """The buckets of captured mixed steps, the dispatch record and the staging, in front of a
    chunkmeta builder mixin; a family's subclass (``GdnFullGraphMixin``,
    ``Mamba2FullGraphMixin``) says how a bucket is made and staged from its metadata."""

    _chunkmeta_family = "gdn"

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        from vllm.v1.attention.backend import AttentionCGSupport

        if graph_unsafe(vllm_config, cls._chunkmeta_family) is not None:
            return super().get_cudagraph_support(vllm_config, kv_cache_spec)
        return AttentionCGSupport.ALWAYS

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs)
        self.chunkmeta_buckets: dict[tuple[int, int], MixedStepInputs] = {}
        self.chunkmeta_mixed_steps = 0  # steps staged into a bucket (captures and warm-ups included)
        self.chunkmeta_mixed_fallbacks: dict[str, int] = {}
        # graph_dispatch.MixedDispatch: the mixed graph vLLM's dispatch chose for the step in
        # flight (set by the runner hook; None where no hook runs)
        self._chunkmeta_dispatch = None
        self._chunkmeta_views: dict[MixedStepInputs, GroupInputs] = {}  # another group's bucket -> ours
        self._chunkmeta_fill = _shared_fill(vllm_config)
        self._chunkmeta_unsafe = graph_unsafe(vllm_config, self._chunkmeta_family)
        if self._chunkmeta_unsafe is not None and self.chunkmeta is not None:
            logger.warning(
                "chunkmeta: %s=1 but mixed steps stay on vLLM's path: %s", FULL_GRAPH_ENV, self._chunkmeta_unsafe
            )

    def _mixed_active(self) -> bool:
        return self.chunkmeta is not None and self._chunkmeta_unsafe is None

    def _vllm_decode_routine(self, m) -> bool:
        """Whether a capture (or, without a runner hook, a batch) is one of vLLM's FULL decode
        routine, served with its own decode kernels: under ``FULL_AND_PIECEWISE`` /
        ``FULL_DECODE_ONLY`` (a separate decode routine), a batch of one-token requests (vLLM's
        dummy runs give the mixed captures ``max_query_len = num_tokens``, the decode ones 1:
        gpu_model_runner.py:5519, MRV2 cudagraph_utils.py:839-842). Under ``cudagraph_mode=FULL``
        (one routine) every batch replays a mixed graph. Read per batch: vLLM settles the mode
        after it has made the builders, from their support levels."""
        mode = getattr(self.vllm_config.compilation_config, "cudagraph_mode", None)
        return mode is not None and mode.separate_routine() and m.max_query_len <= 1

    def build_for_cudagraph_capture(self, common_attn_metadata):
        # FULL captures: vLLM's decode routine's (its decode kernels), or mixed batches' (one
        # routine under FULL; beside the decode routine where graph_dispatch added them)
        m = common_attn_metadata
        record = self._chunkmeta_dispatch
        if record is not None:
            record.current = None  # a capture is no dispatched step (vLLM's decode capture calls build())
        if not self._mixed_active() or self._vllm_decode_routine(m):
            return super().build_for_cudagraph_capture(m)
        shape = (m.num_actual_tokens, m.num_reqs)
        if record is not None and shape in record.refused:
            # its warm-up could not stage: its capture takes the same path (no bucket made again)
            return super().build(0, m)
        try:
            bucket = self.chunkmeta_bucket(*shape)
            return self._staged_build(bucket, self._capture_args(m), {}, strict=True, stage=self._stage_capture)
        except Exception as exc:  # noqa: BLE001  a bucket it cannot make or stage
            # No step is ever dispatched to that graph. Its capture takes the eager build (vLLM's
            # capture builder asserts a decode-sized batch, gdn_attn.py:799-808): a graph that
            # froze the eager path's host branches, never replayed.
            self.chunkmeta_buckets.pop(shape, None)
            if record is not None:
                record.refuse(shape)
            self._mixed_fall_back(exc)
            return super().build(0, m)

    def chunkmeta_bucket(self, num_tokens: int, num_reqs: int) -> MixedStepInputs:
        """The bucket of a captured mixed batch shape, made on first use (raises where it cannot be)."""
        bucket = self.chunkmeta_buckets.get((num_tokens, num_reqs))
        if bucket is None:
            bucket = self.chunkmeta_buckets[num_tokens, num_reqs] = self._new_bucket(num_tokens, num_reqs)
        return bucket

    def _mixed_build(self, args: tuple, kwargs: dict):
        """The one decision of ``build()`` (``args``: its positional arguments, the common
        metadata second): a step vLLM replays in a mixed graph is staged into its bucket, any
        other takes chunkmeta's eager tables (or vLLM's path)."""
        bucket = self._dispatched_bucket(args[1])
        if bucket is None:
            return super().build(*args, **kwargs)
        return self._staged_build(bucket, args, kwargs, strict=self._strict())

    def _strict(self) -> bool:
        """Whether a failed stage must raise: a FULL graph that vLLM dispatched replays whatever
        its bucket holds. A breakable graph's replay is gated (``breakable``): an unstaged step
        runs eagerly, so its stage may fall back."""
        record = self._chunkmeta_dispatch
        return record is not None and record.current not in record.breakable

    def _dispatched_bucket(self, m) -> MixedStepInputs | None:
        """The bucket of a step vLLM replays in a mixed graph, or None. With a runner hook
        (``graph_dispatch``): the step its dispatch sent to one (checked there: stageable), the
        shape of ``m`` that graph's. Without (a runner chunkmeta does not hook): every step of a
        bucket's shape outside vLLM's decode routine."""
        shape = (m.num_actual_tokens, m.num_reqs)
        record = self._chunkmeta_dispatch
        if record is None:
            return None if self._vllm_decode_routine(m) else self.chunkmeta_buckets.get(shape)
        if record.current in record.breakable:
            # a breakable graph's metadata is the unpadded step's, which its graph holds
            if m.num_actual_tokens > record.current[0] or m.num_reqs > record.current[1]:
                return None
            shape = record.current
        elif record.current != shape:
            if record.current is not None and record.in_step:
                # Model Runner V2 dispatched a FULL mixed graph, which replays whatever its bucket
                # holds: a build of another shape cannot be served eagerly (its build matches its
                # descriptor's padded shape, mamba_hybrid.py:244-246)
                raise ChunkMetaError(
                    f"a build of {shape} (tokens, requests) in a step dispatched to the mixed graph "
                    f"{record.current}: that graph would replay another step's inputs."
                )
            return None  # another graph, none, or an eager batch the dispatch never saw
        bucket = self.chunkmeta_buckets.get(shape)
        if bucket is None:
            raise ChunkMetaError(
                f"vLLM dispatched a step to the mixed graph {shape} (tokens, requests), for which "
                f"{type(self).__name__} has no inputs: the graph would replay another step's."
            )
        return bucket

    def _staged_build(self, bucket: MixedStepInputs, args: tuple, kwargs: dict, *, strict: bool, stage=None):
        """vLLM's build() with no eager tables made (the patched layers read the bucket), then
        the step staged (``stage``, default ``_stage``): one fill launch. ``strict`` (a graph will
        replay it): a stage that fails raises, as no other input can be given to that graph;
        otherwise the step gets the eager tables instead, with one warning."""
        metadata, request = self._chunkmeta_recorded_build(*args, **kwargs)
        try:
            (stage or self._stage)(bucket, metadata, args[1])
        except Exception as exc:
            if strict:
                raise
            self._mixed_fall_back(exc)
            if request.asked:
                self._chunkmeta_serve_or_fall_back(metadata, request)
            return metadata
        self.chunkmeta_mixed_steps += 1
        metadata.chunkmeta_mixed = bucket
        metadata.chunkmeta_eager = (self, request)  # the eager tables, if a group's view fails
        if self._chunkmeta_dispatch is not None:
            self._chunkmeta_dispatch.mark(self)
        return metadata

    def update_block_table(self, metadata, blk_table, slot_mapping):
        """vLLM's (Model Runner V2 reuses one KV-cache group's metadata for the others through
        it, capture included; its ``dataclasses.replace`` drops ``chunkmeta_mixed``), then, for a
        staged step, this group's view of the bucket: the batch's tables, this group's state
        indices copied to fixed addresses."""
        out = super().update_block_table(metadata, blk_table, slot_mapping)
        bucket = getattr(metadata, "chunkmeta_mixed", None)
        if bucket is not None:
            view = self._chunkmeta_views.get(bucket)
            if view is None:
                view = self._chunkmeta_views[bucket] = GroupInputs(bucket)
            try:
                self._stage_view(view, out)
            except Exception as exc:
                if self._strict():
                    raise
                # unmarked: the gated replay runs this step eagerly, this group's layers on
                # vLLM's path, which needs the tables the staged build left out
                self._mixed_fall_back(exc)
                owner, request = metadata.chunkmeta_eager
                if request.asked:
                    owner._chunkmeta_serve_or_fall_back(out, request)
                return out
            out.chunkmeta_mixed = view
            if self._chunkmeta_dispatch is not None:
                self._chunkmeta_dispatch.mark(self)
        return out

    # a family's part: its bucket, its build()'s arguments at capture, what its metadata stages
    def _new_bucket(self, num_tokens: int, num_reqs: int) -> MixedStepInputs:
        raise NotImplementedError

    def _capture_args(self, m) -> tuple:
        raise NotImplementedError

    def _stage(self, bucket, metadata, m) -> None:
        raise NotImplementedError

    def _stage_view(self, view: GroupInputs, metadata) -> None:
        raise NotImplementedError

    def _stage_capture(self, bucket, metadata, m) -> None:
        """What a capture stages: its batch (a family whose bucket cannot take vLLM's capture
        batch stages another of the same shape)."""
        self._stage(bucket, metadata, m)

    def chunkmeta_refuses(self, shape: tuple[int, int], record) -> str | None:
        """Why the step in flight cannot go to the mixed graph of ``shape``, beyond its shape, or
        None. ``record``: the ``graph_dispatch.MixedDispatch`` (its ``step`` rows are counted on
        first read, None where the runner recorded none), or None."""
        return None

    def _mixed_fall_back(self, exc: Exception) -> None:
        cause = f"{type(exc).__name__}: {exc}"
        count = self.chunkmeta_mixed_fallbacks[cause] = self.chunkmeta_mixed_fallbacks.get(cause, 0) + 1
        if count == 1:
            logger.warning(
                "chunkmeta: a mixed step stays on vLLM's path: %s (%s=0 turns the graph-safe path off, %s=0 chunkmeta)",
                cause,
                FULL_GRAPH_ENV,
                ENV_VAR,
            )

    def chunkmeta_stats(self) -> dict:
        stats = super().chunkmeta_stats()
        stats["mixed_buckets"] = sorted(self.chunkmeta_buckets)
        stats["mixed_steps"] = self.chunkmeta_mixed_steps
        stats["mixed_fallbacks"] = dict(self.chunkmeta_mixed_fallbacks)
        record = self._chunkmeta_dispatch
        stats["mixed_turned_away"] = dict(record.turned_away) if record is not None else {}
        stats["graph_captures"] = list(record.captures) if record is not None else []
        return stats


class GdnFullGraphMixin(FullGraphBuilderMixin):
    """In front of ``GdnFamilyMixin`` (Kimi-Linear's KDA, Qwen3-Next / Qwen3.5's GDN)."""

    def build(
        self,
        common_prefix_len,
        common_attn_metadata,
        num_accepted_tokens=None,
        num_decode_draft_tokens_cpu=None,
        fast_build=False,
    ):
        args = (common_prefix_len, common_attn_metadata, num_accepted_tokens, num_decode_draft_tokens_cpu, fast_build)
        return self._mixed_build(args, {})

    def _new_bucket(self, num_tokens, num_reqs):
        return MixedStepInputs(
            num_tokens, num_reqs, self.device, levels=bucket_levels(self.device), fill=self._chunkmeta_fill
        )

    def _capture_args(self, m):
        return (0, m, None, None, False)

    def _stage(self, bucket, metadata, m):
        if getattr(metadata, "spec_sequence_masks", None) is not None:
            raise ChunkMetaError("a step with speculative-decode rows has no graph-safe path.")
        bucket.stage(
            m.query_start_loc,
            m.query_start_loc_cpu,
            metadata.non_spec_state_indices_tensor[: m.num_reqs],
            m.compute_num_computed_tokens(),
        )

    def _stage_view(self, view, metadata):
        view.stage_state_indices(metadata.non_spec_state_indices_tensor)


class Mamba2FullGraphMixin(FullGraphBuilderMixin):
    """In front of ``MambaFamilyMixin`` on vLLM's ``Mamba2AttentionMetadataBuilder``
    (``MambaMixer2``: Nemotron-H, Granite-4.0-H, Falcon-H1). Align mode (prefix caching) gives
    the buckets checkpoints: each row's checkpoint offset and block, as vLLM's builder made them."""

    _chunkmeta_family = "mamba2"

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs)
        if self._mixed_active() and not getattr(vllm_config, "use_v2_model_runner", False):
            # V1 captures each KV-cache group on its own builder (its own buckets) but reuses
            # group 1's metadata for the others at run time (gpu_model_runner.py:2446-2460): their
            # graphs would replay their never-restaged buckets. vLLM's GDN builder turns the
            # reuse off on V1 for the same reason (gdn_attn.py:182-190).
            self.supports_update_block_table = False

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False, **kwargs):
        return self._mixed_build((common_prefix_len, common_attn_metadata, fast_build), kwargs)

    def _new_bucket(self, num_tokens, num_reqs):
        align = getattr(self.vllm_config.cache_config, "mamba_cache_mode", None) == "align"
        decodes = _mamba2_decodes(os.environ.get(MAMBA2_DECODES_ENV, MAMBA2_DECODES[0]))
        ssd_rows = None
        # MRV2 only (V1's dummy runs dispatch outside execute_model, with no step recorded), and
        # one data parallel rank (ranks agree on a mode, then each dispatches its own batch)
        parallel = getattr(self.vllm_config, "parallel_config", None)
        one_rank = getattr(parallel, "data_parallel_size", 1) == 1
        if decodes == "ssu" and one_rank and getattr(self.vllm_config, "use_v2_model_runner", False):
            cap = _whole_number(MAMBA2_SSD_ROWS_ENV, os.environ.get(MAMBA2_SSD_ROWS_ENV, ""), MAMBA2_SSD_ROWS, "rows")
            ssd_rows = min(cap, num_reqs) if cap else None
        bucket = Mamba2StepInputs(
            num_tokens,
            num_reqs,
            self.device,
            chunk_size=self.chunk_size,
            checkpoints=align,
            decodes=decodes,
            levels=bucket_levels(self.device),
            ssd_rows=ssd_rows,
            fill=self._chunkmeta_fill,
        )
        budget = _whole_number(MAMBA2_GRAPH_MIB_ENV, os.environ.get(MAMBA2_GRAPH_MIB_ENV, ""), MAMBA2_GRAPH_MIB, "MiB")
        if bucket.ssd_state_rows() * math.prod(self.kv_cache_spec.shapes[1]) * 4 > budget << 20:
            # one message for every such shape: one warning (graph_dispatch warns once per cause)
            raise ChunkMetaError(
                f"a mixed graph whose Mamba2 SSD at capacity needs more than {budget} MiB of states "
                f"({MAMBA2_GRAPH_MIB_ENV}) is not captured"
            )
        return bucket

    def _capture_args(self, m):
        return (0, m, False)

    def _stage(self, bucket, metadata, m):
        if getattr(metadata, "num_accepted_tokens", None) is not None:
            raise ChunkMetaError("a step with speculative-decode rows has no graph-safe path.")
        qsl_cpu = m.query_start_loc_cpu
        # vLLM's own host bound, exact on every row without speculative decoding (backend.py:447-451)
        computed_cpu = (m.seq_lens_cpu_upper_bound[: m.num_reqs] - (qsl_cpu[1:] - qsl_cpu[:-1])).to(torch.int32)
        decodes = metadata.num_decodes
        rows = {}
        if bucket.checkpoints:
            rows = self._checkpoint_rows(metadata.checkpoint_meta, decodes, m.num_reqs)
        bucket.stage(
            m.query_start_loc,
            qsl_cpu,
            _mamba2_state_rows(metadata),
            m.compute_num_computed_tokens(),
            num_computed_tokens_cpu=computed_cpu,
            num_decodes=decodes,
            **rows,
        )

    def _stage_capture(self, bucket, metadata, m) -> None:
        decodes = metadata.num_decodes
        if m.num_reqs - decodes <= bucket.ssd_rows:
            return self._stage(bucket, metadata, m)
        # vLLM's capture batch spreads its tokens over every row, all prefills, more than the
        # bucket's SSD rows. A graph's kernels and grids follow the bucket, not the values staged:
        # the capture stages a step of the same tokens and rows whose prefills the bucket holds,
        # the rows before them one token each (its warm-up runs every kernel the graph launches)
        reqs, tokens = m.num_reqs, m.num_actual_tokens
        prefills = min(bucket.ssd_rows, tokens - reqs)
        decodes = reqs - prefills
        share, extra = divmod(tokens - decodes, prefills)
        lens = [1] * decodes + [share + (i < extra) for i in range(prefills)]
        qsl_cpu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
        zeros_cpu = torch.zeros(reqs, dtype=torch.int32)
        rows = self._checkpoint_rows(None, decodes, reqs) if bucket.checkpoints else {}
        bucket.stage(
            qsl_cpu.to(self.device),
            qsl_cpu,
            _mamba2_state_rows(metadata),
            zeros_cpu.to(self.device),
            num_computed_tokens_cpu=zeros_cpu,
            num_decodes=decodes,
            **rows,
        )

    def chunkmeta_refuses(self, shape, record):
        bucket = self.chunkmeta_buckets.get(shape)
        if bucket is None or bucket.ssd_rows >= bucket.num_reqs:
            return None
        step = record.step if record is not None else None
        if step is None:  # fail closed: a step nobody counted
            return "a Mamba2 graph of few SSD rows and a step whose rows were not recorded"
        if mamba2_prefill_rows(step) > bucket.ssd_rows:
            return f"more prefill rows than a Mamba2 graph's SSD rows ({MAMBA2_SSD_ROWS_ENV})"
        return None

    def _checkpoint_rows(self, checkpoint, decodes: int, num_reqs: int) -> dict:
        """Every row's checkpoint offset (0 = none) and block: vLLM's are the prefill rows'
        (checkpoint.py:74-97), None where no row has one; the decode rows ahead get 0 and the
        null block."""
        if checkpoint is None:
            return dict(
                checkpoint_offsets=self._after_rows(num_reqs, 0),
                checkpoint_offsets_cpu=torch.zeros(num_reqs, dtype=torch.int32),
                checkpoint_state_indices=self._after_rows(num_reqs, NULL_BLOCK_ID),
            )
        return dict(
            checkpoint_offsets=self._after_rows(decodes, 0, checkpoint.checkpoint_offsets),
            checkpoint_offsets_cpu=torch.tensor([0] * decodes + list(checkpoint.offsets), dtype=torch.int32),
            checkpoint_state_indices=self._checkpoint_blocks(checkpoint, decodes, num_reqs),
        )

    def _checkpoint_blocks(self, checkpoint, decodes: int, num_reqs: int):
        """Every row's checkpoint block: the decode rows (and every row, where no row has a
        checkpoint) on the null block."""
        if checkpoint is None:
            return self._after_rows(num_reqs, NULL_BLOCK_ID)
        return self._after_rows(decodes, NULL_BLOCK_ID, checkpoint.state_indices)

    def _after_rows(self, count: int, fill: int, prefills=None):
        """``count`` rows of ``fill`` (int32, on the device), then ``prefills``' values if given."""
        head = torch.full((count,), fill, dtype=torch.int32, device=self.device)
        return head if prefills is None else torch.cat([head, prefills.to(torch.int32)])

    def _stage_view(self, view, metadata):
        # this group's checkpoint blocks: vLLM regathers them from its block table (mamba2_attn.py:230-244)
        checkpoint = None
        if view.bucket.checkpoints:
            rows = metadata.num_decodes + metadata.num_prefills
            checkpoint = self._checkpoint_blocks(metadata.checkpoint_meta, metadata.num_decodes, rows)
        view.stage_state_indices(_mamba2_state_rows(metadata), checkpoint)


def _mamba2_state_rows(metadata):
    """Every row's state index in vLLM's row order: the decode rows' (their first column: no
    speculative decoding), then the prefill rows' (padding rows included, on the null block)."""
    return torch.cat([metadata.state_indices_tensor_d[:, 0], metadata.state_indices_tensor_p]).to(torch.int32)


def _kimi_ops() -> KdaOps:
    """The functions Kimi-Linear's ``_forward`` calls on this platform (kimi_gdn_linear_attn.py:398-415)."""
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn
    from vllm.model_executor.layers.mamba.ops.gather_initial_states import gather_initial_states
    from vllm.platforms import current_platform

    from chunkmeta.integrations.vllm.routing import router

    if current_platform.is_rocm():
        from vllm.models.kimi_k3.amd.ops.third_party.kda import chunk_kda_with_fused_gate
    else:
        from vllm.models.kimi_k3.nvidia.ops.third_party.kda import chunk_kda_with_fused_gate
    return KdaOps(causal_conv1d_fn, gather_initial_states, chunk_kda_with_fused_gate, router())


def _bucket_of(layer):
    """``(the layer's metadata, its bucket)`` for a step the graph-safe path serves, else None:
    the metadata carries a staged bucket and has no spec rows."""
    from vllm.forward_context import get_forward_context

    metadata = get_forward_context().attn_metadata
    m = metadata.get(layer.prefix) if isinstance(metadata, dict) else None
    bucket = getattr(m, "chunkmeta_mixed", None)
    return None if bucket is None or getattr(m, "spec_sequence_masks", None) is not None else (m, bucket)


def _conv_state(conv_state):
    """The conv state as the conv kernels take it, ``(..., dim, width - 1)``."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    return conv_state if is_conv_state_dim_first() else conv_state.transpose(-1, -2)


def kimi_forward(original):
    """``KimiGatedDeltaNetAttention._forward`` with the graph-safe mixed path; ``original`` is
    vLLM's (decorated with ``eager_break_during_capture``), called for everything else. The
    graph-safe path is not decorated: inside a breakable capture (vLLM's piecewise graphs of
    Kimi-Linear) a staged step's KDA is captured with the rest of the segment; a step without a
    bucket goes through vLLM's decorated method, a break as before."""
    ops = functools.cache(_kimi_ops)  # resolved on the first step served, once per patch

    @functools.wraps(getattr(original, "__wrapped__", original))
    def _forward(self, mixed_qkv, g1, g2, beta, core_attn_out):
        served = _bucket_of(self)
        if served is None:
            return original(self, mixed_qkv, g1, g2, beta, core_attn_out)
        _, bucket = served
        conv_state, recurrent_state = self.kv_cache
        conv_state = _conv_state(conv_state)
        weights = self.conv1d.weight.view(self.conv1d.weight.size(0), self.conv1d.weight.size(2))
        # the bucket's tokens: a FULL graph's metadata counts them (vLLM pads it), a breakable
        # graph's counts the step's own, padded to the graph's size in the layer's inputs
        tokens = bucket.num_tokens
        out = kda_mixed_forward(
            ops(),
            bucket,
            mixed_qkv=mixed_qkv[:tokens],
            g1=g1[:, :tokens],
            beta=beta[:, :tokens],
            conv_weights=tuple(weights.split(self.local_projection_size, dim=0)),
            conv_states=tuple(conv_state.split(self.local_projection_size, dim=-2)),
            recurrent_state=recurrent_state,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            lower_bound=self.gate_lower_bound,
            head_dim=self.head_dim,
        )
        core_attn_out[0, :tokens] = out[0, :tokens]
        core_attn_out.copy_(self.o_norm(core_attn_out, g2))

    _forward.__qualname__ = f"chunkmeta.{KIMI_LAYER}._forward"
    return _forward


def _qwen_ops() -> GdnOps:
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn
    from vllm.third_party.flash_linear_attention.ops import fused_post_conv_prep
    from vllm.third_party.flash_linear_attention.ops.chunk import chunk_gated_delta_rule

    return GdnOps(causal_conv1d_fn, fused_post_conv_prep, chunk_gated_delta_rule)


def qwen_forward_core(original):
    """``QwenGatedDeltaNetAttention._forward_core`` with the graph-safe mixed path (FLA-triton
    prefill backend only, as ``graph_unsafe`` requires); ``original`` is vLLM's, called for
    everything else. It runs inside vLLM's ``qwen_gdn_attention_core`` op, a splitting op of
    piecewise graphs."""
    ops = functools.cache(_qwen_ops)  # resolved on the first step served, once per patch

    @functools.wraps(original)
    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        served = _bucket_of(self)
        if served is None or getattr(self.chunk_gated_delta_rule, "gdn_prefill_backend", None) != FLA_TRITON:
            return original(self, mixed_qkv, b, a, core_attn_out)
        m, bucket = served
        conv_state, ssm_state = self.kv_cache
        tokens = m.num_actual_tokens
        out = gdn_mixed_forward(
            ops(),
            bucket,
            mixed_qkv=mixed_qkv[:tokens],
            a=a[:tokens],
            b=b[:tokens],
            conv_weight=self.conv1d.weight.view(self.conv1d.weight.size(0), self.conv1d.weight.size(2)),
            conv_bias=self.conv1d.bias,
            activation=self.activation,
            conv_state=_conv_state(conv_state),
            ssm_state=ssm_state,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            num_k_heads=self.num_k_heads // self.tp_size,
            head_k_dim=self.head_k_dim,
            head_v_dim=self.head_v_dim,
        )
        core_attn_out[:tokens] = out.squeeze(0)

    _forward_core.__qualname__ = f"chunkmeta.{QWEN_LAYER}._forward_core"
    return _forward_core


def _mamba2_ops(is_blackwell: bool) -> Mamba2Ops:
    """The functions ``MambaMixer2.conv_ssm_forward`` calls, as its module imported them (the
    platform's versions)."""
    from vllm.model_executor.layers.mamba import mamba_mixer2 as layer

    ssu = functools.partial(layer.selective_state_update, is_blackwell=is_blackwell)
    return Mamba2Ops(
        layer.causal_conv1d_fn, layer.mamba_chunk_scan_combined_varlen, ssu, layer.store_prefill_checkpoint
    )


def bucket_levels(device, environ=None) -> bool:
    """A bucket's kernels on levels (``MixedStepInputs``): with ``CHUNKMETA_VLLM_LEVELS=1``,
    unless on CUDA IF nodes do not capture here (one warning; every bucket keeps its capacity)."""
    if (os.environ if environ is None else environ).get(LEVELS_ENV, "0").strip() != "1":
        return False
    if device.type == "cuda" and not if_nodes_capture(device.index):
        _warn_once("chunkmeta: CUDA graph IF nodes do not capture here: mixed-step buckets run at their capacity")
        return False
    return True


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def mamba2_prefill_rows(step) -> int:
    """The prefill rows vLLM's Mamba2 builder will count for a step (``graph_dispatch.StepRows``)
    under Model Runner V2, without speculative decoding: MRV2 sorts one-token rows first, in the
    scheduler's order, then the others by length (gpu/model_runner.py:2507-2519); the split puts
    every row from the first prefill on among the prefills, a prefill being a row of more than
    one token or a one-token first chunk of a prompt, with no state before it
    (mamba_attn.py:404-455; utils.py:894-905). A request whose computed tokens the step does not
    give counts as one without state."""
    ones = [rid for rid, n in step.scheduled.items() if n == 1]
    longer = sum(1 for n in step.scheduled.values() if n > 1)
    first = next((k for k, rid in enumerate(ones) if step.computed.get(rid, 0) == 0), len(ones))
    return longer + len(ones) - first


@functools.cache
def _mamba2_decodes(value: str) -> str:
    """``CHUNKMETA_VLLM_MAMBA2_DECODES``: a bucket's decode rows through vLLM's SSU (default) or
    as one-token SSD rows (for a measurement: not vLLM's decode arithmetic); one warning per
    value it does not know."""
    if value in MAMBA2_DECODES:
        return value
    logger.warning(
        "chunkmeta: %s=%r is not one of %s: %r", MAMBA2_DECODES_ENV, value, MAMBA2_DECODES, MAMBA2_DECODES[0]
    )
    return MAMBA2_DECODES[0]


@functools.cache
def _whole_number(name: str, value: str, default: int, unit: str) -> int:
    """An environment variable's whole number (``default`` where unset); one warning per value it
    cannot read, which gives ``default``."""
    if not value.strip():
        return default
    try:
        number = int(value)
        if number >= 0:
            return number
    except ValueError:
        pass
    logger.warning("chunkmeta: %s=%r is not a whole number of %s: %d", name, value, unit, default)
    return default


def mamba2_conv_ssm_forward(original):
    """``MambaMixer2.conv_ssm_forward`` with the graph-safe mixed path (``mamba2_mixed_forward``;
    its bucket says how decode rows run); ``original`` is vLLM's, called for everything else.
    It runs inside vLLM's ``mamba_mixer2`` op (a splitting op of piecewise graphs, inline in a
    FULL capture), which looks the method up per call."""
    ops = functools.cache(_mamba2_ops)  # resolved on the first step served, once per patch

    @functools.wraps(original)
    def conv_ssm_forward(self, projected_states, output):
        served = _bucket_of(self)
        if served is None:
            return original(self, projected_states, output)
        bucket = served[1]
        tokens = bucket.num_tokens
        hidden_states_B_C, dt = torch.split(
            projected_states[:tokens, self.tped_intermediate_size :],
            [self.tped_conv_size, self.tped_dt_size],
            dim=-1,
        )
        mamba2_mixed_forward(
            ops(self.is_blackwell),
            bucket,
            hidden_states_B_C=hidden_states_B_C,
            dt=dt,
            output=output[:tokens],
            conv_weight=self.conv_weights,
            conv_bias=self.conv1d.bias,
            activation=self.activation,
            conv_state=_conv_state(self.kv_cache[0]),
            ssm_state=self.kv_cache[1],
            A=self.A,
            D=self.D,
            dt_bias=self.dt_bias,
            num_heads=self.num_heads // self.tp_size,
            head_dim=self.head_dim,
            n_groups=self.n_groups // self.tp_size,
            state_len=self.conv_kernel_size - 1,
        )

    conv_ssm_forward.__qualname__ = f"chunkmeta.{MAMBA2_LAYER}.conv_ssm_forward"
    return conv_ssm_forward


def _method_wiring(patches, class_name: str, method: str, make, does: str):
    def wire(module):
        cls = getattr(module, class_name, None)
        if not isinstance(cls, type) or not callable(cls.__dict__.get(method)):
            raise ChunkMetaError(f"{module.__name__} has no {class_name}.{method}")
        if patches.current(cls, method) is None:
            patches.apply(cls, method, make(cls.__dict__[method]))
        logger.info("chunkmeta: %s.%s %s", class_name, method, does)

    return wire


def layer_wiring(patches) -> dict:
    """Module name -> what to do when vLLM imports it: Kimi-Linear's ``_forward``, Qwen's
    ``_forward_core``, ``MambaMixer2.conv_ssm_forward``, both model runners' start-up and MRV2's
    capture loop (``graph_dispatch``) patched over vLLM's (``patches``: the adapter's ``plugin.Patches``)."""
    from chunkmeta.integrations.vllm import graph_dispatch as gd

    layers = "takes the graph-safe mixed path on captured buckets"
    graphs = "adds FULL graphs for mixed batches and decides which steps replay them"
    return {
        KIMI_LAYER_MODULE: _method_wiring(patches, KIMI_LAYER, "_forward", kimi_forward, layers),
        QWEN_LAYER_MODULE: _method_wiring(patches, QWEN_LAYER, "_forward_core", qwen_forward_core, layers),
        MAMBA2_LAYER_MODULE: _method_wiring(patches, MAMBA2_LAYER, "conv_ssm_forward", mamba2_conv_ssm_forward, layers),
        gd.V1_RUNNER_MODULE: _method_wiring(
            patches, gd.RUNNER, "initialize_metadata_builders", gd.v1_mixed_graphs, graphs
        ),
        gd.MRV2_RUNNER_MODULE: _method_wiring(patches, gd.RUNNER, "initialize_kv_cache", gd.mrv2_mixed_graphs, graphs),
        gd.CAPTURE_MODULE: _method_wiring(
            patches, gd.CAPTURE_MANAGER, "capture", gd.mrv2_capture, "stages breakable captures, times each graph"
        ),
    }
