"""The GPU check's offline benchmark (`make gpu-check`; docs/GPU.md): on one CUDA device, in one process,

- tinyserve's output tokens/s with 1, 16, 64 and 256 sequences at once (bfloat16, CUDA graphs on);
- TPOT of one sequence with CUDA graphs and with --enforce-eager;
- transformers' `generate` on the same 256 sequences in static batches (the same GPU, bfloat16, SDPA): of 16,
  as benchmarks/hf_static_batching.py batches on CPU (the issue's bar is against these), and as one batch
  of 256 (no batch waits on another: the most this baseline can do).

Every sequence has a 128-token prompt of random ids and 128 output tokens (EOS ignored). Prints one JSON
object and writes it to --json.

    python benchmarks/gpu_offline.py --model FOLDER [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from tinyserve import LLM, SamplingParams

PROMPT_LEN, OUTPUT_LEN = 128, 128
BATCHES = (1, 16, 64, 256)


def _prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(PROMPT_LEN)] for _ in range(n)]


def _timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(r.token_ids) == max_tokens for r in results)
    return elapsed


def _tpot_ms(llm: LLM, vocab: int) -> float:
    """(time of 1 + OUTPUT_LEN tokens - time of 1 token) / OUTPUT_LEN for one sequence, medians of 3."""
    prompt = _prompts(1, vocab, 99)
    first = sorted(_timed(llm, prompt, 1) for _ in range(3))[1]
    whole = sorted(_timed(llm, prompt, 1 + OUTPUT_LEN) for _ in range(3))[1]
    return (whole - first) / OUTPUT_LEN * 1000


def run_tinyserve(model: str) -> dict:
    out: dict = {}
    keywords = dict(dtype="bfloat16", device="cuda", kv_cache_memory=16.0, max_num_seqs=256,
                    max_num_batched_tokens=8192, max_model_len=2048)
    start = time.perf_counter()
    with LLM(model, **keywords) as llm:
        out["start_s"] = round(time.perf_counter() - start, 1)
        graphs = llm.engine.runner.stage.decode_graphs
        out["graph_batch_sizes"] = graphs.sizes if graphs is not None else []
        vocab = llm.engine.model_config.vocab_size
        _timed(llm, _prompts(8, vocab, 1), 8)  # warm-up: Triton compiles its prefill variants
        for n in BATCHES:
            elapsed = _timed(llm, _prompts(n, vocab, n), OUTPUT_LEN)
            out[f"output_tok_s_{n}"] = round(n * OUTPUT_LEN / elapsed, 1)
        out["tpot_ms_graphs"] = round(_tpot_ms(llm, vocab), 3)
    with LLM(model, **keywords, enforce_eager=True) as llm:
        _timed(llm, _prompts(2, vocab, 1), 4)
        out["tpot_ms_eager"] = round(_tpot_ms(llm, vocab), 3)
    out["tpot_graphs_over_eager"] = round(out["tpot_ms_graphs"] / out["tpot_ms_eager"], 3)
    return out


def run_transformers(model: str, vocab: int) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()

    def generate(prompts: list[list[int]]) -> float:
        ids = torch.tensor(prompts, device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=OUTPUT_LEN,
                              min_new_tokens=OUTPUT_LEN, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        assert out.shape[1] == PROMPT_LEN + OUTPUT_LEN
        return time.perf_counter() - start

    generate(_prompts(4, vocab, 1))  # warm-up
    n = BATCHES[-1]
    prompts = _prompts(n, vocab, n)
    out = {}
    for batch in (16, n):
        elapsed = sum(generate(prompts[i : i + batch]) for i in range(0, n, batch))
        out[f"hf_static_batch_{batch}_output_tok_s_{n}"] = round(n * OUTPUT_LEN / elapsed, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN}
    result.update(run_tinyserve(args.model))
    torch.cuda.empty_cache()
    from transformers import AutoConfig

    result.update(run_transformers(args.model, AutoConfig.from_pretrained(args.model).vocab_size))
    n = BATCHES[-1]
    for batch in (16, n):
        result[f"speedup_vs_hf_static_batch_{batch}"] = round(
            result[f"output_tok_s_{n}"] / result[f"hf_static_batch_{batch}_output_tok_s_{n}"], 2)
    text = json.dumps(result, indent=1)
    print(text, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
