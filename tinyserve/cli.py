"""The `tinyserve` command: with cli_engine.py (the flags of every subcommand that runs an engine) and
cli_bench.py (the bench subcommands), the only place that parses arguments and environment variables."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import stat
import sys
from pathlib import Path

from tinyserve.cli_bench import add_bench_parser
from tinyserve.cli_engine import (LOG_LEVELS, add_chat_template_arg, add_engine_args, add_generation_config_args,
                                  engine_config_from_args, models_from_args, parallel_config_from)
from tinyserve.config import ServerConfig
from tinyserve.request_limits import RequestLimits

# Every default below is read from the config dataclasses (tinyserve/config.py), so that the command line and
# the configs cannot drift apart.


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)


def _engine(args: argparse.Namespace):
    from tinyserve.engine.loop.llm_engine import LLMEngine

    return LLMEngine(engine_config_from_args(args))


def _stream(engine, request_id: str, prompt_ids: list[int], params) -> str:
    """Run one request to the end, printing text as it comes; returns the whole text."""
    engine.add_request(request_id, prompt_ids, params)
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.new_text, end="", flush=True)
            text += out.new_text
    print()
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    from tinyserve.types import SamplingParams

    engine = _engine(args)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
        _stream(engine, "generate", engine.tokenizer.encode(args.prompt), params)
    finally:
        engine.close()  # tensor / pipeline parallel: send the other ranks home
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    engine = _engine(args)
    try:
        _chat_turns(args, engine)
    finally:
        engine.close()  # tensor / pipeline parallel: send the other ranks home
    return 0


def _chat_turns(args: argparse.Namespace, engine) -> None:
    from tinyserve.types import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("tinyserve chat: type a message, an empty line or Ctrl-D to quit.")
    for turn in range(10**9):
        try:
            user = input("> ").strip()
        except EOFError:
            break
        if not user:
            break
        messages.append({"role": "user", "content": user})
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt_ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        reply = _stream(engine, f"chat-{turn}", prompt_ids, params)
        messages.append({"role": "assistant", "content": reply})


def api_key_from(args: argparse.Namespace) -> str | None:
    """--api-key-file (its stripped contents), else $TINYSERVE_API_KEY, else None (no authentication).
    Never from the command line itself: arguments are visible to every user in `ps`."""
    if args.api_key is not None:
        raise ValueError("--api-key was removed (a key on the command line is visible in `ps`): "
                         "use --api-key-file PATH or $TINYSERVE_API_KEY")
    if args.api_key_file is None:
        return os.environ.get("TINYSERVE_API_KEY") or None
    path = Path(args.api_key_file)
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a pipe would block the start in read_text
            raise ValueError(f"api_key_file {str(path)!r} is not a regular file")
        key = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise ValueError(f"api_key_file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"api_key_file {str(path)!r} cannot be read: {getattr(exc, 'strerror', None) or exc}"
                         ) from None
    if not key:
        raise ValueError(f"api_key_file {str(path)!r} is empty")
    return key


def add_request_limit_args(group: argparse._ArgumentGroup) -> None:
    """One flag per RequestLimits field, named after it, its default the field's."""
    for f in dataclasses.fields(RequestLimits):
        kind = float if "float" in str(f.type) else int
        group.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default, metavar="N",
                           help=f.metadata["help"] + ("" if f.default is None else " (default: %(default)s)"))


