"""Mamba2's per-forward extend metadata (``Mamba2Metadata.prepare_mixed``'s tables) from one chunkmeta build.

SGLang's ``Mamba2AttnBackend.init_forward_metadata`` (``srt/layers/attention/hybrid_linear_attn_backend.py``)
hands the base's ``ForwardMetadata`` to ``Mamba2Metadata.prepare_mixed``
(``srt/layers/attention/mamba/mamba2_metadata.py``), which on every extend reads
``torch.any(extend_prefix_lens > 0).item()`` (a sync) and, when a row has a cached prefix, runs
``_query_start_loc_to_chunk_indices_offsets``: a Python loop over 0-d device tensors, about four
syncs per sequence. Every value it makes is a function of host data SGLang already holds at that
point: ``extend_seq_lens_cpu`` (the rows' lengths) and ``extend_prefix_lens_cpu`` (their cached
prefixes). So one ``StepTablesBuilder`` launch (``chunkmeta.tables.SglangMamba2``) writes
``seq_idx``, the logical ``chunk_indices`` / ``chunk_offsets`` and ``has_initial_states``, and
``prep_initial_states`` is a host bool.

The result is SGLang's own ``Mamba2Metadata``: its ``prepare_decode`` (device-free) fills the fields
shared with the base metadata, and only the extend fields are replaced, so a field SGLang adds to
both keeps flowing. Where the host data is not there (gpu_only batches, two-batch-overlap children),
the batch is SGLang's (decode, verify, idle), it exceeds the capacity, or its build raises (one
warning per cause), ``prepare`` returns None and the backend runs SGLang's ``prepare_mixed``. A
builder whose warm-up build fails (``tables.warm_up``, when it is made) leaves the backend on
SGLang's ``prepare_mixed`` for good, with one warning.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from chunkmeta.integrations.plugin import keeps_engine_path
from chunkmeta.integrations.sglang import sizing
from chunkmeta.integrations.sglang.tables import (
    ACTIVE_DEVICES,
    ENV_VAR,
    build_failed,
    fallback,
    logical_mode,
    needs_chunk_tables,
    warm_up,
)
from chunkmeta.step_builder import StepTablesBuilder
from chunkmeta.tables import SglangMamba2

logger = logging.getLogger(__name__)


def _draft_token_num(forward_batch) -> int:
    spec_info = forward_batch.spec_info
    return getattr(spec_info, "draft_token_num", 1) if spec_info is not None else 1


def trusted_prefix_lens(forward_batch, num_rows: int):
    """``extend_prefix_lens_cpu`` when it is there with one entry per row, else None."""
    prefix = getattr(forward_batch, "extend_prefix_lens_cpu", None)
    if prefix is None or len(prefix) != num_rows or getattr(forward_batch, "extend_prefix_lens", None) is None:
        return None
    return prefix


class Mamba2ChunkMeta:
    """One Mamba2 backend's extend metadata: a ``StepTablesBuilder`` of ``SglangMamba2`` tables at
    the model's ``mamba_chunk_size`` (made on the first extend: SGLang reads the chunk size from the
    model config lazily, and warmed up then), host scratch for ``query_start_loc`` and the prefix
    lengths, counters. ``disabled``: why the backend keeps SGLang's own path for good (a builder
    that could not be made or warmed up), else None."""

    def __init__(self, *, device, max_num_seqs: int, max_num_tokens: int, ring_depth: int = 4):
        self.device = torch.device(device)
        self.max_num_seqs, self.max_num_tokens, self.ring_depth = max_num_seqs, max_num_tokens, ring_depth
        self.builder: StepTablesBuilder | None = None
        # plain host int32 tensors: the C build reads them by address, no per-forward allocation
        self._qsl_cpu = torch.zeros(max_num_seqs + 1, dtype=torch.int32)
        self._prefix_cpu = torch.zeros(max_num_seqs, dtype=torch.int32)
        self._qsl_np, self._prefix_np = self._qsl_cpu.numpy(), self._prefix_cpu.numpy()
        self.tables = None  # the current forward's SglangMamba2Chunks, or None
        self.counts = {"mamba2": 0, "stock": 0, "fallback": 0, "build_failed": 0}
        self._warned: set[str] = set()
        self._causes: dict[str, int] = {}  # build failures per normalised cause
        self.disabled: str | None = None

    @classmethod
    def for_backend(cls, backend, model_runner) -> Mamba2ChunkMeta | None:
        device = torch.device(getattr(backend, "device", None) or model_runner.device)
        if device.type not in ACTIVE_DEVICES:
            logger.info("chunkmeta: %s on %s keeps SGLang's own Mamba2 metadata", type(backend).__name__, device)
            return None
        try:
            max_num_seqs, max_num_tokens = sizing.backend_capacity(model_runner)
            return cls(device=device, max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens)
        except Exception as exc:  # noqa: BLE001  sizing it cannot do: SGLang must start all the same
            keeps_engine_path(logger, f"{type(backend).__name__} keeps SGLang's own prepare_mixed", exc, ENV_VAR)
            return None

    def _builder(self, chunk_size: int) -> StepTablesBuilder | None:
        """The builder at ``chunk_size``, made and warmed up on first use; None (and ``disabled``
        set, one warning) where that fails: SGLang's ``prepare_mixed`` serves from then on."""
        builder = self.builder
        if builder is None or builder.specs["mamba2"].chunk_size != chunk_size:
            self.builder = None
            try:
                builder = StepTablesBuilder(
                    self.max_num_seqs,
                    self.max_num_tokens,
                    tables={"mamba2": SglangMamba2(chunk_size)},
                    device=self.device,
                    ring_depth=self.ring_depth,
                )
                warm_up(builder)
            except Exception as exc:  # noqa: BLE001  limits it cannot hold, or a fill that fails on this platform
                self.disabled = f"{type(exc).__name__}: {exc}"
                keeps_engine_path(logger, "Mamba2 keeps SGLang's own prepare_mixed", exc, ENV_VAR)
                return None
            self.builder = builder
        return builder

    def prepare(self, metadata_cls, forward_metadata, chunk_size: int, forward_batch):
        """SGLang's ``Mamba2Metadata`` for this extend, from one build; None where SGLang's
        ``prepare_mixed`` must run (it is then sync-free, or the host data to avoid its syncs is missing)."""
        self.tables = None
        qsl = getattr(forward_metadata, "query_start_loc", None)
        if (
            self.disabled is not None
            or qsl is None
            or forward_batch.extend_num_tokens is None
            or not needs_chunk_tables(logical_mode(forward_batch))
        ):
            self.counts["stock"] += 1
            return None
        n = qsl.shape[0] - 1
        lens = sizing.trusted_extend_lens(forward_batch, n)
        prefix = trusted_prefix_lens(forward_batch, n) if lens is not None else None
        if prefix is None:
            self.counts["stock"] += 1
            return None
        if n > self.max_num_seqs:
            return self._fallback("seqs", f"{n} sequences, over the capacity of {self.max_num_seqs}")
        host_qsl = self._qsl_np[: n + 1]
        if n:
            np.cumsum(lens, out=host_qsl[1:])
            self._prefix_np[:n] = prefix
        num_tokens = int(host_qsl[n])
        if num_tokens > self.max_num_tokens:
            return self._fallback("tokens", f"{num_tokens} tokens, over the capacity of {self.max_num_tokens}")
        builder = self._builder(chunk_size)
        if builder is None:
            self.counts["stock"] += 1
            return None
        try:
            step = builder.build(
                qsl,
                self._qsl_cpu[: n + 1],
                num_computed_tokens=forward_batch.extend_prefix_lens,
                num_computed_tokens_cpu=self._prefix_cpu[:n],
            )
        except Exception as exc:  # noqa: BLE001  bad inputs the host checks missed, or a compile/launch failure
            # nothing was published (the ring stands): SGLang's prepare_mixed serves this forward
            return build_failed(self.counts, self._causes, exc, "SGLang's prepare_mixed (syncs)")
        tables = self.tables = step.mamba2
        prep = tables.prep_initial_states
        track_rows = conv_rows = None
        if forward_metadata.has_mamba_track_mask:
            # SGLang's KDA/GDN rule: the base's host path already made the tracked rows (from
            # mamba_prefill_track_mask_cpu) and nonzero() on the device mask would sync to redo it.
            track_rows = forward_metadata.mamba_track_mask_indices
            if track_rows is None:
                track_rows = forward_batch.mamba_track_mask.nonzero(as_tuple=True)[0]  # SGLang's own sync
            conv_rows = forward_batch.mamba_track_indices[track_rows]
        shared = metadata_cls.prepare_decode(
            forward_metadata,
            forward_batch.seq_lens,
            is_target_verify=forward_batch.forward_mode.is_target_verify(),
            draft_token_num=_draft_token_num(forward_batch),
        )
        self.counts["mamba2"] += 1
        return dataclasses.replace(
            shared,
            query_start_loc=qsl[: n + 1],
            num_prefills=n,
            num_prefill_tokens=num_tokens,
            num_decodes=len(forward_batch.seq_lens) - n,
            mamba_track_mask_indices=track_rows,
            conv_states_mask_indices=conv_rows,
            mixed_metadata=metadata_cls.MixedMetadata(
                has_initial_states=tables.has_initial_states,
                prep_initial_states=prep,
                chunk_size=chunk_size,
                seq_idx=tables.seq_idx,
                # SGLang passes none when no row has a prefix: the SSD kernels then skip the logical chunks
                chunk_indices=tables.chunk_indices if prep else None,
                chunk_offsets=tables.chunk_offsets if prep else None,
                extend_seq_lens_cpu=forward_batch.extend_seq_lens_cpu,
            ),
        )

    def _fallback(self, key: str, why: str) -> None:
        # SGLang's own prepare_mixed runs (correct, with its syncs): never take the server down.
        return fallback(self.counts, self._warned, key, f"{why}; SGLang's prepare_mixed builds its tables (syncs)")

    def stats(self) -> dict:
        """Forwards served, left to SGLang (``stock``), fallbacks (``build_failed`` of them: a build
        raised; ``fallback_causes``: those per normalised cause), and ``disabled``."""
        return {**self.counts, "fallback_causes": dict(self._causes), "disabled": self.disabled}

    def close(self) -> None:
        self.tables = None
