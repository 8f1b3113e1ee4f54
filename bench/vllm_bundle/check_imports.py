"""Smoke test for the vLLM .py bundle: imports the builder modules and runs
the pure table builders on small CPU inputs.  Usage:
    python check_imports.py            # uses vllm_bootstrap (CUDA-capable)
    SIM_FORCE_CUDA_PLATFORM=1 ...      # CPU-only host: pretend CudaPlatform
    SIM_FAKE_TRITON_DRIVER=1 ...       # CPU-only host: pretend a Triton GPU driver
"""

import os
import sys
import time
import traceback

t0 = time.time()
if os.environ.get("SIM_FAKE_TRITON_DRIVER"):
    # CPU-only host only: make vLLM believe the Triton CUDA driver is active so
    # the real @triton.jit decorators are used (as on a GPU host).
    import sim_cuda

    sim_cuda.fake_triton_driver()

import vllm_bootstrap  # noqa: F401,E402

if os.environ.get("SIM_FORCE_CUDA_PLATFORM"):
    # CPU-only host only: resolve CudaPlatform the way a GPU host would.
    import vllm.platforms as P
    from vllm.platforms.cuda import CudaPlatform

    CudaPlatform.is_pin_memory_available = classmethod(lambda cls: False)
    P._current_platform = CudaPlatform()

import torch  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.triton_utils import HAS_TRITON  # noqa: E402
from vllm.utils.torch_utils import PIN_MEMORY  # noqa: E402
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder  # noqa: E402
from vllm.v1.attention.backends.mamba_attn import BaseMambaAttentionMetadataBuilder  # noqa: E402
from vllm.v1.attention.backends.utils import compute_causal_conv1d_metadata  # noqa: E402

print(
    f"core imports ok in {time.time() - t0:.1f}s; platform="
    f"{type(current_platform).__name__} PIN_MEMORY={PIN_MEMORY} HAS_TRITON={HAS_TRITON}"
)
print("vllm._C loaded:", "vllm._C" in sys.modules)

# 1. compute_causal_conv1d_metadata(query_start_loc_p_cpu, *, device)
qsl = torch.tensor([0, 5, 17, 20], dtype=torch.int32)
nums_dict, batch_ptr, tok_off = compute_causal_conv1d_metadata(qsl, device=torch.device("cpu"))
print(
    "conv1d nums:",
    nums_dict[8]["nums"].tolist(),
    "mlist:",
    nums_dict[8]["mlist"].tolist(),
    "batch_ptr[:6]:",
    batch_ptr[:6].tolist(),
    "tok_off[:6]:",
    tok_off[:6].tolist(),
    len(batch_ptr),
)

# 2. _compute_chunk_metadata(chunk_size, num_prefills, num_computed_tokens_p_cpu,
#                            query_start_loc_p_cpu, checkpoint_offsets_p=None)
ncomp = torch.tensor([0, 3, 64], dtype=torch.int32)
cu, seq_idx, last, ckpt = BaseMambaAttentionMetadataBuilder._compute_chunk_metadata(8, 3, ncomp, qsl)
print("chunk cu_chunk_seqlen:", cu, "seq_idx:", seq_idx, "last:", last, "ckpt:", ckpt)
assert cu[-1] == 20 and len(last) == 3
cu2, _, _, ck2 = BaseMambaAttentionMetadataBuilder._compute_chunk_metadata(8, 3, ncomp, qsl, [0, 4, 0])
print("with checkpoint_offsets_p=[0,4,0]:", cu2, ck2)

# 2b. _build_chunk_metadata_tensors(self, chunk_size, common, common_attn_metadata, ckpt=None)
from types import SimpleNamespace  # noqa: E402

B = BaseMambaAttentionMetadataBuilder
self_stub = SimpleNamespace(
    _prefill_cpu_metadata=lambda *a: B._prefill_cpu_metadata(None, *a),
    _compute_chunk_metadata=B._compute_chunk_metadata,
)
cam = SimpleNamespace(
    query_start_loc_cpu=qsl, query_start_loc=qsl, seq_lens_cpu_upper_bound=torch.tensor([5, 15, 67], dtype=torch.int32)
)
common = SimpleNamespace(num_prefills=3, num_reqs=3, num_decode_tokens=0)
print("_build_chunk_metadata_tensors:", B._build_chunk_metadata_tensors(self_stub, 8, common, cam))

# 3. GDNAttentionMetadataBuilder._build_chunk_metadata(self, qsl_gpu, qsl_cpu, device)
g = SimpleNamespace(gdn_prefill_backend="triton")
ci, co = GDNAttentionMetadataBuilder._build_chunk_metadata(g, qsl, qsl, torch.device("cpu"))
print("gdn chunk_indices:", ci.tolist(), "chunk_offsets:", co.tolist())

# nice-to-have kernels (import only)
for mod, attr in [
    ("vllm.model_executor.layers.mamba.ops.causal_conv1d", "causal_conv1d_fn"),
    ("vllm.third_party.flash_linear_attention.ops.kda", "chunk_kda"),
    ("vllm.third_party.flash_linear_attention.ops", "chunk_gated_delta_rule"),
]:
    try:
        m = __import__(mod, fromlist=[attr])
        print("import ok:", mod, attr, type(getattr(m, attr)).__name__)
    except Exception:  # noqa: BLE001 - a smoke test: report every failure and go on
        print("import FAILED:", mod, attr)
        traceback.print_exc()
print(f"done in {time.time() - t0:.1f}s")
