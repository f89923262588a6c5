"""The command line's process-wide settings."""

import pytest
import torch

from tinyserve.cli import _set_threads, main, parse_args, server_config_from_args
from tinyserve.cli_engine import engine_config_from_args


def test_threads_sets_torchs_pool_and_refuses_nonsense(capsys):
    before = torch.get_num_threads()
    try:
        _set_threads(1)
        assert torch.get_num_threads() == 1
        _set_threads(None)  # not given: left as it is
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert main(["generate", "--threads", "0", "hi"]) == 1
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--threads", "two", "hi"])


def test_bench_offline_hands_every_engine_flag_to_the_engine(monkeypatch):
    # `bench offline` once took only a few engine flags and ignored the rest (--block-size, --max-model-len...)
    import tinyserve.bench.commands as commands

    seen = {}
    monkeypatch.setattr(commands, "bench_offline", lambda config, result_file: seen.__setitem__("config", config) or 0)
    argv = ["bench", "offline", "--block-size", "32", "--max-model-len", "1024", "--quantization", "none",
            "--kv-cache-dtype", "int8", "--max-num-seqs", "7", "--no-prefix-caching", "--num-prompts", "3",
            "--input-len-range", "5", "9", "--seed", "4"]
    assert main(argv) == 0
    config = seen["config"]
    engine = config.engine
    assert (engine.dtype, engine.quantization, engine.seed) == ("bfloat16", "none", 4)  # the recipe's dtype
    assert (engine.cache.block_size, engine.cache.kv_cache_dtype, engine.cache.enable_prefix_caching) == (32, "int8",
                                                                                                        False)
    assert (engine.scheduler.max_model_len, engine.scheduler.max_num_seqs) == (1024, 7)
    assert (config.num_prompts, config.input_len_range, config.seed) == (3, (5, 9), 4)
    assert main(["bench", "offline", "--dtype", "float32"]) == 0
    assert seen["config"].engine.dtype == "float32"


def test_enable_admin_api_flag_and_its_refusal_beyond_loopback(tmp_path, monkeypatch, capsys):
    from tinyserve.cli import build_parser, server_config_from_args

    monkeypatch.delenv("TINYSERVE_API_KEY", raising=False)

    def config(*argv):
        return server_config_from_args(build_parser().parse_args(["serve", *argv]))

    assert config().enable_admin_api is False
    assert config("--enable-admin-api").enable_admin_api is True  # loopback by default: no key needed
    assert main(["serve", "--host", "0.0.0.0", "--enable-admin-api"]) == 1  # refused before any load
    assert "needs an API key" in capsys.readouterr().err
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    keyed = config("--host", "0.0.0.0", "--enable-admin-api", "--api-key-file", str(key))
    assert (keyed.enable_admin_api, keyed.api_key) == (True, "s3cret")


def test_api_key_file_must_be_a_regular_file(tmp_path, capsys):
    import os
    import threading

    fifo = tmp_path / "key"
    os.mkfifo(fifo)
    codes = []
    thread = threading.Thread(target=lambda: codes.append(main(["serve", "--api-key-file", str(fifo)])), daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive(), "reading the key blocked on a pipe"
    assert codes == [1] and "is not a regular file" in capsys.readouterr().err


def test_kv_cache_memory_is_auto_by_default_or_gib(capsys):
    from tinyserve.cli import build_parser, engine_config_from_args

    def cache(*argv):
        return engine_config_from_args(build_parser().parse_args(["serve", *argv])).cache

    assert cache().kv_cache_memory_gib is None  # auto: engine/memory/fit_check.py sizes it
    assert cache("--kv-cache-memory", "auto").kv_cache_memory_gib is None
    assert cache("--kv-cache-memory", "0.5").kv_cache_memory_gib == 0.5
    for bad in ("lots", "0", "-1"):
        with pytest.raises(SystemExit):
            cache("--kv-cache-memory", bad)
    assert "must be auto or a number of GiB" in capsys.readouterr().err


def test_a_server_whose_model_does_not_fit_exits_naming_the_numbers_and_the_flags(caplog):
    """A KV pool larger than this machine's memory: the server exits 1 with one line that says weights +
    KV pool + activations against the memory available, in MiB, and the flags that change them."""
    assert main(["serve", "--port", "0", "--kv-cache-memory", "100000", "--dtype", "float32"]) == 1
    line = next(r.getMessage() for r in caplog.records if "does not fit in memory" in r.getMessage())
    assert "KV pool 102400000 MiB" in line and "MiB (the memory available to this process" in line
    for flag in ("--kv-cache-memory", "--max-model-len", "--max-num-seqs", "--quantization", "--memory-budget"):
        assert flag in line


def test_a_config_file_sets_flags_under_the_command_line(tmp_path):
    """serve --config FILE (YAML): the command line over the file over the defaults, as vLLM's."""
    config = tmp_path / "serve.yaml"
    config.write_text("max-num-seqs: 8\nmax_queue: none\nport: 9001\nmax-stop-strings: 20\n"
                      "no-warmup: true\nkv-cache-dtype: int8\nrequest-timeout: 30\n")
    args = parse_args(["serve", "--config", str(config), "--port", "9002"])
    server, engine = server_config_from_args(args), engine_config_from_args(args)
    assert (server.port, server.max_queue, server.warmup, server.request_timeout) == (9002, None, False, 30)
    assert server.limits.max_stop_strings == 20 and engine.scheduler.max_num_seqs == 8
    assert engine.cache.kv_cache_dtype == "int8"
    defaults = parse_args(["serve"])  # a later parse without the file is untouched by it
    assert (defaults.port, defaults.max_num_seqs, defaults.no_warmup) == (8000, 64, False)


@pytest.mark.parametrize("text, message", [
    ("max-num-seq: 8\n", "unknown key 'max-num-seq' (not a flag of `tinyserve serve`)"),
    ("config: other.yaml\n", "unknown key 'config'"),
    ("no-warmup: 1\n", "no-warmup must be true or false, got 1"),
    ("kv-cache-dtype: int3\n", "kv-cache-dtype must be one of"),
    ("- max-num-seqs\n", "expected a mapping of flags to values"),
    ("max-num-seqs: [\n", "config file"),
])
def test_a_bad_config_file_is_one_clear_error(tmp_path, capsys, text, message):
    config = tmp_path / "serve.yaml"
    config.write_text(text)
    assert main(["serve", "--config", str(config)]) == 1  # before any model is loaded
    assert message in capsys.readouterr().err
