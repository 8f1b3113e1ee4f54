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

from typing import NamedTuple

import numpy as np
import torch

from chunkmeta import layout as _layout
from chunkmeta import native
from chunkmeta import plan as _plan
from chunkmeta import results as _results
from chunkmeta import tables as _tables
from chunkmeta.errors import ChunkMetaError
from chunkmeta.fill import resolve_backend, resolve_device
from chunkmeta.fill.torch_fill import fill_entry_torch
from chunkmeta.metadata import StepTables
from chunkmeta.ring import SPOILED, TableRing

_MAX_ENTRIES = 6  # chunkmeta.fill.step_fill.MAX_ENTRIES (not imported: it imports triton)
_INT_DTYPES = (torch.int32, torch.int64)
_CUDA_STEP_FILL_FIRST_UP_TO = 4096  # sequences: see _make_steps


class StepTablesBuilder:
    """Builds one step's ``StepTables`` into persistent buffers, with no host<->device sync.

    ``tables``: ``{name: spec}`` (``chunkmeta.tables.Fla``, ``Conv``, ``Mamba2``,
    ``SglangMamba2``), at most six kernel entries (``SglangMamba2`` counts two). ``pad``: the FLA
    tables' padding in ``build(padded=True)`` (``chunkmeta.layout``). Results stay valid for
    ``ring_depth - 1`` later builds.

    ``single``: with one table, ``build`` returns that table's object itself (a ``ChunkMetadata``
    for ``Fla``: what ``ChunkMetadataBuilder`` hands out) rather than a ``StepTables`` holding it.
    ``share_ring_with``: a builder of the same tables, capacity, depth and device whose ring this
    one writes too: one ledger, so the ring rule counts both builders' builds (``ChunkMetadataBuilder``'s
    builders of each padding share one).
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
        single: bool = False,
        share_ring_with: StepTablesBuilder | None = None,
    ):
        self.specs = _tables.check_specs(tables)
        if type(single) is not bool or (single and len(self.specs) != 1):
            raise ChunkMetaError(
                f"single={single!r}: True only for a builder of one table (tables={tuple(self.specs)})."
            )
        self.single = single
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
        fla_names = [name for name, spec in self.specs.items() if isinstance(spec, _tables.Fla)]
        if share_ring_with is None:  # with a host copy of each FLA table's cu_seqlens per slot
            self.ring = TableRing(
                ring_depth, self.layout.regions, self.layout.slot_bytes, self.device, fla_names, max_num_seqs + 2
            )
        else:
            self.ring = self._shared_ring(share_ring_with, ring_depth)
        self._bounded_entries = _tables.bounded_entries(self.layout.entries)
        self.needs_computed = any(spec.needs_computed for spec in self.specs.values())
        self.needs_checkpoints = any(getattr(spec, "checkpoints", False) for spec in self.specs.values())
        self.needs_batch = any(spec.rows == "batch" for spec in self.specs.values())
        self._dummy = torch.zeros(1, dtype=torch.int32, device=self.device)  # for unread pointer arguments
        self._fills: dict[tuple, object] = {}  # (padded, bounded) -> StepFill
        self._device_index = self.device.index if self.device.type == "cuda" else -1
        self._native = native.module()
        # (padded, input dtypes) -> (steps capsule, the kernel it launches or None), or False: no C build
        self._steps: dict[tuple, object] = {}
        self._fla_seqs_pad = _layout.padded_num_seqs(pad, max_num_seqs)
        # what build() returns: the one table's class (single), or StepTables
        one = _results.step_recipe(self.specs, self.layout, False, 0, pad, 0, single=True)[1][0] if single else None
        self._result_type = one or StepTables
        self._results = self._make_results()
        # a slice's plan: the builder's sequences and tokens, rows unbounded (each entry has its own)
        self._slice_capacity = _plan.Capacity(self.capacity.seqs, self.capacity.tokens, _plan.INT32_MAX)
        # each entry's region offsets in the torch fill's order (off0 .. off3), None where unused
        self._entry_regions = [
            tuple(None if off == _tables.UNUSED else off for off in (e.off0, e.off1, e.off2, e.off3))
            for e in self.layout.entries
        ]
        # per padded (exact, padded), the C build's steps capsule per device dtype combination
        self._c_steps = [(None,) * 8, (None,) * 8]
        self._wants = int(self.needs_computed) | int(self.needs_checkpoints) << 1
        # the C build checks device tensors as the CPU's or a CUDA device's: builders on any other
        # device take the general path, which compares devices
        c_build = self._native is not None and self.device.type in ("cpu", "cuda")
        self._c_step = self._make_c_step(self._c_steps) if c_build else None

    def _shared_ring(self, other: StepTablesBuilder, depth: int) -> TableRing:
        if (
            not isinstance(other, StepTablesBuilder)
            or other.layout.regions != self.layout.regions
            or other.ring.depth != depth
            or other.device != self.device
        ):
            raise ChunkMetaError(
                "share_ring_with: a StepTablesBuilder of the same tables, capacity, ring_depth and device."
            )
        return other.ring

    def _make_c_step(self, steps_tables: list):
        """``native.step``'s state: what it reads of this builder (``steps_tables``, its results
        executors: the objects themselves, so later changes to them count)."""
        cuda = self._device_index >= 0
        return self._native.make_step(
            steps_tables,
            self._results,
            self.ring,
            SPOILED,
            self._wants,
            self._dummy.data_ptr(),
            self._device_index,
            torch._C._cuda_getDevice if cuda else None,
            torch._C._cuda_getCurrentRawStream if cuda else None,
        )

    @property
    def builds(self) -> int:
        return self.ring.generation

    @property
    def c_build(self) -> dict[tuple, str | None]:
        """What the C build does per ``(padded, input dtypes)`` after that layout's first build:
        ``"cuda"`` / ``"triton"`` (the host side and the launch of that kernel, one C call),
        ``"c"`` (a CPU builder: the host side and the fill, in C), ``"host"`` (the host side; the
        fill launches from Python), or None (the general path)."""
        return {key: ((made[1] or "host") if made else None) for key, made in self._steps.items()}

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
        if self._c_step is not None:
            made = self._native.step(
                self._c_step,
                query_start_loc,
                query_start_loc_cpu,
                first_seq,
                num_seqs,
                num_computed_tokens,
                num_computed_tokens_cpu,
                checkpoint_offsets,
                checkpoint_offsets_cpu,
                padded,
            )
            if type(made) is self._result_type:
                return made
            made = self._after_c_step(made, query_start_loc, num_computed_tokens, checkpoint_offsets, padded)
            if made is not None:
                return made
        host = _plan.host_array(query_start_loc_cpu)
        _plan.check_device_tensor(query_start_loc, host.shape[0], self.device)
        num_requests = host.shape[0] - 1
        computed_dev = checkpoints_dev = self._dummy
        if self.needs_computed:
            self._require("num_computed_tokens", num_computed_tokens, num_computed_tokens_cpu)
            computed_dev = num_computed_tokens
        if self.needs_checkpoints:
            self._require("checkpoint_offsets", checkpoint_offsets, checkpoint_offsets_cpu)
            checkpoints_dev = checkpoint_offsets
        facts, counts, step, batch = self.plan_host(
            host, first_seq, num_seqs, num_computed_tokens_cpu, checkpoint_offsets_cpu
        )
        if self.needs_computed:
            _plan.check_row_tensor("num_computed_tokens", computed_dev, num_requests, self.device)
        if self.needs_checkpoints:
            _plan.check_row_tensor("checkpoint_offsets", checkpoints_dev, num_requests, self.device)
        if not isinstance(padded, bool):
            raise ChunkMetaError(f"padded={padded!r}: must be a bool.")
        # validated: from here on nothing fails on bad input
        rows = self.layout.rows_pad if padded else counts
        slot, generation = self.ring.claim()
        with self.ring.writing(slot):  # a fill, or results, that raise leave the slot's tables dead
            self._fill_slot(query_start_loc, computed_dev, checkpoints_dev, slot, facts, rows, padded)
            host_cu = {name: host[slot] for name, host in self.ring.host_np.items()}
            self.write_host_cu_seqlens(host_cu, step, batch, padded)
            result = self._results[padded](slot, generation, counts, facts)
        self.ring.publish(slot, generation)
        key = self._key(padded, query_start_loc, computed_dev, checkpoints_dev)
        if key not in self._steps:
            self._make_steps(key)
        return result

    # -- the C build ---------------------------------------------------------------------------

    def _after_c_step(self, out, qsl, computed, checkpoints, padded):
        """What ``native.step`` (the C build: the input tensors' checks, every table's checks and
        counts, host copies, the launch, the results, the publish) left to do: an int, nothing
        written (a CUresult turns that layout's C build off; the general path then raises the
        precise error, or builds) -> None; ``(slot, generation, counts, facts)``, the host side
        done but no kernel in C -> the fill launched from here, then the results and the publish."""
        if type(out) is int:
            if out > 0:  # a CUresult: this layout's C launch is off from now on
                self._set_steps(self._key(padded, qsl, computed, checkpoints), False)
            return None
        slot, generation, counts, facts = out
        rows = self.layout.rows_pad if padded else counts
        computed_dev = computed if self.needs_computed else self._dummy
        checkpoints_dev = checkpoints if self.needs_checkpoints else self._dummy
        with self.ring.writing(slot):  # as in build's general path
            self._fill_slot(qsl, computed_dev, checkpoints_dev, slot, StepFacts(*facts), rows, padded)
            result = self._results[padded](slot, generation, counts, facts)
        self.ring.publish(slot, generation)
        return result

    def _key(self, padded, qsl, computed, checkpoints) -> tuple:
        """A C build's key: the layout and the input dtypes its kernel is compiled for."""
        return (
            padded,
            qsl.dtype,
            computed.dtype if self.needs_computed else self._dummy.dtype,
            checkpoints.dtype if self.needs_checkpoints else self._dummy.dtype,
        )

    def _set_steps(self, key, made) -> None:
        """Record a key's C build (``(capsule, kernel name or None)``, or False: none), and put
        its capsule where ``native.step`` looks: by the device dtypes, int64 as bits."""
        self._steps[key] = made
        padded, *dtypes = key
        index = sum(1 << bit for bit, dtype in enumerate(dtypes) if dtype is torch.int64)
        table = list(self._c_steps[padded])
        table[index] = made[0] if made else None
        self._c_steps[padded] = tuple(table)

    def _make_steps(self, key) -> None:
        """The C build's constants for a layout and input dtypes, after its first build (which
        compiled the kernel): launching the kernel itself where the driver and the kernel allow,
        else the host side only (the fill then launches from Python)."""
        if self._native is None:
            self._set_steps(key, False)
            return
        padded = key[0]
        # the kernels it may launch, best first. On the H200 the CUDA C step fill (two-level row
        # search) took less device time than the Triton kernel at 256 and 1024 sequences in 18
        # of 20 workloads (up to 0.44 us less; 0.03 and 0.04 more at one request with capacity
        # 256 and for all five tables at 1024 x 64k: bench/results/step_fill_sweep-2026-12-02.json)
        # and at 4096 in all 16 (0.36-1.51 us less: step_fill_sweep-2026-12-02-4096.json), so it
        # goes first up to 4096 sequences; above, unswept, the Triton kernel.
        candidates = []
        fill = self._fills.get((padded, False))
        if fill is not None and self.device.type == "cuda" and native.cuda_launcher() is not None:
            from chunkmeta.fill.cuda_fill import CudaStepFill

            cuda = CudaStepFill(
                entries=self.layout.entries,
                block_seqs=self.capacity.seqs,
                padded=padded,
                row_capacities=self.layout.rows_pad,
            )
            kernel = cuda.kernel(key[1:], self.device)
            if kernel is not None:
                candidates.append(("cuda", *kernel, cuda.block_rows))
            kernel = fill.plain_kernel(key[1:])
            if kernel is not None:
                candidates.append(("triton", *kernel, fill.block_rows))
            if self.capacity.seqs > _CUDA_STEP_FILL_FIRST_UP_TO:
                candidates.reverse()
        arenas = [self.ring.pointer(k) for k in range(self.ring.depth)]
        cu_hosts = self.ring.host_pointers()
        for name, function, num_warps, shared, block_rows in candidates:
            made = self.native_steps(function, block_rows, num_warps, shared, padded, arenas, cu_hosts)
            if made is not None:
                self._set_steps(key, (made, name))
                return
        # no kernel the C build packs: a CPU builder of the torch fill has the C build fill the tables
        # itself (serially, microseconds where the torch fill's ops take a millisecond), else the
        # host side only (the fill then launches from Python: Triton's interpreter stays the kernel
        # a CPU "triton" builder runs, which is how the CPU suite tests the kernel)
        cpu_fill = self.device.type == "cpu" and self.backend == "torch"
        made = self.native_steps(0, 1, 1, 0, padded, arenas, cu_hosts, cpu_fill=cpu_fill)
        self._set_steps(key, (made, "c" if cpu_fill else None) if made is not None else False)

    def native_steps(
        self,
        function: int,
        block_rows: int,
        num_warps: int,
        shared: int,
        padded: bool,
        arenas,
        cu_hosts,
        *,
        cpu_fill: bool = False,
    ):
        """``chunkmeta.native``'s ``make_steps`` for this builder's entries: the C build's constants
        for slots at ``arenas`` (an address per slot) whose FLA tables' host ``cu_seqlens`` are at
        ``cu_hosts[name]`` (an address per slot); ``function`` 0: no kernel, the host side only, or
        with ``cpu_fill`` the host side and the fill in C (CPU arenas). None where the kernel's
        parameters are not the layout it packs."""
        entries = [e.packed(rows) for e, rows in zip(self.layout.entries, self.layout.rows_pad, strict=True)]
        none = [0] * len(arenas)
        per_entry = [
            cu_hosts[name] if e.kind == _tables.FLA else none
            for name, e in zip(self.layout.owners, self.layout.entries, strict=True)
        ]
        cap = self.capacity
        return self._native.make_steps(
            function,
            block_rows,
            num_warps,
            shared,
            cap.seqs,
            cap.tokens,
            int(padded),
            entries,
            arenas,
            per_entry,
            int(cpu_fill),
        )

    # -- plan --------------------------------------------------------------------------------

    def plan_host(self, host: np.ndarray, first_seq, num_seqs, computed_cpu, checkpoints_cpu):
        """Every host check and size of a step: ``(StepFacts, rows per kernel entry, prefill
        StepPlan, batch StepPlan or None)``; raises ChunkMetaError naming the field. Host data only."""
        num_requests = host.shape[0] - 1
        address = _plan.host_address(host)
        step = self._plan_slice(host, first_seq, num_seqs, address)
        batch = self._plan_slice(host, 0, None, address) if self.needs_batch else None
        computed = checkpoints = None
        if self.needs_computed:
            if computed_cpu is None:
                self._require("num_computed_tokens", None, None)
            computed = _plan.row_values("num_computed_tokens_cpu", computed_cpu, num_requests)
        if self.needs_checkpoints:
            if checkpoints_cpu is None:
                self._require("checkpoint_offsets", None, None)
            checkpoints = _plan.row_values("checkpoint_offsets_cpu", checkpoints_cpu, num_requests)
        first, n = step.first_seq, step.num_seqs
        # per-row lengths only where positions matter (Mamba2's chunks); entries from a row's
        # own start are counted by the plan
        lengths = np.diff(step.segment).astype(np.int64) if self.needs_computed else None
        if computed is not None:
            # compared with what is left below int32, not summed: an int64 count near its max wraps
            over = np.flatnonzero(computed[first : first + n].astype(np.int64) > _plan.INT32_MAX - lengths)
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
        counts = self._counts(host, address, step, batch, lengths, computed, checkpoints)
        facts = StepFacts(
            first,
            n,
            step.num_tokens,
            step.max_seqlen,
            num_requests,
            batch.num_tokens if batch else 0,
            batch.max_seqlen if batch else 0,
            computed is not None and bool((computed[first : first + n] > 0).any()),
            checkpoints is not None and bool((checkpoints[first : first + n] > 0).any()),
        )
        return facts, counts, step, batch

    def write_host_cu_seqlens(self, targets: dict, step, batch, padded: bool) -> None:
        """The FLA tables' host ``cu_seqlens`` into ``targets[name]`` (int32 numpy, long enough)."""
        for name, spec in self.specs.items():
            if isinstance(spec, _tables.Fla):
                plan = batch if spec.rows == "batch" else step
                seqs_out = self._fla_seqs_pad if padded else plan.num_seqs
                _plan.write_host_cu_seqlens(plan, targets[name][: seqs_out + 1])

    def _require(self, name, device_tensor, host_values) -> None:
        if host_values is None or device_tensor is None:
            wanted = [n for n, s in self.specs.items() if s.needs_computed or getattr(s, "checkpoints", False)]
            raise ChunkMetaError(
                f"{name} and {name}_cpu are required: tables {wanted} cut chunks on each request's position; pass "
                "the device tensor and its host copy (one entry per request)."
            )

    def _plan_slice(self, host, first_seq, num_seqs, address) -> _plan.StepPlan:
        # the checks and sizes of a slice (chunk size 16: the smallest; FLA tables recount)
        return _plan.plan_step(host, first_seq, num_seqs, 16, self._slice_capacity, address)

    def _counts(self, host, address, step, batch, lengths, computed, checkpoints) -> tuple[int, ...]:
        """Rows of every kernel entry in the exact layout, from host data. Chunks cut from each
        sequence's own start (FLA, conv) are counted by the plan (its compiled pass on large
        batches); chunks cut on positions by numpy."""
        counts = []
        capacity = self._slice_capacity
        for name, entry in zip(self.layout.owners, self.layout.entries, strict=True):
            plan = batch if entry.slice == 1 else step
            if entry.kind == _tables.TOKENS:
                counts.append(plan.num_tokens)
                continue
            if entry.base == _tables.BASE_ZERO:
                counted = _plan.plan_step(host, plan.first_seq, plan.num_seqs, 1 << entry.shift, capacity, address)
                counts.append(counted.num_chunks)
                continue
            first, n = plan.first_seq, plan.num_seqs
            if entry.base == _tables.BASE_PACKED:
                positions = (plan.segment[:-1] - plan.segment[0]).astype(np.int64)
            else:
                positions = computed[first : first + n].astype(np.int64)
            chunks = _plan.segment_counts(positions, lengths, entry.shift)
            if entry.kind == _tables.MAMBA2 and self.specs[name].checkpoints:
                k = checkpoints[first : first + n].astype(np.int64)
                split = _plan.segment_counts(positions, k, entry.shift) + _plan.segment_counts(
                    positions + k, lengths - k, entry.shift
                )
                chunks = np.where(k > 0, split, chunks)
            counts.append(int(chunks.sum()))
        return tuple(counts)

    # -- launch, results -------------------------------------------------------------------------

    def fill_bounded(self, query_start_loc, num_seqs: int, rows: tuple[int, ...]) -> tuple[int, int]:
        """Claim a slot, fill it in the bounded layout (the padded one's rows, ``rows`` per entry,
        and the prefill slice's own ``num_seqs`` sequences; ``ChunkMetadataBuilder.build_bounded``)
        and publish it: ``(slot, generation)``. The caller has checked everything."""
        facts = StepFacts(0, num_seqs, 0, 0, 0, 0, 0, False, False)
        slot, generation = self.ring.claim()
        with self.ring.writing(slot):
            self._fill_slot(query_start_loc, self._dummy, self._dummy, slot, facts, rows, True, bounded=True)
        self.ring.publish(slot, generation)
        return slot, generation

    def _fill_slot(self, query_start_loc, computed, checkpoints, slot, facts, rows, padded, bounded=False) -> None:
        entries = self._bounded_entries if bounded else self.layout.entries
        if not (padded or any(rows) or facts.num_seqs or (self.needs_batch and facts.batch_seqs)):
            return  # nothing to write (an empty prefill of FLA tables): as the C build, no launch
        if self.backend == "torch":
            for entry, offsets, num_rows in zip(entries, self._entry_regions, rows, strict=True):
                first, n = (facts.first_seq, facts.num_seqs) if entry.slice == 0 else (0, facts.batch_seqs)
                regions = tuple(None if off is None else self.ring.region(slot, off) for off in offsets)
                fill_entry_torch(entry, query_start_loc, computed, checkpoints, regions, first, n, num_rows, padded)
            return
        fill = self._fills.get((padded, bounded))
        if fill is None:
            from chunkmeta.fill.step_fill import StepFill  # imports triton

            fill = self._fills[(padded, bounded)] = StepFill(
                entries=entries, block_seqs=self.capacity.seqs, padded=padded
            )
        ints = (facts.first_seq, facts.num_seqs, facts.batch_seqs, *rows, *([0] * (_MAX_ENTRIES - len(rows))))
        dtypes = (query_start_loc.dtype, computed.dtype, checkpoints.dtype)
        qsl = query_start_loc.data_ptr()
        pointers = (qsl, computed.data_ptr(), checkpoints.data_ptr(), self.ring.pointer(slot), qsl)
        if not fill.launch(dtypes, pointers, ints):
            fill(query_start_loc, computed, checkpoints, self.ring.arena[slot], ints)

    def results_maker(self, padded: bool, ring: TableRing, lease):
        """The executor of this builder's result recipe for ``padded``, over ``ring``'s views
        (graph mode passes its static ring, and itself as the lease), in C where the builder's
        C build is loaded."""
        recipe = _results.step_recipe(
            self.specs, self.layout, padded, self._fla_seqs_pad, self.pad, self.capacity.seqs, single=self.single
        )
        return _results.results_maker(recipe, ring, lease, self._native)

    def _make_results(self) -> dict:
        """padded -> (slot, generation, counts, facts) -> StepTables (``chunkmeta.results``)."""
        return {padded: self.results_maker(padded, self.ring, self.ring) for padded in (False, True)}


class StepFacts(NamedTuple):
    """Host facts of one step build, from the plan (Python or C)."""

    first_seq: int
    num_seqs: int
    num_tokens: int
    max_seqlen: int
    batch_seqs: int
    batch_tokens: int
    batch_max_seqlen: int
    prep_initial_states: bool
    any_checkpoint: bool
