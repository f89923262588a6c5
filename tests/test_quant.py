"""Weight-only int8 / int4: the kernels compute the quantized weights' products, a Q4_1 GGUF keeps its own
4-bit codes, and a quantized model's small-step (int kernel) and large-step (bfloat16) paths agree."""

import copy

import gguf
import numpy as np
import pytest
import torch

from tinyserve.config import EngineConfig
from tinyserve.engine.reference import forward_sequence
from tinyserve.layers.linear import (
    Linear,
    TiedLMHead,
    can_pack,
    pack_linear_weights,
    quantize_linear_weights,
)
from tinyserve.layers.quant import (
    Int4Weight,
    Int8Weight,
    check_quantization,
    int4_codes,
)
from tinyserve.loader.gguf import open_gguf

needs_bf16 = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                                reason="this CPU's oneDNN has no bfloat16 kernels")


@pytest.mark.parametrize("fmt", [Int8Weight, Int4Weight])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int_kernel_computes_the_dequantized_product(fmt, rows):
    torch.manual_seed(rows)
    weight = torch.randn(96, 64) * 0.05
    quantized, dequantized = fmt.quantize(weight)
    # quantization error is bounded by half a step: 1/254 of the row's max (int8), 1/30 of the group's range (int4)
    step = weight.abs().amax() / 127 if fmt is Int8Weight else (weight.amax() - weight.amin()) / 15
    assert (dequantized - weight).abs().max() <= step / 2 + 1e-6
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    expected = x.float() @ dequantized.t()
    got = quantized.matmul(x).float()
    assert got.shape == (rows, 96)
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max()


def _q4_1_blocks(tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_1 tensor's raw blocks: per 32 weights, scale d (fp16), minimum m (fp16), 16 bytes of codes
    (weight j < 16 in the low nibble of byte j, weight j >= 16 in the high nibble of byte j - 16)."""
    raw = np.asarray(tensor.data)
    blocks = raw.reshape(raw.shape[0], -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = np.concatenate([blocks[..., 4:] & 0xF, blocks[..., 4:] >> 4], axis=-1).reshape(raw.shape[0], -1)
    return codes, d, m


def test_int4_keeps_a_q4_1_gguf_s_own_codes(smollm2_path):
    reader = open_gguf(smollm2_path)
    checked = 0
    for tensor in reader.tensors:
        if tensor.tensor_type != gguf.GGMLQuantizationType.Q4_1 or not tensor.name.startswith(("blk.0.", "blk.29.")):
            continue
        codes, d, m = _q4_1_blocks(tensor)
        weight = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(codes.shape)
        ours, scale, minimum = int4_codes(torch.from_numpy(weight))
        assert np.array_equal(ours.numpy(), codes), tensor.name
        np.testing.assert_allclose(scale.numpy(), d, rtol=1e-6)
        np.testing.assert_array_equal(minimum.numpy(), m)
        checked += 1
    assert checked == 14  # q, k, v, o, gate, up, down in two layers


@needs_bf16
@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("tied", [True, False])
def test_quantized_model_small_and_large_steps_agree(quantization, tied, tiny_llama):
    model = tiny_llama(tied)
    assert quantize_linear_weights(model, quantization) == 2 * 4  # qkv, o, gate_up, down; not the head
    block_format = Int8Weight if quantization == "int8" else Int4Weight
    assert all(isinstance(m.quantized, block_format) for m in model.model.modules() if isinstance(m, Linear))
    assert getattr(model.lm_head, "quantized", None) is None
    assert isinstance(model.lm_head, TiedLMHead) == tied
    assert quantize_linear_weights(model, quantization) == 0  # idempotent
    dequantized = copy.deepcopy(model)  # float32, weights = the dequantized values, plain F.linear
    for module in dequantized.modules():
        if isinstance(module, Linear):
            module.quantized = None
    model = model.to(torch.bfloat16)
    pack_linear_weights(model)
    ids = list(range(5, 45))
    large = forward_sequence(model, ids)  # 40 tokens in one step: the packed bfloat16 path
    small = forward_sequence(model, ids[:2])  # 2 tokens: the int kernels of both formats
    assert large.shape == (40, 320)
    # causal: the first 2 positions are the same computation; only kernel rounding differs
    assert (small - large[:2]).abs().max() <= 0.05 * large[:2].abs().max()
    assert torch.equal(small.argmax(-1), large[:2].argmax(-1))
    # both compute the dequantized weights' model (up to bfloat16 rounding)
    exact = forward_sequence(dequantized, ids)
    assert (large - exact).abs().max() <= 0.05 * exact.abs().max()


def test_quantization_needs_cpu_bfloat16():
    check_quantization(None, torch.float32, torch.device("cuda"))  # unquantized: anything goes
    check_quantization("int4", torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match="bfloat16"):
        check_quantization("int4", torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU"):
        check_quantization("int8", torch.bfloat16, torch.device("cuda"))
    with pytest.raises(ValueError, match="int8, int4"):
        check_quantization("fp8", torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="q4_k")


@needs_bf16
def test_int4_default_model_through_the_engine(smollm2_fp32):
    """The int4 model runs through the whole engine: its greedy tokens are those of the reference loop on
    the same model, and where they leave the float32 model's, each side's token is in the other's top 5.

    One prompt per generate(), so that the engine's steps have the reference's sizes: a step of at most
    8 tokens runs the int4 kernel, a larger one the bf16 kernel on the same weights, and their rounding
    differs ("def add(a, b):" has two next tokens within one bf16 step of each other)."""
    from tinyserve import LLM
    from tinyserve.engine.reference import greedy_generate
    from tinyserve.types import SamplingParams

    llm = LLM(quantization="int4", kv_cache_memory=0.1, max_model_len=1024)
    prompts = ["The capital of France is", "def add(a, b):", "Water boils at"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    results = [llm.generate([prompt], params)[0] for prompt in prompts]
    model = llm.engine.runner.model
    for result in results:
        ids = result.prompt_token_ids
        assert result.token_ids == greedy_generate(model, ids, 16, decode_kernel=llm.engine.runner.decode_kernel)
        ref = greedy_generate(smollm2_fp32, ids, 16)
        same = next((i for i, (a, b) in enumerate(zip(ref, result.token_ids)) if a != b), len(ref))
        if same < len(ref):
            prefix = ids + ref[:same]
            assert result.token_ids[same] in forward_sequence(smollm2_fp32, prefix)[-1].topk(5).indices.tolist()
            assert ref[same] in forward_sequence(model, prefix)[-1].topk(5).indices.tolist()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
