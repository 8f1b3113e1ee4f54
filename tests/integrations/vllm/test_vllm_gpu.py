"""On a GPU with vLLM 0.33.0's Python code (installed, or the carried ``.vllm_bundle``): the real
builders and the real vendored ``chunk_kda_with_fused_gate`` called as Kimi-Linear calls it
(``cu_seqlens=non_spec_query_start_loc`` only), with chunkmeta under
``torch.cuda.set_sync_debug_mode("error")``, give outputs bit-identical to vLLM's own path.

    source .vllm_bundle/setup_env.sh && python -m pytest -m gpu tests/integrations/vllm/test_vllm_gpu.py
"""

import importlib
import importlib.util

import pytest
import torch

import vllm_real_batches
from chunkmeta.integrations import vllm as adapter

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if importlib.util.find_spec("vllm_bootstrap") is not None:
    import vllm_bootstrap  # noqa: F401  the carried .py-only vLLM's stand-in for its compiled module
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not importable (install it, or source .vllm_bundle/setup_env.sh)", allow_module_level=True)


DEVICE = torch.device("cuda")
# decodes first, then prefills (one partial first chunk): the seed's shape, smaller
CASE = ([1] * 7 + [700, 1500, 389], [30] * 7 + [0, 100, 0], None)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    from vllm.config import VllmConfig

    path = str(tmp_path_factory.mktemp("qwen3_next"))
    model = vllm_real_batches.model_config(vllm_real_batches.tiny_qwen3_next(linear_head_dim=128), path)
    scheduler = vllm_real_batches.scheduler_config(64, 8192)
    return VllmConfig(model_config=model, scheduler_config=scheduler)


@pytest.fixture(autouse=True)
def installed():
    adapter.install()
    yield
    adapter.uninstall()


def spec():
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=16,
        shapes=((4, 8), (2, 8, 8)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
    )


def kda_inputs(num_tokens, num_seqs, heads=4, dim=128, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device=DEVICE, dtype=torch.float32).to(dtype)

    return dict(
        q=rand(1, num_tokens, heads, dim),
        k=rand(1, num_tokens, heads, dim),
        v=rand(1, num_tokens, heads, dim),
        raw_g=rand(1, num_tokens, heads, dim),
        raw_beta=rand(1, num_tokens, heads),
        A_log=rand(heads, dtype=torch.float32),
        g_bias=rand(heads * dim, dtype=torch.float32),
        initial_state=torch.zeros(num_seqs, heads, dim, dim, device=DEVICE, dtype=torch.float32),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )


@pytest.mark.parametrize("builder_name", ["gdn", "kimi_k3"])
def test_kimi_linear_kda_forward_is_bit_identical_without_sync(config, builder_name):
    from vllm.models.kimi_k3.nvidia.ops.third_party.kda import chunk_kda_with_fused_gate
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    if builder_name == "gdn":
        stock_cls = GDNAttentionMetadataBuilder
    else:
        stock_cls = importlib.import_module("vllm.models.kimi_k3.nvidia.kda_metadata").KimiK3KDAMetadataBuilder
    stock = stock_cls(spec(), ["layer"], config, DEVICE)
    ours = adapter.chunkmeta_builder_class(stock_cls)(spec(), ["layer"], config, DEVICE)

    want_md = vllm_real_batches.build(stock, CASE, DEVICE)
    # the op writes into its v (vLLM's vendored KDA): each call gets its own copy of the inputs
    num_tokens, num_seqs = int(want_md.non_spec_query_start_loc[-1]), want_md.non_spec_query_start_loc.shape[0] - 1
    inputs, ours_inputs = kda_inputs(num_tokens, num_seqs), kda_inputs(num_tokens, num_seqs)
    want = chunk_kda_with_fused_gate(**inputs, cu_seqlens=want_md.non_spec_query_start_loc)  # vLLM's own path
    torch.cuda.synchronize()

    m = vllm_real_batches.common_metadata(*CASE[:2], DEVICE)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got_md = ours.build(0, m)
        got = chunk_kda_with_fused_gate(**ours_inputs, cu_seqlens=got_md.non_spec_query_start_loc)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    tot = want_md.nums_dict[8]["tot"]
    assert got_md.nums_dict[8]["tot"] == tot
    assert torch.equal(got_md.batch_ptr[:tot], want_md.batch_ptr[:tot])
    assert torch.equal(got_md.token_chunk_offset_ptr[:tot], want_md.token_chunk_offset_ptr[:tot])
    if want_md.chunk_indices is not None:
        assert torch.equal(got_md.chunk_indices, want_md.chunk_indices)
        assert torch.equal(got_md.chunk_offsets, want_md.chunk_offsets)
    assert ours.chunkmeta_stats()["fallbacks"] == 0 and adapter.stats()["router_hits"] > 0
