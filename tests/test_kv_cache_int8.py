"""The 8-bit KV pool (`--kv-cache-dtype int8`): rows rounded with their own scale, read back by the C++ decode
kernel and by the prefill gather exactly as code x scale, ~1.9x the blocks in the same budget, and an engine
whose outputs stay within the rounding of the float pool's."""

import dataclasses

import pytest
import torch
import transformers as tf

from tinyserve import LLM, SamplingParams
from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.engine.memory.sizing import kv_bytes_per_token, kv_pool_dtype
from tinyserve.engine.greedy_reference import forward_sequence
from tinyserve.layers import ops
from tinyserve.server.registry.model_slot import _kv_bytes
from tinyserve.layers.attention import paged_attention, reference_paged_attention
from tinyserve.layers.kv_cache import (KV_INT8_MAX, KVCache, dequantize_rows, gather_kv, kv_row_bytes,
                                       quantize_rows, write_kv)

from test_attention import MIXES, _build
from test_llama import PROMPTS as LLAMA_PROMPTS


def test_quantize_rows_rounds_each_row_to_its_own_absmax():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=gen) * torch.logspace(-3, 2, 50).view(50, 1, 1)
    x[7, 1] = 0.0  # a row of zeros: scale 0, codes 0
    codes, scale = quantize_rows(x)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float16 and scale.shape == (50, 3)
    assert codes.abs().max() == KV_INT8_MAX and codes.min() >= -KV_INT8_MAX
    assert (codes.abs().amax(-1)[scale > 0] >= KV_INT8_MAX - 1).all()  # each row's largest is (about) +-127
    assert scale[7, 1] == 0 and (codes[7, 1] == 0).all()
    back = dequantize_rows(codes, scale, torch.float32)
    # within half a step of the row's own scale (the float16 scale is what both sides use)
    assert ((back - x).abs() <= scale.float().unsqueeze(-1) * 0.5 + 1e-7).all()


def _int8_copy(cache: KVCache) -> KVCache:
    """The same K/V written into an int8 pool of the same shape."""
    key, value = quantize_rows(cache.key), quantize_rows(cache.value)
    return KVCache(key[0], value[0], key[1], value[1])


