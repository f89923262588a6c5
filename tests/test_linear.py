"""Repacked bfloat16 weights (our kernel's interleaved layout, or oneDNN's blocked one where our kernels are
not built) compute what the plain weights compute."""

import copy

import pytest
import torch
import torch.nn.functional as F

from tinyserve.engine.greedy_reference import forward_sequence
from tinyserve.layers.linear import (
    Linear,
    MergedLinear,
    TiedLMHead,
    can_pack,
    pack_linear_weights,
)
from tinyserve.layers.weight_format import Bf16Weight, OneDnnWeight

needs_pack = pytest.mark.skipif(not can_pack(torch.bfloat16, torch.device("cpu")),
                                reason="this CPU's oneDNN has no bfloat16 kernels")


def test_can_pack_only_bfloat16_on_cpu():
    assert not can_pack(torch.float32, torch.device("cpu"))
    assert not can_pack(torch.bfloat16, torch.device("cuda"))


@needs_pack
@pytest.mark.parametrize("own_kernel", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 9, 64, 300])
def test_packed_linear_equals_plain(rows, own_kernel):
    """rows: one pass of the kernel (<= 8 tokens), passes with a remainder, and prefill sizes; 96 outputs
    are 6 blocks of 16 rows, 40 of them a padded block."""
    torch.manual_seed(rows)
    for layer in (MergedLinear(96, [64, 32], bias=True), Linear(96, 40, bias=False)):
        layer = layer.to(torch.bfloat16).requires_grad_(False)
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        expected = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
        assert pack_linear_weights(layer, own_kernel) == 1
        assert isinstance(layer.weight_format, Bf16Weight) == own_kernel
        assert (not isinstance(layer.weight_format, OneDnnWeight)) == own_kernel
        assert layer.weight.is_meta and layer.weight.shape == (layer.out_features, 96)  # no plain copy left
        torch.testing.assert_close(layer(x).float(), expected, rtol=1.6e-2, atol=1e-2)


@needs_pack
@pytest.mark.parametrize("own_kernel", [True, False])
@pytest.mark.parametrize("tied", [True, False])
def test_packed_model_logits_equal_plain(tied, own_kernel, tiny_llama):
    plain = tiny_llama(tied).to(torch.bfloat16)
    packed = copy.deepcopy(plain)
    linears = sum(isinstance(m, (Linear, TiedLMHead)) for m in packed.modules())
    assert pack_linear_weights(packed, own_kernel) == linears == 2 * 4 + 1  # qkv, o, gate_up, down per layer + head
    if tied:  # the head reads the embedding, which must stay a real tensor
        assert not packed.model.embed_tokens.weight.is_meta
    ids = list(range(3, 40))
    expected = forward_sequence(plain, ids)
    got = forward_sequence(packed, ids)
    # bf16 outputs of the same products: equal up to the rounding of the last bit or two
    assert (got - expected).abs().max().item() <= 0.05 * expected.abs().max().item()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert pack_linear_weights(packed, own_kernel) == 0  # idempotent

