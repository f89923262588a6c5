"""Weight-only int8 / int4: our kernels compute what their formula says, GGUF's Q4_1 and Q8_0 tensors keep
their own values, int4 without minimums (Q4_0's rule) computes what it did with -8 * scale stored, and a
quantized model computes its quantized weights at every step size."""

import copy
import dataclasses

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tinyserve.config import EngineConfig
from tinyserve.engine.greedy_reference import forward_sequence
from tinyserve.layers import ops
from tinyserve.layers.linear import (
    Linear,
    TiedLMHead,
    can_pack,
    pack_linear_weights,
    quantize_linear_weights,
)
from tinyserve.layers.quant import (
    SPAN,
    GroupCodes,
    Int4Weight,
    Int8ChannelWeight,
    Int8Weight,
    check_quantization,
    int4_codes,
)
from tinyserve.layers.weight_format import Bf16Weight
from tinyserve.loader.gguf.checkpoint import open_gguf

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
    got = ops.linear(x, quantized).float()
    assert got.shape == (rows, 96)
    # the int4 kernel also rounds its inputs to int8 per group of 32 (as llama.cpp's Q4_1 x Q8_1)
    assert (got - expected).abs().max() <= 0.03 * expected.abs().max()


def _kernel_formula(x: torch.Tensor, weight: torch.Tensor, fmt) -> torch.Tensor:
    """What csrc/quantized_matmul.cpp computes, in torch: per group of 32 weights a float16 scale (and,
    int4, minimum); inputs rounded to int8 per group of 32 with scale max|x| / 127; integer dots; exact
    input sums."""
    tokens, groups = x.shape[0], weight.shape[1] // 32
    if fmt is Int4Weight:
        codes, scale, minimum = int4_codes(weight)
        scale, minimum = scale.half().float(), minimum.half().float()
    else:
        grouped = weight.reshape(weight.shape[0], groups, 32)
        scale = (grouped.abs().amax(-1) / 127).half().float()
        codes, minimum = torch.round(grouped / scale[..., None]).clamp(-127, 127), torch.zeros_like(scale)
    xg = x.float().reshape(tokens, groups, 32)
    amax = xg.abs().amax(-1, keepdim=True)
    # (not 127 / amax: torch computes that as 127 * (1 / amax), one rounding more than the kernel)
    xq = torch.round(xg * torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0))
    dots = torch.einsum("tgi,ngi->tng", xq, codes.reshape(-1, groups, 32).float())  # exact: |sum| < 2^24
    return (dots * scale * (amax[..., 0] / 127)[:, None]).sum(-1) + xg.sum(-1) @ minimum.t()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", [Int4Weight, Int8Weight])
@pytest.mark.parametrize("out_features, in_features", [(96, 64), (40, 96), (16, 32), (960, 576)])
@pytest.mark.parametrize("tokens", [1, 2, 5, 8, 19, 64])
def test_int_kernels_match_their_formula(fmt, out_features, in_features, tokens, dtype):
    """Every output row (40: a block of 16 padded; 96 inputs: an odd number of groups) for token counts
    within one pass of 8 and across passes (19), to the rounding of the output (bfloat16; float32: the
    order of the float sums); 64 x 576 inputs are rounded to int8 on all threads."""
    torch.manual_seed(out_features + tokens)
    weight = torch.randn(out_features, in_features) * 0.05
    x = torch.randn(tokens, in_features, dtype=dtype)
    x[0, :32] = 0  # an all-zero input group: scale 0, no division by zero
    expected = _kernel_formula(x, weight, fmt)
    got = ops.linear(x, fmt.quantize(weight)[0])
    assert got.dtype == dtype and got.shape == (tokens, out_features)
    relative = 1 / 256 if dtype == torch.bfloat16 else 1e-5
    assert ((got.float() - expected).abs() <= expected.abs() * relative + 1e-5 * expected.abs().max()).all()


needs_kernels = pytest.mark.skipif(not ops.has_cpu_kernels(), reason="our C++ kernels are not built here")


