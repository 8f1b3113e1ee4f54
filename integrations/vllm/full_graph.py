"""Opt-in (``CHUNKMETA_VLLM_FULL_GRAPH=1``, with ``CHUNKMETA_VLLM=1``): vLLM captures mixed
prefill+decode steps of Kimi-Linear's KDA layers in FULL CUDA graphs.

* ``FullGraphBuilderMixin`` goes in front of a GDN-family chunkmeta builder:
  ``get_cudagraph_support`` says ``ALWAYS`` (vLLM keeps a user's ``cudagraph_mode=FULL`` only if
  every KV-cache group's builder does: config/compilation.py:1394-1419);
  ``build_for_cudagraph_capture`` makes one ``MixedStepInputs`` bucket per captured batch shape
  ``(num_actual_tokens, num_reqs)`` (vLLM's FULL keys pad both: gpu_model_runner.py:4047, 4107)
  without the stock decode-size assert (gdn_attn.py:799-808); ``build`` stages every batch of a
  bucket's shape into it (one fill launch, the runner's values copied in) and hands it to the
  layers as ``metadata.chunkmeta_mixed``.
* ``kimi_forward(original)``: ``KimiGatedDeltaNetAttention._forward`` taking the graph-safe
  non-spec path (``mixed_step.kda_mixed_forward``) whenever its metadata carries a bucket, the
  decode-only steps of a bucket too (under FULL they replay the same graph); anything else is
  vLLM's own ``_forward``.

Steps that are not a bucket's shape (larger than every capture size, or eager runs) keep vLLM's
path. Speculative decoding keeps vLLM's support level and path (its multi-query decode is not in
the graph-safe forward). The GEMMs, norms and the other groups' attention are vLLM's to capture:
the whole model needs every group ALWAYS (Kimi-Linear's MLA: FlashInfer-MLA is, FlashMLA and
Triton-MLA are not: docs/vllm.md).
"""

from __future__ import annotations

import functools

from chunkmeta.errors import ChunkMetaError
from chunkmeta.integrations import plugin
from chunkmeta.integrations.vllm.interface import ENV_VAR, logger
from chunkmeta.integrations.vllm.mixed_step import KdaOps, MixedStepInputs, kda_mixed_forward

FULL_GRAPH_ENV = "CHUNKMETA_VLLM_FULL_GRAPH"
KIMI_LAYER_MODULE = "vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn"
KIMI_LAYER = "KimiGatedDeltaNetAttention"


def opted_in(environ=None) -> bool:
    return plugin.opt_in(FULL_GRAPH_ENV, logger, environ=environ) is not None


class FullGraphBuilderMixin:
    """In front of ``GdnFamilyMixin``: the buckets of captured mixed steps and their staging."""

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        from vllm.v1.attention.backend import AttentionCGSupport

        if getattr(vllm_config, "speculative_config", None) is not None:
            return super().get_cudagraph_support(vllm_config, kv_cache_spec)
        return AttentionCGSupport.ALWAYS

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunkmeta_buckets: dict[tuple[int, int], MixedStepInputs] = {}
        self.chunkmeta_mixed_steps = 0  # steps staged into a bucket (captures and warm-ups included)
        self.chunkmeta_mixed_fallbacks: dict[str, int] = {}

    def _mixed_active(self) -> bool:
        return self.chunkmeta is not None and not getattr(self, "use_spec_decode", False)

    def build_for_cudagraph_capture(self, common_attn_metadata):
        m = common_attn_metadata
        if not self._mixed_active():
            return super().build_for_cudagraph_capture(m)
        key = (m.num_actual_tokens, m.num_reqs)
        if key not in self.chunkmeta_buckets:
            try:
                self.chunkmeta_buckets[key] = MixedStepInputs(m.num_actual_tokens, m.num_reqs, self.device)
            except Exception as exc:  # noqa: BLE001  a bucket it cannot make: vLLM's capture path
                self._mixed_fall_back(exc)
                return super().build_for_cudagraph_capture(m)
        return self.build(0, m)

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
        if not self.chunkmeta_buckets:  # nothing captured: one dict read per step
            return metadata
        m = common_attn_metadata
        bucket = self.chunkmeta_buckets.get((m.num_actual_tokens, m.num_reqs))
        if bucket is None or getattr(metadata, "spec_sequence_masks", None) is not None:
            return metadata
        try:
            bucket.stage(
                m.query_start_loc,
                m.query_start_loc_cpu,
                metadata.non_spec_state_indices_tensor[: m.num_reqs],
                m.compute_num_computed_tokens() > 0,
            )
        except Exception as exc:  # noqa: BLE001  vLLM's eager path for this step
            self._mixed_fall_back(exc)
            return metadata
        self.chunkmeta_mixed_steps += 1
        metadata.chunkmeta_mixed = bucket
        return metadata

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
        return stats


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


def kimi_forward(original):
    """``KimiGatedDeltaNetAttention._forward`` with the graph-safe mixed path; ``original`` is
    vLLM's (decorated with ``eager_break_during_capture``, whose wrapped function it calls for
    everything else). The result is decorated the same way, so piecewise capture still breaks
    around it."""
    from vllm.compilation.breakable_cudagraph import eager_break_during_capture
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    inner = getattr(original, "__wrapped__", original)
    ops = []

    @functools.wraps(inner)
    def _forward(self, mixed_qkv, g1, g2, beta, core_attn_out):
        metadata = get_forward_context().attn_metadata
        m = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        bucket = getattr(m, "chunkmeta_mixed", None)
        if bucket is None or m.spec_sequence_masks is not None:
            return inner(self, mixed_qkv, g1, g2, beta, core_attn_out)
        if not ops:
            ops.append(_kimi_ops())
        conv_state, recurrent_state = self.kv_cache
        if not is_conv_state_dim_first():
            conv_state = conv_state.transpose(-1, -2)
        weights = self.conv1d.weight.view(self.conv1d.weight.size(0), self.conv1d.weight.size(2))
        tokens = m.num_actual_tokens
        out = kda_mixed_forward(
            ops[0],
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
    return eager_break_during_capture(_forward)


def kimi_layer_wiring(patches):
    """What to do when vLLM imports Kimi-Linear's layer module: ``KimiGatedDeltaNetAttention._forward``
    becomes ``kimi_forward`` over vLLM's (``patches``: the adapter's ``plugin.Patches``)."""

    def wire(module):
        layer = getattr(module, KIMI_LAYER, None)
        if not isinstance(layer, type) or not callable(layer.__dict__.get("_forward")):
            raise ChunkMetaError(f"{module.__name__} has no {KIMI_LAYER}._forward")
        if patches.current(layer, "_forward") is None:
            patches.apply(layer, "_forward", kimi_forward(layer.__dict__["_forward"]))
        logger.info("chunkmeta: %s._forward takes the graph-safe mixed path on captured buckets", KIMI_LAYER)

    return wire