def test_gather_kv_reads_code_times_scale():
    cache, meta, *_ = _build([(9, 1), (0, 5), (6, 4)], torch.float32, seed=1)
    q8 = _int8_copy(cache)
    table = meta.groups[0].block_tables[2]
    k, v = gather_kv(q8, table, 10, first=3, dtype=torch.bfloat16)
    k_ref, v_ref = gather_kv(cache, table, 10, first=3)
    assert k.dtype == torch.bfloat16 and k.shape == k_ref.shape
    scale_k = q8.key_scale.view(q8.key.shape[0], -1)  # the error is at most half a row's step
    assert (k.float() - k_ref).abs().max() <= scale_k.float().max() * 0.5 + 0.02 * k_ref.abs().max()
    exact_k, exact_v = gather_kv(q8, table, 10, first=3)  # float32: exactly code x scale
    blocks = table[: -(-10 // 4)]
    rows = q8.key[:, blocks].reshape(q8.key.shape[0], -1, q8.key.shape[-1])[:, 3:10].float()
    row_scales = q8.key_scale[:, blocks].reshape(q8.key.shape[0], -1)[:, 3:10].float()
    torch.testing.assert_close(exact_k, rows * row_scales.unsqueeze(-1), rtol=0, atol=0)
    torch.testing.assert_close(exact_v, dequantize_rows(
        q8.value[:, blocks].reshape(q8.key.shape[0], -1, q8.key.shape[-1])[:, 3:10],
        q8.value_scale[:, blocks].reshape(q8.key.shape[0], -1)[:, 3:10], torch.float32), rtol=0, atol=0)


def _int8_pool(heads=2, blocks=4, block=4, dim=16) -> KVCache:
    return KVCache(torch.zeros(heads, blocks, block, dim, dtype=torch.int8),
                   torch.zeros(heads, blocks, block, dim, dtype=torch.int8),
                   torch.zeros(heads, blocks, block, dtype=torch.float16),
                   torch.zeros(heads, blocks, block, dtype=torch.float16))


def test_write_kv_into_an_int8_pool_stores_codes_and_scales():
    pool = _int8_pool()
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    slots = torch.tensor([13, 2, 6])
    write_kv(pool, k, v, slots)
    codes, scale = quantize_rows(k)
    assert torch.equal(pool.key.view(2, -1, 16)[:, slots], codes.transpose(0, 1))
    assert torch.equal(pool.key_scale.view(2, -1)[:, slots], scale.transpose(0, 1))
    assert torch.equal(pool.value.view(2, -1, 16)[:, slots], quantize_rows(v)[0].transpose(0, 1))
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert (pool.key.view(2, -1, 16)[:, untouched] == 0).all() and (pool.key_scale.view(2, -1)[:, untouched] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 64, 80])
def test_the_write_kernel_gives_the_formulas_codes_and_scales(dtype, dim):
    """csrc/kv_write.cpp against kv_cache.write_kv's torch formula, bit for bit: rows over six decades, a zero
    row, a head_dim that is no multiple of the vector width; K and V read in place from a qkv-like buffer
    (rows strided by its width)."""
    gen = torch.Generator().manual_seed(dim)
    qkv = torch.randn(12, 7, dim, generator=gen)
    qkv[:, 3:5] *= torch.logspace(-4, 2, 12).view(12, 1, 1)
    qkv = qkv.to(dtype)
    qkv[3, 3] = 0.0
    k, v = qkv[:, 3:5], qkv[:, 5:7]
    slots = torch.randperm(16, generator=gen)[:12]
    want, got = _int8_pool(dim=dim), _int8_pool(dim=dim)
    write_kv(want, k, v, slots)
    ops.write_kv(got, k, v, slots)
    for name in ("key", "value", "key_scale", "value_scale"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.key_scale.view(2, -1)[:, slots] > 0).sum() == 23  # all but the zero row


def test_the_write_kernel_refuses_a_slot_outside_the_pool():
    pool = _int8_pool()
    with pytest.raises(RuntimeError, match=r"slot_mapping\[1\] = 16 is outside the pool \[0, 16\)"):
        ops.cpu_kernels.write_kv(*torch.randn(2, 2, 2, 16), pool.key, pool.value, torch.tensor([0, 16]),
                                 pool.key_scale, pool.value_scale)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        ops.cpu_kernels.write_kv(*torch.randn(2, 2, 3, 16), pool.key, pool.value, torch.tensor([0, 1]),
                                 pool.key_scale, pool.value_scale)
    with pytest.raises(RuntimeError, match="both scales or neither"):
        ops.cpu_kernels.write_kv(*torch.randn(2, 2, 2, 16), pool.key, pool.value, torch.tensor([0, 1]),
                                 pool.key_scale)
    with pytest.raises(RuntimeError, match="float pool must be in x's dtype"):
        ops.cpu_kernels.write_kv(*torch.randn(2, 2, 2, 16), pool.key, pool.value, torch.tensor([0, 1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_write_kernel_copies_k_and_v_into_a_float_pool(dtype):
    """A float pool: the kernel's one call per layer against the formula's two index_copy_, on K and V
    views of a qkv-like buffer."""
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(6, 4, 32, generator=gen).to(dtype)
    k, v = qkv[:, 2:3], qkv[:, 3:4]
    slots = torch.tensor([9, 0, 31, 4, 17, 8])
    want, got = (KVCache(torch.zeros(1, 8, 4, 32, dtype=dtype), torch.zeros(1, 8, 4, 32, dtype=dtype)) for _ in "ab")
    write_kv(want, k, v, slots)
    ops.write_kv(got, k, v, slots)
    assert torch.equal(got.key, want.key) and torch.equal(got.value, want.value)
    assert torch.equal(got.key.view(-1, 32)[slots], k[:, 0]) and got.key.view(-1, 32)[1].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("mix", range(len(MIXES)))
def test_attention_over_an_int8_pool_matches_the_reference_on_the_same_codes(mix, window, dtype):
    """Decodes through the C++ kernel (scales folded into scores and weights), prefill chunks through the
    gather, against the float32 reference over the same int8 pool (which dequantizes as it gathers)."""
    cache, meta, q, k_new, v_new, _ = _build(MIXES[mix], dtype, seed=mix, cpu_attention=True, window=window)
    q8 = _int8_copy(cache)
    meta8 = dataclasses.replace(meta, kv_caches=(q8,))
    got = paged_attention(q, q8, meta8, meta8.groups[0], 0.25, k_new, v_new, window)
    want = reference_paged_attention(q, q8, meta8, 0.25, window)
    # prefill chunks without a cached prefix read their own unrounded K/V (as vLLM's do): compare the rest
    start, rows = 0, []
    for q_len, seq_len in zip(meta.query_lens_host, meta.seq_lens_host):
        if q_len != seq_len:
            rows += range(start, start + q_len)
        start += q_len
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[rows].float(), want[rows].float(), rtol=tol, atol=tol)


def test_the_kernel_refuses_an_int8_pool_without_scales():
    cache, meta, q, *_ = _build([(7, 1)], torch.float32, cpu_attention=True)
    q8 = _int8_copy(cache)
    tables, lens = meta.groups[0].block_tables, meta.seq_lens
    with pytest.raises(RuntimeError, match="needs key_scale and value_scale"):
        ops.cpu_kernels.paged_attention(q, q8.key, q8.value, tables, lens, 0.25)
    with pytest.raises(RuntimeError, match="scales must be contiguous float16"):
        ops.cpu_kernels.paged_attention(q, q8.key, q8.value, tables, lens, 0.25, None,
                                               q8.key_scale.float(), q8.value_scale.float())


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, hf_smollm2_tokenizer) -> str:
    """A small random Llama (head_dim 32, GQA) with SmolLM2's tokenizer, saved as a checkpoint folder."""
    config = tf.LlamaConfig(vocab_size=len(hf_smollm2_tokenizer), hidden_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, intermediate_size=192,
                            max_position_embeddings=512, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config)
    with torch.no_grad():  # spread the logits, so that greedy ties are rare
        for param in model.parameters():
            param.normal_(0, 0.3)
    folder = tmp_path_factory.mktemp("int8-kv")
    model.save_pretrained(folder, safe_serialization=True)
    hf_smollm2_tokenizer.save_pretrained(folder)
    return str(folder)


def _config(folder):
    from tinyserve.loader.hf import hf_model_config

    return hf_model_config(folder)


def test_an_int8_pool_takes_about_half_the_bytes_per_token(tiny_folder):
    config = _config(tiny_folder)
    assert kv_row_bytes(64, torch.bfloat16) == 128 and kv_row_bytes(64, torch.int8) == 66
    assert kv_pool_dtype(CacheConfig(kv_cache_dtype="int8"), torch.bfloat16) == torch.int8
    assert kv_pool_dtype(CacheConfig(), torch.bfloat16) == torch.bfloat16
    ratio = kv_bytes_per_token(config, torch.bfloat16) / kv_bytes_per_token(config, torch.int8)
    assert ratio == 2 * config.head_dim / (config.head_dim + 2)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8"):
        CacheConfig(kv_cache_dtype="fp8")


PROMPTS = ["The quick brown fox", "Once upon a time in a land far away, there lived", "1 2 3 4 5 6 7 8"]


def test_engine_with_an_int8_pool_holds_more_blocks_and_stays_near_the_float_pool(tiny_folder):
    """Same budget, ~1.9x the blocks; greedy outputs' logprobs within the rounding of the float pool's,
    through chunked prefill, prefix hits and batched decodes; and every block back at the end."""
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True)
    prompts = PROMPTS + [PROMPTS[1] + " a king"]  # shares a cached prefix with the second
    outs = {}
    for kv in ("auto", "int8"):
        llm = LLM(str(tiny_folder), dtype="float32", kv_cache_memory=0.01, kv_cache_dtype=kv,
                  max_num_batched_tokens=8)
        outs[kv] = (llm.engine.block_manager.num_blocks, llm.generate(prompts, params))
        manager = llm.engine.block_manager
        assert manager.num_free_blocks == manager.num_blocks  # nothing leaked
        # what /metrics and the memory figures report as the pool's bytes: codes and scales
        pool_dtype = torch.int8 if kv == "int8" else torch.float32
        assert _kv_bytes(llm.engine) == manager.num_blocks * 16 * kv_bytes_per_token(_config(tiny_folder), pool_dtype)
    (float_blocks, float_outs), (int8_blocks, int8_outs) = outs["auto"], outs["int8"]
    head_dim = _config(tiny_folder).head_dim  # float32 rows are 4 bytes an element, int8 rows 1 and a scale
    assert int8_blocks / float_blocks == pytest.approx(4 * head_dim / (head_dim + 2), rel=0.01)
    for f, q in zip(float_outs, int8_outs):
        f_ids, q_ids = f.outputs[0].token_ids, q.outputs[0].token_ids
        n = next((i for i, (a, b) in enumerate(zip(f_ids, q_ids)) if a != b), len(f_ids))
        for a, b in zip(f.outputs[0].logprobs[:n], q.outputs[0].logprobs[:n]):
            assert abs(a.logprob - b.logprob) < 0.05


def _greedy_with_logprobs(loaded, kv_cache_dtype: str) -> list[tuple[list[int], list]]:
    # chunks of 32 tokens: the long prompts prefill over several steps, reading their own rounded prefix
    config = EngineConfig(cache=CacheConfig(num_blocks=256, kv_cache_dtype=kv_cache_dtype),
                          scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=32, max_model_len=1024))
    engine = LLMEngine(config, loaded=loaded)
    params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=2, ignore_eos=True)
    for i, prompt in enumerate(LLAMA_PROMPTS):
        engine.add_request(str(i), prompt, params)
    results = {i: ([], []) for i in range(len(LLAMA_PROMPTS))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids, logprobs = results[int(out.request_id)]
            ids += out.new_token_ids
            logprobs += out.logprobs
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "leaked KV blocks"
    engine.close()
    return [results[i] for i in range(len(LLAMA_PROMPTS))]


def test_smollm2_greedy_over_an_int8_pool_flips_only_near_ties(smollm2_loaded):
    """The real model in float32, its suite prompts chunked and batched: before the first differing token
    every logprob is within 0.2 of the float pool's, and a differing token was within 0.15 of the float
    pool's choice (a near-tie, which any rounding may flip)."""
    float_runs = _greedy_with_logprobs(smollm2_loaded, "auto")
    int8_runs = _greedy_with_logprobs(smollm2_loaded, "int8")
    same = 0
    for (f_ids, f_lp), (q_ids, q_lp) in zip(float_runs, int8_runs):
        n = next((i for i, (a, b) in enumerate(zip(f_ids, q_ids)) if a != b), len(f_ids))
        same += n
        for a, b in zip(f_lp[:n], q_lp[:n]):
            assert abs(a.logprob - b.logprob) < 0.2  # measured: up to 0.105 over these prompts
        if n < len(f_ids):
            top = dict(f_lp[n].top)
            assert q_ids[n] in top and top[f_ids[n]] - top[q_ids[n]] < 0.15
    assert same >= 0.75 * sum(len(ids) for ids, _ in float_runs)


def test_int8_pool_logits_stay_near_the_float_pool(smollm2_loaded):
    """Decoding token by token through the C++ kernel over an int8 pool (the reference loop, no scheduler):
    the real model's log-probabilities move by the rounding, and no further."""
    model = smollm2_loaded.model
    ids = smollm2_loaded.tokenizer.encode(LLAMA_PROMPTS[4])[:48]
    ref = forward_sequence(model, ids, step_tokens=1, cpu_attention=True)
    got = forward_sequence(model, ids, step_tokens=1, cpu_attention=True, kv_dtype=torch.int8)
    ref, got = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (ref.exp() * (ref - got)).sum(-1)  # KL(float pool || int8 pool) at each position
    assert kl.min() > 0  # rounded: not the float pool itself
    assert kl.max() < 0.02 and kl.median() < 0.002  # measured here: 0.0044 and 0.0003
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95


def test_cuda_or_torch_decode_paths_refuse_an_int8_pool(tiny_folder):
    with pytest.raises(ValueError, match="--kv-cache-dtype int8 needs our C\\+\\+ decode kernel"):
        LLM(str(tiny_folder), dtype="float16", kv_cache_memory=0.01, kv_cache_dtype="int8")
