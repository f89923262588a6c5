"""A checkpoint is data from outside: its config must not make a kernel divide by zero or the loader
allocate absurd memory, and its index must not open files outside its folder. ModelConfig's bounds
against real models' sizes and hostile ones; Hugging Face folders with forged index.json and config.json
files, refused before any tensor is allocated."""

import json
import math
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
import transformers as tf

from tinyserve.config import ModelConfig, RopeScaling
from tinyserve.loader import model_loader
from tinyserve.loader.errors import ModelLoadError
from tinyserve.loader.hf import hf_ignored, hf_model_config, hf_tensors
from tinyserve.loader.model_loader import build_model

BASE = dict(architecture="llama", vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=96, max_position_embeddings=256, norm_eps=1e-5)
SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
         "intermediate_size", "max_position_embeddings", "head_dim")

# Published configs of large models: every bound must admit them.
REAL = {
    "llama-3.1-405b": dict(vocab_size=128256, hidden_size=16384, num_hidden_layers=126, num_attention_heads=128,
                           num_key_value_heads=8, intermediate_size=53248, max_position_embeddings=131072,
                           rope_theta=500000.0),
    "qwen2.5-7b-1m": dict(architecture="qwen2", vocab_size=152064, hidden_size=3584, num_hidden_layers=28,
                          num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                          max_position_embeddings=1010000, rope_theta=10000000.0),
    "gemma-like-head-256": dict(vocab_size=262144, hidden_size=3840, num_hidden_layers=48, num_attention_heads=16,
                                num_key_value_heads=8, intermediate_size=15360, head_dim=256,
                                max_position_embeddings=131072),
    "gpt2-xl": dict(architecture="gpt2", vocab_size=50257, hidden_size=1600, num_hidden_layers=48,
                    num_attention_heads=25, num_key_value_heads=25, intermediate_size=6400,
                    max_position_embeddings=1024),
}


def _config(**changes) -> ModelConfig:
    return ModelConfig(**{**BASE, **changes})


def _refused(field: str, **changes) -> str:
    """The message of the ValueError, which must start with the field's name (the server maps it)."""
    with pytest.raises(ValueError) as info:
        _config(**changes)
    assert str(info.value).startswith(field), str(info.value)
    return str(info.value)