def _w4a16(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    return ops.cpu_kernels.w4a16_matmul(x, weight.codes, weight.scales, weight.minimums, weight.out_features)


@needs_kernels
@pytest.mark.parametrize("out_features, in_features", [(96, 64), (40, 96), (16, 32), (960, 576)])
@pytest.mark.parametrize("tokens", [1, 2, 5, 8, 19, 64])
def test_w4a16_kernel_computes_the_dequantized_product_of_unrounded_inputs(out_features, in_features, tokens):
    """csrc/w4a16_matmul.cpp against float64: the Q4_1 weights (code * scale + minimum, float16 scale and
    minimum) times the bfloat16 inputs as they are, to the rounding of the bfloat16 output plus float32 sums
    (the int8-rounded inputs of int4_matmul would miss this bound by far: the last assertion)."""
    torch.manual_seed(out_features + tokens)
    weight = torch.randn(out_features, in_features) * 0.05
    x = torch.randn(tokens, in_features, dtype=torch.bfloat16)
    x[0, :32] *= in_features == 32 or 0  # an all-zero group (but for a 32-input layer: its only one)
    codes, scale, minimum = int4_codes(weight)
    groups = codes.reshape(out_features, -1, 32).double()
    dequantized = (groups * scale.half().double()[..., None] + minimum.half().double()[..., None]).flatten(1)
    expected = x.double() @ dequantized.t()
    bound = expected.abs() / 256 + 1e-6 * (x.double().abs() @ dequantized.abs().t())
    quantized = Int4Weight.quantize(weight)[0]
    got = _w4a16(x, quantized)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, out_features)
    assert ((got.double() - expected).abs() <= bound).all()
    rounded = ops.cpu_kernels.int4_matmul(x, quantized.codes, quantized.scales, quantized.minimums, out_features)
    assert not ((rounded.double() - expected).abs() <= bound).all()


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 3, 8, 21])
def test_w4a16_rounds_float32_inputs_to_bfloat16_only_where_the_cpu_folds(tokens):
    """Float32 x: on an AVX512-BF16 CPU (w4a16_rounds_to_bfloat16) the kernel computes the fold of csrc/a16_fold.h,
    x rounded to bfloat16 once; elsewhere x as it is. Against float64 on the values it reads, to float32 sums
    (the fold's sums carry each code as 128 + code: its bound counts 160 scales more a weight); the other
    reading of x misses that bound by far."""
    torch.manual_seed(tokens)
    weight = torch.randn(80, 160) * 0.05
    x = torch.randn(tokens, 160)
    codes, scale, minimum = int4_codes(weight)
    scale, minimum = scale.half().double()[..., None], minimum.half().double()[..., None]
    dequantized = (codes.reshape(80, -1, 32).double() * scale + minimum).flatten(1)
    magnitude = (dequantized.abs() + (160 * scale + minimum.abs()).expand(-1, -1, 32).flatten(1)).t()
    rounded, as_is = x.bfloat16().double(), x.double()
    read, other = (rounded, as_is) if ops.cpu_kernels.w4a16_rounds_to_bfloat16() else (as_is, rounded)
    got = _w4a16(x, Int4Weight.quantize(weight)[0])
    assert got.dtype == torch.float32 and got.shape == (tokens, 80)
    bound = 64 * 2.0 ** -24 * (read.abs() @ magnitude)
    assert ((got.double() - read @ dequantized.t()).abs() <= bound).all()
    assert not ((got.double() - other @ dequantized.t()).abs() <= bound).all()


@needs_kernels
def test_w4a16_gives_a_token_the_same_bits_in_any_step_shape():
    """A token's output does not depend on the tokens beside it: one at a time, in passes of 8 with a
    remainder, in a 64-token chunk (tokens must not depend on how a step was batched or chunked)."""
    torch.manual_seed(3)
    weight = Int4Weight.quantize(torch.randn(200, 256) * 0.05)[0]
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    whole = _w4a16(x, weight)
    assert torch.equal(torch.cat([_w4a16(x[t : t + 1], weight) for t in range(64)]), whole)
    assert torch.equal(torch.cat([_w4a16(x[a : a + 19], weight) for a in range(0, 64, 19)]), whole)


@needs_kernels
@pytest.mark.parametrize("fmt, dtype", [(Int4Weight, torch.bfloat16), (Int8Weight, torch.bfloat16),
                                        (Int8ChannelWeight, torch.bfloat16), (Int4Weight, torch.float32),
                                        (Int8Weight, torch.float32)])
