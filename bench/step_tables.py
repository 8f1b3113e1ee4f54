"""A whole hybrid step's tables: chunkmeta's one launch against the engines' own functions (issue 18).

    python bench/step_tables.py --out DIR [--rounds 30]

Per workload (decodes + prefills, tokens; each request has a cached prefix) and method, methods
interleaved round by round (``measure``): host µs with the queue idle (calls back to back, as
``../shared/ANCHORS.md`` measures its anchors), cold (a round's first call, after the other
methods ran) and busy (a call behind ~1 ms of queued GPU work: a sync shows as waiting), and
device µs per call (``chunkmeta.timing.device_us_per_call``) for the methods that do not sync.

chunkmeta (one ``StepTablesBuilder.build``, one launch each):

* ``chunkmeta_kda_gdn``  FLA tables of the prefill slice and of the whole batch + conv1d blocks
                         (what a Kimi-Linear / Qwen3-Next step's layers read), with fresh
                         ``cu_seqlens`` objects for FLA's kernels;
* ``chunkmeta_kda_gdn_vllm``  the same tables as the vLLM adapter asks for them: no fresh
                         ``cu_seqlens`` (vLLM's layers get vLLM's own; ``tables.Fla``);
* ``chunkmeta_mamba2``   vLLM's Mamba2 SSD chunks + conv1d blocks of the prefill rows;
* ``chunkmeta_hybrid``   both in one build (five tables: a hybrid with KDA/GDN and Mamba2 layers,
                         the demo's ``all``, ``chunkmeta.replay.table_set``);
* ``chunkmeta_kda_gdn_new_batch`` / ``chunkmeta_mamba2_new_batch``  the same builds on a new
                         batch of the workload's shape every call (other prompt lengths and
                         cached prefixes, never repeated), as an engine's steps come: a table
                         whose row count is new makes its view (the others repeat the same batch,
                         whose views are cached);
* ``chunkmeta_oneshot``  ``build_chunk_metadata`` (fresh tensors, the FLA prefill tables).

The engines' own functions, called from their packages where they import:

* ``fla_host``      FLA's helpers on the host copy, then the copy to the device;
* ``vllm_gdn_fla``  vLLM's ``GDNAttentionMetadataBuilder._build_chunk_metadata`` (triton prefill backend);
* ``vllm_fla_batch``  vLLM's vendored ``prepare_chunk_indices`` + ``prepare_chunk_offsets``
                    (``vllm/third_party/flash_linear_attention/ops/index.py``) on the whole batch's
                    ``query_start_loc``: what Kimi-Linear's first KDA layer derives, as its layers
                    pass ``cu_seqlens=non_spec_query_start_loc`` and no tables (a ``.tolist()``
                    sync; a fresh tensor per call, as every step has, past the identity cache);
* ``vllm_conv1d``   vLLM's ``compute_causal_conv1d_metadata`` on the rows the conv kernel gets;
* ``vllm_mamba2``   vLLM's ``_compute_chunk_metadata`` and the three ``async_tensor_h2d`` of
                    ``_build_chunk_metadata_tensors``;
* ``rocm_style`` / ``floor``  the one-shot's comparisons (``bench/anchors.py``).

Engine steps are sums of the medians of their parts (``vllm_kda_gdn`` = ``vllm_gdn_fla`` +
``vllm_fla_batch`` + ``vllm_conv1d`` of the batch rows: the three tables ``chunkmeta_kda_gdn``
builds, the record's ``kda_gdn_step_parts``; records before it summed the first and the last
only; ``vllm_mamba2_step`` = ``vllm_mamba2`` + ``vllm_conv1d`` of the
prefill rows; the hybrid step both); the ratios printed are engine / chunkmeta host time, idle
and cold (the KDA-GDN step against both chunkmeta KDA-GDN builds). Every chunkmeta build's
tables are checked against ``chunkmeta.reference`` (``chunkmeta.replay.expected``: values,
dtypes, host ints). Writes its record
(``bench/results.py``: ``step_tables.runs.jsonl``) under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import anchors
import results as runs

from chunkmeta import StepTablesBuilder, build_chunk_metadata, replay
from chunkmeta import tables as T
from chunkmeta.replay import expected
from chunkmeta.timing import busy_queue, device_us_per_call, host_us, median, percentile
from chunkmeta.workloads import Batch, split_tokens

# (decodes, prefills, prefill tokens): the seed's 4096-token chunks at 8-64 requests, and larger
# the step builders' capacity (sequences, tokens): the largest workload's, with a token a sequence to spare
CAPACITY = (1024, 65536 + 1024)
WORKLOADS = [(0, 1, 4096), (4, 4, 4096), (32, 32, 16384), (64, 64, 32768), (512, 512, 65536), (0, 1024, 65536)]
MAMBA_CHUNK = 256
# vLLM's functions for the tables chunkmeta_kda_gdn builds: FLA prefill, FLA batch, conv1d; and
# for chunkmeta_mamba2's: SSD chunks, conv1d of the prefill rows
KDA_GDN_STEP_PARTS = ("vllm_gdn_fla", "vllm_fla_batch", "vllm_conv1d_batch")
MAMBA2_STEP_PARTS = ("vllm_mamba2", "vllm_conv1d_prefill")
# the methods that do not sync: their device time is measured too
DEVICE_TIMED = (
    "chunkmeta_kda_gdn",
    "chunkmeta_kda_gdn_vllm",
    "chunkmeta_mamba2",
    "chunkmeta_hybrid",
    "chunkmeta_oneshot",
    "rocm_style",
    "floor",
)


def engine_methods():
    """vLLM's own functions, or the reason they do not import here."""
    try:
        import importlib.util

        # a .py-only vLLM carried to a GPU machine needs its bootstrap first (it stands in for
        # the compiled module vLLM's CUDA platform imports); an installed vLLM needs nothing
        if importlib.util.find_spec("vllm_bootstrap") is not None:
            import vllm_bootstrap  # noqa: F401
        from types import SimpleNamespace

        from vllm.third_party.flash_linear_attention.ops.index import prepare_chunk_indices, prepare_chunk_offsets
        from vllm.utils.torch_utils import async_tensor_h2d
        from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
        from vllm.v1.attention.backends.mamba_attn import BaseMambaAttentionMetadataBuilder
        from vllm.v1.attention.backends.utils import compute_causal_conv1d_metadata
    except Exception as exc:  # noqa: BLE001 - any import failure means: not measured here
        return None, f"{type(exc).__name__}: {exc}"

    gdn_self = SimpleNamespace(gdn_prefill_backend="triton")  # the attribute the method reads

    def gdn_fla(qsl, qsl_cpu):
        return GDNAttentionMetadataBuilder._build_chunk_metadata(gdn_self, qsl, qsl_cpu, torch.device("cuda"))

    def fla_batch(qsl):
        return prepare_chunk_indices(qsl, 64), prepare_chunk_offsets(qsl, 64)

    def conv1d(qsl_cpu):
        return compute_causal_conv1d_metadata(qsl_cpu, device=torch.device("cuda"))

    def mamba2(num_prefills, computed_cpu, qsl_cpu):
        cu, seq_idx, last, _ = BaseMambaAttentionMetadataBuilder._compute_chunk_metadata(
            MAMBA_CHUNK, num_prefills, computed_cpu, qsl_cpu
        )
        device = torch.device("cuda")
        return (
            async_tensor_h2d(cu, dtype=torch.int32, device=device),
            async_tensor_h2d(seq_idx, dtype=torch.int32, device=device),
            async_tensor_h2d(last, dtype=torch.int32, device=device),
        )

    return {"gdn_fla": gdn_fla, "fla_batch": fla_batch, "conv1d": conv1d, "mamba2": mamba2}, None


