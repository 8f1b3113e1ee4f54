"""StepTablesBuilder: every prefill table a hybrid step asks for, in one device launch.

The engine says once which tables it wants (``chunkmeta.tables``: FLA chunks per slice,
causal-conv1d blocks, Mamba2 SSD chunks in vLLM's or SGLang's convention); each step passes the
device and host ``query_start_loc`` (and the rows' computed-token counts where a Mamba2 table is
wanted) and gets one frozen ``StepTables``. A build reads as the FLA builder's
(``chunkmeta.builder``): **accept** the tensors, **plan** every table's size from host data
(validating everything), **claim** a ring slot, **launch** one kernel that writes every table,
**publish**. No table is copied host to device and nothing reads the device.
"""

from __future__ import annotations

import numpy as np
import torch

from chunkmeta import layout as _layout
from chunkmeta import plan as _plan
from chunkmeta import tables as _tables
from chunkmeta.builder import resolve_backend, resolve_device
from chunkmeta.errors import ChunkMetaError
from chunkmeta.fill.torch_fill import fill_entry_torch
from chunkmeta.metadata import ChunkMetadata, ConvBlocks, Mamba2Chunks, SglangMamba2Chunks, StepTables
from chunkmeta.ring import TableRing

_MAX_ENTRIES = 6  # chunkmeta.fill.step_fill.MAX_ENTRIES (not imported: it imports triton)


