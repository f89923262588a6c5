"""Repacked (oneDNN-blocked) bfloat16 weights compute what the plain weights compute."""

import copy

import pytest
import torch
import torch.nn.functional as F

from tinyserve.config import ModelConfig
from tinyserve.engine.reference import forward_sequence
from tinyserve.layers.linear import Linear, MergedLinear, TiedLMHead, can_pack, pack_linear_weights
from tinyserve.models.llama import LlamaForCausalLM

needs_pack = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                                reason="this CPU's oneDNN has no bfloat16 kernels")


def test_can_pack_only_bfloat16_on_cpu():
    assert not can_pack(torch.float32, torch.device("cpu"))
    assert not can_pack(torch.bfloat16, torch.device("cuda"))


def _tiny_llama(tied: bool) -> LlamaForCausalLM:
    config = ModelConfig(architecture="llama", vocab_size=300, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                         max_position_embeddings=256, norm_eps=1e-5, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    return model.to(torch.bfloat16).eval().requires_grad_(False)


@needs_pack
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_equals_plain(rows):
    torch.manual_seed(rows)
    layer = MergedLinear(96, [64, 32], bias=True).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    expected = F.linear(x, layer.weight, layer.bias)
    assert pack_linear_weights(layer) == 1
    assert layer.weight.is_meta and layer.weight.shape == (96, 64 + 32)[::-1]  # no plain copy left
    torch.testing.assert_close(layer(x), expected, rtol=1.6e-2, atol=1e-2)


@needs_pack
@pytest.mark.parametrize("tied", [True, False])
def test_packed_model_logits_equal_plain(tied):
    plain = _tiny_llama(tied)
    packed = copy.deepcopy(plain)
    linears = sum(isinstance(m, (Linear, TiedLMHead)) for m in packed.modules())
    assert pack_linear_weights(packed) == linears == 2 * 4 + 1  # qkv, o, gate_up, down per layer + head
    if tied:  # the head reads the embedding, which must stay a real tensor
        assert not packed.model.embed_tokens.weight.is_meta
    ids = list(range(3, 40))
    expected = forward_sequence(plain, ids)
    got = forward_sequence(packed, ids)
    # bf16 outputs of the same products: equal up to the rounding of the last bit or two
    assert (got - expected).abs().max().item() <= 0.05 * expected.abs().max().item()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert pack_linear_weights(packed) == 0  # idempotent