def add_timeout_args(group: argparse._ArgumentGroup) -> None:
    for flag, default, help in (
        ("--request-timeout", ServerConfig.request_timeout, "end a request this many seconds after its arrival "
         "(finish_reason timeout); caps a request's own `timeout` field (default: never)"),
        ("--body-read-timeout", ServerConfig.body_read_timeout, "a request's headers, and then its body, must "
         "arrive within this long (else the connection is closed; a late body gets 408)"),
        ("--stream-write-timeout", ServerConfig.stream_write_timeout,
         "a stream whose client reads nothing for this long is aborted"),
        ("--keep-alive-timeout", ServerConfig.keep_alive_timeout,
         "close a connection that has sent nothing for this long between requests"),
        ("--stall-timeout", ServerConfig.stall_timeout,
         "/health is 503 when work is pending and no step has finished for this long"),
        ("--drain-timeout", ServerConfig.drain_timeout, "swap / unload: in-flight requests get this long to "
         "finish on the old weights, then end with finish_reason abort"),
        ("--shutdown-timeout", ServerConfig.shutdown_timeout, "on SIGTERM/SIGINT, in-flight requests get this "
         "long to finish before being aborted; a second signal aborts them at once"),
    ):
        group.add_argument(flag, type=float, default=default, metavar="S", help=help)


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    _, names, models = models_from_args(args)
    return ServerConfig(
        host=args.host, port=args.port, grpc_port=args.grpc_port, served_model_names=names,
        models=models, models_dir=args.models_dir, max_loaded_models=args.max_loaded_models,
        memory_budget_gib=args.memory_budget, idle_unload=args.idle_unload, drain_timeout=args.drain_timeout,
        api_key=api_key_from(args), enable_admin_api=args.enable_admin_api, max_queue=args.max_queue,
        request_timeout=args.request_timeout, shutdown_timeout=args.shutdown_timeout,
        allowed_origins=tuple(args.allowed_origins or ()), stall_timeout=args.stall_timeout, warmup=not args.no_warmup,
        limits=RequestLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RequestLimits)}),
        allow_special_tokens_in_messages=args.allow_special_tokens_in_messages,
        allow_unknown_fields=args.allow_unknown_fields,
        stream_write_timeout=args.stream_write_timeout, body_read_timeout=args.body_read_timeout,
        max_connections=args.max_connections, keep_alive_timeout=args.keep_alive_timeout,
        admission=args.admission, target_ttft=None if args.target_ttft is None else args.target_ttft / 1000,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    engine_config = engine_config_from_args(args)
    if engine_config.parallel.rank != 0:  # torchrun started this rank: it computes, rank 0 serves
        from tinyserve.engine.execution.worker import run_worker

        return run_worker(engine_config)
    from tinyserve.server.launcher import serve

    return serve(engine_config, server_config_from_args(args), args.log_level)


def cmd_worker(args: argparse.Namespace) -> int:
    """A rank that `tinyserve serve` (or tinyserve.LLM) started: its engine config and its place in the
    group come in its environment."""
    from dataclasses import replace

    from tinyserve.engine.execution.rank_setup import CONFIG_ENV, config_from_json
    from tinyserve.engine.execution.worker import run_worker

    config = config_from_json(os.environ[CONFIG_ENV])
    parallel = config.parallel
    return run_worker(replace(config, parallel=parallel_config_from(
        parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.timeout_s, os.environ)))


