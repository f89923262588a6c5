"""A checkpoint of SmolLM2-135M's shape (Llama, 30 layers, 9 query / 3 KV heads, tied embeddings, its
tokenizer) with random weights, for the GPU check: the real GGUF (94 MB) cannot travel to the GPU machine
with the working tree, and a model's speed and its CPU-vs-GPU agreement need its shape, not its training.

Weights are scaled so that every layer keeps its activations near unit size (linears N(0, 1/fan_in)) and
the logits spread over tens of units (EMBED_STD): greedy ties, which would make two devices disagree by
rounding alone, are then rare, and the tokens depend on the context.

    python benchmarks/random_smollm2.py OUT_FOLDER [--tokenizer FOLDER]

--tokenizer: a saved Hugging Face tokenizer folder (`make gpu-check-prepare` writes .gpu-check/tokenizer);
without it, SmolLM2's tokenizer is read from the default model's GGUF.
"""

from __future__ import annotations

import argparse
import math

import torch
import transformers as tf

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


# The embedding is tied to the LM head. Small in the residual stream (so that the layers, not the input
# token, decide the next token: with unit embeddings a random model repeats its input), and the final norm's
# weight scales the head's logits back up to a spread of tens of units.
EMBED_STD = 0.05


def load_tokenizer(folder: str | None):
    if folder:
        return tf.AutoTokenizer.from_pretrained(folder)
    from tinyserve.loader.model_loader import resolve_model_path

    path = resolve_model_path("smollm2-135m")
    return tf.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def save_random_smollm2(out: str, tokenizer_folder: str | None = None, seed: int = 0) -> str:
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMOLLM2_135M))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name == "model.norm.weight":
                param.fill_(1.0 / EMBED_STD)
            elif "norm" in name:
                param.fill_(1.0)
            elif "embed_tokens" in name:
                param.normal_(0.0, EMBED_STD)
            else:
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[1]))
    model.save_pretrained(out, safe_serialization=True)
    load_tokenizer(tokenizer_folder).save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--tokenizer", default=None)
    args = parser.parse_args()
    print(save_random_smollm2(args.out, args.tokenizer))


if __name__ == "__main__":
    main()
