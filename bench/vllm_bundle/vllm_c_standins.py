"""Stand-ins for the ``torch.ops._C`` operators vLLM 0.33.0's CUDA platform touches when its own
compiled ``vllm._C_stable_libtorch`` is missing (the .py bundle on a GPU machine without vLLM).

``register()`` defines each operator of ``SCHEMAS`` in the ``_C`` namespace, with the schema
vLLM's extension declares (read from the 0.33.0 wheel's ``_C_stable_libtorch.abi3.so``):

* four with real implementations, the ones vLLM calls on the engine path that bench/vllm_engine.py
  runs: ``weak_ref_tensor`` (CUDA-graph capture keeps non-owning views of its outputs),
  ``get_cuda_view_from_cpu_tensor`` (Model Runner V2's UVA buffers: a device view of pinned host
  memory, the same address under unified addressing) and the ``cutlass_scaled_mm_supports_*``
  queries (False: no CUTLASS here; only quantized models ask);
* the rest schema-only: vLLM's modules name them at import (compile passes match on them) and
  never call them with ``custom_ops=["none"]``. A call raises, naming the stand-in, so that a
  path which would need the real kernel fails loudly instead of computing something else.

The same operators for every method of the engine benchmark: chunkmeta changes none of them.
"""

from __future__ import annotations

import torch

# name -> schema (vLLM 0.33.0's csrc/torch_bindings.cpp, as its compiled extension declares them)
SCHEMAS = {
    "weak_ref_tensor": "weak_ref_tensor(Tensor input) -> Tensor",
    "get_cuda_view_from_cpu_tensor": "get_cuda_view_from_cpu_tensor(Tensor cpu_tensor) -> Tensor",
    "cutlass_scaled_mm_supports_fp8": "cutlass_scaled_mm_supports_fp8(int cuda_device_capability) -> bool",
    "cutlass_scaled_mm_supports_block_fp8": "cutlass_scaled_mm_supports_block_fp8(int cuda_device_capability) -> bool",
    "cutlass_scaled_mm_supports_fp4": "cutlass_scaled_mm_supports_fp4(int cuda_device_capability) -> bool",
    # schema-only: what vllm/compilation/ names (at import, or in passes that run on every graph:
    # fix_functionalization compares each mutating node's target against these) and what the
    # models' CustomOps take in __init__; the ones vLLM itself probes with hasattr
    # (scaled_fp4_quant, silu_and_mul_nvfp4_quant) stay absent
    "dynamic_per_token_scaled_fp8_quant": "dynamic_per_token_scaled_fp8_quant(Tensor! result, Tensor input, "
    "Tensor! scale, Tensor? scale_ub) -> ()",
    "dynamic_scaled_fp8_quant": "dynamic_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale) -> ()",
    "fused_add_rms_norm": "fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor? weight, float epsilon) -> ()",
    "fused_add_rms_norm_static_fp8_quant": "fused_add_rms_norm_static_fp8_quant(Tensor! result, Tensor input, "
    "Tensor! residual, Tensor weight, Tensor scale, float epsilon) -> ()",
    "fused_qk_norm_rope": "fused_qk_norm_rope(Tensor! qkv, int num_heads_q, int num_heads_k, int num_heads_v, "
    "int head_dim, float eps, Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, bool is_neox, "
    "Tensor position_ids, int forced_token_heads_per_warp=-1) -> ()",
    "per_token_group_fp8_quant": "per_token_group_fp8_quant(Tensor input, Tensor! output_q, Tensor! output_s, "
    "int group_size, float eps, float fp8_min, float fp8_max, bool scale_ue8m0, bool dummy_is_scale_transposed, "
    "bool dummy_is_tma_aligned) -> ()",
    "rms_norm": "rms_norm(Tensor! result, Tensor input, Tensor? weight, float epsilon) -> ()",
    "rms_norm_dynamic_per_token_quant": "rms_norm_dynamic_per_token_quant(Tensor! result, Tensor input, "
    "Tensor weight, Tensor! scale, float epsilon, Tensor? scale_ub, Tensor!? residual) -> ()",
    "rms_norm_per_block_quant": "rms_norm_per_block_quant(Tensor! result, Tensor input, Tensor weight, "
    "Tensor! scale, float epsilon, Tensor? scale_ub, Tensor!? residual, int group_size, "
    "bool is_scale_transposed) -> ()",
    "rms_norm_static_fp8_quant": "rms_norm_static_fp8_quant(Tensor! result, Tensor input, Tensor weight, "
    "Tensor scale, float epsilon) -> ()",
    "rotary_embedding": "rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, "
    "Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()",
    "silu_and_mul": "silu_and_mul(Tensor! result, Tensor input) -> ()",
    # ReLUSquaredActivation (Nemotron-H's relu2) takes it in __init__ on CUDA; runs forward_native
    "relu_squared": "relu_squared(Tensor! out, Tensor input) -> ()",
    "silu_and_mul_per_block_quant": "silu_and_mul_per_block_quant(Tensor! out, Tensor input, Tensor! scales, "
    "int group_size, Tensor? scale_ub=None, bool is_scale_transposed=False) -> ()",
    "silu_and_mul_quant": "silu_and_mul_quant(Tensor! result, Tensor input, Tensor scale) -> ()",
    "static_scaled_fp8_quant": "static_scaled_fp8_quant(Tensor! result, Tensor input, Tensor scale, "
    "int[]? group_shape=None) -> ()",
}

