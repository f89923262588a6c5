"""Gemma 3 (text) against transformers' Gemma3ForCausalLM on a tiny random checkpoint: local layers with a
16-token window and their own rotary base, global layers with linear rope scaling, one KV head, a
query_pre_attn_scalar other than head_dim, random (1 + w) norm weights. float32 logits within 1e-4 at every
position of contexts 2-6 windows long, in one chunk, in 8-token chunks and decoded one token at a time
(C++ decode kernel and torch ops), and through the engine at every decode step, where the local layers'
block tables release what their window left behind. The helpers are
test_models.py's, the same oracle as every other family's."""

import copy
import json
import shutil
from functools import partial

import pytest
import torch
import transformers as tf
from test_models import VOCAB, _check_engine_logits, _load, _perturb_vectors, _save, _sequences, window_effect

from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.engine.greedy_reference import forward_sequence
from tinyserve.loader.model_loader import LoadedModel
from tinyserve.types import SamplingParams
from tinyserve.loader.errors import ModelLoadError
from tinyserve.loader.hf import hf_ignored, hf_model_config, hf_tensors
from tinyserve.loader.model_loader import build_model

WINDOW = 16
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
# bases far apart, so that a layer rotated with the other kind's table is off by far more than 1e-4
ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}


def _config(**changes) -> tf.Gemma3TextConfig:
    return tf.Gemma3TextConfig(**{
        "hidden_size": 64, "num_hidden_layers": len(LAYER_TYPES), "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 96, "vocab_size": VOCAB,
        "max_position_embeddings": 256, "sliding_window": WINDOW, "layer_types": LAYER_TYPES,
        "query_pre_attn_scalar": 24, "rope_parameters": json.loads(json.dumps(ROPE)),
        # eager: transformers' plain attention applies the window through its mask (checked below)
        "attn_implementation": "eager", **changes})


def _make_case(name: str, tmp_path_factory, **changes) -> tuple:
    """(name, transformers model, its checkpoint folder, our model loaded from it)."""
    torch.manual_seed(0)
    hf = _perturb_vectors(tf.Gemma3ForCausalLM(_config(**changes)).eval())
    folder = _save(hf, tmp_path_factory.mktemp(name))
    return name, hf, folder, _load(folder)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return _make_case("gemma3", tmp_path_factory)


def test_config_is_read(gemma):
    _, _, folder, ours = gemma
    config = hf_model_config(folder)
    assert config.architecture == "gemma3" and config.tie_word_embeddings and config.qk_norm
    assert config.layer_sliding_windows() == (WINDOW, WINDOW, None, WINDOW, None)
    assert (config.rope_theta, config.rope_local_theta) == (500.0, 10000.0)
    assert (config.rope_scaling.rope_type, config.rope_scaling.factor) == ("linear", 2.0)
    assert (config.query_pre_attn_scalar, config.final_logit_softcapping) == (24.0, None)
    assert (config.head_dim, config.num_key_value_heads, config.hidden_act) == (32, 1, "gelu_pytorch_tanh")
    assert [layer.self_attn.attn.sliding_window for layer in ours.model.layers] == [WINDOW, WINDOW, None, WINDOW, None]


def test_the_window_changes_transformers_logits(gemma):
    """Keeps the fidelity tests from passing vacuously: transformers' Gemma 3 must apply the window on its
    local layers (positions from WINDOW on differ from a window longer than the context)."""
    diff = window_effect(gemma[1], 1000)  # Gemma 3's mask takes no None
    assert diff[:WINDOW].max() == 0 and diff[WINDOW:].min() > 1e-3


@pytest.mark.parametrize("step_tokens, cpu_attention", [(None, False), (8, False), (1, True), (1, False)],
                         ids=["one-chunk", "8-token-chunks", "decode-kernel", "decode-torch-ops"])
def test_logits_at_every_position_match_transformers(gemma, step_tokens, cpu_attention):
    """16-token blocks; 1, 37 and 100 tokens (up to 6 windows)."""
    _, hf, _, ours = gemma
    for ids in _sequences():
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0].float()  # [len, vocab]
        got = forward_sequence(ours, ids, block_size=16, step_tokens=step_tokens, cpu_attention=cpu_attention)
        diff = (got - expected).abs().max().item()
        assert diff <= 1e-4, f"max |ours - transformers| = {diff:.2e} at length {len(ids)}"


@pytest.mark.parametrize("torch_decode", [False, True], ids=["decode-kernel", "decode-torch-ops"])
@pytest.mark.parametrize("budget", [512, 8], ids=["one-chunk", "chunked"])
def test_engine_logits_at_every_decode_step_match_transformers(gemma, budget, torch_decode, word_tokenizer,
                                                               record_logits):
    """test_models.py's engine test: three requests at once (37, 21 and 3 tokens, 12 decodes each), prompts
    prefilled in one step or in 8-token chunks beside the others' decodes, 16-token blocks."""
    _check_engine_logits(gemma, budget, 16, word_tokenizer, record_logits, torch_decode)


