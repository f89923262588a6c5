"""benchmarks/real_size_gguf.py at a tiny shape: the file it writes holds every Llama tensor in the asked type
with the shape's GGUF shape, weights near N(0, 0.02) and norms at 1 after the `gguf` library's own
dequantization, the vocabulary's keys copied, and tinyserve reads the shape back from its metadata."""

import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from tinyserve.loader.gguf.checkpoint import gguf_model_config, open_gguf

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("real_size_gguf", ROOT / "benchmarks" / "real_size_gguf.py")
real_size_gguf = sys.modules["real_size_gguf"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(real_size_gguf)

TINY = real_size_gguf.LlamaShape("tiny", 64, 2, 4, 2, 96, tie_embeddings=False, context_length=256)
TOKENS = [f"t{i}" for i in range(40)]


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> list:
    path = tmp_path_factory.mktemp("vocab") / "vocab.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * len(TOKENS))
    writer.add_token_merges(["t 1"])
    writer.add_bos_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return real_size_gguf.read_vocab(path)


@pytest.mark.parametrize("type_name, qtype", [("q4_0", gguf.GGMLQuantizationType.Q4_0),
                                              ("q8_0", gguf.GGMLQuantizationType.Q8_0)])
def test_tiny_shape_written_in_its_type(tmp_path, vocab, type_name, qtype):
    out = real_size_gguf.write_gguf(TINY, type_name, vocab, tmp_path / "tiny.gguf", pool_rows=64)
    assert not (tmp_path / "tiny.gguf.tmp").exists()
    reader = gguf.GGUFReader(out)
    tensors = {t.name: t for t in reader.tensors}
    plan = dict(real_size_gguf.tensor_plan(TINY, len(TOKENS)))
    assert set(tensors) == set(plan) and len(plan) == 1 + 9 * TINY.num_layers + 2
    for name, dims in plan.items():
        tensor = tensors[name]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        assert values.shape == dims, name
        if len(dims) == 1:
            assert tensor.tensor_type == gguf.GGMLQuantizationType.F32 and np.all(values == 1.0), name
        else:
            assert tensor.tensor_type == qtype, name
            assert abs(values.std() - real_size_gguf.WEIGHT_STD) < 0.004 and abs(values.mean()) < 0.004, name
    assert reader.fields["tokenizer.ggml.tokens"].contents() == TOKENS
    assert reader.fields["tokenizer.ggml.merges"].contents() == ["t 1"]

    config = gguf_model_config(open_gguf(out))
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size, config.rope_theta, config.tie_word_embeddings) == \
        (64, 2, 4, 2, 96, len(TOKENS), 500000.0, False)
