"""What a model path may name, checked by os.stat alone before anything opens it: a regular file (a GGUF),
or a folder (a Hugging Face checkpoint) whose config.json is a regular file and whose other files are
regular files too.

Why stat and never open: opening a named pipe blocks until a writer comes, a device such as /dev/zero
reads without end, a socket cannot be opened at all; a load runs on the thread that steps every engine
(engine/loop/step_loop.py), so one such path from the admin API would hang every model. Why one message for
"missing" and "not a model file": a path comes from a client, and different answers would tell it which
paths exist on the server and what they are.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tinyserve.loader.errors import ModelLoadError

_GGUF_MAGIC = b"GGUF"
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
# the files of a checkpoint folder the loaders open (config, tokenizer, weights, index): each must be a
# regular file where it exists
_FOLDER_FILE_SUFFIXES = (".json", ".safetensors", ".txt", ".model", ".jinja")


def not_a_model(model: str, aliases: str) -> ModelLoadError:
    """The one error for a path that is missing, unreadable or not a model's file or folder."""
    return ModelLoadError(f"model {model[:256]!r} is neither a known alias ({aliases}) nor a model file "
                          "(a GGUF file, or a folder holding config.json and .safetensors files)")


def is_model_source(path: Path) -> bool:
    """Whether `path` is a regular file, or a folder as a Hugging Face checkpoint is (see module doc)."""
    mode = _mode(path)
    if mode is None:
        return False
    if stat.S_ISREG(mode):
        return True
    return stat.S_ISDIR(mode) and _is_checkpoint_folder(path)


def looks_like_model(path: Path) -> bool:
    """is_model_source, and a first look inside: a file that begins with the GGUF magic, a folder with a
    weight file (model.safetensors or its index). For a path a client names (the admin API): a file or
    folder that is no model then gets the error of a missing path, not a loader's message about its
    contents. Opens a regular file only, non-blocking, and checks it is still one before reading 4 bytes."""
    if not is_model_source(path):
        return False
    if path.is_dir():
        return any(_is_regular(path / name) for name in _WEIGHT_FILES)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.pread(fd, len(_GGUF_MAGIC), 0) == _GGUF_MAGIC
    except OSError:
        return False
    finally:
        os.close(fd)


def _is_regular(path: Path) -> bool:
    mode = _mode(path)
    return mode is not None and stat.S_ISREG(mode)


def _mode(path: Path | str) -> int | None:
    try:
        return os.stat(path).st_mode  # follows links: a link to a pipe is a pipe
    except (OSError, ValueError):  # missing, no permission, a NUL in the name, a name too long
        return None


def _is_checkpoint_folder(folder: Path) -> bool:
    if not _is_regular(folder / "config.json"):
        return False
    try:
        with os.scandir(folder) as entries:
            names = [entry.name for entry in entries if entry.name.endswith(_FOLDER_FILE_SUFFIXES)]
    except OSError:
        return False
    modes = [_mode(folder / name) for name in names]
    return all(mode is not None and (stat.S_ISREG(mode) or stat.S_ISDIR(mode)) for mode in modes)
