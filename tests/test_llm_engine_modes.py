"""The engine in each mode users get: float32, bfloat16 (the default on a CPU with bf16 kernels) and int4
weights (--quantization int4), on a tiny random Llama loaded as a checkpoint is (build_model quantizes
the linears for int4; bfloat16 packs them for our matmul kernel). Batch invariance under queueing,
chunked prefill and preemption, and prefix caching, each against the same requests run without them.

The comparison is the model's logits for every sampled token, not only the tokens. float32 agrees to
rounding. bfloat16 and int4 legitimately do not agree bit for bit: a token computed in a chunk of
another size, or recomputed after preemption inside a prefill instead of as a decode, goes through
other kernels (SDPA instead of the decode kernel) and other summation orders (our bf16 kernel keeps
more accumulators for fewer tokens per pass), so its K/V rounds to a neighbouring bfloat16 value; int4
also rounds each group of activations to int8, where such a difference can move a rounding step. So
logits must agree within the tolerances stated in MODES, and a run may pick another token only where
the oracle's two candidates are within that tolerance (a near tie); after it the runs go on with
different tokens and are compared no further.

bfloat16 and int4 run on every CPU at this size: without AVX512-BF16 / VNNI our kernels take their
AVX2 or portable loops (conftest's smollm2_bf16 skips only whole runs of the default model, for their time)."""

import random
from functools import partial

import pytest
import torch
import transformers as tf

from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.layers.kernels import cpu_kernels
from tinyserve.layers.linear import pack_linear_weights
from tinyserve.loader.hf import hf_ignored, hf_model_config, hf_tensors
from tinyserve.loader.model_loader import LoadedModel, build_model
from tinyserve.types import SamplingParams

VOCAB = 512
# mode -> (dtype, quantization, and two bounds on the logits' error as a fraction of the oracle row's
# max |logit|: on any one row (a wrong token's K/V shows there), and its RMS over every compared row (a
# small error everywhere, a precision bug, shows there). Seen here (AMD EPYC, our kernels' portable
# loops): max 4.5e-7, 1.0%, 2.9% and RMS 5e-8, 5.2e-4, 2.9e-3; rounding the bf16 kernel's partial sums
# to bf16 in multi-token passes made bfloat16's max 2.5% and its RMS 3.2e-3.
MODES = {"float32": (torch.float32, None, 1e-5, 1e-6), "bfloat16": (torch.bfloat16, None, 0.03, 1.5e-3),
         "int4": (torch.bfloat16, "int4", 0.08, 1e-2)}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=96, max_position_embeddings=256,
                            tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(config)
    with torch.no_grad():  # larger than transformers' init, so that logits spread and ties are rare
        for param in hf.parameters():
            param.normal_(0, 0.2)
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module", params=list(MODES))
def mode(request):
    return request.param


@pytest.fixture(scope="module")
def loaded(tiny_folder, mode, word_tokenizer) -> LoadedModel:
    dtype, quantization, _, _ = MODES[mode]
    config = hf_model_config(tiny_folder)
    model = build_model(config, hf_tensors(tiny_folder), dtype, torch.device("cpu"),
                        ignore=partial(hf_ignored, config=config), quantization=quantization)
    if dtype == torch.bfloat16 and quantization is None and cpu_kernels.load() is not None:
        # what build_model does where oneDNN has bf16 kernels (a no-op there): our kernel's layout
        pack_linear_weights(model)
    return LoadedModel(model, config, word_tokenizer(VOCAB), tiny_folder)


def make_engine(loaded, *, num_blocks=64, block_size=8, max_num_seqs=8, budget=512, prefix_caching=True):
    config = EngineConfig(
        cache=CacheConfig(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=120),
    )
    return LLMEngine(config, loaded=loaded)


def run(engine, prompts, params, first_index=0) -> dict[int, tuple[list[int], int]]:
    """Submit all at once (ids first_index...), step to the end: {index: (token ids, cached prompt tokens)}."""
    for i, (prompt, p) in enumerate(zip(prompts, params), start=first_index):
        engine.add_request(str(i), prompt, p)
    tokens, cached = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(int(out.request_id), []).extend(out.new_token_ids)
            if out.finished:
                cached[int(out.request_id)] = out.usage.cached_tokens
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, "leaked KV blocks"
    return {i: (tokens[i], cached[i]) for i in tokens}


