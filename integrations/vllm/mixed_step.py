"""A hybrid model's mixed prefill+decode step with shapes fixed by a bucket: what one CUDA graph holds.

vLLM 0.33.0 never captures a step that holds a prefill for a GDN-family model: the builder says
``UNIFORM_BATCH`` (v1/attention/backends/gdn_attn.py:136), the linear-attention layers branch on
host counts, derive their grids from per-step tensor lengths and, for Kimi-Linear, sync inside
the vendored KDA op (``prepare_chunk_indices``). Here every shape a kernel sees is fixed by a
bucket of ``num_tokens`` tokens and ``num_reqs`` requests:

* ``MixedStepInputs``: the per-step values the layers read, at fixed addresses. ``stage()``
  (before a replay, outside the graph) checks the batch on the host, queues one fill of a
  one-slot ``StepTablesBuilder`` (its own, or the ``SharedFill`` of every bucket of a builder)
  from the engine's ``query_start_loc`` and copies the state
  indices and ``has_initial_state`` in: FLA's tables over every row (``cu_seqlens`` padded with zero-length
  tail sequences, ``chunk_indices`` capacity rows, padding rows on the reserved tail sequence)
  and the causal-conv1d tables (capacity rows, ``PAD_SLOT_ID`` tail, on which vLLM's conv kernel
  returns: model_executor/layers/mamba/ops/causal_conv1d.py:78).
* ``kda_mixed_forward``: the non-spec path of ``KimiGatedDeltaNetAttention._forward`` with
  prefills (kimi_gdn_linear_attn.py:533-593) with no host branch: decodes ride the chunked path
  as one-token sequences, as they already do there whenever a prefill is in the batch.
* ``gdn_mixed_forward``: the same for the FLA-triton prefill of Qwen3-Next / Qwen3.5
  (``chunk_gated_delta_rule`` with the tables passed), decodes not peeled off.
* ``Mamba2StepInputs`` / ``mamba2_mixed_forward``: the same for ``MambaMixer2`` (Nemotron-H,
  Granite-4.0-H, Falcon-H1; docs/notes/issue49-mamba2.md): one conv and one SSD over every row,
  decodes through vLLM's ``selective_state_update`` on the bucket's first rows.

Padded rows never touch real state: their state index is vLLM's null block 0 (never ``-1``:
torch indexing wraps it to the last cache line), ``has_initial_state`` False (the gather masks
the load and the conv starts from zeros), conv rows ``PAD_SLOT_ID``. Padded tokens past the last
row belong to no sequence: no conv or chunk program reads them as a row's input, and their
outputs are garbage the engine discards (it samples real tokens only).

``cu_seqlens`` handed to the kernels is a view of the first ``num_reqs + 1`` entries of the
tail-padded table, which has two more: the reserved tail sequence ``num_reqs`` (where the
padding rows point) and an entry after it. KDA's token-parallel intra-chunk kernel (Kimi-Linear:
no ``gate_lower_bound``) reads ``cu_seqlens[N + 1]`` for a token past ``cu_seqlens[N]``; here it
exists and equals the total, so that program returns.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import attrs
import torch

from chunkmeta import tables
from chunkmeta.errors import ChunkMetaError
from chunkmeta.integrations.vllm.tables import CONV_BLOCK_M, FLA_CHUNK_SIZE, conv_fields, ssd_fields
from chunkmeta.step_builder import StepTablesBuilder

NULL_BLOCK_ID = 0  # vLLM's null block (v1/attention/backends/utils.py:55): padded rows' state
MAMBA2_DECODES = ("ssu", "ssd")  # a Mamba2 step's decode rows: vLLM's SSU, or one-token SSD rows


class ConvMetadata(NamedTuple):
    """The three fields ``causal_conv1d_fn(metadata=...)`` reads of vLLM's attention metadata."""

    nums_dict: dict
    batch_ptr: torch.Tensor
    token_chunk_offset_ptr: torch.Tensor


class _RoutedTables(NamedTuple):
    """What ``FlaRouter`` reads of a provider, for the ``cu_seqlens`` view the kernels get."""

    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    chunk_size: int
    padding: str
    metadata: object

    def check_live(self):
        self.metadata.check_live()
        return self


class SharedFill:
    """One table fill for every bucket of a builder: a one-slot ``StepTablesBuilder`` per table
    set at the largest bucket's capacity (``num_tokens``, ``num_reqs``), so that every capture
    size runs one layout, compiled once, where a builder per bucket compiled one per layout (31
    for the engine benchmark's 39 buckets). A bucket reads views of the first rows of each table;
    their padding rows point at the fill's tail sequence (``num_reqs``), zero-length like the
    bucket's own and past its rows, as a level's are already. One step replays one graph, staged
    just before: a stage retires the previous step's tables whichever bucket staged them."""

    def __init__(self, num_tokens: int, num_reqs: int):
        self.num_tokens, self.num_reqs = num_tokens, num_reqs
        self._builders: dict[tuple, StepTablesBuilder] = {}

    def builder(self, specs: dict, device, num_tokens: int, num_reqs: int) -> StepTablesBuilder | None:
        """The builder of ``specs`` on ``device``, or None for a bucket larger than the fill."""
        if num_tokens > self.num_tokens or num_reqs > self.num_reqs:
            return None
        key = (tuple(specs.items()), str(device))
        builder = self._builders.get(key)
        if builder is None:
            builder = self._builders[key] = StepTablesBuilder(
                self.num_reqs, self.num_tokens, tables=specs, device=device, ring_depth=1, pad="tail"
            )
        return builder


