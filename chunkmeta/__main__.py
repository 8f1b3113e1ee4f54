"""``python -m chunkmeta``: replay a scheduler trace, check every step's tables, print timings.

Every step goes through the scheduler hooks (``ChunkMetaService``) as an engine calls them.
``--tables`` picks what a step builds (``chunkmeta.replay``): ``all`` (default) every table a
Kimi-Linear / Qwen3-Next step reads (FLA prefill, FLA batch, conv1d) and a vLLM Mamba2 step's (SSD
chunks, conv1d of the prefill rows) in one build; ``kda`` or ``mamba2`` one family's; ``fla`` the
FLA prefill table alone (the FLA-only service). Exits 1 if any table of any step differs from the
reference, 2 on bad input (a malformed trace, a bad argument) with ``error: ...`` on stderr and no
traceback.
"""

from __future__ import annotations

import argparse
import os
import sys


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not an int") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chunkmeta", description=__doc__.splitlines()[0])
    parser.add_argument("--trace", help="JSON Lines trace (default: the embedded decode-first engine trace)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"])
    parser.add_argument(
        "--tables",
        default="all",
        choices=["all", "kda", "mamba2", "fla"],
        help="the step's tables: all (default), kda (FLA prefill + batch, conv1d), mamba2 (vLLM SSD chunks, "
        "conv1d), fla (the FLA prefill table alone)",
    )
    parser.add_argument("--chunk-size", type=int, default=64, help="the FLA tables' chunk size")
    parser.add_argument("--mamba-chunk-size", type=int, default=256, help="the Mamba2 SSD chunk size")
    parser.add_argument("--repeats", type=_positive_int, default=5, help="timed builds per step (median reported)")
    parser.add_argument("--no-fla", action="store_true", help="skip the comparison with fla-core")
    args = parser.parse_args(argv)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.backend == "triton" and device == "cpu":
        # The Triton kernel runs on CPU tensors only under Triton's interpreter, which must be
        # chosen before triton is imported (chunkmeta imports it on the first triton build).
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from chunkmeta.errors import ChunkMetaError
    from chunkmeta.replay import load_trace, replay, report

    try:
        steps = load_trace(args.trace)
        run = replay(
            steps,
            device=device,
            backend=args.backend,
            tables=args.tables,
            chunk_size=args.chunk_size,
            mamba_chunk_size=args.mamba_chunk_size,
            repeats=args.repeats,
            compare_fla=not args.no_fla,
        )
    except ChunkMetaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report(run, device=device, backend=args.backend, fla_skipped=args.no_fla))
    return 0 if all(r.matched for r in run.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