def compared_steps(label, oracle_ids, oracle_logits, ids, logits, bound) -> tuple[int, bool]:
    """Assert that a run agrees with its oracle token by token, as the module docstring says. Returns how
    many leading tokens were compared, and whether the run then took another token at a near tie."""
    assert len(ids) == len(oracle_ids) == len(logits) == len(oracle_logits), label
    for step, (expected, got) in enumerate(zip(oracle_ids, ids)):
        ref = oracle_logits[step]
        scale = ref.abs().max().item()
        diff = (logits[step] - ref).abs().max().item()
        assert diff <= bound * scale, (f"{label}: logits differ by {diff / scale:.2g} of their max (bound "
                                       f"{bound:g}) at output token {step}")
        if got != expected:
            gap = (ref[expected] - ref[got]).item()
            assert gap <= bound * scale, (f"{label}: token {got} instead of {expected} at output token {step}, "
                                          f"where the oracle's logits differ by {gap / scale:.2g} of their max "
                                          f"(bound {bound:g}): not a near tie")
            return step + 1, True
    return len(ids), False


def assert_runs_agree(mode, runs, oracle_runs, logits, oracle_logits) -> None:
    """runs / oracle_runs: {index: (token ids, _)}; logits: the recorded rows of each."""
    _, _, max_bound, rms_bound = MODES[mode]
    errors, diverged = [], []
    for i, (oracle_ids, _) in oracle_runs.items():
        key = (str(i), 0)
        n, is_diverged = compared_steps(f"{mode}, request {i}", oracle_ids, oracle_logits[key], runs[i][0],
                                        logits[key], max_bound)
        errors += [(logits[key][j] - oracle_logits[key][j]) / oracle_logits[key][j].abs().max() for j in range(n)]
        if is_diverged:
            diverged.append(i)
    rms = torch.stack(errors).pow(2).mean().sqrt().item()
    assert rms <= rms_bound, f"{mode}: RMS error of the logits {rms:.2g} of their max (bound {rms_bound:g})"
    # near ties are rare: if most requests left their oracle, the comparison above compared little
    assert len(diverged) <= (0 if mode == "float32" else len(oracle_runs) // 4), f"{mode}: {diverged} diverged"


def test_batch_invariance_under_queueing_chunking_and_preemption(loaded, mode, record_logits):
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(5, 100))] for _ in range(16)]
    params = [SamplingParams(max_tokens=rng.randint(1, 16), temperature=0.0, ignore_eos=True) for _ in prompts]
    # 16 blocks x 8 = 128 tokens for 16 requests of up to 116: queueing, preemption, and chunks of at
    # most 24 tokens, which end inside a block
    busy = make_engine(loaded, num_blocks=16, max_num_seqs=6, budget=24)
    busy_logits = record_logits(busy)
    together = run(busy, prompts, params)
    assert busy.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    # the oracle: one request at a time, each prompt in one step, nothing cached
    alone = make_engine(loaded, prefix_caching=False)
    alone_logits = record_logits(alone)
    oracle = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        oracle |= run(alone, [prompt], [p], first_index=i)
    assert all(len(oracle[i][0]) == p.max_tokens for i, p in enumerate(params))
    assert_runs_agree(mode, together, oracle, busy_logits, alone_logits)


def test_prefix_caching_hits_and_matches_a_run_without_it(loaded, mode, record_logits):
    """Requests sharing a 40-token prefix (5 blocks) reuse its blocks; X + Y and Y + X share no block
    (a block's cache entry stands for its whole prefix, not its own tokens)."""
    rng = random.Random(3)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    shared, x, y = tokens(40), tokens(16), tokens(16)
    first = [shared + tokens(5), x + y + tokens(4)]
    rest = [shared + tokens(rng.randint(1, 9)) for _ in range(5)] + [y + x + tokens(4)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    runs, logits = {}, {}
    for caching in (True, False):
        engine = make_engine(loaded, prefix_caching=caching)
        logits[caching] = record_logits(engine)
        runs[caching] = (run(engine, first, [params] * len(first))
                         | run(engine, rest, [params] * len(rest), first_index=len(first)))
    assert_runs_agree(mode, runs[True], runs[False], logits[True], logits[False])
    cached = [runs[True][i][1] for i in range(len(first + rest))]
    assert cached == [0, 0] + [40] * 5 + [0], f"cached prompt tokens of each request: {cached}"