@pytest.mark.parametrize("name", REAL)
def test_real_models_fit_the_bounds(name):
    config = _config(**REAL[name])
    assert config.head_dim == REAL[name].get("head_dim", REAL[name]["hidden_size"] // REAL[name]["num_attention_heads"])


@pytest.mark.parametrize("field", SIZES)
@pytest.mark.parametrize("value", [-1, "past the bound", 2.0, True])
def test_every_size_is_an_integer_within_bounds(field, value):
    if value == "past the bound":
        value = ModelConfig.MAX_SIZES[field] + 1
    _refused(field, **{field: value})


@pytest.mark.parametrize("field", SIZES)  # an unset head_dim is None (derived), never 0
def test_zero_sizes_are_refused(field):
    _refused(field, **{field: 0})


def test_documented_bounds():
    assert _config(vocab_size=1 << 24).vocab_size == 1 << 24  # the sampler's float32 ids are exact to 2**24
    _refused("vocab_size", vocab_size=(1 << 24) + 1)
    _refused("vocab_size", vocab_size=10**12)
    _refused("max_position_embeddings", max_position_embeddings=1 << 22, head_dim=128)  # 2**29 rotary entries
    assert _config(architecture="gpt2", max_position_embeddings=1 << 22, num_key_value_heads=4).head_dim == 16


def test_head_layout_each_family_needs():
    _refused("hidden_size", hidden_size=66)  # head_dim derived: 66 / 4 heads
    assert _config(hidden_size=66, head_dim=16).head_dim == 16  # given explicitly (Qwen3), need not divide
    _refused("head_dim", head_dim=15)  # rotary turns pairs of dimensions
    _refused("head_dim", hidden_size=4 * 2048)  # derived 2048 > 1024
    _refused("head_dim", architecture="gpt2", num_key_value_heads=4, head_dim=32)  # c_attn splits hidden_size
    _refused("num_attention_heads", num_key_value_heads=3)


@pytest.mark.parametrize("field", ["norm_eps", "rope_theta"])
@pytest.mark.parametrize("value", [0.0, -1e-5, math.nan, math.inf])
def test_positive_finite_floats(field, value):
    _refused(field, **{field: value})


def test_sliding_window_and_rope_scaling():
    _refused("sliding_window", sliding_window=0)
    assert _config(sliding_window=4096).sliding_window == 4096
    for factor in (0.0, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"^rope_scaling\.factor"):
            RopeScaling("linear", factor=factor)
    with pytest.raises(ValueError, match=r"^rope_scaling\.low_freq_factor"):  # llama3 divides by high - low
        RopeScaling("llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=4.0)
    with pytest.raises(ValueError, match=r"^rope_scaling\.low_freq_factor"):
        RopeScaling("llama3", factor=8.0, low_freq_factor=0.0)
    with pytest.raises(ValueError, match=r"^rope_scaling\.original_max_position_embeddings"):
        RopeScaling("llama3", factor=8.0, original_max_position_embeddings=0)
    assert RopeScaling("linear", factor=2.0, low_freq_factor=0.0).factor == 2.0  # llama3's fields unused


_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, vocab_size=300, max_position_embeddings=256)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers model, a folder of 3+ safetensors shards with model.safetensors.index.json)."""
    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(tf.LlamaConfig(**_SMALL, tie_word_embeddings=False)).eval()
    folder = tmp_path_factory.mktemp("sharded")
    hf.save_pretrained(folder, safe_serialization=True, max_shard_size="100KB")
    assert len(list(folder.glob("*.safetensors"))) >= 3
    return hf, folder


def _copy(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    return dest


def _load(folder: Path) -> torch.nn.Module:
    config = hf_model_config(folder)
    return build_model(config, hf_tensors(folder), torch.float32, torch.device("cpu"),
                       ignore=partial(hf_ignored, config=config))


def _edit_json(path: Path, edit) -> None:
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def _rename_shard(folder: Path, name: str) -> str:
    """Point the index's entries for the first shard at `name`; returns the shard's old file name."""
    index = folder / "model.safetensors.index.json"
    first = sorted(set(json.loads(index.read_text())["weight_map"].values()))[0]
    _edit_json(index, lambda raw: raw["weight_map"].update(
        {k: name for k, v in raw["weight_map"].items() if v == first}))
    return first


def _same_weights(model, hf) -> None:
    ours = model.model.layers[1].mlp.down_proj.weight
    assert torch.equal(ours, hf.state_dict()["model.layers.1.mlp.down_proj.weight"])


def test_a_sharded_checkpoint_loads(checkpoint):
    hf, folder = checkpoint
    _same_weights(_load(folder), hf)


@pytest.mark.parametrize("forged", ["../outside.safetensors", "sub/../../outside.safetensors", "absolute"])
def test_index_names_outside_the_folder_are_refused(checkpoint, tmp_path, forged):
    """The file exists and is a valid shard: only where it lies is wrong."""
    folder = _copy(checkpoint[1], tmp_path / "model")
    outside = tmp_path / "outside.safetensors"
    first = _rename_shard(folder, str(outside) if forged == "absolute" else forged)
    shutil.move(folder / first, outside)
    with pytest.raises(ModelLoadError, match=r"index\.json: weight_map file .*outside\.safetensors.* is outside"):
        _load(folder)


def test_a_linked_folder_inside_is_refused_a_linked_file_is_not(checkpoint, tmp_path):
    """Hugging Face's cache links each file of a snapshot to a blob outside it: that must keep loading.
    A linked directory could lead anywhere, so a name through one is refused."""
    hf, original = checkpoint
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    snapshot.mkdir()
    for path in original.iterdir():
        shutil.copy(path, blobs / path.name)
        (snapshot / path.name).symlink_to(blobs / path.name)
    _same_weights(_load(snapshot), hf)

    folder = _copy(original, tmp_path / "model")
    (folder / "sub").symlink_to(blobs, target_is_directory=True)
    first = _rename_shard(folder, "sub/moved.safetensors")
    shutil.move(blobs / first, blobs / "moved.safetensors")
    with pytest.raises(ModelLoadError, match="sub/moved.safetensors.*outside the model folder"):
        _load(folder)


@pytest.mark.parametrize("value", [5, "", None])
def test_index_values_that_are_not_file_names(checkpoint, tmp_path, value):
    folder = _copy(checkpoint[1], tmp_path / "model")
    _edit_json(folder / "model.safetensors.index.json",
               lambda raw: raw["weight_map"].update({"model.norm.weight": value}))
    with pytest.raises(ModelLoadError, match="index.json: weight_map"):
        _load(folder)


@pytest.fixture
def no_allocation(monkeypatch):
    """Fails the test if the loader gets as far as allocating the model's memory."""
    def fail(*_):
        raise AssertionError("the model was allocated before the checkpoint was checked")

    monkeypatch.setattr(model_loader, "_materialize", fail)


