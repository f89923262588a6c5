"""layers/embedding.py: lookups from a plain matrix or from int8 codes, and no random init."""

import subprocess
import sys

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
    embedding.kernel_weight = quantized
    embedding.weight = torch.nn.Parameter(embedding.weight.to("meta"), requires_grad=False)
    assert torch.equal(embedding(ids), plain)


def test_building_on_the_meta_device_imports_no_compiler():
    """nn.Embedding's random init on the meta device imports torch._dynamo and sympy (~50 MiB resident);
    ours skips the init, since the loader fills every weight."""
    code = ("import sys, torch\n"
            "from tinyserve.layers.embedding import Embedding\n"
            "with torch.device('meta'):\n"
            "    Embedding(100, 8)\n"
            "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
