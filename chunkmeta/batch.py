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
            f"StepBatch.query_start_loc_cpu is a {type(value).__name__}: must be a CPU torch tensor or numpy array."
        )


def _device(instance, attribute, value):
    if not isinstance(value, torch.Tensor):
        raise ChunkMetaError(f"StepBatch.query_start_loc is a {type(value).__name__}: must be a torch tensor.")


@attrs.frozen(slots=True, eq=False)
class StepBatch:
    """One step's batch as the scheduler sees it.

    ``query_start_loc`` (device) and ``query_start_loc_cpu`` (host, the same values) cover every
    request of the step; the prefill slice is ``[first_seq, first_seq + num_seqs)`` (``num_seqs``
    None: the rest of the batch). ``step_id`` is the engine's own step number, kept for logs and
    stats. Values are checked when the step is built, not here.
    """

    query_start_loc: torch.Tensor = attrs.field(validator=_device)
    query_start_loc_cpu: torch.Tensor | np.ndarray = attrs.field(validator=_host)
    first_seq: int = attrs.field(default=0, validator=_index)
    num_seqs: int | None = attrs.field(default=None, validator=_optional_index)
    step_id: int | None = attrs.field(default=None, validator=_optional_index)

    @classmethod
    def decode_first(
        cls,
        query_start_loc,
        query_start_loc_cpu,
        num_decodes: int,
        *,
        num_prefills: int | None = None,
        step_id: int | None = None,
    ) -> StepBatch:
        """vLLM's order: ``num_decodes`` decode requests first, the prefills after them."""
        return cls(query_start_loc, query_start_loc_cpu, num_decodes, num_prefills, step_id)

    @classmethod
    def all_prefill(cls, query_start_loc, query_start_loc_cpu, *, step_id: int | None = None) -> StepBatch:
        """Every request is a prefill row (SGLang EXTEND, and MIXED, whose decodes are one-token
        extends appended at the end)."""
        return cls(query_start_loc, query_start_loc_cpu, 0, None, step_id)
