"""What each speed mode costs in quality, against the float32 reference: greedy agreement on 16 prompts
and perplexity on a fixed text (benchmarks/data/quality_text.txt). README "Speed modes" quotes it.

Both are computed one token per step, as decoding computes them: a quantized mode's int kernels serve
steps of at most a few tokens (layers/quant.py), so that is the path a stream's tokens come from; decode
attention runs in the engine's C++ kernel (layers/ops.py) in every mode but the reference.

- agreement: per prompt, 64 greedy tokens (chat template where the model has one, ignore EOS); "same
  tokens" is the share of all tokens before each prompt's first divergence from float32, "identical"
  counts prompts with all 64.
- perplexity: exp(mean negative log-likelihood) of the text's tokens after the first.

    .venv/bin/python benchmarks/quality.py --result-file benchmarks/results/quality.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from tinyserve.engine.greedy_reference import forward_sequence, greedy_generate
from tinyserve.layers.ops import cpu_attention_applies
from tinyserve.loader.model_loader import load_model
from tinyserve.models.registry import device_and_dtype

TEXT = Path(__file__).parent / "data" / "quality_text.txt"
# (name, dtype, weight quantization, KV pool dtype)
MODES = [("float32", "float32", None, None), ("bfloat16", "bfloat16", None, None),
         ("int8", "bfloat16", "int8", None), ("int4", "bfloat16", "int4", None),
         ("int8-kv", "bfloat16", None, torch.int8),  # --kv-cache-dtype int8 beside bfloat16 weights
         ("w4a16", "bfloat16", "w4a16", None),  # int4's codes, the activations unrounded bfloat16
         ("default", "auto", "auto", None)]  # what `tinyserve serve` runs: the file's codes, float32 activations
PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one paragraph.",
    "Give three tips for learning a new language.", "What is 17 times 23?",
    "Write a Python function that reverses a string.", "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.", "List the planets of the solar system in order.",
    "How do I make a cup of tea?", "What causes the seasons on Earth?", "Translate 'good morning' into Spanish.",
    "Describe a cat to someone who has never seen one.", "What is the difference between a list and a tuple?",
    "Write a short story opening about a lost key.", "What are the benefits of regular exercise?",
]


def perplexity(model, ids: list[int], cpu_attention: bool, kv_dtype: torch.dtype | None) -> float:
    logits = forward_sequence(model, ids, step_tokens=1, cpu_attention=cpu_attention, kv_dtype=kv_dtype)
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="mean")
    return math.exp(nll.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--result-file", type=Path, default=None)
    parser.add_argument("--modes", default="float32,bfloat16,int8,int4,int8-kv,w4a16,default",
                        help="which rows, comma-separated (float32, the reference, always runs first)")
    args = parser.parse_args()
    wanted = {"float32", *args.modes.split(",")}
    if unknown := wanted - {mode[0] for mode in MODES}:
        parser.error(f"unknown modes {sorted(unknown)}")
    records, reference = [], None
    print("| mode | identical prompts | same tokens before divergence | perplexity | vs float32 | first-token logits, max abs error |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, dtype, quantization, kv_dtype in [mode for mode in MODES if mode[0] in wanted]:
        start = time.perf_counter()
        loaded = load_model(args.model, dtype, "cpu", quantization)
        tokenizer = loaded.tokenizer
        # a base model's file has no chat template (Gemma 3 270M): its prompts are the questions as text
        prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}])
                                    if tokenizer.chat_template else p) for p in PROMPTS]
        # The speed modes decode as the engine does (our C++ decode attention on CPU); the float32
        # reference keeps the plain torch ops.
        device, model_dtype = device_and_dtype(loaded.model)
        kernel = dtype != "float32" and cpu_attention_applies(device, model_dtype, loaded.config.head_dim)
        outputs = [greedy_generate(loaded.model, ids, args.max_tokens, cpu_attention=kernel, kv_dtype=kv_dtype)
                   for ids in prompts]
        ppl = perplexity(loaded.model, tokenizer.encode(TEXT.read_text()), kernel, kv_dtype)
        # the first token comes from the prompt's prefill step: its logits, against float32's
        first_logits = [forward_sequence(loaded.model, ids, kv_dtype=kv_dtype)[-1] for ids in prompts]
        if reference is None:
            reference = {"outputs": outputs, "perplexity": ppl, "first_logits": first_logits}
        first_error = max((a - b).abs().max().item() for a, b in zip(first_logits, reference["first_logits"]))
        prefixes = [next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), len(ref))
                    for ref, out in zip(reference["outputs"], outputs)]
        record = {
            "mode": name, "dtype": dtype, "quantization": quantization,
            "kv_cache_dtype": "int8" if kv_dtype == torch.int8 else "auto",
            "identical_prompts": sum(p == args.max_tokens for p in prefixes), "num_prompts": len(PROMPTS),
            "same_tokens": sum(prefixes) / (len(PROMPTS) * args.max_tokens),
            "perplexity": round(ppl, 3), "perplexity_ratio": round(ppl / reference["perplexity"], 4),
            "first_token_logit_max_abs_error": round(first_error, 4),
            "seconds": round(time.perf_counter() - start, 1),
        }
        records.append(record)
        print(f"| {name} | {record['identical_prompts']}/{len(PROMPTS)} | {record['same_tokens']:.1%} | "
              f"{ppl:.3f} | {record['perplexity_ratio']:.3f}x | {first_error:.3f} |", flush=True)
        del loaded
    if args.result_file:
        args.result_file.write_text(json.dumps({"model": args.model, "max_tokens": args.max_tokens,
                                                "text": TEXT.name, "modes": records}, indent=2) + "\n")


if __name__ == "__main__":
    main()