def table_sets(replay_module, tables_module) -> dict:
    """The table sets of the chunkmeta methods (``chunkmeta_<name>``), from a chunkmeta tree's
    ``replay`` and ``tables`` modules (bench/diagnostics/ab_host.py passes an old tree's)."""
    kda = replay_module.kda_tables(64)
    ssd = replay_module.mamba2_tables(MAMBA_CHUNK)
    vllm_tables = {  # as the vLLM adapter asks for them: no fresh cu_seqlens
        "fla": tables_module.Fla(64, fresh_cu_seqlens=False),
        "fla_batch": tables_module.Fla(64, rows="batch", fresh_cu_seqlens=False),
        "conv": tables_module.Conv(),
    }
    return {"kda_gdn": kda, "kda_gdn_vllm": vllm_tables, "mamba2": ssd, "hybrid": {**kda, **ssd}}


def make_case(decodes, prefills, tokens, seed):
    rng = np.random.default_rng(seed)
    lengths = [1] * decodes + [int(n) for n in split_tokens(rng, prefills, tokens)]
    qsl_cpu = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
    computed_cpu = torch.tensor(
        [int(rng.integers(1, 8192)) if i >= decodes else int(rng.integers(1, 4096)) for i in range(len(lengths))],
        dtype=torch.int32,
    )
    return qsl_cpu, computed_cpu