class StepTablesBuilder:
    """Builds one step's ``StepTables`` into persistent buffers, with no host<->device sync.

    ``tables``: ``{name: spec}`` (``chunkmeta.tables.Fla``, ``Conv``, ``Mamba2``,
    ``SglangMamba2``), at most six kernel entries (``SglangMamba2`` counts two). ``pad``: the FLA
    tables' padding in ``build(padded=True)`` (``chunkmeta.layout``). Results stay valid for
    ``ring_depth - 1`` later builds.
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_num_tokens: int,
        *,
        tables: dict,
        device: torch.device | str,
        backend: str = "auto",
        ring_depth: int = 4,
        pad: str = "tail",
    ):
        self.specs = _tables.check_specs(tables)
        chunk_sizes = [spec.chunk_size for spec in self.specs.values() if hasattr(spec, "chunk_size")]
        self.capacity = _plan.capacity_for(max_num_seqs, max_num_tokens, min(chunk_sizes, default=64))
        if not isinstance(ring_depth, int) or isinstance(ring_depth, bool) or not 1 <= ring_depth <= 64:
            raise ChunkMetaError(f"ring_depth={ring_depth!r}: must be an int in [1, 64].")
        for spec in self.specs.values():
            if isinstance(spec, _tables.Fla):
                _layout.check_pad(pad, _layout.PADS, max_num_tokens, spec.chunk_size)
        self.pad = pad
        self.device = resolve_device(device)
        self.backend = resolve_backend(backend, self.device)
        self.layout = _tables.slot_layout(self.specs, max_num_seqs, max_num_tokens, pad)
        if len(self.layout.entries) > _MAX_ENTRIES:
            raise ChunkMetaError(
                f"tables={tuple(self.specs)} need {len(self.layout.entries)} kernel entries, more than one launch "
                f"holds ({_MAX_ENTRIES}); use two builders."
            )
        self.ring = TableRing(ring_depth, self.layout.regions, self.layout.slot_bytes, self.device)
        self.needs_computed = any(spec.needs_computed for spec in self.specs.values())
        self.needs_checkpoints = any(getattr(spec, "checkpoints", False) for spec in self.specs.values())
        self.needs_batch = any(spec.rows == "batch" for spec in self.specs.values())
        # host copies of the FLA tables' cu_seqlens, per slot
        self._cu_cpu = {
            name: torch.zeros(ring_depth, max_num_seqs + 2, dtype=torch.int32)
            for name, spec in self.specs.items()
            if isinstance(spec, _tables.Fla)
        }
        self._cu_cpu_np = {name: t.numpy() for name, t in self._cu_cpu.items()}
        self._cu_cpu_views: dict[tuple, torch.Tensor] = {}
        self._dummy = torch.zeros(1, dtype=torch.int32, device=self.device)  # for unread pointer arguments
        self._fills: dict[bool, object] = {}

    @property
    def builds(self) -> int:
        return self.ring.generation

    # -- build ------------------------------------------------------------------------------

    def build(
        self,
        query_start_loc: torch.Tensor,
        query_start_loc_cpu,
        *,
        first_seq: int = 0,
        num_seqs: int | None = None,
        num_computed_tokens: torch.Tensor | None = None,
        num_computed_tokens_cpu=None,
        checkpoint_offsets: torch.Tensor | None = None,
        checkpoint_offsets_cpu=None,
        padded: bool = False,
    ) -> StepTables:
        """Every table of one step. The prefill slice is requests ``[first_seq, first_seq +
        num_seqs)`` (vLLM: ``first_seq = num_decodes``); the batch slice is every request of
        ``query_start_loc``. ``num_computed_tokens`` (device) / ``_cpu`` (host, the same values):
        per request of the batch, the tokens already in its cache (vLLM:
        ``seq_lens - query_lens``; SGLang: ``extend_prefix_lens``), needed by ``Mamba2`` and
        ``SglangMamba2``. ``checkpoint_offsets`` / ``_cpu``: per request, a checkpoint that many
        tokens into its new ones (0 = none), for ``Mamba2(checkpoints=True)``. ``padded``:
        capacity-shaped tables (``StepTables.padded``)."""
        host = _plan.host_array(query_start_loc_cpu)
        _plan.check_device_tensor(query_start_loc, host.shape[0], self.device)
        num_requests = host.shape[0] - 1
        address = _plan.host_address(host)
        step = self._plan_slice(host, first_seq, num_seqs, address)
        batch = self._plan_slice(host, 0, None, address) if self.needs_batch else None
        computed = checkpoints = None
        computed_dev = checkpoints_dev = self._dummy
        if self.needs_computed:
            computed, computed_dev = self._row_input(
                "num_computed_tokens", num_computed_tokens, num_computed_tokens_cpu, num_requests
            )
        if self.needs_checkpoints:
            checkpoints, checkpoints_dev = self._row_input(
                "checkpoint_offsets", checkpoint_offsets, checkpoint_offsets_cpu, num_requests
            )
        first, n = step.first_seq, step.num_seqs
        # per-row lengths only where positions matter (Mamba2's chunks); entries from a row's
        # own start are counted by the plan
        lengths = np.diff(step.segment).astype(np.int64) if self.needs_computed else None
        if computed is not None:
            ends = computed[first : first + n].astype(np.int64) + lengths
            over = np.flatnonzero(ends > _plan.INT32_MAX)
            if over.size:
                i = first + int(over[0])
                raise ChunkMetaError(
                    f"num_computed_tokens_cpu[{i}]={int(computed[i])}: with its {int(lengths[over[0]])} new tokens "
                    f"the request passes {_plan.INT32_MAX} tokens (positions are int32)."
                )
        if checkpoints is not None:
            beyond = np.flatnonzero(checkpoints[first : first + n] > lengths)
            if beyond.size:
                i = first + int(beyond[0])
                raise ChunkMetaError(
                    f"checkpoint_offsets_cpu[{i}]={int(checkpoints[i])}: more than request {i}'s "
                    f"{int(lengths[beyond[0]])} new tokens; a checkpoint lies within them (0 = none)."
                )
        if not isinstance(padded, bool):
            raise ChunkMetaError(f"padded={padded!r}: must be a bool.")
        counts = self._counts(host, address, step, batch, lengths, computed, checkpoints)
        # validated: from here on nothing fails on bad input
        rows = self.layout.rows_pad if padded else counts
        slot, generation = self.ring.claim()
        self._launch(
            query_start_loc, computed_dev, checkpoints_dev, slot, step, batch or step, num_requests, rows, padded
        )
        result = self._results(slot, generation, step, batch, lengths, computed, checkpoints, counts, padded)
        self.ring.publish(slot, generation)
        return result

    # -- plan --------------------------------------------------------------------------------

    def _plan_slice(self, host, first_seq, num_seqs, address) -> _plan.StepPlan:
        # the checks and sizes of a slice (chunk size 16: the smallest; FLA tables recount)
        capacity = _plan.Capacity(self.capacity.seqs, self.capacity.tokens, _plan.INT32_MAX)
        return _plan.plan_step(host, first_seq, num_seqs, 16, capacity, address)

    def _row_input(self, name, device_tensor, host_values, num_requests):
        if host_values is None or device_tensor is None:
            wanted = [n for n, s in self.specs.items() if s.needs_computed or getattr(s, "checkpoints", False)]
            raise ChunkMetaError(
                f"{name} and {name}_cpu are required: tables {wanted} cut chunks on each request's position; pass "
                "the device tensor and its host copy (one entry per request)."
            )
        values = _plan.row_values(f"{name}_cpu", host_values, num_requests)
        _plan.check_row_tensor(name, device_tensor, num_requests, self.device)
        return values, device_tensor

    def _counts(self, host, address, step, batch, lengths, computed, checkpoints) -> tuple[int, ...]:
        """Rows of every kernel entry in the exact layout, from host data. Chunks cut from each
        sequence's own start (FLA, conv) are counted by the plan (its compiled pass on large
        batches); chunks cut on positions by numpy."""
        counts = []
        capacity = _plan.Capacity(self.capacity.seqs, self.capacity.tokens, _plan.INT32_MAX)
        for name, entry in zip(self.layout.owners, self.layout.entries, strict=True):
            plan = batch if entry.slice == 1 else step
            if entry.kind == 5:
                counts.append(plan.num_tokens)
                continue
            if entry.base == 0:
                counted = _plan.plan_step(host, plan.first_seq, plan.num_seqs, 1 << entry.shift, capacity, address)
                counts.append(counted.num_chunks)
                continue
            first, n = plan.first_seq, plan.num_seqs
            if entry.base == 1:
                positions = (plan.segment[:-1] - plan.segment[0]).astype(np.int64)
            else:
                positions = computed[first : first + n].astype(np.int64)
            chunks = _plan.segment_counts(positions, lengths, entry.shift)
            if entry.kind == 3 and self.specs[name].checkpoints:
                k = checkpoints[first : first + n].astype(np.int64)
                split = _plan.segment_counts(positions, k, entry.shift) + _plan.segment_counts(
                    positions + k, lengths - k, entry.shift
                )
                chunks = np.where(k > 0, split, chunks)
            counts.append(int(chunks.sum()))
        return tuple(counts)

    # -- launch, results -------------------------------------------------------------------------

    def _launch(self, query_start_loc, computed, checkpoints, slot, step, batch, num_requests, rows, padded) -> None:
        if self.backend == "torch":
            for entry, num_rows in zip(self.layout.entries, rows, strict=True):
                first, n = (step.first_seq, step.num_seqs) if entry.slice == 0 else (0, num_requests)
                regions = tuple(
                    self.ring.region(slot, off) if off or i == 0 else None
                    for i, off in enumerate((entry.off0, entry.off1, entry.off2, entry.off3))
                )
                fill_entry_torch(entry, query_start_loc, computed, checkpoints, regions, first, n, num_rows, padded)
            return
        fill = self._fills.get(padded)
        if fill is None:
            from chunkmeta.fill.step_fill import StepFill  # imports triton

            fill = self._fills[padded] = StepFill(
                entries=self.layout.entries, block_seqs=self.capacity.seqs, padded=padded
            )
        ints = (step.first_seq, step.num_seqs, num_requests, *rows, *([0] * (_MAX_ENTRIES - len(rows))))
        dtypes = (query_start_loc.dtype, computed.dtype, checkpoints.dtype)
        pointers = (query_start_loc.data_ptr(), computed.data_ptr(), checkpoints.data_ptr(), self.ring.pointer(slot))
        if not fill.launch(dtypes, pointers, ints):
            fill(query_start_loc, computed, checkpoints, self.ring.arena[slot], ints)

    def _host_cu_seqlens(self, name: str, slot: int, count: int) -> torch.Tensor:
        """A new object per build (FLA memoizes by identity: see ``chunkmeta.ring.Ring.views``)
        of the cached host view."""
        key = (name, slot, count)
        view = self._cu_cpu_views.get(key)
        if view is None:
            if len(self._cu_cpu_views) >= 16384:
                self._cu_cpu_views.clear()
            view = self._cu_cpu_views[key] = self._cu_cpu[name][slot, :count]
        return view.detach()

    def _results(self, slot, generation, step, batch, lengths, computed, checkpoints, counts, padded) -> StepTables:
        ring = self.ring
        out = {}
        entry_counts = dict(zip(range(len(counts)), counts, strict=True))
        index = 0
        for name, spec in self.specs.items():
            regions = self.layout.regions[name]
            if isinstance(spec, _tables.Fla):
                plan = batch if spec.rows == "batch" else step
                nt = counts[index]
                shape = (
                    _layout.padded(self.pad, self.capacity.seqs, self.layout.rows_pad[index])
                    if padded
                    else _layout.exact(plan.num_seqs, nt)
                )
                cu_cpu = self._host_cu_seqlens(name, slot, shape.seqs_out + 1)
                _plan.write_host_cu_seqlens(plan, self._cu_cpu_np[name][slot, : shape.seqs_out + 1])
                out[name] = ChunkMetadata(
                    ring.view(slot, regions["cu_seqlens"].offset, shape.seqs_out + 1).detach(),
                    cu_cpu,
                    ring.view(slot, regions["chunk_indices"].offset, shape.rows_out, pairs=True),
                    ring.view(slot, regions["chunk_offsets"].offset, shape.seqs_out + 1),
                    spec.chunk_size,
                    plan.num_seqs,
                    plan.num_tokens,
                    nt,
                    plan.max_seqlen,
                    self.pad if padded else None,
                    generation,
                    ring,
                    slot,
                )
                index += 1
            elif isinstance(spec, _tables.Conv):
                plan = batch if spec.rows == "batch" else step
                tot = entry_counts[index]
                rows = self.layout.rows_pad[index] if padded else tot
                if spec.paired:
                    pair = ring.view(slot, regions["block_table"].offset, rows, pairs=True)
                    out[name] = ConvBlocks(None, None, pair, tot, spec.block_m, plan.num_seqs)
                else:
                    out[name] = ConvBlocks(
                        ring.view(slot, regions["batch_ptr"].offset, rows),
                        ring.view(slot, regions["token_chunk_offset_ptr"].offset, rows),
                        None,
                        tot,
                        spec.block_m,
                        plan.num_seqs,
                    )
                index += 1
            elif isinstance(spec, _tables.Mamba2):
                n = step.num_seqs
                nchunks = entry_counts[index]
                rows = self.layout.rows_pad[index] if padded else nchunks
                seqs = self.capacity.seqs if padded else n
                first = step.first_seq
                has_checkpoint = checkpoints is not None and bool((checkpoints[first : first + n] > 0).any())
                out[name] = Mamba2Chunks(
                    ring.view(slot, regions["cu_chunk_seqlens"].offset, rows + 1),
                    ring.view(slot, regions["seq_idx"].offset, rows),
                    ring.view(slot, regions["last_chunk_indices"].offset, seqs),
                    ring.view(slot, regions["checkpoint_chunk_idx"].offset, seqs) if has_checkpoint else None,
                    spec.chunk_size,
                    nchunks,
                    n,
                    bool((computed[first : first + n] > 0).any()),
                )
                index += 1
            else:
                n = step.num_seqs
                tokens = self.layout.rows_pad[index] if padded else step.num_tokens
                logical = entry_counts[index + 1]
                rows = self.layout.rows_pad[index + 1] if padded else logical
                seqs = self.capacity.seqs if padded else n
                first = step.first_seq
                out[name] = SglangMamba2Chunks(
                    ring.view(slot, regions["seq_idx"].offset, tokens).view(1, tokens),
                    ring.view(slot, regions["chunk_indices"].offset, rows),
                    ring.view(slot, regions["chunk_offsets"].offset, rows),
                    ring.view(slot, regions["has_initial_states"].offset, seqs),
                    spec.chunk_size,
                    logical,
                    n,
                    step.num_tokens,
                    bool((computed[first : first + n] > 0).any()),
                )
                index += 2
        return StepTables(out, padded, generation, ring, slot)