@pytest.mark.parametrize("key, value, message", [
    ("vocab_size", 10**12, "vocab_size must be in"),
    ("num_attention_heads", 0, "num_attention_heads must be in"),  # was a ZeroDivisionError
    ("num_key_value_heads", 3, "num_attention_heads .* multiple"),
    ("hidden_size", "64", "hidden_size must be an integer"),
    ("hidden_size", 64.5, "hidden_size must be an integer"),
    ("num_hidden_layers", [2, 2], "num_hidden_layers must be an integer"),
    ("rms_norm_eps", math.nan, "rms_norm_eps must be a finite number"),
    ("max_position_embeddings", -1, "max_position_embeddings must be in"),
])
def test_absurd_config_values_are_refused_naming_the_field(checkpoint, tmp_path, no_allocation, key, value, message):
    folder = _copy(checkpoint[1], tmp_path / "model")
    _edit_json(folder / "config.json", lambda raw: raw.update({key: value}))
    with pytest.raises(ModelLoadError, match=message):
        _load(folder)


def test_a_config_declaring_a_trillion_parameters_beside_a_small_file(checkpoint, tmp_path, no_allocation):
    """Every value within its bound, every tensor name right, 2**24 x 2**16 = 1.1e12 embedding values
    declared beside a ~1 MB checkpoint: refused from the files' headers, before anything is allocated."""
    folder = _copy(checkpoint[1], tmp_path / "model")
    huge = dict(vocab_size=1 << 24, hidden_size=1 << 16, num_attention_heads=64, num_key_value_heads=64,
                intermediate_size=1 << 20, max_position_embeddings=4096)
    _edit_json(folder / "config.json", lambda raw: raw.update(huge))
    assert sum(p.stat().st_size for p in folder.glob("*.safetensors")) < 2 << 20
    with pytest.raises(ModelLoadError, match=r"has shape \(300, 64\), expected \(16777216, 65536\)"):
        _load(folder)


def test_a_config_declaring_more_layers_than_the_file_holds(checkpoint, tmp_path, no_allocation):
    folder = _copy(checkpoint[1], tmp_path / "model")
    _edit_json(folder / "config.json", lambda raw: raw.update(num_hidden_layers=40))
    with pytest.raises(ModelLoadError, match=r"missing tensor\(s\).*\(and \d+ more\)"):
        _load(folder)


def test_a_config_that_is_not_an_object(checkpoint, tmp_path):
    folder = _copy(checkpoint[1], tmp_path / "model")
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="config.json: not a JSON object"):
        _load(folder)