def is_exact(builders, case, decodes) -> bool:
    """Whether every table each builder makes of one batch (``case``: ``qsl_cpu, qsl,
    computed_cpu, computed``; the prefill slice after ``decodes``) equals the reference's."""
    qsl_cpu, qsl, computed_cpu, computed = case
    qsl_list = qsl_cpu.tolist()
    batch = Batch(qsl_list, decodes, len(qsl_list) - 1 - decodes, computed_cpu.tolist())
    exact = True
    positions = dict(num_computed_tokens=computed, num_computed_tokens_cpu=computed_cpu)
    for builder in builders:
        rows = positions if builder.needs_computed else {}
        tables = builder.build(qsl, qsl_cpu, first_seq=decodes, **rows)
        checks = expected(builder.specs, batch, 64).checks
        exact &= all(matches(tables[name]) for name, matches in checks.items())
    return exact


def measure(methods: dict, rounds: int, calls: int) -> dict:
    """Per method: host µs p50 with the queue idle (``calls`` calls back to back, as
    ``../shared/ANCHORS.md`` defines it; the first of each block left out), cold (that first
    call, right after the other methods ran: caches hold their code and data, as in an engine
    step), and busy (one call behind ~1 ms of queued GPU work). Methods interleaved round by round,
    in a new (seeded) random order each round: a method that shares code with the one before it
    (two chunkmeta builds) makes its "cold" call warm, and a fixed or rotated order keeps the same
    neighbours every round."""
    idle = {name: [] for name in methods}
    cold = {name: [] for name in methods}
    busy = {name: [] for name in methods}
    names = list(methods)
    shuffle = np.random.default_rng(0)
    for _ in range(rounds):
        order = [names[k] for k in shuffle.permutation(len(names))]
        for name in order:
            samples = [host_us(methods[name]) for _ in range(calls)]
            cold[name].append(samples[0])
            idle[name].extend(samples[1:])
        for name in order:
            busy_queue(1000.0)
            busy[name].append(host_us(methods[name]))
            torch.cuda.synchronize()
    return {
        name: {
            "host_idle_us": median(idle[name]),
            "host_idle_p99_us": percentile(idle[name], 99),
            "host_cold_us": median(cold[name]),
            "host_busy_us": median(busy[name]),
        }
        for name in methods
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=20, help="back-to-back calls per method per round")
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    engine, engine_error = engine_methods()
    print("vLLM's own functions:", "imported" if engine else f"not importable here ({engine_error}); not measured")
    sets = table_sets(replay, T)
    # the new-batch methods have builders of their own: their views fill their own caches
    kda_gdn, kda_gdn_vllm, mamba2, hybrid, kda_gdn_new, mamba2_new = (
        StepTablesBuilder(*CAPACITY, tables=sets[name], device="cuda")
        for name in ("kda_gdn", "kda_gdn_vllm", "mamba2", "hybrid", "kda_gdn", "mamba2")
    )
    rows = []
    # each new-batch method's calls: every measured one, its warm-up, and spares
    new_batches = args.rounds * (args.calls + 1) + 8
    for decodes, prefills, tokens in WORKLOADS:
        qsl_cpu, computed_cpu = make_case(decodes, prefills, tokens, seed=decodes + prefills)
        qsl, computed = qsl_cpu.cuda(), computed_cpu.cuda()
        cases = [make_case(decodes, prefills, tokens, seed=1000 + k) for k in range(new_batches)]
        on_device = [(q, q.cuda(), c, c.cuda()) for q, c in cases]
        kda_batches, mamba2_batches = iter(on_device), iter(on_device)

        def kda_gdn_new_batch():
            q_cpu, q, _, _ = next(kda_batches)
            return kda_gdn_new.build(q, q_cpu, first_seq=decodes)

        def mamba2_new_batch():
            q_cpu, q, c_cpu, c = next(mamba2_batches)
            return mamba2_new.build(q, q_cpu, first_seq=decodes, num_computed_tokens=c, num_computed_tokens_cpu=c_cpu)

        prefill_cpu = (qsl_cpu[decodes:] - qsl_cpu[decodes]).contiguous()
        prefill = prefill_cpu.cuda()
        fla_host, rocm_style, floor = anchors.fla_host(64), anchors.rocm_style(64), anchors.floor(64)
        methods = {
            "chunkmeta_kda_gdn": lambda: kda_gdn.build(qsl, qsl_cpu, first_seq=decodes),
            "chunkmeta_kda_gdn_vllm": lambda: kda_gdn_vllm.build(qsl, qsl_cpu, first_seq=decodes),
            "chunkmeta_mamba2": lambda: mamba2.build(
                qsl, qsl_cpu, first_seq=decodes, num_computed_tokens=computed, num_computed_tokens_cpu=computed_cpu
            ),
            "chunkmeta_hybrid": lambda: hybrid.build(
                qsl, qsl_cpu, first_seq=decodes, num_computed_tokens=computed, num_computed_tokens_cpu=computed_cpu
            ),
            "chunkmeta_kda_gdn_new_batch": kda_gdn_new_batch,
            "chunkmeta_mamba2_new_batch": mamba2_new_batch,
            "chunkmeta_oneshot": lambda: build_chunk_metadata(prefill, prefill_cpu),
            "fla_host": lambda: fla_host(prefill.detach(), prefill_cpu),
            "rocm_style": lambda: rocm_style(prefill, prefill_cpu),
            "floor": lambda: floor(prefill, prefill_cpu),
        }
        if engine:
            computed_p = computed_cpu[decodes:].contiguous()
            methods["vllm_gdn_fla"] = lambda: engine["gdn_fla"](prefill.detach(), prefill_cpu)
            methods["vllm_fla_batch"] = lambda: engine["fla_batch"](qsl.detach())
            methods["vllm_conv1d_batch"] = lambda: engine["conv1d"](qsl_cpu)
            methods["vllm_conv1d_prefill"] = lambda: engine["conv1d"](prefill_cpu)
            methods["vllm_mamba2"] = lambda: engine["mamba2"](prefills, computed_p, prefill_cpu)
        for fn in methods.values():  # compile, warm caches
            fn()
        torch.cuda.synchronize()
        # exactness of what is timed (chunkmeta's tables against the reference): the repeated
        # batch before and after the timed calls (after: as they ran, every view from its memo),
        # and the new-batch builders on their last spare batch once they have run
        repeated = (kda_gdn, kda_gdn_vllm, mamba2, hybrid)
        exact = is_exact(repeated, (qsl_cpu, qsl, computed_cpu, computed), decodes)
        figures = measure(methods, args.rounds, args.calls)
        exact &= is_exact(repeated, (qsl_cpu, qsl, computed_cpu, computed), decodes)
        exact &= is_exact((kda_gdn_new, mamba2_new), on_device[-1], decodes)
        for name in DEVICE_TIMED:
            figures[name]["device_us"] = device_us_per_call(methods[name], calls=100, lead_us=100 * 120, repeats=3)
        row = {"decodes": decodes, "prefills": prefills, "tokens": tokens, "exact": exact, "methods": figures}
        if engine:
            for state in ("idle", "cold"):
                key = f"host_{state}_us"
                kda_step = sum(figures[part][key] for part in KDA_GDN_STEP_PARTS)
                ssd_step = sum(figures[part][key] for part in MAMBA2_STEP_PARTS)
                suffix = "" if state == "idle" else "_cold"
                row[f"vllm_kda_gdn_step{suffix}_us"] = kda_step
                row[f"vllm_mamba2_step{suffix}_us"] = ssd_step
                row[f"ratio_kda_gdn{suffix}"] = kda_step / figures["chunkmeta_kda_gdn"][key]
                row[f"ratio_kda_gdn_vllm{suffix}"] = kda_step / figures["chunkmeta_kda_gdn_vllm"][key]
                row[f"ratio_mamba2{suffix}"] = ssd_step / figures["chunkmeta_mamba2"][key]
                row[f"ratio_hybrid{suffix}"] = (kda_step + ssd_step) / figures["chunkmeta_hybrid"][key]
                row[f"ratio_kda_gdn_new_batch{suffix}"] = kda_step / figures["chunkmeta_kda_gdn_new_batch"][key]
                row[f"ratio_mamba2_new_batch{suffix}"] = ssd_step / figures["chunkmeta_mamba2_new_batch"][key]
        rows.append(row)
        line = ", ".join(
            f"{name} {m['host_idle_us']:.1f}/{m['host_cold_us']:.1f}/{m['host_busy_us']:.1f}"
            + (f" dev {m['device_us']:.2f}" if "device_us" in m else "")
            for name, m in figures.items()
        )
        print(f"[{decodes} decodes + {prefills} prefills, {tokens} tokens] exact={exact}: {line}")
        if engine:
            print(
                f"    vLLM step host µs idle (cold): kda/gdn {row['vllm_kda_gdn_step_us']:.1f} "
                f"({row['vllm_kda_gdn_step_cold_us']:.1f}), "
                f"{row['ratio_kda_gdn']:.1f}x ({row['ratio_kda_gdn_cold']:.1f}x) "
                f"chunkmeta; mamba2 {row['vllm_mamba2_step_us']:.1f} ({row['vllm_mamba2_step_cold_us']:.1f}), "
                f"{row['ratio_mamba2']:.1f}x ({row['ratio_mamba2_cold']:.1f}x) chunkmeta; hybrid "
                f"{row['ratio_hybrid']:.1f}x ({row['ratio_hybrid_cold']:.1f}x); a new batch every "
                f"call: {row['ratio_kda_gdn_new_batch']:.1f}x ({row['ratio_kda_gdn_new_batch_cold']:.1f}x), "
                f"{row['ratio_mamba2_new_batch']:.1f}x ({row['ratio_mamba2_new_batch_cold']:.1f}x)"
            )
    figures = {
        "rounds": args.rounds,
        "calls": args.calls,
        "engine_functions": engine is not None,
        "engine_error": engine_error,
        "kda_gdn_step_parts": list(KDA_GDN_STEP_PARTS),
    }
    figures["rows"] = rows
    runs.save("step_tables", figures, script="bench/step_tables.py", argv=argv, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