def test_int_kernels_give_a_token_the_same_bits_in_any_step_shape(fmt, dtype):
    """As test_w4a16_gives_a_token_the_same_bits_in_any_step_shape, for the kernels that round the inputs
    to int8: every token count from 1 to 64 (the kernels take tokens 8, 4 or 3 at a time), rows not a
    multiple of a block's 16."""
    torch.manual_seed(4)
    weight = fmt.quantize(torch.randn(200, 256) * 0.05)[0]
    x = torch.randn(64, 256, dtype=dtype)
    whole = ops.linear(x, weight)
    for size in range(1, 65):
        assert torch.equal(torch.cat([ops.linear(x[a : a + size], weight) for a in range(0, 64, size)]), whole), size


def _symmetric_codes(rows: int, in_features: int, seed: int) -> GroupCodes:
    """4-bit codes without minimums (a GGUF Q4_0's rule, w = (code - 8) * scale): random codes, float16 scales
    of either sign, the largest whose -8 * scale float16 holds (8188) and a subnormal one among them."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, in_features), generator=generator, dtype=torch.uint8)
    scales = (torch.randn(rows, in_features // 32, generator=generator) * 0.01).half()
    scales[0, 0], scales[-1, -1] = 8188, -6e-8
    return GroupCodes(4, codes, scales, None)


@needs_kernels
@pytest.mark.parametrize("int8_inputs", [True, False], ids=["int4", "w4a16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_without_minimums_gives_the_bits_it_gave_with_minus_8_scale_stored(int8_inputs, dtype):
    """The kernels' offset -8 * scale, computed in float32, is exact, as the float16 minimum -8 * scale the
    loader stored before: every output the same bits (both kernels, token counts across their passes, rows
    not a multiple of 16) and every looked-up row (an embedding's), the formula's (code - 8) * scale; the
    weight holds the codes and scales alone."""
    rows, in_features = 40, 96
    codes = _symmetric_codes(rows, in_features, seed=5)
    symmetric, explicit = Int4Weight.from_codes(codes), Int4Weight.from_codes(codes.with_minimums())
    assert symmetric.minimums is None and explicit.minimums is not None
    assert symmetric.nbytes == explicit.nbytes - explicit.minimums.nbytes == 48 * 3 * 18  # 3 blocks of 16 rows
    symmetric, explicit = (dataclasses.replace(w, int8_inputs=int8_inputs) for w in (symmetric, explicit))
    x = torch.randn(64, in_features, generator=torch.Generator().manual_seed(6)).to(dtype)
    for tokens in (1, 2, 3, 5, 8, 19, 64):
        assert torch.equal(ops.linear(x[:tokens], symmetric), ops.linear(x[:tokens], explicit)), tokens
    formula = (codes.codes.reshape(rows, -1, 32).float() - 8) * codes.scales.float()[..., None]
    ids = torch.arange(rows)
    assert torch.equal(symmetric.rows(ids), formula.reshape(rows, in_features))
    assert torch.equal(symmetric.rows(ids), explicit.rows(ids))


def _channel_formula(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What csrc/int8_channel_matmul.cpp computes, in float64: per output row a scale max|w| / 127 and codes
    round(w / scale); inputs rounded to int8 per span of 32 (the last one shorter) with scale max|x| / 127;
    integer dots per span (exact), summed times the spans' scales, times the row's scale."""
    scale = weight.abs().amax(1) / 127
    codes = torch.round(weight / torch.where(scale > 0, scale, 1)[:, None]).clamp(-127, 127)
    pad = -x.shape[1] % SPAN
    spans = F.pad(x.float(), (0, pad)).reshape(x.shape[0], -1, SPAN)
    amax = spans.abs().amax(-1, keepdim=True)
    xq = torch.round(spans * torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0))
    code_spans = F.pad(codes, (0, pad)).reshape(codes.shape[0], -1, SPAN)
    dots = torch.einsum("tsi,nsi->tns", xq.double(), code_spans.double())
    return (dots * (amax[..., 0].double() / 127)[:, None]).sum(-1) * scale.double()


