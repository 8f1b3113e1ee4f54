"""vLLM 0.33.0's real metadata builders: ``build()`` host time, stock against chunkmeta (issue 19).

    python bench/vllm_builders.py --out DIR [--rounds 20] [--decode-rounds 2000]

Per workload and builder, the stock builder and its chunkmeta builder (``chunkmeta.integrations.vllm``)
are called back to back on metadata made the same way, interleaved round by round (who goes first
alternating), in one process. Workloads: prefill steps (decodes + prefills, tokens; prefills with a
cached prefix on every other row; ``--rounds`` rounds) and decode-only steps of 1, 8, 64 and 256
decodes (``--decode-rounds`` rounds: the difference is a microsecond or less, so many rounds; each
row also gives the median of the per-round differences, chunkmeta minus stock), and what
chunkmeta's ``build()`` alone adds there, with vLLM's swapped for a stub (``dispatch_ns``). Builders:

* ``gdn_triton``, ``gdn_flashinfer``  ``GDNAttentionMetadataBuilder`` (Qwen3-Next's; the
  flashinfer prefill backend is the resolver's choice on H100/H200, where vLLM still builds the
  conv tables every prefill step);
* ``kimi_k3``  ``KimiK3KDAMetadataBuilder`` (NVIDIA; its build() needs CUDA tensors);
* ``mamba2``  ``Mamba2AttentionMetadataBuilder`` (conv + SSD tables).

Prints the medians, stock / chunkmeta ratios and paired differences; writes its record (``bench/results.py``:
``vllm_builders.runs.jsonl``) under ``--out``. Runs on CPU (vLLM's CPU platform) and on a GPU
machine with an installed vLLM or the carried ``.vllm_bundle`` (``source
.vllm_bundle/setup_env.sh`` first: ``vllm_bootstrap`` is imported before vLLM).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import sys
import tempfile

import results as runs
import torch

# the real-vLLM tests' runner batches and tiny model configs (tests/integrations/vllm)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "integrations", "vllm"))

from chunkmeta.timing import host_us, median

WORKLOADS = [(0, 1, 4096), (4, 4, 4096), (8, 8, 8192), (32, 32, 16384), (64, 64, 32768)]
# Decode-only steps: chunkmeta builds nothing there, and its build() must cost what vLLM's does.
DECODE_ONLY = (1, 8, 64, 256)
CONTROLS = ("control_gdn_twice", "control_gdn_empty_subclass")  # builders(): decode-only rows only
MAX_NUM_SEQS, MAX_NUM_TOKENS, MAMBA_CHUNK = 256, 65536, 256


def import_vllm():
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if importlib.util.find_spec("vllm_bootstrap") is not None:
        import vllm_bootstrap  # noqa: F401


def configs(
    root: str, max_num_seqs: int = MAX_NUM_SEQS, max_num_tokens: int = MAX_NUM_TOKENS, prefix_caching: bool = True
) -> dict:
    """VllmConfigs of tiny Qwen3-Next ("gdn") and Mamba2 ("mamba") models with these scheduler
    limits (the builders read only the limits, the compilation / speculative / cache configs and
    the GDN prefill backend's inputs from them). ``prefix_caching=False``: vLLM's
    ``--no-enable-prefix-caching``, whose Mamba cache mode is "none" (one state block per request)
    instead of the hybrid models' "align"."""
    from vllm.config import CacheConfig, VllmConfig

    from vllm_real_batches import model_config, scheduler_config, tiny_mamba2, tiny_qwen3_next

    def model(config, name):
        return model_config(config, os.path.join(root, name), max_model_len=32768)

    qwen = tiny_qwen3_next(linear_head_dim=128)
    mamba = tiny_mamba2(MAMBA_CHUNK)

    def scheduler():
        return scheduler_config(max_num_seqs, max_num_tokens, max_model_len=32768)

    def config(model):
        cache = CacheConfig(enable_prefix_caching=prefix_caching)
        return VllmConfig(model_config=model, scheduler_config=scheduler(), cache_config=cache)

    return {"gdn": config(model(qwen, "qwen3_next")), "mamba": config(model(mamba, "mamba2"))}


def builders(cfg: dict, device) -> dict:
    """name -> (stock builder, chunkmeta builder), or a reason it cannot run here."""
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadataBuilder
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    from chunkmeta.integrations import vllm as adapter

    adapter.install()

    def spec(kind):
        return MambaSpec(block_size=16, shapes=((4, 8), (2, 8, 8)), dtypes=(torch.bfloat16,) * 2, mamba_type=kind)

    def pair(cls, config, kind=MambaAttentionBackendEnum.GDN_ATTN):
        ours = adapter.chunkmeta_builder_class(cls)
        return cls(spec(kind), ["layer"], config, device), ours(spec(kind), ["layer"], config, device)

    out = {}
    resolve = qwen_gdn_linear_attn._resolve_gdn_prefill_backend
    for backend in ("triton", "flashinfer"):
        qwen_gdn_linear_attn._resolve_gdn_prefill_backend = lambda c, b=backend: (resolve(c)[0], b)
        try:
            out[f"gdn_{backend}"] = pair(GDNAttentionMetadataBuilder, cfg["gdn"])
        finally:
            qwen_gdn_linear_attn._resolve_gdn_prefill_backend = resolve
    if device.type == "cuda":
        from vllm.models.kimi_k3.nvidia.kda_metadata import KimiK3KDAMetadataBuilder

        out["kimi_k3"] = pair(KimiK3KDAMetadataBuilder, cfg["gdn"])
    else:
        out["kimi_k3"] = "its build() asserts CUDA tensors"
    out["mamba2"] = pair(Mamba2AttentionMetadataBuilder, cfg["mamba"], MambaAttentionBackendEnum.MAMBA2)

    # Controls, decode-only rows only: what the method reads between two builders that do the same
    # work. vLLM's GDN builder against a second instance of itself (the method's own noise), and
    # against a subclass that overrides nothing (what any class other than vLLM's costs or saves
    # in CPython, with no code of its own: the floor for chunkmeta's class)
    class EmptySubclass(GDNAttentionMetadataBuilder):
        pass

    def made(cls):
        return cls(spec(MambaAttentionBackendEnum.GDN_ATTN), ["layer"], cfg["gdn"], device)

    out[CONTROLS[0]] = made(GDNAttentionMetadataBuilder), made(GDNAttentionMetadataBuilder)
    out[CONTROLS[1]] = made(GDNAttentionMetadataBuilder), made(EmptySubclass)
    return out


def batch(decodes: int, prefills: int, tokens: int, device):
    from vllm_real_batches import common_metadata

    per = (tokens - decodes) // prefills
    query = [1] * decodes + [per] * (prefills - 1) + [tokens - decodes - per * (prefills - 1)]
    context = [100] * decodes + [(i % 2) * 300 for i in range(prefills)]
    return lambda: common_metadata(query, context, device)


def decode_batch(decodes: int, device):
    """A decode-only step: ``decodes`` one-token rows with 100 cached tokens each."""
    from vllm_real_batches import common_metadata

    return lambda: common_metadata([1] * decodes, [100] * decodes, device)


# CPython's cost of one call moves by about a microsecond either way with the depth of the
# caller's stack (measured here: vLLM's own builder against chunkmeta's, called through 0 to 5
# extra frames, differed by -0.9 to +1.2 us by depth alone), so each round calls both builders
# through the same number of frames, cycling through these depths.
DEPTHS = 4


def _through(frames: int, call):
    return call() if frames == 0 else _through(frames - 1, call)


def interleaved(stock, ours, make, rounds: int, device) -> dict:
    """Host µs of ``build(0, m)`` of both builders, round by round on fresh metadata (vLLM's runner
    makes new tensors every step), who goes first alternating, both at one stack depth a round
    (``DEPTHS``); ``delta`` per round: chunkmeta's time minus stock's in that round (their median
    is robust to drift over the rounds)."""
    times = {"stock": [], "chunkmeta": [], "delta": []}
    for i in range(rounds):
        pair = (("stock", stock), ("chunkmeta", ours))
        for label, builder in pair if i % 2 == 0 else pair[::-1]:
            m = make()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[label].append(_through(i // 2 % DEPTHS, lambda b=builder, m=m: host_us(lambda: b.build(0, m))))
        times["delta"].append(times["chunkmeta"][-1] - times["stock"][-1])
    return times


def _vllm_build_stub(builder, *args):
    return None


def dispatch_ns(ours, make, rounds: int = 40, calls: int = 10_000) -> dict:
    """What chunkmeta's build() itself adds to a decode-only step, resolved below the noise of
    vLLM's ~200 µs build(): ns per call of chunkmeta's build() with vLLM's build() swapped for a
    stub that returns at once, against that stub called directly (medians over ``rounds`` of
    ``calls`` calls, alternating). The decode rows above include vLLM's build() itself and what
    chunkmeta's subclass does to it (the empty-subclass control shows how much of that is noise)."""
    import time

    cls = type(ours)
    saved = cls.__dict__.get("_chunkmeta_vllm_build")
    cls._chunkmeta_vllm_build = staticmethod(_vllm_build_stub)
    m = make()

    def per_call(call) -> float:
        start = time.perf_counter_ns()
        for _ in range(calls):
            call(0, m)
        return (time.perf_counter_ns() - start) / calls

    def direct(common_prefix_len, metadata):
        return _vllm_build_stub(ours, common_prefix_len, metadata)

    try:
        through, alone = [], []
        for _ in range(rounds):
            through.append(per_call(ours.build))
            alone.append(per_call(direct))
    finally:
        if saved is None:
            del cls._chunkmeta_vllm_build
        else:
            cls._chunkmeta_vllm_build = saved
    wrapped, stub = median(through), median(alone)
    return {"chunkmeta_build_ns": wrapped, "stub_ns": stub, "added_ns": wrapped - stub}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--decode-rounds", type=int, default=2000, help="rounds per decode-only row (µs resolution)")
    args = parser.parse_args(argv)
    import_vllm()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as root:
        pairs = builders(configs(root), device)
    figures = {"device": str(torch.cuda.get_device_name() if device.type == "cuda" else "cpu"), "rows": []}
    print(f"{'builder':16} {'workload':>18} {'stock us':>10} {'chunkmeta us':>13} {'ratio':>7} {'paired diff us':>15}")
    for name, made in pairs.items():
        if isinstance(made, str):
            print(f"{name:16} not measured: {made}")
            figures["rows"].append({"builder": name, "skipped": made})
            continue
        stock, ours = made
        control = name in CONTROLS
        workloads = [] if control else [(d, p, t, batch(d, p, t, device), args.rounds) for d, p, t in WORKLOADS]
        workloads += [(d, 0, d, decode_batch(d, device), args.decode_rounds) for d in DECODE_ONLY]
        for decodes, prefills, tokens, make, rounds in workloads:
            builds = None if control else ours.chunkmeta.builds
            gc.collect()
            times = interleaved(stock, ours, make, rounds, device)
            s, c, delta = median(times["stock"]), median(times["chunkmeta"]), median(times["delta"])
            stats = {"fallbacks": 0} if control else ours.chunkmeta_stats()
            workload = f"{decodes:>4}d+{prefills:>4}p/{tokens:>6}t"
            print(f"{name:16} {workload} {s:>10.1f} {c:>13.1f} {s / c:>6.2f}x {delta:>+15.2f}")
            figures["rows"].append(
                {
                    "builder": name,
                    "decodes": decodes,
                    "prefills": prefills,
                    "tokens": tokens,
                    "stock_us": s,
                    "chunkmeta_us": c,
                    "ratio": s / c,
                    "paired_diff_us": delta,
                    "rounds": rounds,
                    "chunkmeta_builds": None if control else ours.chunkmeta.builds - builds,
                    "fallbacks": stats["fallbacks"],
                }
            )
    # chunkmeta's build() on a decode-only step, alone (dispatch_ns); 8 decodes: its work does not
    # depend on the batch (an attribute read and a compare)
    figures["dispatch"] = {}
    for name, made in pairs.items():
        if isinstance(made, str) or name in CONTROLS:
            continue
        cost = dispatch_ns(made[1], decode_batch(8, device))
        figures["dispatch"][name] = cost
        print(
            f"{name:16} decode-only dispatch: chunkmeta's build() {cost['chunkmeta_build_ns']:.0f} ns over a stub "
            f"of vLLM's build(), the stub alone {cost['stub_ns']:.0f} ns: {cost['added_ns']:+.0f} ns"
        )
    runs.save("vllm_builders", figures, script="bench/vllm_builders.py", argv=argv, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
