"""loader/model_files.py: a model path is a regular file or a checkpoint folder of regular files, checked by
os.stat before anything opens it; a missing path and every other kind get the one same error (no oracle of
what exists on the server). Each check runs on a thread joined with a deadline: a check that opened a pipe
would block, and the test fails instead of hanging."""

from __future__ import annotations

import os
import re
import socket
import stat
import threading
import time
from pathlib import Path

import pytest

from tinyserve.loader.errors import ModelLoadError
from tinyserve.loader.model_files import is_model_source, looks_like_model
from tinyserve.loader.model_loader import resolve_model_path


def _resolve_within(path: str, seconds: float = 1.0) -> BaseException | Path:
    """resolve_model_path(path) on a thread; its result or error, failing the test if it takes > seconds."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(resolve_model_path(path))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome.append(exc)

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"resolve_model_path({path!r}) blocked (it opened the file?)"
    assert time.monotonic() - start < seconds
    return outcome[0]


@pytest.fixture
def kinds(tmp_path) -> dict[str, str]:
    """A path of each kind that is not a model, and a missing one."""
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    sock_path = tmp_path / "s.gguf"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock_path))
    (tmp_path / "folder").mkdir()
    (tmp_path / "link.gguf").symlink_to(fifo)
    paths = {"fifo": str(fifo), "socket": str(sock_path), "folder": str(tmp_path / "folder"),
             "link to a fifo": str(tmp_path / "link.gguf"), "missing": str(tmp_path / "missing.gguf")}
    if os.path.exists("/dev/zero"):
        paths["device"] = "/dev/zero"
    yield paths
    server.close()


def test_every_kind_but_a_regular_file_is_refused_with_the_message_of_a_missing_path(kinds):
    messages = {}
    for kind, path in kinds.items():
        error = _resolve_within(path)
        assert isinstance(error, ModelLoadError), f"{kind}: {error!r}"
        messages[kind] = str(error).replace(repr(path), "PATH")
    assert set(messages.values()) == {messages["missing"]}, messages  # one message: no oracle
    assert "PATH" in messages["missing"] and "GGUF file" in messages["missing"]


def test_a_regular_file_and_a_checkpoint_folder_pass(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "sub").mkdir()  # a subfolder (onnx/, original/) is no weight file: left alone
    assert _resolve_within(str(gguf)) == gguf
    assert _resolve_within(str(folder)) == folder


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_a_checkpoint_folder_with_a_pipe_for_one_of_its_files_is_refused(tmp_path, name):
    folder = tmp_path / "hf"
    folder.mkdir()
    for regular in ("config.json", "model.safetensors", "tokenizer.json"):
        if regular != name:
            (folder / regular).write_text("{}")
    os.mkfifo(folder / name)
    assert stat.S_ISFIFO(os.stat(folder / name).st_mode)
    error = _resolve_within(str(folder))
    assert isinstance(error, ModelLoadError) and "neither a known alias" in str(error)
    assert not is_model_source(folder)


def test_the_message_is_the_same_for_a_long_path_and_stays_short(tmp_path):
    long_path = str(tmp_path / ("x" * 5000))
    error = _resolve_within(long_path)
    assert isinstance(error, ModelLoadError) and len(str(error)) < 600
    assert re.search("neither a known alias", str(error))


def test_a_first_look_inside_refuses_files_and_folders_that_are_no_model(tmp_path, kinds):
    text = tmp_path / "passwd"
    text.write_text("root:x:0:0:root:/root:/bin/bash\n")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text("{}")
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "model.safetensors").write_bytes(b"")
    assert looks_like_model(gguf) and looks_like_model(checkpoint)
    assert not looks_like_model(text) and not looks_like_model(config_only)
    for kind, path in kinds.items():  # never opened: a pipe would block here
        outcome = []
        thread = threading.Thread(target=lambda: outcome.append(looks_like_model(Path(path))), daemon=True)
        thread.start()
        thread.join(1.0)
        assert outcome == [False], kind