_LIBRARY = None


class _DeviceMemory:
    """A ``__cuda_array_interface__`` over ``nbytes`` at device address ``ptr``: a tensor made
    from it references this object, not whoever owns the memory. ``owner``: kept alive with it
    (the pinned tensor of a UVA view), or None (a weak reference: the caller keeps the memory)."""

    def __init__(self, ptr: int, nbytes: int, owner=None):
        self.__cuda_array_interface__ = {
            "data": (ptr, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
            "stream": None,  # no stream synchronization on import: the caller orders its own work
        }
        self._owner = owner


def _view(tensor: torch.Tensor, ptr: int, device, owner=None) -> torch.Tensor:
    """``tensor``'s sizes, strides and dtype over the memory at ``ptr`` on ``device``."""
    span = tensor.storage_offset() + 1 + sum((s - 1) * st for s, st in zip(tensor.shape, tensor.stride(), strict=True))
    nbytes = span * tensor.element_size()
    base = ptr - tensor.storage_offset() * tensor.element_size()
    raw = torch.as_tensor(_DeviceMemory(base, nbytes, owner), device=device)
    flat = raw.view(tensor.dtype)
    return flat.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def _weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.numel() == 0:
        return tensor
    return _view(tensor, tensor.data_ptr(), tensor.device)


def _cuda_view_from_cpu(cpu_tensor: torch.Tensor) -> torch.Tensor:
    if not cpu_tensor.is_pinned():
        raise RuntimeError("get_cuda_view_from_cpu_tensor (stand-in): the tensor must be in pinned memory")
    if cpu_tensor.numel() == 0:
        return torch.empty(cpu_tensor.shape, dtype=cpu_tensor.dtype, device="cuda")
    # pinned memory from cudaHostAlloc is mapped at the same address on the device (UVA)
    return _view(cpu_tensor, cpu_tensor.data_ptr(), torch.device("cuda", torch.cuda.current_device()), cpu_tensor)


def _unsupported(capability: int) -> bool:
    return False


IMPLS = {
    "weak_ref_tensor": ("CompositeExplicitAutograd", _weak_ref_tensor),
    "get_cuda_view_from_cpu_tensor": ("CPU", _cuda_view_from_cpu),
    "cutlass_scaled_mm_supports_fp8": ("CompositeExplicitAutograd", _unsupported),
    "cutlass_scaled_mm_supports_block_fp8": ("CompositeExplicitAutograd", _unsupported),
    "cutlass_scaled_mm_supports_fp4": ("CompositeExplicitAutograd", _unsupported),
}


def _missing(name: str):
    def call(*args, **kwargs):
        raise RuntimeError(
            f"torch.ops._C.{name} is a schema-only stand-in (bench/vllm_bundle/vllm_c_standins.py): "
            "vLLM's compiled kernel is not installed"
        )

    return call


def register() -> tuple[str, ...]:
    """Define the stand-ins (once per process; an operator that exists already is left alone).
    Returns the names defined by this call."""
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library("_C", "FRAGMENT")
    defined = []
    for name, schema in SCHEMAS.items():
        if hasattr(torch.ops._C, name):
            continue
        _LIBRARY.define(schema)
        key, fn = IMPLS.get(name, ("CompositeExplicitAutograd", _missing(name)))
        _LIBRARY.impl(name, fn, key)
        defined.append(name)
    return tuple(defined)
