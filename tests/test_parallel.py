"""Tensor and pipeline parallel: float32 greedy tokens identical to one process, over gloo on this CPU.

Tiny random checkpoints (on the default model's tokenizer, whose 49,152-token vocabulary splits 2, 3 and
4 ways) cover Llama with its KV heads split and replicated, Qwen3 and TP x PP; the real SmolLM2 (9 query
and 3 KV heads, 30 layers) covers TP=3, PP=2 and PP=3 on the suite's prompts (test_llama.PROMPTS). Each
case starts its ranks as subprocesses (tinyserve.LLM does), batches the prompts with prefill chunks
smaller than the longest prompt, and compares 64 greedy tokens per prompt. The SmolLM2 cases run with
`-m reliability` (`make test-reliability`, which .ci/run runs after the default suite).
"""

import pytest
import torch
import transformers as tf

from test_llama import PROMPTS
from tinyserve import LLM
from tinyserve.config import ModelConfig
from tinyserve.engine.memory.sizing import held_weight_bytes
from tinyserve.loader.gguf.checkpoint import gguf_model_config, gguf_tensors, open_gguf
from tinyserve.loader.model_loader import build_model
from tinyserve.parallel.dispatch import split_layers
from tinyserve.parallel.group import TensorParallelGroup
from tinyserve.parallel.shard import ModelShard, check_tensor_parallel
from tinyserve.types import SamplingParams

GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
TINY_PROMPTS = ["Hello there, my friend", "The capital of France is",
                "Once upon a time, in a land far away, " * 12, "1, 2, 3, 4,"]
_TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=96,
             max_position_embeddings=1024, tie_word_embeddings=True)
TINY = {
    "llama": lambda vocab: tf.LlamaConfig(**_TINY, vocab_size=vocab, num_key_value_heads=2),
    "llama-one-kv-head": lambda vocab: tf.LlamaConfig(**_TINY, vocab_size=vocab, num_key_value_heads=1),
    "llama-untied": lambda vocab: tf.LlamaConfig(**{**_TINY, "tie_word_embeddings": False}, vocab_size=vocab,
                                                 num_key_value_heads=2),
    "qwen3": lambda vocab: tf.Qwen3Config(**_TINY, vocab_size=vocab, num_key_value_heads=2, head_dim=32),
}


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory, hf_smollm2_tokenizer) -> dict[str, str]:
    root = tmp_path_factory.mktemp("parallel")
    folders = {}
    for seed, (name, make_config) in enumerate(TINY.items()):
        config = make_config(len(hf_smollm2_tokenizer))
        torch.manual_seed(seed)
        model = (tf.Qwen3ForCausalLM if name == "qwen3" else tf.LlamaForCausalLM)(config)
        with torch.no_grad():  # spread the logits, so that greedy ties are rare
            for param in model.parameters():
                param.normal_(0, 0.3)
        model.save_pretrained(root / name, safe_serialization=True)
        hf_smollm2_tokenizer.save_pretrained(root / name)
        folders[name] = str(root / name)
    return folders


