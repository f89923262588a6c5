"""layers/embedding.py: lookups from a plain matrix or from int8 codes."""

import torch

from tinyserve.layers.embedding import Embedding
from tinyserve.layers.quant import Int8Weight


def test_lookup_from_int8_codes_equals_the_dequantized_rows():
    torch.manual_seed(0)
    matrix = torch.randn(37, 64)  # 37 rows: the kernel layout pads the last block of 16
    quantized, dequantized = Int8Weight.quantize(matrix)
    embedding = Embedding(37, 64)
    embedding.weight.data.copy_(dequantized)
    ids = torch.tensor([0, 36, 5, 16, 15, 36, 31])
    plain = embedding(ids)
    assert torch.equal(plain, dequantized[ids])
    embedding.weight_format = quantized
    embedding.weight = torch.nn.Parameter(embedding.weight.to("meta"), requires_grad=False)
    assert torch.equal(embedding(ids), plain)