@pytest.mark.parametrize("torch_decode", [False, True], ids=["decode-kernel", "decode-torch-ops"])
def test_window_groups_let_long_sequences_share_a_pool_too_small_to_keep_every_block(gemma, torch_decode,
                                                                                      word_tokenizer, record_logits):
    """The local layers' groups release the blocks their 16-token window left behind. Four requests of 100
    prompt + 60 output tokens (10 blocks of 16 per table) in an 80-block pool: keeping every block they would
    need 3 tables x 10 x 4 = 120; releasing, at most 10 + 4 + 4 each while prefilling in 32-token chunks and
    10 + 2 + 2 while decoding. They run side by side, never preempted, logits within 1e-4 of the reference
    loop's (which keeps every block)."""
    _, _, folder, ours = gemma
    config = EngineConfig(cache=CacheConfig(num_blocks=80, block_size=16),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32))
    engine = LLMEngine(config, loaded=LoadedModel(ours, ours.config, word_tokenizer(VOCAB), folder))
    assert engine.runner.layout.group_windows == (WINDOW, WINDOW, None)  # local layers 0, 1 | 3; global 2, 4
    if torch_decode:
        engine.runner.stage.cpu_attention = False
    logits = record_logits(engine)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (100,), generator=gen).tolist() for _ in range(4)]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs, most_used, most_released = {}, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        bm = engine.block_manager
        bm.check_invariants()
        most_used = max(most_used, bm.num_blocks - bm.num_free_blocks)
        most_released = max([most_released, *(sum(r.num_released_blocks) for r in engine.scheduler.running)])
    assert engine.scheduler.num_preemptions == 0 and most_used <= 4 * (10 + 4 + 4)
    assert most_released == 2 * 8  # last step at 158 cached tokens: keys from 143, blocks 0-7 released in each
    assert engine.block_manager.num_free_blocks == 80
    for i, prompt in enumerate(prompts):
        ids = prompt + outputs[str(i)]
        expected = forward_sequence(ours, ids[:-1])[len(prompt) - 1:]
        got = torch.stack(logits[(str(i), 0)])
        assert got.shape == expected.shape == (60, VOCAB)
        assert (got - expected).abs().max() <= 1e-4


def test_final_logit_softcapping(tmp_path_factory):
    """A cap of 0.1, well below the raw logits, so that a missing or misplaced tanh is far off."""
    _, hf, _, ours = _make_case("gemma3-softcap", tmp_path_factory, final_logit_softcapping=0.1)
    ids = _sequences()[1]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float()
        raw = hf.lm_head(hf.model(torch.tensor([ids])).last_hidden_state)[0]
    assert raw.abs().max() > 0.3 and expected.abs().max() <= 0.1
    diff = (forward_sequence(ours, ids) - expected).abs().max().item()
    assert diff <= 1e-4, f"max |ours - transformers| = {diff:.2e}"


def _edited_folder(folder, dest, **changes):
    shutil.copytree(folder, dest)
    raw = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**raw, **changes}))
    return dest


@pytest.mark.parametrize("change", [{"attn_logit_softcapping": 50.0}, {"use_bidirectional_attention": True},
                                    {"rope_parameters": {**ROPE, "sliding_attention": ROPE["full_attention"]}}],
                         ids=["attn-softcap", "bidirectional", "local-rope-scaling"])
def test_unsupported_fields_refused(gemma, tmp_path, change):
    """Fields our layers do not compute are refused, never ignored."""
    folder = _edited_folder(gemma[2], tmp_path / "bad", **change)
    with pytest.raises(ModelLoadError, match=next(iter(change)).split("_")[0]):
        hf_model_config(folder)


def test_pre_v5_config_reads_the_same(gemma, tmp_path):
    """Configs on the Hub (transformers 4.x): rope_theta, rope_scaling and rope_local_base_freq at the top,
    the layers' kinds from sliding_window_pattern alone."""
    raw = json.loads((gemma[2] / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        raw.pop(key, None)
    raw.update(rope_theta=500.0, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0},
               sliding_window_pattern=3, num_hidden_layers=6)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = hf_model_config(tmp_path)
    assert config.layer_sliding_windows() == (WINDOW, WINDOW, None) * 2
    assert (config.rope_theta, config.rope_local_theta, config.rope_scaling.factor) == (500.0, 10000.0, 2.0)


def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(gemma):
    """bfloat16, the default on a CPU with bf16 kernels (our packed linears, decode kernel): no exact
    oracle, so our error against float32 transformers must stay below transformers' own in bfloat16. A
    bound against gross errors only: the (1 + w) norms rounded as Llama's, before the product, still pass
    it (the float32 formula is checked exactly by the tests above)."""
    _, hf, folder, _ = gemma
    config = hf_model_config(folder)
    ours = build_model(config, hf_tensors(folder), torch.bfloat16, torch.device("cpu"),
                       ignore=partial(hf_ignored, config=config))
    ids = _sequences()[2]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float()
        hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
        reference_error = (hf_bf16(torch.tensor([ids])).logits[0].float() - expected).abs().max().item()
    for step_tokens in (None, 1):
        got = forward_sequence(ours, ids, step_tokens=step_tokens, cpu_attention=step_tokens == 1)
        error = (got - expected).abs().max().item()
        assert error <= reference_error, f"bfloat16: {error:.2e} vs transformers' {reference_error:.2e}"