class MixedStepInputs:
    """The per-step inputs of a mixed step for a bucket of ``num_tokens`` tokens and ``num_reqs``
    requests, at fixed addresses (``stage()`` a step, capture once, ``stage()`` before every replay).

    Fields the layers read: ``cu_seqlens`` (int32 ``[num_reqs + 1]``), ``state_indices`` (int32
    ``[num_reqs]``, padded with the null block), ``has_initial_state`` (bool ``[num_reqs]``,
    padded False), ``conv`` (``ConvMetadata``, ``tot`` = the capacity rows), ``chunk_indices`` /
    ``chunk_offsets`` (FLA's, capacity rows). ``fla_routed()`` hands the tables to a vendored FLA
    op that derives them from ``cu_seqlens`` itself (Kimi's KDA).

    ``levels``: ``(rows, chunks)`` pairs, rows ``1, 2, 4, ...`` up to ``num_reqs``, chunks the
    tables' bound for a step of that many rows (``levels=False``: the capacity alone);
    ``level_taken`` (bool per level): the staged step's, the smallest that holds its rows. The
    forwards run their state-carrying kernels on the first ``rows`` rows and ``chunks`` chunk rows
    of the staged level (``_by_level``), so a padded row or chunk past it costs no state traffic.

    ``fill``: the ``SharedFill`` whose tables the bucket views (its own one-slot builder where
    None, or where the bucket is larger than the fill).
    """

    def __init__(
        self,
        num_tokens: int,
        num_reqs: int,
        device,
        *,
        chunk_size: int = FLA_CHUNK_SIZE,
        levels: bool = True,
        fill: SharedFill | None = None,
    ):
        for name, value in (("num_tokens", num_tokens), ("num_reqs", num_reqs)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ChunkMetaError(f"{name}={value!r}: a mixed-step bucket needs a positive int.")
        self.num_tokens, self.num_reqs, self.chunk_size = num_tokens, num_reqs, chunk_size
        # every family's conv table: the causal-conv1d one (its grid is cut to the bucket below)
        self._conv_spec = tables.Conv(rows="batch", block_m=CONV_BLOCK_M)
        specs = self._specs()
        self.builder = fill.builder(specs, device, num_tokens, num_reqs) if fill is not None else None
        if self.builder is None:
            # one ring slot: every build writes the same addresses, which is what a captured graph
            # reads (the object of a step is retired by the next build, as a graph step's is)
            self.builder = StepTablesBuilder(
                num_reqs, num_tokens, tables=specs, device=device, ring_depth=1, pad="tail"
            )
        self.device = self.builder.device
        self.state_indices = torch.full((num_reqs,), NULL_BLOCK_ID, dtype=torch.int32, device=self.device)
        self.has_initial_state = torch.zeros(num_reqs, dtype=torch.bool, device=self.device)
        empty, zero = torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        rows = self._rows(zero.to(self.device), num_computed_tokens_cpu=zero, checkpoint_offsets=zero.to(self.device),
                          checkpoint_offsets_cpu=zero)  # fmt: skip
        step = self.builder.build(empty.to(self.device), empty, padded=True, **rows)  # compiles the fill; the views
        self._set_tables(step)
        # the grid is the bucket's capacity: padding rows are PAD_SLOT_ID, on which the kernel returns
        conv = step["conv"]
        conv_rows = self._conv_spec.entry_rows(num_reqs, num_tokens)[0]
        own = attrs.evolve(
            conv,
            batch_ptr=conv.batch_ptr[:conv_rows],
            token_chunk_offset_ptr=conv.token_chunk_offset_ptr[:conv_rows],
            tot=conv_rows,
        )
        self.conv = ConvMetadata(*conv_fields(own))
        self.staged = None  # the StepTables of the last staged step (live until the next stage)
        capacity, top = self._chunk_capacity(), self._level_rows()
        rows = [1 << k for k in range(top.bit_length()) if 1 << k < top] + [top] if levels else [top]
        self.levels = tuple((r, min(capacity, self._chunk_bound(r))) for r in rows)
        self._level_index = torch.arange(len(self.levels), device=self.device)
        self.level_taken = self._level_index == len(self.levels) - 1
        self.staged_level: int | None = len(self.levels) - 1

    def _specs(self) -> dict:
        self._fla_spec = tables.Fla(self.chunk_size, rows="batch", fresh_cu_seqlens=False)
        return {"fla": self._fla_spec, "conv": self._conv_spec}

    def _chunk_capacity(self) -> int:
        return self.chunk_indices.shape[0]

    def _chunk_bound(self, rows: int) -> int:
        """The chunk rows of any step of at most ``rows`` rows (the tables' own bound)."""
        return self._fla_spec.entry_rows(rows, self.num_tokens)[0]

    def _level_rows(self) -> int:
        """The rows of the top level: every row of the bucket."""
        return self.num_reqs

    def _level_rows_of(self, query_start_loc_cpu, first_seq: int) -> int:
        """The rows a step's leveled kernels see: every row from ``first_seq`` (the padded ones
        too: their final states go to the null block, as vLLM's own path writes them)."""
        return query_start_loc_cpu.shape[0] - 1 - first_seq

    def _take_level(self, rows: int) -> None:
        """The staged step's level: the smallest holding its ``rows`` (host int), none for none;
        one flag per level written on the device, which the graph's IF nodes read."""
        self.staged_level = next((k for k, (r, _) in enumerate(self.levels) if r >= rows), None) if rows else None
        taken = -1 if self.staged_level is None else self.staged_level
        torch.eq(self._level_index, taken, out=self.level_taken)

    def level_cu_seqlens(self, rows: int) -> torch.Tensor:
        """``cu_seqlens`` of the first ``rows`` rows: one fixed view per level (the FLA router
        recognizes a provider's ``cu_seqlens`` by identity)."""
        view = self._cu_seqlens_views.get(rows)
        if view is None:
            view = self._cu_seqlens_views[rows] = self._cu_seqlens_table[: rows + 1]
        return view

    def _rows(self, num_computed_tokens, **rows) -> dict:
        """The per-row inputs of a build beside ``query_start_loc`` (none for FLA and conv)."""
        return {}

    def _set_tables(self, step) -> None:
        # views of this bucket's capacity (a shared fill's tables are the largest bucket's);
        # cu_seqlens keeps the entry after the tail sequence (module docstring)
        fla, seqs = step["fla"], self.num_reqs
        self._cu_seqlens_table = fla.cu_seqlens[: seqs + 2]
        self.cu_seqlens = fla.cu_seqlens[: seqs + 1]
        self._cu_seqlens_views = {seqs: self.cu_seqlens}  # level_cu_seqlens
        self.chunk_indices = fla.chunk_indices[: self._chunk_bound(seqs)]
        self.chunk_offsets = fla.chunk_offsets[: seqs + 2]

    def fits(self, num_reqs: int, num_tokens: int) -> bool:
        return num_reqs <= self.num_reqs and num_tokens <= self.num_tokens

    def stage(
        self,
        query_start_loc: torch.Tensor,
        query_start_loc_cpu: torch.Tensor,
        state_indices: torch.Tensor,
        num_computed_tokens: torch.Tensor,
        **rows,
    ):
        """Write one step's values before a replay (outside the graph), on the current stream:
        every check on host data first (a ``ChunkMetaError``, nothing written), then one fill of
        the tables from the engine's ``query_start_loc``, the state indices copied in and
        ``has_initial_state = num_computed_tokens > 0`` (vLLM's rule, gdn_attn.py:560) written
        in place; the padded rows' entries only where the batch has fewer requests than the
        bucket (vLLM's FULL padding fills the bucket: none then). No sync, and nothing the graph
        reads is allocated or moved. ``rows``: a subclass's per-row inputs (``_rows``)."""
        if (
            not isinstance(query_start_loc_cpu, torch.Tensor)
            or query_start_loc_cpu.dim() != 1
            or not len(query_start_loc_cpu)
        ):
            raise ChunkMetaError(
                "query_start_loc_cpu: the host copy of query_start_loc, a 1-D tensor of N + 1 entries."
            )
        num_reqs = query_start_loc_cpu.shape[0] - 1
        num_tokens = int(query_start_loc_cpu[-1])  # a host tensor: no sync
        if not self.fits(num_reqs, num_tokens):
            raise ChunkMetaError(
                f"a batch of {num_reqs} requests / {num_tokens} tokens is over this mixed-step bucket "
                f"({self.num_reqs} requests, {self.num_tokens} tokens): it runs eagerly."
            )
        _check_rows("state_indices", state_indices, num_reqs, self.device)
        _check_rows("num_computed_tokens", num_computed_tokens, num_reqs, self.device)
        # checks, then the fill
        self.staged = self.builder.build(
            query_start_loc, query_start_loc_cpu, padded=True, **self._rows(num_computed_tokens, **rows)
        )
        _copy_padded(self.state_indices, state_indices, NULL_BLOCK_ID)
        _has_prior_state(self.has_initial_state, num_computed_tokens)
        self._take_level(self._level_rows_of(query_start_loc_cpu, rows.get("first_seq", 0)))
        return self.staged

    @contextlib.contextmanager
    def fla_routed(self, router, level: tuple[int, int] | None = None):
        """``router`` (an ``FlaRouter``) answers ``prepare_chunk_indices`` / ``_offsets`` for
        ``cu_seqlens`` with this bucket's tables for the calls inside (``level``: the first
        ``(rows, chunk rows)`` of them, for ``level_cu_seqlens(rows)``). At capture too: the
        answer is the bucket's fixed tensors, so a replay reads whatever the latest ``stage()``
        wrote."""
        if self.staged is None:
            raise ChunkMetaError("MixedStepInputs: stage() a step before the forward (capture included).")
        rows, chunks = level or self.levels[-1]
        provider = _RoutedTables(
            self.level_cu_seqlens(rows),
            self.chunk_indices[:chunks],
            self.chunk_offsets[: rows + 1],
            self.chunk_size,
            "tail",
            self.staged["fla"],
        )
        with router.active(provider):
            yield


class Mamba2StepInputs(MixedStepInputs):
    """A Mamba2 mixed step's inputs for a bucket (``MambaMixer2``, ``mamba2_mixed_forward``:
    docs/notes/issue49-mamba2.md). Over every row: ``conv`` (capacity rows), ``cu_seqlens``
    (``[num_reqs + 1]``, the engine's ``query_start_loc`` copied in, padded rows at the total),
    ``state_indices`` / ``has_initial_state`` (as the GDN bucket's) and ``decode_rows`` (bool
    ``[num_reqs]``: the first ``num_decodes`` rows, vLLM's order).

    The SSD's rows, ``ssd_*``: the prefill rows (every row with ``decodes="ssd"``: one-token SSD
    sequences), first, then padding rows on the null block: ``ssd_cu_seqlens``,
    ``ssd_state_indices``, ``ssd_has_initial``, vLLM's chunk tables of those rows (chunks cut on
    absolute positions; ``ssd_cu_chunk_seqlens`` in tokens of the whole step, ``seq_idx``,
    ``last_chunk_indices``; padding chunks empty and on row 0, a row every level has) and, with
    ``checkpoints`` (align mode), ``ssd_checkpoint_offsets`` (0 = none), ``ssd_checkpoint_state_indices``
    and ``checkpoint_chunk_idx``. Its ``levels`` are the SSD's: rows of the SSD rows, chunks of
    ``seq_idx``. ``ssd_rows`` (default ``num_reqs``; ``decodes="ssu"`` only): the SSD rows a step
    may have, the top level's rows; its chunks are the tables' bound for them, so a bucket for
    steps of few prefills runs no padding chunk past that bound; ``stage()`` refuses a step of
    more SSD rows (``ChunkMetaError``).

    ``stage()`` takes every row's values in vLLM's order: the computed-token counts on both sides
    (Mamba2 cuts chunks on absolute positions), ``num_decodes`` and, with ``checkpoints``, each
    row's checkpoint offset on both sides and its checkpoint block."""

    def __init__(
        self,
        num_tokens: int,
        num_reqs: int,
        device,
        *,
        chunk_size: int,
        checkpoints: bool = False,
        decodes: str = "ssu",
        levels: bool = True,
        ssd_rows: int | None = None,
        fill: SharedFill | None = None,
    ):
        if decodes not in MAMBA2_DECODES:
            raise ChunkMetaError(f"decodes={decodes!r}: one of {MAMBA2_DECODES}.")
        if ssd_rows is None:
            ssd_rows = num_reqs  # (a bad num_reqs is the base class's error)
        elif not isinstance(ssd_rows, int) or isinstance(ssd_rows, bool) or not 1 <= ssd_rows <= num_reqs:
            raise ChunkMetaError(f"ssd_rows={ssd_rows!r}: an int from 1 to the bucket's {num_reqs} requests.")
        if decodes == "ssd" and ssd_rows != num_reqs:
            raise ChunkMetaError(f"ssd_rows={ssd_rows}: with decodes='ssd' every row is an SSD row ({num_reqs}).")
        self.checkpoints, self.decodes, self.ssd_rows = checkpoints, decodes, ssd_rows
        super().__init__(num_tokens, num_reqs, device, chunk_size=chunk_size, levels=levels, fill=fill)
        rows = lambda value, dtype=torch.int32: torch.full((num_reqs,), value, dtype=dtype, device=self.device)  # noqa: E731
        self._row_index = torch.arange(num_reqs, dtype=torch.int32, device=self.device)
        self.decode_rows = rows(False, torch.bool)
        self.cu_seqlens = torch.zeros(num_reqs + 1, dtype=torch.int32, device=self.device)
        self.ssd_cu_seqlens = torch.zeros_like(self.cu_seqlens)
        self.ssd_cu_chunk_seqlens = torch.zeros_like(self._chunk_table)
        self.ssd_state_indices = rows(NULL_BLOCK_ID)
        self.ssd_has_initial = rows(False, torch.bool)
        self.ssd_checkpoint_offsets = rows(0)
        self.ssd_checkpoint_state_indices = rows(NULL_BLOCK_ID)
        self.first_ssd_row = 0  # the staged step's: a host int (GroupInputs slices there too)
        if checkpoints:
            # a step's checkpoint_chunk_idx is None where no row has a checkpoint (vLLM's rule):
            # the bucket's is the region itself, from a build whose row has one (every step
            # writes it: zeros past the rows, and on rows without a checkpoint)
            # (one token, its checkpoint at its end: a bucket of one token has room for it)
            qsl, one = torch.tensor([0, 1], dtype=torch.int32), torch.ones(1, dtype=torch.int32)
            zero = torch.zeros(1, dtype=torch.int32)
            probe = self.builder.build(
                qsl.to(self.device),
                qsl,
                padded=True,
                **self._rows(zero.to(self.device), zero, one.to(self.device), one),
            )
            self.checkpoint_chunk_idx = probe["ssd"].checkpoint_chunk_idx[:num_reqs]

    def _specs(self) -> dict:
        self.ssd_spec = tables.Mamba2(self.chunk_size, checkpoints=self.checkpoints, seq_idx_pad=0)
        return {"ssd": self.ssd_spec, "conv": self._conv_spec}

    def _chunk_capacity(self) -> int:
        return self.seq_idx.shape[0]

    def ssd_state_rows(self) -> int:
        """The SSM states the SSD allocates in a capture, counted in states: per level (each IF
        body allocates its own), twice its chunk rows (vLLM's chunk states and their
        state-passing output) and twice its rows (the initial states gathered, then masked),
        once more with checkpoints (the final states taken from the chunk states)."""
        per_row = 3 if self.checkpoints else 2
        return sum(2 * chunks + per_row * rows for rows, chunks in self.levels)

    def _chunk_bound(self, rows: int) -> int:
        return self.ssd_spec.entry_rows(rows, self.num_tokens)[0]

    def _level_rows(self) -> int:
        return self.ssd_rows

    def _level_rows_of(self, query_start_loc_cpu, first_seq: int) -> int:
        # the trailing rows of no token (vLLM's padding, on the null block) are left out: no table
        # gives them a chunk, and a bucket of few SSD rows has none of them to spare (a step of
        # decodes alone: vLLM's decode count takes the padding rows too, none left)
        return max(0, _rows_with_tokens(query_start_loc_cpu) - first_seq)

    def _rows(
        self,
        num_computed_tokens,
        num_computed_tokens_cpu=None,
        checkpoint_offsets=None,
        checkpoint_offsets_cpu=None,
        first_seq=0,
    ) -> dict:
        rows = dict(
            num_computed_tokens=num_computed_tokens,
            num_computed_tokens_cpu=num_computed_tokens_cpu,
            first_seq=first_seq,
        )
        if self.checkpoints:
            rows.update(checkpoint_offsets=checkpoint_offsets, checkpoint_offsets_cpu=checkpoint_offsets_cpu)
        return rows

    def _set_tables(self, step) -> None:
        # the SSD rows' chunk boundaries count from their first token: ssd_cu_chunk_seqlens
        # shifts them by the decode tokens ahead. Views of this bucket's capacity (as the base's).
        chunks, seqs = self._chunk_bound(self.num_reqs), self.num_reqs
        table, seq_idx, last, checkpoint = ssd_fields(step["ssd"])
        self._chunk_table, self.seq_idx, self.last_chunk_indices = table[: chunks + 1], seq_idx[:chunks], last[:seqs]
        self.checkpoint_chunk_idx = None if checkpoint is None else checkpoint[:seqs]

    def stage(
        self,
        query_start_loc,
        query_start_loc_cpu,
        state_indices,
        num_computed_tokens,
        *,
        num_computed_tokens_cpu,
        num_decodes: int,
        checkpoint_offsets=None,
        checkpoint_offsets_cpu=None,
        checkpoint_state_indices=None,
    ):
        n = query_start_loc_cpu.shape[0] - 1 if isinstance(query_start_loc_cpu, torch.Tensor) else -1
        if not isinstance(num_decodes, int) or isinstance(num_decodes, bool) or not 0 <= num_decodes <= max(n, 0):
            raise ChunkMetaError(f"num_decodes={num_decodes!r}: an int from 0 to the batch's {n} requests.")
        if query_start_loc.dim() != 1 or query_start_loc.shape[0] != n + 1:
            raise ChunkMetaError(
                f"query_start_loc: a 1-D tensor of {n + 1} entries, not {tuple(query_start_loc.shape)}."
            )
        if self.checkpoints:
            _check_rows("checkpoint_state_indices", checkpoint_state_indices, n, self.device)
        first = num_decodes if self.decodes == "ssu" else 0  # the decode rows go through the SSU
        ssd_rows = self._level_rows_of(query_start_loc_cpu, first) if n > 0 else 0
        if ssd_rows > self.ssd_rows:
            raise ChunkMetaError(
                f"a step of {ssd_rows} SSD rows is over this bucket's {self.ssd_rows} (its SSD's rows and "
                "chunks are sized for them): it runs eagerly."
            )
        staged = super().stage(
            query_start_loc,
            query_start_loc_cpu,
            state_indices,
            num_computed_tokens,
            num_computed_tokens_cpu=num_computed_tokens_cpu,
            checkpoint_offsets=checkpoint_offsets,
            checkpoint_offsets_cpu=checkpoint_offsets_cpu,
            first_seq=first,
        )
        # validated by the build: from here on nothing fails on bad input
        total, ahead = int(query_start_loc_cpu[-1]), int(query_start_loc_cpu[first])  # host: no sync
        _copy_padded(self.cu_seqlens, query_start_loc, total)  # padded rows: empty
        torch.lt(self._row_index, num_decodes, out=self.decode_rows)
        _copy_padded(self.ssd_cu_seqlens, query_start_loc[first:], total)
        torch.add(self._chunk_table, ahead, out=self.ssd_cu_chunk_seqlens)
        _copy_padded(self.ssd_state_indices, state_indices[first:], NULL_BLOCK_ID)
        _has_prior_state(self.ssd_has_initial, num_computed_tokens[first:])
        if self.checkpoints:
            _copy_padded(self.ssd_checkpoint_offsets, checkpoint_offsets[first:], 0)
            _copy_padded(self.ssd_checkpoint_state_indices, checkpoint_state_indices[first:], NULL_BLOCK_ID)
        self.first_ssd_row = first
        return staged


def _rows_with_tokens(query_start_loc_cpu: torch.Tensor) -> int:
    """The rows before the batch's trailing rows of no token (host only)."""
    return int(torch.searchsorted(query_start_loc_cpu, query_start_loc_cpu[-1:]))


def _check_rows(name: str, tensor, rows: int, device) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1 or tensor.shape[0] != rows or tensor.device != device:
        shape = (tuple(tensor.shape), tensor.device) if isinstance(tensor, torch.Tensor) else (type(tensor).__name__,)
        raise ChunkMetaError(f"{name}: a 1-D tensor of {rows} entries on {device} (one per request), not {shape}.")


def _copy_padded(dst: torch.Tensor, src: torch.Tensor, pad) -> None:
    """``dst[:len(src)] = src``, the rest ``pad`` (the rows a batch leaves of its bucket)."""
    rows = src.shape[0]
    dst[:rows].copy_(src, non_blocking=True)
    if rows < dst.shape[0]:
        dst[rows:].fill_(pad)


def _has_prior_state(dst: torch.Tensor, num_computed_tokens: torch.Tensor) -> None:
    """``dst[:rows] = num_computed_tokens > 0`` (vLLM's rule, gdn_attn.py:560), the rest False."""
    rows = num_computed_tokens.shape[0]
    torch.gt(num_computed_tokens, 0, out=dst[:rows])
    dst[rows:].fill_(False)


class GroupInputs:
    """Another KV-cache group's view of a bucket (Model Runner V2 builds one group's metadata and
    gives the others its batch-level fields): the bucket's tables and ``has_initial_state``,
    this group's own ``state_indices`` (and a Mamba2 bucket's ``ssd_state_indices`` and
    ``ssd_checkpoint_state_indices``) at fixed addresses (``stage_state_indices`` before every
    replay, after the bucket's ``stage``)."""

    def __init__(self, bucket: MixedStepInputs):
        self.bucket = bucket
        self.state_indices = torch.full_like(bucket.state_indices, NULL_BLOCK_ID)
        if isinstance(bucket, Mamba2StepInputs):
            self.ssd_state_indices = torch.full_like(bucket.state_indices, NULL_BLOCK_ID)
            self.ssd_checkpoint_state_indices = torch.full_like(bucket.state_indices, NULL_BLOCK_ID)

    def __getattr__(self, name):
        return getattr(self.bucket, name)

    def stage_state_indices(self, state_indices: torch.Tensor, checkpoint_state_indices=None) -> None:
        """This group's indices of the staged step's rows (vLLM pads them with the null block);
        in a Mamba2 bucket with checkpoints, its checkpoint blocks too, one per row."""
        rows = state_indices.shape[0] if state_indices.dim() == 1 else -1
        if not 0 < rows <= self.bucket.num_reqs or state_indices.device != self.state_indices.device:
            raise ChunkMetaError(
                f"state_indices: a 1-D tensor of at most {self.bucket.num_reqs} entries on "
                f"{self.state_indices.device}, not {tuple(state_indices.shape)} on {state_indices.device}."
            )
        if getattr(self.bucket, "checkpoints", False):
            _check_rows("checkpoint_state_indices", checkpoint_state_indices, rows, self.state_indices.device)
        _copy_padded(self.state_indices, state_indices, NULL_BLOCK_ID)
        if isinstance(self.bucket, Mamba2StepInputs):
            first = self.bucket.first_ssd_row
            _copy_padded(self.ssd_state_indices, state_indices[first:], NULL_BLOCK_ID)
            if self.bucket.checkpoints:
                _copy_padded(self.ssd_checkpoint_state_indices, checkpoint_state_indices[first:], NULL_BLOCK_ID)


def _conv_rows(causal_conv1d_fn, inputs: MixedStepInputs, x, weight, bias, activation, conv_state) -> torch.Tensor:
    """vLLM's ``causal_conv1d_fn`` over every row of the bucket (``x`` ``[dim, num_tokens]``, the
    kernel's layout), from and into each row's conv state; the output ``[num_tokens, dim]``."""
    return causal_conv1d_fn(
        x,
        weight,
        bias,
        activation=activation,
        conv_states=conv_state,
        has_initial_state=inputs.has_initial_state,
        cache_indices=inputs.state_indices,
        query_start_loc=inputs.cu_seqlens,
        metadata=inputs.conv,
    ).transpose(0, 1)


class KdaOps(NamedTuple):
    """vLLM's functions Kimi-Linear's non-spec path calls (the platform's versions)."""

    causal_conv1d_fn: object
    gather_initial_states: object
    chunk_kda_with_fused_gate: object
    router: object  # the FlaRouter over vLLM's vendored FLA (chunkmeta.integrations.vllm.routing)


def kda_mixed_forward(
    ops: KdaOps,
    inputs: MixedStepInputs,
    *,
    mixed_qkv: torch.Tensor,
    g1: torch.Tensor,
    beta: torch.Tensor,
    conv_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    conv_states: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    recurrent_state: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound,
    head_dim: int,
) -> torch.Tensor:
    """Kimi-Linear's KDA over a mixed batch, shapes fixed by ``inputs``' bucket: ``mixed_qkv``
    ``[num_tokens, 3 * H * D]`` (q, k, v column blocks), ``g1`` ``[1, num_tokens, H, D]``,
    ``beta`` ``[1, num_tokens, H]``; the conv weights and conv-state views per block, as
    ``_forward`` splits them. Writes the final states of every row into ``recurrent_state`` (the
    padded rows' into the null block) and returns the output ``[1, num_tokens, H, D]``."""
    num_tokens = mixed_qkv.shape[0]
    if num_tokens != inputs.num_tokens:
        raise ChunkMetaError(f"{num_tokens} tokens in a mixed-step bucket of {inputs.num_tokens}: pad to the bucket.")
    projection = mixed_qkv.shape[1] // 3

    q, k, v = (
        _conv_rows(ops.causal_conv1d_fn, inputs, x.transpose(0, 1), w, None, "silu", s).reshape(
            1, num_tokens, -1, head_dim
        )
        for x, w, s in zip(mixed_qkv.split(projection, dim=-1), conv_weights, conv_states, strict=True)
    )

    def rule(rows: int, chunks: int) -> torch.Tensor:
        state_indices = inputs.state_indices[:rows]
        initial_state = ops.gather_initial_states(recurrent_state, state_indices, inputs.has_initial_state[:rows])
        with inputs.fla_routed(ops.router, (rows, chunks)):
            o, last_state = ops.chunk_kda_with_fused_gate(
                q=q,
                k=k,
                v=v,
                raw_g=g1,
                raw_beta=beta,
                A_log=A_log,
                g_bias=dt_bias,
                lower_bound=lower_bound,
                initial_state=initial_state,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
                cu_seqlens=inputs.level_cu_seqlens(rows),
            )
        recurrent_state[state_indices] = last_state
        return o

    return _by_level(inputs, rule, like=v)


class GdnOps(NamedTuple):
    """vLLM's functions Qwen3-Next / Qwen3.5's non-spec prefill path calls, FLA-triton backend."""

    causal_conv1d_fn: object
    fused_post_conv_prep: object
    chunk_gated_delta_rule: object  # vllm.third_party.flash_linear_attention.ops.chunk_gated_delta_rule


def gdn_mixed_forward(
    ops: GdnOps,
    inputs: MixedStepInputs,
    *,
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias,
    activation: str,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
) -> torch.Tensor:
    """Qwen3-Next's GDN over a mixed batch (``_forward_core``'s non-spec path with prefills,
    qwen_gdn_linear_attn.py:1663-1872), shapes fixed by ``inputs``' bucket: one packed
    ``causal_conv1d_fn``, ``fused_post_conv_prep``, the chunked rule with the bucket's tables.
    Decodes are not peeled off onto the recurrent kernel (a host count would size that split):
    they are one-token sequences of the chunked rule. Returns ``[1, num_tokens, HV, V]``."""
    num_tokens = mixed_qkv.shape[0]
    if num_tokens != inputs.num_tokens:
        raise ChunkMetaError(f"{num_tokens} tokens in a mixed-step bucket of {inputs.num_tokens}: pad to the bucket.")
    conv_out = _conv_rows(
        ops.causal_conv1d_fn, inputs, mixed_qkv.transpose(0, 1), conv_weight, conv_bias, activation, conv_state
    )
    q, k, v, g, beta = ops.fused_post_conv_prep(
        conv_output=conv_out,
        a=a,
        b=b,
        A_log=A_log,
        dt_bias=dt_bias,
        num_k_heads=num_k_heads,
        head_k_dim=head_k_dim,
        head_v_dim=head_v_dim,
        apply_l2norm=True,
        output_g_exp=False,
    )

    def rule(rows: int, chunks: int) -> torch.Tensor:
        state_indices = inputs.state_indices[:rows]
        initial_state = ssm_state[state_indices]
        # vLLM zeroes rows without a prior state with a boolean-mask assignment; where() gives
        # the same values with no mask-to-index conversion
        keep = inputs.has_initial_state[:rows].view(-1, *([1] * (initial_state.dim() - 1)))
        zero = torch.zeros((), dtype=initial_state.dtype, device=keep.device)
        o, last_state = ops.chunk_gated_delta_rule(
            q=q.unsqueeze(0),
            k=k.unsqueeze(0),
            v=v.unsqueeze(0),
            g=g.unsqueeze(0),
            beta=beta.unsqueeze(0),
            initial_state=torch.where(keep, initial_state, zero),
            output_final_state=True,
            cu_seqlens=inputs.level_cu_seqlens(rows),
            chunk_indices=inputs.chunk_indices[:chunks],
            chunk_offsets=inputs.chunk_offsets[: rows + 1],
            use_qk_l2norm_in_kernel=False,
        )
        ssm_state[state_indices] = last_state.to(ssm_state.dtype)
        return o

    return _by_level(inputs, rule, like=v.unsqueeze(0))


class Mamba2Ops(NamedTuple):
    """vLLM's functions ``MambaMixer2.conv_ssm_forward`` calls (the platform's versions)."""

    causal_conv1d_fn: object
    mamba_chunk_scan_combined_varlen: object
    selective_state_update: object  # bound to the layer's ``is_blackwell`` by the caller
    store_prefill_checkpoint: object


class _Checkpoints(NamedTuple):
    """The two fields ``store_prefill_checkpoint`` reads of ``MambaPrefillCheckpointMetadata``."""

    checkpoint_offsets: torch.Tensor
    state_indices: torch.Tensor


def mamba2_mixed_forward(
    ops: Mamba2Ops,
    inputs: Mamba2StepInputs,
    *,
    hidden_states_B_C: torch.Tensor,
    dt: torch.Tensor,
    output: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias,
    activation,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    num_heads: int,
    head_dim: int,
    n_groups: int,
    state_len: int,
) -> None:
    """``MambaMixer2.conv_ssm_forward``'s non-spec path over a mixed batch
    (mamba_mixer2.py:803-1106), shapes fixed by ``inputs``' bucket: ``hidden_states_B_C``
    ``[num_tokens, conv_dim]`` (pre-conv x, B, C), ``dt`` ``[num_tokens, num_heads]``; writes
    ``output`` ``[num_tokens, num_heads * head_dim]`` and every real row's conv and SSM state.

    One ``causal_conv1d_fn`` over every row (decodes are one-token rows), then the SSD over the
    bucket's SSD rows at the staged level (``_by_level``). ``inputs.decodes == "ssu"``
    (vLLM's decode arithmetic): the SSD rows are the prefill rows and the decode rows run vLLM's
    ``selective_state_update`` on the bucket's first rows, their outputs merged in; ``"ssd"``:
    every row is an SSD row (not vLLM's rounding: the note's §3). Align mode
    (``inputs.checkpoints``): the chunk states, the checkpoint store and the final states'
    ``index_put``, as vLLM's path."""
    num_tokens = inputs.num_tokens
    if hidden_states_B_C.shape[0] != num_tokens or dt.shape[0] != num_tokens or output.shape[0] != num_tokens:
        raise ChunkMetaError(f"a mixed step of {num_tokens} tokens: pad x, dt and output to the bucket.")
    x = hidden_states_B_C.transpose(0, 1)  # the conv's layout, and the checkpoint store's input
    conv_out = _conv_rows(ops.causal_conv1d_fn, inputs, x, conv_weight, conv_bias, activation, conv_state)
    state_size = (conv_out.shape[1] - num_heads * head_dim) // (2 * n_groups)
    hidden, B, C = conv_out.split([num_heads * head_dim, n_groups * state_size, n_groups * state_size], dim=-1)
    hidden, B, C = (
        hidden.view(num_tokens, num_heads, head_dim),
        B.view(num_tokens, n_groups, -1),
        C.view(num_tokens, n_groups, -1),
    )
    out = output.view(num_tokens, num_heads, head_dim)

    def ssd(rows: int, chunks: int) -> None:
        # the level's rows hold every SSD row and its chunks every chunk of theirs (the tables'
        # bound): the kernels' grids and the state traffic are the slices', not the bucket's
        ssd_rows = inputs.ssd_state_indices[:rows]
        # masked initial states are always passed (a fixed shape); vLLM's where() with a scalar 0
        initial_states = torch.where(inputs.ssd_has_initial[:rows, None, None, None], ssm_state[ssd_rows], 0)
        last_chunk_indices = inputs.last_chunk_indices[:rows]
        chunk_states = ops.mamba_chunk_scan_combined_varlen(
            hidden,
            dt,
            A,
            B,
            C,
            chunk_size=inputs.chunk_size,
            D=D,
            z=None,
            dt_bias=dt_bias,
            seq_idx=inputs.seq_idx[:chunks],
            cu_seqlens=inputs.ssd_cu_seqlens[: rows + 1],
            cu_chunk_seqlens=inputs.ssd_cu_chunk_seqlens[: chunks + 1],
            last_chunk_indices=last_chunk_indices,
            initial_states=initial_states,
            return_intermediate_states=inputs.checkpoints,
            dt_softplus=True,
            dt_limit=(0.0, float("inf")),
            out=out,
            state_dtype=ssm_state.dtype,
            final_states_out=None if inputs.checkpoints else ssm_state,
            final_state_indices=None if inputs.checkpoints else ssd_rows,
        )
        if inputs.checkpoints:
            final_states = chunk_states[last_chunk_indices]
            # rows of offset 0 (padding, no checkpoint) write nothing
            ops.store_prefill_checkpoint(
                _Checkpoints(inputs.ssd_checkpoint_offsets[:rows], inputs.ssd_checkpoint_state_indices[:rows]),
                inputs.checkpoint_chunk_idx[:rows],
                x,
                conv_state,
                chunk_states,
                ssm_state,
                inputs.ssd_cu_seqlens[: rows + 1],
                state_len=state_len,
            )
            ssm_state[ssd_rows] = final_states

    _by_level(inputs, ssd)
    if inputs.decodes == "ssu":
        _decode_rows_ssu(ops, inputs, hidden, dt, B, C, out, ssm_state, A, D, dt_bias)


def _by_level(inputs: MixedStepInputs, run, like: torch.Tensor | None = None):
    """``run(rows, chunks)`` at the staged step's level (``MixedStepInputs.levels``), and its
    result. Inside a CUDA graph capture, every level in a graph IF node on ``inputs.level_taken``
    (a replay runs the one its stage chose, none for a step without rows), each result copied
    into one tensor shaped ``like``, allocated before them (what follows reads one address), or
    the bucket's capacity where it has one level; eagerly, the staged level."""
    levels = inputs.levels
    capturing = inputs.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    graph = _capturing_graph() if capturing and len(levels) > 1 else None  # levels: IF nodes probed
    if graph is None:
        # a step without rows (a Mamba2 step of decodes only) still runs the smallest level, on
        # padding rows: the warm-up vLLM runs before a capture must compile and tune every kernel
        # the captured levels launch (a first compile or autotune inside a capture fails it)
        staged = len(levels) - 1 if capturing else inputs.staged_level or 0
        return run(*levels[staged])
    out = None if like is None else torch.empty_like(like)
    for k, level in enumerate(levels):
        graph.begin_capture_to_if_node(inputs.level_taken[k])
        try:
            result = run(*level)
            if out is not None:
                out.copy_(result)
        finally:
            graph.end_capture_to_conditional_node()
    return out


def _capturing_graph():
    """The ``torch.cuda.CUDAGraph`` being captured, where this torch captures IF nodes into it."""
    graph_cls = torch.cuda.CUDAGraph
    if not hasattr(graph_cls, "begin_capture_to_if_node") or not hasattr(graph_cls, "get_currently_capturing_graph"):
        return None
    return graph_cls.get_currently_capturing_graph()


def if_nodes_capture(device_index: int) -> bool:
    """Whether a CUDA graph with an IF node captures on this device (torch's API, the driver's
    conditional nodes): one tiny capture at start-up (``torch.cuda.graph`` synchronizes), once per
    process and device. Asked during another capture (vLLM makes its buckets before capturing),
    the answer is no. It does not check what a real body holds (allocations, Triton launches)."""
    graph_cls = torch.cuda.CUDAGraph
    if not hasattr(graph_cls, "begin_capture_to_if_node") or not hasattr(graph_cls, "get_currently_capturing_graph"):
        return False
    return not torch.cuda.is_current_stream_capturing() and _if_node_probe(device_index)


@functools.cache
def _if_node_probe(device_index: int) -> bool:
    try:
        with torch.cuda.device(device_index):
            taken = torch.ones((), dtype=torch.bool, device="cuda")
            x = torch.zeros(1, device="cuda")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                capturing = torch.cuda.CUDAGraph.get_currently_capturing_graph()
                capturing.begin_capture_to_if_node(taken)
                try:
                    x.add_(1)
                finally:
                    capturing.end_capture_to_conditional_node()
            del graph
    except Exception:  # noqa: BLE001  no IF nodes here: a bucket's SSD keeps its capacity
        return False
    return True


def _decode_rows_ssu(ops, inputs, hidden, dt, B, C, out, ssm_state, A, D, dt_bias) -> None:
    """vLLM's decode SSU (mamba_mixer2.py:960-1106, non-spec) over the bucket's first rows: decodes
    come first, one token each, so row i is token i. Rows past the decodes are on the null block,
    whose state the kernel neither loads nor stores; it still writes their output rows, so it
    writes a side buffer and the decode rows are merged into ``out``."""
    rows = inputs.num_reqs
    head_dim, state_size = hidden.shape[2], B.shape[2]
    decode_state = torch.where(inputs.decode_rows, inputs.state_indices, NULL_BLOCK_ID).unsqueeze(-1)
    ssu_out = torch.empty_like(out[:rows])
    ops.selective_state_update(
        ssm_state,
        hidden[:rows],
        dt[:rows, :, None].expand(-1, -1, head_dim),
        A[:, None, None].expand(-1, head_dim, state_size).to(dtype=torch.float32),
        B[:rows],
        C[:rows],
        D[:, None].expand(-1, head_dim),
        dt_bias[:, None].expand(-1, head_dim),
        dt_softplus=True,
        state_batch_indices=decode_state,
        dst_state_batch_indices=decode_state,
        out=ssu_out,
    )
    torch.where(inputs.decode_rows[:, None, None], ssu_out, out[:rows], out=out[:rows])
