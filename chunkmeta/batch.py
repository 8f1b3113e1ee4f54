"""StepBatch: what an engine hands chunkmeta for one step."""

from __future__ import annotations

import numbers

import attrs
import numpy as np
import torch

from chunkmeta.errors import ChunkMetaError


def _optional_index(instance, attribute, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise ChunkMetaError(f"StepBatch.{attribute.name}={value!r}: must be an int or None.")


def _index(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ChunkMetaError(f"StepBatch.{attribute.name}={value!r}: must be an int.")


def _host(instance, attribute, value):
    if not isinstance(value, (torch.Tensor, np.ndarray)):
        raise ChunkMetaError(
            f"StepBatch.{attribute.name} is a {type(value).__name__}: must be a CPU torch tensor or numpy array."
        )


def _device(instance, attribute, value):
    if not isinstance(value, torch.Tensor):
        raise ChunkMetaError(f"StepBatch.{attribute.name} is a {type(value).__name__}: must be a torch tensor.")


def _optional(check):
    def validator(instance, attribute, value):
        if value is not None:
            check(instance, attribute, value)

    return validator


def _paired(device_name: str, host_name: str):
    """A per-request array comes as its device tensor and its host copy, or not at all: a build
    reads the device one and sizes its tables from the host one."""

    def validator(instance, attribute, value):
        device, host = getattr(instance, device_name), value
        if (device is None) != (host is None):
            given, missing = (device_name, host_name) if host is None else (host_name, device_name)
            raise ChunkMetaError(
                f"StepBatch.{given} is given without StepBatch.{missing}: pass the device tensor and its host "
                "copy (the same values, one entry per request of the batch), or neither."
            )
        if value is not None:
            _host(instance, attribute, value)

    return validator


@attrs.frozen(slots=True, eq=False)
class StepBatch:
    """One step's batch as the scheduler sees it.

    ``query_start_loc`` (device) and ``query_start_loc_cpu`` (host, the same values) cover every
    request of the step; the prefill slice is ``[first_seq, first_seq + num_seqs)`` (``num_seqs``
    None: the rest of the batch). ``step_id`` is the engine's own step number, kept for logs and
    stats.

    Keyword-only, for the Mamba2 tables of a service made with ``tables=`` (others ignore them):
    ``num_computed_tokens`` (device) / ``num_computed_tokens_cpu`` (host), per request of the
    batch, the tokens already in its cache (vLLM: ``seq_lens - query_lens``); ``checkpoint_offsets``
    / ``_cpu``, per request, a checkpoint that many tokens into its new ones (0 = none), for
    ``Mamba2(checkpoints=True)``. Each comes as a pair or not at all. Values are checked when the
    step is built, not here.
    """

    query_start_loc: torch.Tensor = attrs.field(validator=_device)
    query_start_loc_cpu: torch.Tensor | np.ndarray = attrs.field(validator=_host)
    first_seq: int = attrs.field(default=0, validator=_index)
    num_seqs: int | None = attrs.field(default=None, validator=_optional_index)
    step_id: int | None = attrs.field(default=None, validator=_optional_index)
    num_computed_tokens: torch.Tensor | None = attrs.field(default=None, kw_only=True, validator=_optional(_device))
    num_computed_tokens_cpu: torch.Tensor | np.ndarray | None = attrs.field(
        default=None, kw_only=True, validator=_paired("num_computed_tokens", "num_computed_tokens_cpu")
    )
    checkpoint_offsets: torch.Tensor | None = attrs.field(default=None, kw_only=True, validator=_optional(_device))
    checkpoint_offsets_cpu: torch.Tensor | np.ndarray | None = attrs.field(
        default=None, kw_only=True, validator=_paired("checkpoint_offsets", "checkpoint_offsets_cpu")
    )

    @classmethod
    def decode_first(
        cls,
        query_start_loc,
        query_start_loc_cpu,
        num_decodes: int,
        *,
        num_prefills: int | None = None,
        step_id: int | None = None,
        **rows,
    ) -> StepBatch:
        """vLLM's order: ``num_decodes`` decode requests first, the prefills after them. ``rows``:
        the keyword-only per-request arrays (``num_computed_tokens=...`` and so on)."""
        return cls(query_start_loc, query_start_loc_cpu, num_decodes, num_prefills, step_id, **rows)

    @classmethod
    def all_prefill(cls, query_start_loc, query_start_loc_cpu, *, step_id: int | None = None, **rows) -> StepBatch:
        """Every request is a prefill row (SGLang EXTEND, and MIXED, whose decodes are one-token
        extends appended at the end)."""
        return cls(query_start_loc, query_start_loc_cpu, 0, None, step_id, **rows)
