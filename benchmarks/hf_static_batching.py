"""The static-batching baseline: transformers' `generate` on the offline workload, in fixed batches with
left padding, every batch running until its longest requested output (that waste is what continuous
batching removes). Same token ids and lengths as `tinyserve bench offline` (tinyserve.bench.offline).

Output tokens counted are the ones asked for (sum of the requested lengths), so the number compares with
tinyserve's; `generated_tokens` adds the padding tokens a batch computes for its shorter requests.

    .venv/bin/python benchmarks/hf_static_batching.py [--num-prompts 256] [--batch-size 16]
"""

from __future__ import annotations

import argparse
import json
import time

from tinyserve.bench.config import OfflineBenchConfig
from tinyserve.config import EngineConfig
from tinyserve.bench.offline import offline_workload, peak_rss_mib


def _load(model: str, dtype: str):
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise SystemExit(f"the transformers baseline needs transformers and accelerate: pip install "
                         f"transformers accelerate ({exc})") from exc
    from tinyserve.loader.model_loader import resolve_model_path

    path = resolve_model_path(model)
    torch_dtype = getattr(torch, dtype)
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype).eval()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch_dtype).eval()


def _generate_batch(model, batch: list[tuple[list[int], int]], pad_id: int) -> int:
    """One left-padded batch run to its longest output with EOS ignored; returns the tokens generated."""
    import torch

    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids, _ in batch])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch])
    num_new = max(n for _, n in batch)
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=num_new,
                             min_new_tokens=num_new, do_sample=False, pad_token_id=pad_id)
    return (out.shape[1] - width) * len(batch)


def run_hf_static(config: OfflineBenchConfig, batch_size: int = 16) -> dict:
    import torch

    model = _load(config.engine.model, config.engine.dtype)
    pad_id = model.generation_config.pad_token_id or model.config.eos_token_id or 0
    pad_id = pad_id[0] if isinstance(pad_id, list) else pad_id
    _generate_batch(model, [(list(range(1, 17)), config.num_warmup_tokens or 1)], pad_id)  # warm-up
    workload = offline_workload(config)
    start = time.perf_counter()
    generated = sum(_generate_batch(model, workload[i:i + batch_size], pad_id)
                    for i in range(0, len(workload), batch_size))
    elapsed = time.perf_counter() - start
    num_output = sum(n for _, n in workload)
    num_input = sum(len(ids) for ids, _ in workload)
    return {
        "bench": "offline", "engine": "transformers-static", "model": config.engine.model,
        "dtype": config.engine.dtype,
        "device": "cpu", "torch_threads": torch.get_num_threads(), "num_prompts": config.num_prompts,
        "batch_size": batch_size, "seed": config.seed, "input_tokens": num_input, "output_tokens": num_output,
        "generated_tokens": generated, "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(num_output / elapsed, 2),
        "total_tokens_per_s": round((num_input + num_output) / elapsed, 2),
        "requests_per_s": round(len(workload) / elapsed, 3), "peak_rss_mib": round(peak_rss_mib(), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=OfflineBenchConfig.model)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=[64, 512], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len-range", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = OfflineBenchConfig(EngineConfig(args.model, args.dtype), num_prompts=args.num_prompts, seed=args.seed,
                                input_len_range=tuple(args.input_len_range),
                                output_len_range=tuple(args.output_len_range))
    print(json.dumps(run_hf_static(config, args.batch_size)), flush=True)


if __name__ == "__main__":
    main()