def test_int8_channel_quantization_is_within_half_a_step_of_each_row():
    torch.manual_seed(0)
    weight = torch.randn(40, 70) * torch.rand(40, 1)  # rows of different sizes
    weight[3] = 0  # an all-zero row: scale 0, no division by zero
    quantized, dequantized = Int8ChannelWeight.quantize(weight)
    step = weight.abs().amax(1, keepdim=True) / 127
    assert ((dequantized - weight).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(dequantized[3], torch.zeros(70))
    assert quantized.codes.shape == (3, 72 // 4 * 64) and quantized.scales.shape == (48,)


@pytest.mark.parametrize("out_features, in_features", [(96, 64), (40, 70), (17, 3), (33, 100), (960, 576),
                                                        (576, 1536)])
@pytest.mark.parametrize("tokens", [1, 2, 5, 8, 19, 64])
def test_int8_channel_kernel_matches_its_formula(out_features, in_features, tokens):
    """Every output to the rounding of the bfloat16 output: rows not a multiple of the kernel's tiles (16
    rows a block, 3 blocks and 4 tokens a tile), inputs not a multiple of 4 (3, 70) or of a span (100),
    the model's shapes; an all-zero span of inputs and an all-zero row of weights."""
    torch.manual_seed(out_features + tokens)
    weight = torch.randn(out_features, in_features) * 0.05
    weight[out_features // 2] = 0
    x = torch.randn(tokens, in_features, dtype=torch.bfloat16)
    x[0, :SPAN] = 0
    expected = _channel_formula(x, weight)
    got = ops.linear(x, Int8ChannelWeight.quantize(weight)[0])
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, out_features)
    assert ((got.double() - expected).abs() <= expected.abs() / 256 + 1e-5 * expected.abs().max()).all()
    assert torch.equal(got[:, out_features // 2], torch.zeros(tokens, dtype=torch.bfloat16))


@pytest.mark.parametrize("pack", [lambda w: Int4Weight.quantize(w)[0], lambda w: Int8Weight.quantize(w)[0],
                                  lambda w: Int8ChannelWeight.quantize(w)[0], Bf16Weight.pack],
                         ids=["int4", "int8", "int8-channel", "bf16"])
def test_our_matmul_kernels_refuse_what_they_are_not_built_for(pack):
    quantized = pack(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="no tokens"):
        ops.linear(torch.empty(0, 64, dtype=torch.bfloat16), quantized)
    with pytest.raises(RuntimeError, match="shapes"):
        ops.linear(torch.randn(1, 96, dtype=torch.bfloat16), quantized)
    with pytest.raises(RuntimeError, match="bfloat16"):  # int4 and int8 take float32 too, not float16
        ops.linear(torch.randn(1, 64, dtype=torch.float16), quantized)


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


def test_int8_keeps_a_q8_0_gguf_s_own_values(smollm2_path):
    """The default GGUF's embedding (the tied LM head) is Q8_0: quantized again, its values do not move."""
    tensor = next(t for t in open_gguf(smollm2_path).tensors if t.name == "token_embd.weight")
    assert tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0
    values = torch.from_numpy(gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type))[:4096]
    assert torch.equal(Int8Weight.quantize(values)[1], values)


@needs_bf16
@pytest.mark.parametrize("quantization", ["int8", "int4", "w4a16"])
@pytest.mark.parametrize("tied", [True, False])
def test_quantized_model_computes_its_quantized_values(quantization, tied, tiny_llama):
    """The int kernels run every step of a quantized model, whatever its size, and compute the model
    whose weights are the quantized values: blocks in the mode's format (int8: one scale per row; a float
    checkpoint has no Q8_0 values to keep), the LM head in int8 per group (Q8_0)."""
    model = tiny_llama(tied)
    dequantized = copy.deepcopy(model)  # float32, each weight set to its quantized values, plain F.linear
    for name, module in dequantized.named_modules():
        if isinstance(module, (Linear, TiedLMHead)):
            fmt = Int8Weight if name == "lm_head" else Int8ChannelWeight if quantization == "int8" else Int4Weight
            module.weight.data.copy_(fmt.quantize(module.weight)[1])
    assert quantize_linear_weights(model, quantization) == 2 * 4 + 1  # qkv, o, gate_up, down; the head
    assert quantize_linear_weights(model, quantization) == 0  # idempotent
    block_format = Int8ChannelWeight if quantization == "int8" else Int4Weight
    blocks = [m for m in model.model.modules() if isinstance(m, Linear)]
    assert all(isinstance(m.weight_format, block_format) and m.weight.is_meta for m in blocks)  # no float copy
    assert isinstance(model.lm_head.weight_format, Int8Weight)
    # w4a16: int4's codes, the kernels that keep the activations unrounded
    assert all(getattr(m.weight_format, "int8_inputs", True) == (quantization != "w4a16") for m in [*blocks, model.lm_head])
    assert isinstance(model.lm_head, TiedLMHead) == tied
    # a tied head's matrix is the embedding: lookups read its int8 codes, and no float copy is kept
    assert model.model.embed_tokens.weight.is_meta == tied
    vocab = torch.arange(model.config.vocab_size)
    assert torch.equal(model.model.embed_tokens(vocab), dequantized.model.embed_tokens(vocab))
    model = model.to(torch.bfloat16)
    assert pack_linear_weights(model) == 0  # nothing left for oneDNN
    ids = list(range(5, 45))
    got = forward_sequence(model, ids)  # one 40-token step
    assert got.shape == (40, 320)
    exact = forward_sequence(dequantized, ids)
    assert (got - exact).abs().max() <= 0.05 * exact.abs().max()
    # a 2-token step computes the same first rows, up to bfloat16 rounding in attention (which can move
    # an activation across an int8 rounding boundary)
    small = forward_sequence(model, ids[:2])
    assert (small - got[:2]).abs().max() <= 0.05 * got[:2].abs().max()
    assert torch.equal(small.argmax(-1), got[:2].argmax(-1))


def test_the_lm_head_is_the_one_its_model_marks(tiny_llama):
    """int4 mode keeps the head in int8 because the model marks it when it builds it, not by its name."""
    model = tiny_llama(False)
    model.output = model.lm_head  # the same head under another name (GGUF's)
    del model.lm_head
    quantize_linear_weights(model, "int4")
    assert isinstance(model.output.weight_format, Int8Weight)
    assert all(isinstance(m.weight_format, Int4Weight) for m in model.model.modules() if isinstance(m, Linear))


def test_quantization_needs_cpu_bfloat16():
    check_quantization(None, torch.float32, torch.device("cuda"))  # unquantized: anything goes
    check_quantization("int4", torch.bfloat16, torch.device("cpu"))
    check_quantization("int4", torch.float32, torch.device("cpu"))  # its kernels round float32 inputs too
    with pytest.raises(ValueError, match="bfloat16"):
        check_quantization("int8", torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU"):
        check_quantization("int8", torch.bfloat16, torch.device("cuda"))
    with pytest.raises(ValueError, match="int8, int4"):
        check_quantization("fp8", torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="q4_k")


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=needs_bf16), "float32"])
def test_int4_default_model_through_the_engine(smollm2_fp32, dtype):
    """The int4 model runs through the whole engine, at bfloat16 (its default where bf16 kernels exist) and
    at float32 (the speed mode on a CPU without them): its greedy tokens are those of the reference loop on
    the same model, and where they leave the float32 model's, each side's token is in the other's top 5.
    One prompt per generate(), so that the engine's steps have the reference's sizes."""
    from tinyserve import LLM
    from tinyserve.engine.greedy_reference import greedy_generate
    from tinyserve.types import SamplingParams

    llm = LLM(dtype=dtype, quantization="int4", kv_cache_memory=0.1, max_model_len=1024)
    prompts = ["The capital of France is", "def add(a, b):", "Water boils at"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    results = [llm.generate([prompt], params)[0] for prompt in prompts]
    model = llm.engine.runner.model
    for result in results:
        ids = result.prompt_token_ids
        assert result.token_ids == greedy_generate(model, ids, 16, cpu_attention=llm.engine.runner.stage.cpu_attention)
        ref = greedy_generate(smollm2_fp32, ids, 16)
        same = next((i for i, (a, b) in enumerate(zip(ref, result.token_ids)) if a != b), len(ref))
        if same < len(ref):
            prefix = ids + ref[:same]
            assert result.token_ids[same] in forward_sequence(smollm2_fp32, prefix)[-1].topk(5).indices.tolist()
            assert ref[same] in forward_sequence(model, prefix)[-1].topk(5).indices.tolist()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