def _greedy(model: str, prompts: list[str], **parallel) -> list[list[int]]:
    # chunks of 64 tokens: the long prompts prefill over several steps, beside the others' decodes
    with LLM(model, dtype="float32", device="cpu", kv_cache_memory=0.1, max_num_batched_tokens=64,
             max_model_len=1024, **parallel) as llm:
        return [r.token_ids for r in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def tiny_reference(tiny_folders) -> dict[str, list[list[int]]]:
    return {name: _greedy(folder, TINY_PROMPTS) for name, folder in tiny_folders.items()}


@pytest.mark.parametrize("name", ["llama", "llama-one-kv-head", "llama-untied", "qwen3"])
def test_tensor_parallel_2_matches_one_process(tiny_folders, tiny_reference, name):
    """KV heads split (2 over 2 ranks) and replicated (1 over 2); tied and untied heads; Qwen3's q/k norms."""
    assert _greedy(tiny_folders[name], TINY_PROMPTS, tensor_parallel_size=2) == tiny_reference[name]


def test_tensor_2_by_pipeline_2_matches_one_process(tiny_folders, tiny_reference):
    threads = torch.get_num_threads()
    assert _greedy(tiny_folders["llama"], TINY_PROMPTS, tensor_parallel_size=2,
                   pipeline_parallel_size=2) == tiny_reference["llama"]
    # rank 0 ran in this process on its share of the cores (1 of 4 ranks); closing gives them back
    assert torch.get_num_threads() == threads


@pytest.fixture(scope="module")
def smollm2_reference() -> list[list[int]]:
    return _greedy("smollm2-135m", PROMPTS)


# the real model's runs take about two minutes on 2 cores: with the long runs `.ci/run` runs after the suite
@pytest.mark.reliability
@pytest.mark.parametrize("sizes", [dict(tensor_parallel_size=3), dict(pipeline_parallel_size=2),
                                   dict(pipeline_parallel_size=3)], ids=["tp3", "pp2", "pp3"])
def test_smollm2_matches_one_process(smollm2_reference, sizes):
    assert _greedy("smollm2-135m", PROMPTS, **sizes) == smollm2_reference


def test_a_model_that_does_not_split_evenly_is_refused():
    config = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                         max_position_embeddings=2048, norm_eps=1e-5)
    check_tensor_parallel(config, 3)
    with pytest.raises(ValueError, match="9 attention heads"):
        check_tensor_parallel(config, 2)
    with pytest.raises(ValueError, match="3 KV heads"):
        check_tensor_parallel(ModelConfig(**{**config.__dict__, "num_attention_heads": 12}), 4)


def test_stage_split_follows_bytes_and_budgets():
    # 6 layers of 10 bytes, stage 0 also holding 20: equal budgets balance the bytes (40 / 40)
    assert split_layers([10] * 6, 20, [100, 100]).layers == (range(0, 2), range(2, 6))
    # stage 1 with half stage 0's memory gets about half as many bytes
    assert split_layers([10] * 6, 0, [200, 100]).layers == (range(0, 4), range(4, 6))
    with pytest.raises(ValueError, match="do not fit"):
        split_layers([10] * 6, 20, [30, 30])
    with pytest.raises(ValueError, match="at least as many layers"):
        split_layers([10] * 2, 0, [100] * 3)


def test_each_tensor_rank_holds_a_third_of_smollm2s_weights(smollm2_path, smollm2_fp32):
    """The three TP=3 shards, loaded in this process (loading needs no collective): each holds its rows or
    columns of the whole model's tensors, and about a third of its bytes (the norms are replicated)."""
    reader = open_gguf(smollm2_path)
    config = gguf_model_config(reader)
    whole = dict(smollm2_fp32.named_parameters())
    total = held_weight_bytes(smollm2_fp32)
    for rank in range(3):
        shard = ModelShard(config.num_hidden_layers, range(config.num_hidden_layers), TensorParallelGroup(rank, 3))
        model = build_model(config, gguf_tensors(reader, config), torch.float32, torch.device("cpu"), shard=shard)
        params = dict(model.named_parameters())
        rows = slice(rank * 192, (rank + 1) * 192)  # 3 of the 9 query heads, 64 wide; the one KV head
        qkv, whole_qkv = params["model.layers.7.self_attn.qkv_proj.weight"], whole["model.layers.7.self_attn.qkv_proj.weight"]
        assert torch.equal(qkv[:192], whole_qkv[rows])
        assert torch.equal(qkv[192:256], whole_qkv[576 + rank * 64 : 576 + (rank + 1) * 64])  # its K head
        assert torch.equal(params["model.layers.7.mlp.down_proj.weight"],
                           whole["model.layers.7.mlp.down_proj.weight"][:, rank * 512 : (rank + 1) * 512])
        assert torch.equal(params["model.embed_tokens.weight"],
                           whole["model.embed_tokens.weight"][rank * 16384 : (rank + 1) * 16384])
        assert abs(held_weight_bytes(model) / total - 1 / 3) < 0.01