def _add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
                           description="Exit codes: 0 after SIGTERM / SIGINT and a drain (also while the model "
                           "is still loading), 1 if the model or a setting is bad, 3 if the port cannot be "
                           "bound, 128+N when a second signal N cut the drain short.")
    serve.add_argument("--config", default=None, metavar="FILE",
                       help="a YAML file of flags (`max-num-seqs: 32`, as vLLM's --config): the command line "
                            "wins over the file, the file over the defaults; an unknown key is an error")
    g = serve.add_argument_group("server")
    g.add_argument("--host", default=ServerConfig.host, help="bind address (default: loopback only)")
    g.add_argument("--port", type=int, default=ServerConfig.port)
    g.add_argument("--grpc-port", type=int, default=ServerConfig.grpc_port, metavar="PORT",
                   help="also serve the gRPC API (README 'gRPC') on --host:PORT, 0 for any free port (default: off)")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients use (default: --model); the first is reported")
    g.add_argument("--enable-admin-api", action="store_true",
                   help="serve /admin/models/* (load, unload, swap to a path on this machine; README 'Several "
                        "models'); refused without an API key unless --host is loopback (default: off, 404)")
    g.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="require 'Authorization: Bearer KEY' on the API routes, KEY being this file's stripped "
                        "contents (default: $TINYSERVE_API_KEY; /health, /metrics and /version stay open)")
    # the old flag put the key in `ps`; kept hidden only to refuse it clearly (and so that argparse does not
    # take it as an abbreviation of --api-key-file)
    g.add_argument("--api-key", default=None, help=argparse.SUPPRESS)
    g.add_argument("--max-queue", type=lambda s: None if s.lower() == "none" else int(s),
                   default=ServerConfig.max_queue, metavar="N",
                   help="waiting sequences beyond which new requests get 503 ('none': no limit); "
                        "a request of more samples (prompts x n) than this gets 400")
    g.add_argument("--admission", choices=("fixed", "adaptive"), default=ServerConfig.admission,
                   help="fixed: up to --max-queue sequences wait; adaptive: the limit follows measured TTFT "
                        "to hold --target-ttft (README 'Admission')")
    g.add_argument("--target-ttft", type=float, default=None, metavar="MS",
                   help="adaptive admission's time-to-first-token target, in milliseconds")
    g.add_argument("--allowed-origins", nargs="*", default=None, metavar="ORIGIN",
                   help="enable CORS for these origins ('*' for any); off by default")
    g.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation before ready")
    m = serve.add_argument_group("several models (README 'Several models')")
    m.add_argument("--models-dir", default=None, metavar="DIR",
                   help="also serve each .gguf file and Hugging Face folder in DIR (by its name), loaded on "
                        "the first request that names it")
    m.add_argument("--max-loaded-models", type=int, default=ServerConfig.max_loaded_models, metavar="N",
                   help="at most N models loaded; loading another unloads the least recently used (default: no limit)")
    m.add_argument("--memory-budget", type=float, default=ServerConfig.memory_budget_gib, metavar="GIB",
                   help="weights + KV pools of the loaded models; each model's KV pool is its share "
                        "(GIB / --max-loaded-models) minus its weights (default: no budget)")
    m.add_argument("--idle-unload", type=float, default=ServerConfig.idle_unload, metavar="S",
                   help="unload a model no request has used for S seconds (default: never)")
    g.add_argument("--allow-unknown-fields", action="store_true",
                   help="ignore request fields this server does not implement (default: a 400 naming the "
                        "field, code unknown_parameter), for clients that send other servers' extras")
    add_request_limit_args(serve.add_argument_group("request limits (tinyserve/request_limits.py; beyond one: 400, "
                                                    "413 for the body)"))
    limits = serve.add_argument_group("connections")
    limits.add_argument("--allow-special-tokens-in-messages", action="store_true",
                        help="render special-token text in chat messages (e.g. '<|im_start|>') as control "
                             "tokens instead of plain text: trusted clients only, it lets a message forge turns")
    limits.add_argument("--max-connections", type=int, default=ServerConfig.max_connections, metavar="N",
                        help="concurrent connections; requests beyond it get 503")
    add_timeout_args(serve.add_argument_group("timeouts (seconds)"))
    add_engine_args(serve, several_models=True)
    add_chat_template_arg(serve)
    add_generation_config_args(serve)
    serve.set_defaults(func=cmd_serve, log_level="info")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinyserve", description="An LLM inference server from scratch.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve_parser(sub)
    gen = sub.add_parser("generate", help="complete one prompt and print it as it streams")
    gen.add_argument("prompt")
    add_engine_args(gen)
    _sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", default=None, help="system message")
    add_engine_args(chat)
    add_chat_template_arg(chat)
    _sampling_args(chat)
    chat.set_defaults(func=cmd_chat)
    add_bench_parser(sub)
    worker = sub.add_parser("worker", help="(internal) a tensor / pipeline parallel rank that `serve` starts")
    worker.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    worker.set_defaults(func=cmd_worker)
    return parser


def _set_threads(threads: int | None) -> None:
    """One process-wide setting: our kernels run on torch's OpenMP pool (they are linked against it)."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def config_file_defaults(parser: argparse.ArgumentParser, path: str) -> dict[str, object]:
    """The flags a YAML config file sets, as `parser` defaults: {dest: value}. Keys are flag names without
    the dashes (`max-num-seqs` or `max_num_seqs`); a string value is parsed as the command line would parse
    it. Raises ValueError naming the file and the key that is not a flag, or the value that does not fit."""
    import yaml

    try:
        values = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"config file {path!r}: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError(f"config file {path!r}: expected a mapping of flags to values")
    actions = parser._option_string_actions  # argparse keeps its flags here; no public accessor exists
    defaults = {}
    for key, value in values.items():
        action = actions.get("--" + str(key).replace("_", "-"))
        if action is None or action.dest in ("config", "help"):
            raise ValueError(f"config file {path!r}: unknown key {key!r} (not a flag of `tinyserve {parser.prog.split()[-1]}`)")
        if isinstance(value, str) and action.type is not None:
            value = action.type(value)
        elif action.nargs == 0 and not isinstance(value, bool):  # --no-warmup and other switches
            raise ValueError(f"config file {path!r}: {key} must be true or false, got {value!r}")
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"config file {path!r}: {key} must be one of {list(action.choices)}, got {value!r}")
        defaults[action.dest] = value
    return defaults


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, over `serve --config FILE`'s values, over the defaults."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        subparser = parser._subparsers._group_actions[0].choices[args.command]
        subparser.set_defaults(**config_file_defaults(subparser, args.config))
        args = parser.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ValueError as exc:
        print(f"tinyserve: error: {exc}", file=sys.stderr)
        return 1
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from tinyserve.loader.errors import ModelLoadError

    try:
        _set_threads(getattr(args, "threads", None))
        return args.func(args)
    except (ModelLoadError, ValueError) as exc:  # bad model file or setting: one clear line, no traceback
        print(f"tinyserve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
