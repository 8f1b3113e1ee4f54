"""SGLang's Mamba2 extend metadata per forward: its own code against chunkmeta's, side by side (issue 20).

    .venv-sglang/bin/python bench/sglang_mamba2.py --out DIR [--rounds 20] [--device cpu|cuda]

Runs the real SGLang (its ``Mamba2AttnBackend`` and ``Mamba2Metadata``, imported from the installed
package; tests/integrations/sglang/sglang_cpu_stubs.py stands in for torchvision). Per workload
(N extend rows of the same length, at Nemotron-H's ``mamba_chunk_size`` 256; every row with a
cached prefix, or none), methods interleaved round by round:

* ``stock_init``        ``Mamba2AttnBackend.init_forward_metadata`` as released (base
                        ``_forward_metadata``, then ``Mamba2Metadata.prepare_mixed``);
* ``chunkmeta_init``    chunkmeta's subclass: the same base, then ``Mamba2ChunkMeta.prepare``;
* ``stock_prepare_mixed`` / ``chunkmeta_prepare``  the two table builders alone, on the same
                        base metadata;
* ``chunkmeta_init_host_side``  ``chunkmeta_init`` with the fill skipped: on CPU the device fill is
                        torch ops on the host, so this is chunkmeta's host side alone.

Host µs: the median of single calls (the first of each round's block left out). Syncs per call:
``sync_count.SyncCounter`` (tests/support), the reads of tensor data to the host that sync on CUDA
(on CPU nothing waits, so this counts the idioms); with ``--device cuda`` also the warnings of
``torch.cuda.set_sync_debug_mode("warn")``. Every chunkmeta metadata is checked against the stock
one (``exact``). Writes its record (``bench/results.py``: ``sglang_mamba2.runs.jsonl``) under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

from chunkmeta.timing import host_us, median

HERE = Path(__file__).resolve().parent
for extra in (HERE, HERE.parent / "tests" / "support", HERE.parent / "tests" / "integrations" / "sglang"):
    sys.path.insert(0, str(extra))

import results as runs  # noqa: E402

WORKLOADS = [(1, 2048), (8, 512), (64, 64), (256, 64), (1024, 64)]  # (rows, new tokens per row)
CHUNK = 256
CALLS = 5


def sync_count(fn, device) -> tuple[int, int | None]:
    from sync_count import SyncCounter

    with SyncCounter() as syncs:
        fn()
    if device.type != "cuda":
        return syncs.count, None
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return syncs.count, sum("synchroniz" in str(w.message) for w in caught)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    # SGLang's classes, the hand-made backend and ForwardBatch (it installs the torchvision stubs first)
    import test_sglang_mamba2_real as harness
    from chunkmeta.integrations import sglang as sg

    Mamba2Metadata = harness.Mamba2Metadata

    def on_device(batch):
        for name in ("input_ids", "req_pool_indices", "seq_lens", "out_cache_loc", "extend_seq_lens"):
            setattr(batch, name, getattr(batch, name).to(device))
        batch.extend_prefix_lens = batch.extend_prefix_lens.to(device)
        batch.extend_start_loc = batch.extend_start_loc.to(device)
        return batch

    stock = harness.mamba2_backend(harness.STOCK_MAMBA2, CHUNK)
    ours = harness.mamba2_backend(sg.chunkmeta_backend(harness.STOCK_MAMBA2, kind="mamba2"), CHUNK)
    stock.device = ours.device = device
    ours.chunkmeta = sg.mamba2.Mamba2ChunkMeta(device=device, max_num_seqs=1024, max_num_tokens=1 << 17)
    # On CPU the "device" fill is torch ops on the host; chunkmeta's host side alone (checks, sizes,
    # the C build) is measured on a twin whose fill is skipped (on CUDA: one asynchronous launch).
    host_side = harness.mamba2_backend(sg.chunkmeta_backend(harness.STOCK_MAMBA2, kind="mamba2"), CHUNK)
    host_side.device = device
    host_side.chunkmeta = sg.mamba2.Mamba2ChunkMeta(device=device, max_num_seqs=1024, max_num_tokens=1 << 17)
    host_side.chunkmeta._builder(CHUNK)._launch = lambda *args: None
    rows = []
    for n, length in WORKLOADS:
        for cached in (True, False):
            prefix = [37 + 64 * (i % 5) if cached else 0 for i in range(n)]  # prefixes off the chunk grid
            batch = on_device(harness.forward_batch([length] * n, prefix))
            base = stock._forward_metadata(batch)
            methods = {
                "stock_init": lambda: stock.init_forward_metadata(batch),
                "chunkmeta_init": lambda: ours.init_forward_metadata(batch),
                "stock_prepare_mixed": lambda: Mamba2Metadata.prepare_mixed(base, CHUNK, batch),
                "chunkmeta_prepare": lambda: ours.chunkmeta.prepare(Mamba2Metadata, base, CHUNK, batch),
                "chunkmeta_init_host_side": lambda: host_side.init_forward_metadata(batch),
            }
            for fn in methods.values():  # first builds compile and check
                fn()
            ours.init_forward_metadata(batch)
            stock.init_forward_metadata(batch)
            try:
                harness.assert_same(ours.forward_metadata, stock.forward_metadata)
                exact = True
            except AssertionError:
                exact = False
            samples = {name: [] for name in methods}
            rounds = args.rounds if n <= 256 else max(3, args.rounds // 4)
            for _ in range(rounds):
                for name, fn in methods.items():
                    samples[name].extend([host_us(fn) for _ in range(CALLS)][1:])
            figures = {}
            for name, fn in methods.items():
                syncs, cuda_syncs = sync_count(fn, device)
                figures[name] = {"host_us": median(samples[name]), "syncs": syncs}
                if cuda_syncs is not None:
                    figures[name]["cuda_sync_warnings"] = cuda_syncs
            row = {"rows": n, "tokens_per_row": length, "cached_prefix": cached, "exact": exact, "methods": figures}
            row["ratio_init"] = figures["stock_init"]["host_us"] / figures["chunkmeta_init"]["host_us"]
            row["ratio_prepare"] = figures["stock_prepare_mixed"]["host_us"] / figures["chunkmeta_prepare"]["host_us"]
            host_side_us = figures["chunkmeta_init_host_side"]["host_us"]
            row["ratio_init_host_side"] = figures["stock_init"]["host_us"] / host_side_us
            rows.append(row)
            line = ", ".join(f"{k} {v['host_us']:.1f} us / {v['syncs']} syncs" for k, v in figures.items())
            print(
                f"[{n} rows x {length}, prefix={cached}] exact={exact}: {line}; init {row['ratio_init']:.1f}x, "
                f"host side {row['ratio_init_host_side']:.1f}x"
            )
    figures = {"rounds": args.rounds, "chunk_size": CHUNK, "device": str(device), "rows": rows}
    runs.save("sglang_mamba2", figures, script="bench/sglang_mamba2.py", argv=argv, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
