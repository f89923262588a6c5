"""The default model (Llama architecture, GGUF Q4_1) against transformers loading the same file."""

import pytest
import torch

from tinyserve.engine.greedy_reference import forward_sequence, greedy_generate

_PARAGRAPH = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring "
    "panels; later, stored programs let a single machine run many tasks. def fib(n):\n    return n if n < 2 "
    "else fib(n - 1) + fib(n - 2)\n Compilers, operating systems and networks each hid a layer of detail. "
    "北京是中国的首都。 Numbers like 3.14159 and 2,718 appear too! "
)
PROMPTS = [
    "Hello there, my friend",
    "The capital of France is",
    "Write a Python function that reverses a string.",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a land far away, " * 6,
    _PARAGRAPH * 2,
    _PARAGRAPH * 4,
    _PARAGRAPH * 3 + "The end of the story is near. " * 12,
]


@pytest.fixture(scope="module")
def prompt_ids(hf_smollm2_tokenizer):
    ids = [hf_smollm2_tokenizer(p)["input_ids"] for p in PROMPTS]
    lengths = [len(i) for i in ids]
    assert min(lengths) >= 5 and max(lengths) <= 500 and min(lengths) <= 8 and max(lengths) >= 400, lengths
    return ids


def test_float32_logits_match_transformers(smollm2_fp32, hf_smollm2, prompt_ids):
    worst = 0.0
    for ids in prompt_ids:
        ours = forward_sequence(smollm2_fp32, ids)
        with torch.no_grad():
            ref = hf_smollm2(torch.tensor([ids])).logits[0].float()
        worst = max(worst, (ours - ref).abs().max().item())
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    print(f"max |logit diff| over {len(prompt_ids)} prompts: {worst:.2e}")
    assert worst <= 1e-3


def test_float32_greedy_matches_transformers_generate(smollm2_fp32, hf_smollm2, prompt_ids):
    eos = hf_smollm2.generation_config.eos_token_id
    eos = frozenset([eos] if isinstance(eos, int) else eos)
    for ids in prompt_ids:
        ours = greedy_generate(smollm2_fp32, ids, 64, eos_token_ids=eos)
        with torch.no_grad():
            ref = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
        assert ours == ref[0, len(ids):].tolist()


def test_bfloat16_greedy_agrees_within_top5(smollm2_fp32, smollm2_bf16, prompt_ids):
    """vLLM's check_logprobs_close rule: at the first divergence each side's token is in the other's top 5."""
    agreed = total = 0
    for ids in prompt_ids:
        ref = greedy_generate(smollm2_fp32, ids, 32)
        low = greedy_generate(smollm2_bf16, ids, 32)
        same = next((i for i, (a, b) in enumerate(zip(ref, low)) if a != b), len(ref))
        agreed, total = agreed + same, total + len(ref)
        if same == len(ref):
            continue
        prefix = ids + ref[:same]
        top_ref = forward_sequence(smollm2_fp32, prefix)[-1].topk(5).indices.tolist()
        top_low = forward_sequence(smollm2_bf16, prefix)[-1].topk(5).indices.tolist()
        assert low[same] in top_ref and ref[same] in top_low
    print(f"bf16 greedy agreement before first divergence: {agreed}/{total} = {agreed / total:.1%}")
