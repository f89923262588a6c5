"""--quantization's modes (loader/model_loader.py, resolve_quantization): "auto" serves a GGUF stored
quantized through our kernels from its own codes (int4 at bfloat16, w4a16 at float32 by --dtype auto), keeps
anything else in its dtype; "none" and an explicit --dtype float32 keep the float path."""

from collections import Counter

import pytest
import torch

from tinyserve.config import EngineConfig
from tinyserve.layers import ops
from tinyserve.layers.linear import Linear, TiedLMHead, can_pack
from tinyserve.loader import model_loader
from tinyserve.loader.model_loader import auto_activations, load_model, resolve_quantization

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
needs_int_kernels = pytest.mark.skipif(not ops.has_cpu_kernels(),
                                       reason="without our C++ kernels auto keeps the float path")


def _formats(model) -> Counter:
    return Counter(type(m.weight_format).__name__ for m in model.modules() if isinstance(m, (Linear, TiedLMHead)))


def test_auto_is_the_default():
    assert EngineConfig().quantization == "auto"


def test_explicit_modes_are_taken_as_they_are():
    for stored in (True, False):
        assert resolve_quantization(None, stored, torch.bfloat16, CPU) is None
        assert resolve_quantization("none", stored, torch.bfloat16, CPU) is None
        assert resolve_quantization("int8", stored, torch.bfloat16, CPU) == "int8"
        assert resolve_quantization("int4", stored, torch.bfloat16, CPU) == "int4"


@needs_int_kernels
def test_auto_runs_our_kernels_only_for_a_quantized_file_on_cpu():
    # --dtype auto, whatever it resolves to: the file's codes, float32 activations (auto_activations)
    for dtype in (torch.bfloat16, torch.float32):
        assert resolve_quantization("auto", True, dtype, CPU) == "w4a16"
        assert auto_activations("w4a16", dtype, "auto") == torch.float32
        assert resolve_quantization("auto", False, dtype, CPU) is None  # a float checkpoint
        assert auto_activations(None, dtype, "auto") == dtype
    # an explicit dtype: bfloat16 keeps int4 mode, float32 is the reference
    assert resolve_quantization("auto", True, torch.bfloat16, CPU, dtype_flag="bfloat16") == "int4"
    assert auto_activations("int4", torch.bfloat16, "bfloat16") == torch.bfloat16
    assert resolve_quantization("auto", True, torch.float32, CPU, dtype_flag="float32") is None
    assert resolve_quantization("auto", True, torch.bfloat16, CUDA) is None  # our kernels are CPU's


@needs_int_kernels
@pytest.mark.parametrize("cpu_dtype", [torch.float32, torch.bfloat16], ids=["avx2-cpu", "bf16-cpu"])
def test_dtype_auto_serves_the_file_s_codes_with_float32_activations(monkeypatch, cpu_dtype):
    """Whatever --dtype auto resolves to on the CPU, the default model is held in its file's formats and computes
    with float32 activations: Q4_1 block linears as int4, the Q8_0 embedding as the tied int8 head."""
    monkeypatch.setattr(model_loader, "resolve_dtype", lambda dtype, device: cpu_dtype)
    loaded = load_model("smollm2-135m", "auto", "cpu", "auto")
    assert loaded.quantization == "w4a16"
    assert _formats(loaded.model) == Counter({"Int4Weight": 120, "Int8Weight": 1})
    assert not any(m.weight_format.int8_inputs for m in loaded.model.modules() if isinstance(m, (Linear, TiedLMHead)))
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters() if p.is_floating_point())


@needs_int_kernels
def test_the_default_model_loads_its_own_codes_by_default():
    """SmolLM2's GGUF: Q4_1 block linears (120, int4) and its Q8_0 embedding as the tied head (int8)."""
    loaded = load_model("smollm2-135m", "bfloat16", "cpu", EngineConfig().quantization)
    assert loaded.quantization == "int4"
    assert _formats(loaded.model) == Counter({"Int4Weight": 120, "Int8Weight": 1})


def test_none_and_float32_keep_the_float_path():
    loaded = load_model("smollm2-135m", "float32", "cpu", "auto")
    assert loaded.quantization is None and set(_formats(loaded.model)) == {"DenseWeight"}
    loaded = load_model("smollm2-135m", "bfloat16", "cpu", "none")
    packed = {"Bf16Weight", "OneDnnWeight"} if can_pack(torch.bfloat16, CPU) else {"DenseWeight"}
    assert loaded.quantization is None and set(_formats(loaded.model)) <= packed
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters() if p.is_floating_point())
