"""Every supported architecture against transformers on the same tiny random checkpoint: float32 logits
through the paged cache within 1e-4 (one prefill, and through the engine at every decode step after a
prefill in one chunk or in many), and the same greedy tokens; Mistral also with a sliding window far
shorter than the contexts. Checkpoints are written with save_pretrained (safetensors) and read back with
loader/hf.py; broken folders must fail loudly."""

import json
import shutil
import subprocess
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from tinyserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.engine.greedy_reference import forward_sequence, greedy_generate
from tinyserve.loader.errors import ModelLoadError
from tinyserve.loader.hf import hf_ignored, hf_model_config, hf_tensors
from tinyserve.loader.model_loader import LoadedModel, build_model
from tinyserve.types import SamplingParams

VOCAB = 300
_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=256)
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32, "rope_theta": 10000.0}

# name -> (transformers config, model class). Small original_max_position_embeddings so that llama3's
# rescaled band covers the positions used here.
CASES = {
    "llama3-untied": (lambda: tf.LlamaConfig(**_SMALL, rope_scaling=_LLAMA3, tie_word_embeddings=False),
                      tf.LlamaForCausalLM),
    "llama-linear-tied": (lambda: tf.LlamaConfig(**{**_SMALL, "num_hidden_layers": 3}, tie_word_embeddings=True,
                                                 rope_scaling={"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 10000.0}),
                          tf.LlamaForCausalLM),
    "mistral": (lambda: tf.MistralConfig(**_SMALL, sliding_window=4096), tf.MistralForCausalLM),
    # eager: transformers' plain attention applies the window through its mask (checked below)
    "mistral-window": (lambda: tf.MistralConfig(**_SMALL, sliding_window=WINDOW, attn_implementation="eager"),
                       tf.MistralForCausalLM),
    "qwen2": (lambda: tf.Qwen2Config(**_SMALL, tie_word_embeddings=True), tf.Qwen2ForCausalLM),
    "qwen3": (lambda: tf.Qwen3Config(**_SMALL, head_dim=32, tie_word_embeddings=True), tf.Qwen3ForCausalLM),
    "gpt2": (lambda: tf.GPT2Config(n_embd=64, n_layer=3, n_head=4, n_inner=96, vocab_size=VOCAB, n_positions=256,
                                   bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1), tf.GPT2LMHeadModel),
}
SEQ_LENS = (1, 37, 100)
WINDOW = 16  # "mistral-window": the contexts above and the engine's (up to 49 tokens) are 2-6 windows long


def _load(folder: Path) -> torch.nn.Module:
    config = hf_model_config(folder)
    return build_model(config, hf_tensors(folder), torch.float32, torch.device("cpu"),
                       ignore=partial(hf_ignored, config=config))


def _save(model: torch.nn.Module, folder: Path, **kwargs) -> Path:
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


def _sequences(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in SEQ_LENS]


@torch.no_grad()
def _perturb_vectors(model: torch.nn.Module) -> torch.nn.Module:
    """transformers initializes biases to 0 and norm weights to 1, which would hide a bias or norm that
    is loaded into the wrong place: give every 1-d parameter random values."""
    for param in model.parameters():
        if param.dim() == 1:
            param.add_(torch.randn_like(param) * 0.2)
    return model


def _make_case(name: str, tmp_path_factory) -> tuple:
    """(name, transformers model, its checkpoint folder, our model loaded from it)."""
    make_config, cls = CASES[name]
    torch.manual_seed(0)
    hf = _perturb_vectors(cls(make_config()).eval())
    folder = _save(hf, tmp_path_factory.mktemp(name))
    return name, hf, folder, _load(folder)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    return _make_case(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    make_config, cls = CASES["llama3-untied"]
    torch.manual_seed(1)
    hf = _perturb_vectors(cls(make_config()).eval())
    return hf, _save(hf, tmp_path_factory.mktemp("llama"))


def test_logits_match_transformers(case):
    name, hf, _, ours = case
    for ids in _sequences():
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0].float()  # [len, vocab]
        diff = (forward_sequence(ours, ids) - expected).abs().max().item()
        assert diff <= 1e-4, f"{name}: max |ours - transformers| = {diff:.2e} at length {len(ids)}"


def test_greedy_matches_transformers_generate(case):
    name, hf, _, ours = case
    prompt = _sequences(seed=1)[1][:12]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy_generate(ours, prompt, 16) == expected, name


@pytest.mark.parametrize("budget", [512, 8], ids=["one-chunk", "chunked"])
def test_engine_logits_at_every_decode_step_match_transformers(case, budget, word_tokenizer, record_logits):
    """Three requests at once through the engine, 4-token blocks: each prompt prefilled in one step, or in
    chunks of at most 8 tokens beside the others' decodes, then decoded; our logits for every sampled
    token against transformers' on the same tokens (teacher-forced: it reads the tokens our engine
    picked). Decodes take the C++ decode kernel where it is built, and positions, block tables and slots
    are the model runner's for a mixed batch (forward_sequence builds its own, for one sequence)."""
    _check_engine_logits(case, budget, 4, word_tokenizer, record_logits)


def _check_engine_logits(case, budget: int, block_size: int, word_tokenizer, record_logits,
                         torch_decode: bool = False) -> None:
    name, hf, folder, ours = case
    config = EngineConfig(cache=CacheConfig(num_blocks=64, block_size=block_size),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget))
    engine = LLMEngine(config, loaded=LoadedModel(ours, ours.config, word_tokenizer(VOCAB), folder))
    if torch_decode:
        engine.runner.stage.cpu_attention = False  # the decode groups' torch ops, as off the CPU kernels
    logits = record_logits(engine)
    sequences = _sequences(seed=2)
    prompts = [sequences[1], sequences[2][:21], sequences[2][50:53]]  # 37, 21 and 3 tokens
    num_decodes = 12
    params = SamplingParams(max_tokens=num_decodes, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    if budget < len(prompts[0]):
        assert engine.num_steps > num_decodes + 4, "the prompts were meant to take several steps each"
    else:
        assert engine.num_steps == num_decodes, "every prompt was meant to be prefilled in the first step"
    for i, prompt in enumerate(prompts):
        ids = prompt + outputs[str(i)]
        with torch.no_grad():  # the logits that predict each output token
            expected = hf(torch.tensor([ids[:-1]])).logits[0, len(prompt) - 1:].float()  # [num_decodes, vocab]
        got = torch.stack(logits[(str(i), 0)])
        assert got.shape == expected.shape == (num_decodes, VOCAB)
        diff = (got - expected).abs().amax(dim=-1)  # [num_decodes]
        worst = int(diff.argmax())
        assert diff[worst] <= 1e-4, (f"{name}, request {i} ({len(prompt)}-token prompt): max |ours - transformers|"
                                     f" = {diff[worst]:.2e} at output token {worst}")


def test_config_flags(case):
    name, hf, folder, ours = case
    config = hf_model_config(folder)
    expected_family = {"llama3-untied": "llama", "llama-linear-tied": "llama", "mistral": "llama",
                       "mistral-window": "llama"}.get(name, name)
    assert config.architecture == expected_family
    assert config.attention_bias == (name == "qwen2")
    assert config.qk_norm == (name == "qwen3")
    assert config.tie_word_embeddings == (name in ("llama-linear-tied", "qwen2", "qwen3", "gpt2"))
    assert config.sliding_window == {"mistral": 4096, "mistral-window": WINDOW}.get(name)
    if name == "qwen3":
        assert config.head_dim == 32 != config.hidden_size // config.num_attention_heads
    if name == "llama3-untied":
        assert config.rope_scaling.rope_type == "llama3"
        assert config.rope_scaling.original_max_position_embeddings == 32
    if name == "gpt2":
        assert (config.intermediate_size, config.max_position_embeddings, config.hidden_act) == (96, 256, "gelu_new")


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    return _make_case("mistral-window", tmp_path_factory)


def window_effect(hf, no_window: int | None) -> torch.Tensor:
    """max |logits - logits with config.sliding_window = no_window| at each of 100 positions: [100]."""
    ids, window = torch.tensor([_sequences()[2]]), hf.config.sliding_window
    with torch.no_grad():
        windowed_logits = hf(ids).logits[0]
        hf.config.sliding_window = no_window
        try:
            return (windowed_logits - hf(ids).logits[0]).abs().amax(dim=-1)
        finally:
            hf.config.sliding_window = window


def test_the_window_changes_transformers_logits(windowed):
    """Keeps the window's fidelity tests from passing vacuously: transformers' Mistral must apply the
    window (positions from WINDOW on differ from full attention), and so must each of our layers."""
    _, hf, _, ours = windowed
    diff = window_effect(hf, None)
    assert diff[:WINDOW].max() == 0 and diff[WINDOW:].min() > 1e-3
    assert {layer.self_attn.attn.sliding_window for layer in ours.model.layers} == {WINDOW}


@pytest.mark.parametrize("step_tokens, cpu_attention", [(8, False), (1, True), (1, False)],
                         ids=["8-token-chunks", "decode-kernel", "decode-torch-ops"])
def test_windowed_logits_at_every_position_match_transformers(windowed, step_tokens, cpu_attention):
    """16-token blocks, 100 tokens (6 windows): every position computed in 8-token chunks (each attending
    to its cached prefix within the window), or one token at a time as decodes, through the C++ kernel or
    the torch ops."""
    _, hf, _, ours = windowed
    ids = _sequences()[2]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float()
    got = forward_sequence(ours, ids, block_size=16, step_tokens=step_tokens, cpu_attention=cpu_attention)
    diff = (got - expected).abs().max().item()
    assert diff <= 1e-4, f"max |ours - transformers| = {diff:.2e}"


@pytest.mark.parametrize("torch_decode", [False, True], ids=["decode-kernel", "decode-torch-ops"])
@pytest.mark.parametrize("budget", [512, 8], ids=["one-chunk", "chunked"])
def test_windowed_engine_logits_match_transformers(windowed, budget, torch_decode, word_tokenizer, record_logits):
    """The engine test above with a window and blocks as long as the window."""
    _check_engine_logits(windowed, budget, 16, word_tokenizer, record_logits, torch_decode)


def test_sharded_checkpoint_loads_identically(llama_folder, tmp_path):
    hf, folder = llama_folder
    sharded = _save(hf, tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    ids = _sequences()[2]
    assert torch.equal(forward_sequence(_load(sharded), ids), forward_sequence(_load(folder), ids))


def test_gpt2_original_names_load(tmp_path_factory, tmp_path):
    """openai-community/gpt2 was saved from GPT2Model: no `transformer.` prefix, causal-mask buffers."""
    _, _, folder, ours = _make_case("gpt2", tmp_path_factory)
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(folder / "model.safetensors").items()}
    tensors["h.0.attn.bias"] = torch.ones(1, 1, 256, 256)
    tensors["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ids = _sequences()[1]
    assert torch.equal(forward_sequence(_load(tmp_path), ids), forward_sequence(ours, ids))


def _copy(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    return dest


def _edit_tensors(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _expect_error(folder: Path, *fragments: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        _load(folder)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_folder_without_config(llama_folder, tmp_path):
    _, folder = llama_folder
    (tmp_path / "w").mkdir()
    shutil.copy(folder / "model.safetensors", tmp_path / "w" / "model.safetensors")
    _expect_error(tmp_path / "w", "no config.json")


def test_truncated_safetensors(llama_folder, tmp_path):
    bad = _copy(llama_folder[1], tmp_path / "bad")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) * 2 // 3])
    _expect_error(bad, "model.safetensors", "not a readable safetensors file")


def test_missing_tensor(llama_folder, tmp_path):
    bad = _copy(llama_folder[1], tmp_path / "bad")
    _edit_tensors(bad, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    _expect_error(bad, "missing", "model.layers.1.mlp.down_proj.weight")


def test_unexpected_tensor(llama_folder, tmp_path):
    bad = _copy(llama_folder[1], tmp_path / "bad")
    _edit_tensors(bad, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.zeros(4, 4)}))
    _expect_error(bad, "unexpected", "model.layers.0.mlp.extra_proj.weight")


def test_misshapen_tensor(llama_folder, tmp_path):
    bad = _copy(llama_folder[1], tmp_path / "bad")
    _edit_tensors(bad, lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    _expect_error(bad, "model.norm.weight", "(65,)", "(64,)")


def test_unknown_architecture(llama_folder, tmp_path):
    bad = _copy(llama_folder[1], tmp_path / "bad")
    _edit_config(bad, architectures=["FalconForCausalLM"])
    _expect_error(bad, "FalconForCausalLM", "not supported")


def test_pickled_weights_refused(llama_folder, tmp_path):
    bad = _copy(llama_folder[1], tmp_path / "bad")
    (bad / "model.safetensors").rename(bad / "pytorch_model.bin")
    _expect_error(bad, "only safetensors")


def test_no_weight_files(llama_folder, tmp_path):
    bad = _copy(llama_folder[1], tmp_path / "bad")
    (bad / "model.safetensors").unlink()
    _expect_error(bad, "no weight files")


def test_unsupported_rope_scaling(llama_folder, tmp_path):
    bad = _copy(llama_folder[1], tmp_path / "bad")
    _edit_config(bad, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    _expect_error(bad, "'yarn'", "not supported")


def _config_folder(tmp_path: Path, raw: dict, generation: dict | None = None) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(raw))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_old_style_rope_and_eos_lists(tmp_path):
    """transformers 4.x configs: rope_theta at the top, rope_scaling keyed by `type`; eos may be a list."""
    raw = {"architectures": ["LlamaForCausalLM"], **_SMALL, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "rope_scaling": {"type": "linear", "factor": 2.0}, "bos_token_id": 1, "eos_token_id": [2, 7]}
    config = hf_model_config(_config_folder(tmp_path, raw, {"eos_token_id": [9, 2]}))
    assert config.rope_theta == 500000.0
    assert (config.rope_scaling.rope_type, config.rope_scaling.factor) == ("linear", 2.0)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (9, 2, 7))


def test_qwen_sliding_window_only_when_enabled(tmp_path):
    raw = {"architectures": ["Qwen2ForCausalLM"], **_SMALL, "rms_norm_eps": 1e-6, "sliding_window": 128,
           "use_sliding_window": False}
    assert hf_model_config(_config_folder(tmp_path, raw)).sliding_window is None
    # enabled, Qwen's window covers only the layers from max_window_layers on: refused, not applied to all
    with pytest.raises(ModelLoadError, match="use_sliding_window"):
        hf_model_config(_config_folder(tmp_path, {**raw, "use_sliding_window": True}))


def test_hf_ignored_drops_lm_head_only_when_tied():
    tied = ModelConfig(
        architecture="llama", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=96, max_position_embeddings=256, norm_eps=1e-5,
        tie_word_embeddings=True)
    assert hf_ignored("lm_head.weight", tied)
    assert not hf_ignored("lm_head.weight", replace(tied, tie_word_embeddings=False))
    assert hf_ignored("model.layers.0.self_attn.rotary_emb.inv_freq", tied)
    assert not hf_ignored("model.layers.0.self_attn.q_proj.bias", tied)


@pytest.mark.slow
def test_smollm2_gguf_and_its_hf_export_agree(tmp_path):
    """The default GGUF, dequantized and saved as a Hugging Face folder by transformers, must load to the
    same model as the GGUF itself (both paths undo llama.cpp's Q/K permutation)."""
    from tinyserve.loader.gguf.checkpoint import gguf_model_config, gguf_tensors, open_gguf
    from tinyserve.loader.model_loader import resolve_model_path

    gguf_path = resolve_model_path("smollm2-135m")
    hf = tf.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    hf.hf_quantizer = None  # weights are dequantized already; the quantizer only blocks saving
    del hf.config.quantization_config
    folder = _save(hf, tmp_path / "smollm2")
    del hf
    reader = open_gguf(gguf_path)
    gguf_config = gguf_model_config(reader)
    assert replace(hf_model_config(folder), bos_token_id=None, eos_token_ids=()) == gguf_config
    from_gguf = build_model(gguf_config, gguf_tensors(reader, gguf_config), torch.float32, torch.device("cpu"))
    ids = _sequences()[2]
    diff = (forward_sequence(_load(folder), ids) - forward_sequence(from_gguf, ids)).abs().max().item()
    assert diff <= 1e-6, f"max |hf folder - gguf| = {diff:.2e}"


def test_loading_imports_no_compiler_stack():
    """Built on the meta device, a model must not pull in torch._dynamo or sympy: nn.Embedding's random
    init and to() / to_empty() on meta tensors do (~60 MiB resident in a server that never compiles)."""
    code = ("import sys\n"
            "from tinyserve.loader.model_loader import load_model\n"
            "load_model('smollm2-135m', 'auto', 'cpu')\n"
            "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"
