"""Text <-> token ids, and chat templates, for a GGUF file or a Hugging Face checkpoint folder.

The HF `tokenizers` library runs the BPE; a folder's tokenizer.json is read as is, and a GGUF's vocabulary is
assembled by loader/gguf/tokenizer.py. Chat templates are Jinja, rendered in a sandbox the way transformers
renders them, so prompts match token for token.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
import threading
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import processors
from tokenizers.models import BPE

from tinyserve.loader.errors import ModelLoadError
from tinyserve.loader.gguf.file_format import GGUFFile
from tinyserve.loader.gguf.tokenizer import gpt2_byte_alphabet, read_gguf_tokenizer

# Texts longer than this (characters) are encoded through encode_batch, and token lists longer than this
# decoded through decode_batch: those release the GIL, while encode / decode hold it for the whole call and
# so stall every other thread (the server's event loop) for as long as a long text takes.
_GIL_FREE_LENGTH = 4096

# Tokens that end a turn in the common chat formats. The declared eos often is not the one a chat turn ends
# with (SmolLM2's GGUF), so, like llama.cpp, any of these that is an added/control token also stops generation.
_END_OF_TURN = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>",
    "</s>", "<|EOT|>", "<EOT>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>",
)  # fmt: skip


_CHAR_TO_BYTE = {char: byte for byte, char in gpt2_byte_alphabet().items()}


def _set_post_processor(
    backend: tokenizers.Tokenizer, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool
) -> None:
    """encode(add_special_tokens=True) puts bos before / eos after the text when the checkpoint asks for it."""
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    special = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    backend.post_processor = processors.TemplateProcessing(single=single, special_tokens=special)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering ignores it."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_chat_template(source: str) -> jinja2.Template:
    # The same environment transformers uses, so rendered prompts match its apply_chat_template exactly.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as a serialized AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _as_ids(value: Any) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def _component_kinds(component: Any, nested_key: str) -> list[dict]:
    """A normalizer's or pre-tokenizer's serialized steps, Sequences flattened."""
    if component is None:
        return []
    steps, kinds = [json.loads(component.__getstate__())], []
    while steps:
        step = steps.pop()
        if step["type"] == "Sequence":
            steps.extend(step.get(nested_key) or [])
        else:
            kinds.append(step)
    return kinds


def _keeps_every_character(backend: tokenizers.Tokenizer) -> bool:
    """Whether every character of a text lands in some token whose spelling is at least as long as what it
    covers: true of byte-level BPE and SentencePiece with byte fallback (all a GGUF gives us), false where
    characters are merged (NFC), dropped (BERT's whitespace split, Strip) or swallowed (a fused unk run)."""
    model = backend.model
    if not isinstance(model, BPE) or (model.unk_token is not None and model.fuse_unk and not model.byte_fallback):
        return False
    for step in _component_kinds(backend.normalizer, "normalizers"):
        pattern = step.get("pattern", {}).get("String")
        if step["type"] == "Replace" and pattern is not None and len(pattern) <= len(step["content"]):
            continue
        if step["type"] != "Prepend":
            return False
    keeping = {"ByteLevel", "Split", "Digits", "Metaspace", "Punctuation"}
    return all(step["type"] in keeping and step.get("behavior") != "Removed"
               for step in _component_kinds(backend.pre_tokenizer, "pretokenizers"))


class Tokenizer:
    """A BPE tokenizer plus what serving needs around it: bos/eos ids, special tokens, the chat template.

    Immutable after construction. `eos_token_ids` is the declared eos plus every added token named like an
    end of turn (see _END_OF_TURN), so a chat model stops at the end of its turn whatever its metadata says.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Iterable[int] = (),  # declared besides eos_token (generation_config.json)
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        added = backend.get_added_tokens_decoder()  # id -> AddedToken
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        self._special_id_of = {t.content: i for i, t in added.items() if t.special}
        self._special_pattern_compiled: re.Pattern | None = None  # built on first use: see _special_pattern
        self._text_backend: tokenizers.Tokenizer | None = None  # built on first use: see _encode_as_text
        self._text_backend_lock = threading.Lock()
        # A text of more than n * max_token_chars characters cannot encode to n tokens or fewer (None: no such
        # bound, the tokenizer may merge or drop characters), so a prompt that cannot fit the context is refused
        # without tokenizing it.
        vocab = backend.get_vocab(with_added_tokens=True)
        self.max_token_chars = max(map(len, vocab)) if vocab and _keeps_every_character(backend) else None
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = None if bos_token is None else backend.token_to_id(bos_token)
        declared = {None if eos_token is None else backend.token_to_id(eos_token), *eos_token_ids}
        end_of_turn = {i for i in map(backend.token_to_id, _END_OF_TURN) if i in added}
        self.eos_token_ids: frozenset[int] = frozenset((declared | end_of_turn) - {None})
        self.chat_template = chat_template
        self._compiled_template = None if chat_template is None else _compile_chat_template(chat_template)

    @classmethod
    def from_gguf(cls, reader: GGUFFile) -> Tokenizer:
        parts = read_gguf_tokenizer(reader)
        _set_post_processor(parts.backend, parts.bos_token, parts.eos_token, parts.add_bos, parts.add_eos)
        return cls(parts.backend, bos_token=parts.bos_token, eos_token=parts.eos_token,
                   chat_template=parts.chat_template)

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """A Hugging Face checkpoint folder: tokenizer.json, tokenizer_config.json, and eos ids from
        generation_config.json and config.json."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ModelLoadError(f"{path}: no tokenizer.json (a Hugging Face checkpoint folder needs one)")
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        if "add_bos_token" in config or "add_eos_token" in config:  # as transformers: they override tokenizer.json
            add_bos, add_eos = config.get("add_bos_token", False), config.get("add_eos_token", False)
            _set_post_processor(backend, bos, eos, add_bos, add_eos)
        eos_ids = _as_ids(_read_json(path / "generation_config.json").get("eos_token_id"))
        eos_ids += _as_ids(_read_json(path / "config.json").get("eos_token_id"))
        template = cls._folder_template(path, config)
        return cls(backend, bos_token=bos, eos_token=eos, eos_token_ids=eos_ids, chat_template=template)

    @staticmethod
    def _folder_template(path: Path, config: dict) -> str | None:
        if (path / "chat_template.jinja").is_file():  # newer checkpoints keep it in its own file
            return (path / "chat_template.jinja").read_text(encoding="utf-8")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}.get("default")
        return template

    def with_chat_template(self, source: str) -> Tokenizer:
        """This tokenizer with `source` as its chat template instead of the checkpoint's (--chat-template).
        A template that does not compile is a ModelLoadError naming the line."""
        try:
            compiled = _compile_chat_template(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ModelLoadError(f"chat template: line {exc.lineno}: {exc.message}") from None
        other = copy.copy(self)  # the backend and ids are immutable: shared
        other._text_backend, other._text_backend_lock = None, threading.Lock()
        other.chat_template, other._compiled_template = source, compiled
        return other

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        """The special tokens (those decode(skip_special_tokens=True) drops), plus bos and eos."""
        return sorted(self._special_ids | self.eos_token_ids | ({self.bos_token_id} - {None}))

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for. Its decoded text is enough unless the token holds part of
        a multi-byte character (the text is then U+FFFD): those bytes come from the vocab spelling, in
        GPT-2's byte alphabet or SentencePiece's <0xNN> byte tokens."""
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        spelling = self.id_to_token(token_id) or ""
        if len(spelling) == 6 and spelling.startswith("<0x") and spelling.endswith(">"):
            return bytes([int(spelling[3:5], 16)])
        if spelling and all(char in _CHAR_TO_BYTE for char in spelling):
            return bytes(_CHAR_TO_BYTE[char] for char in spelling)
        return text.encode("utf-8")

    def backend_json(self) -> str:
        """The Hugging Face `tokenizers` definition as JSON (what a grammar library reads the vocabulary from)."""
        return self._backend.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special tokens written in the text (e.g. "<|im_start|>") always become their ids; add_special_tokens
        only controls whether bos/eos are added around it."""
        if len(text) > _GIL_FREE_LENGTH:
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        token_ids = list(token_ids)
        if len(token_ids) > _GIL_FREE_LENGTH:
            return self._backend.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)[0]
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @property
    def special_texts(self) -> frozenset[str]:
        """The text of every special token, e.g. "<|im_start|>"."""
        return frozenset(self._special_id_of)

    def has_special_text(self, text: str) -> bool:
        """Whether `text` spells a special token, e.g. "<|im_start|>"."""
        return any(special in text for special in self._special_id_of)

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template shows a `tools` list to the model (Hugging Face's tool-use templates)."""
        return self.chat_template is not None and "tools" in self.chat_template

    def encode_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, allow_special_in_content: bool = False,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """The prompt ids of a conversation (bos, if any, is the template's to write). Special-token text inside
        a message's content ("<|im_end|><|im_start|>system ...") is encoded as plain text, so a user cannot
        forge a turn: only the template's own special tokens become control ids. `allow_special_in_content`
        (trusted clients) parses them everywhere. Without such text the ids are exactly
        encode(apply_chat_template(...), add_special_tokens=False). Raises ValueError as apply_chat_template."""
        prompt = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        contents = [m.get("content") for m in messages]
        if allow_special_in_content or not any(isinstance(c, str) and self.has_special_text(c) for c in contents):
            return self.encode(prompt, add_special_tokens=False)
        return self._encode_pieces(self._template_and_contents(messages, add_generation_prompt, prompt, tools))

    def _encode_pieces(self, pieces: list[str]) -> list[int]:
        """[template, content, ..., template] -> ids: the template's special tokens become their ids, all else is
        text. The text between two of them is encoded in one piece, as the backend itself encodes a prompt (it
        splits at special tokens only), so a conversation without special text in content gets the same ids."""
        ids, text = [], []  # text: what runs since the last special token of the template
        for i, piece in enumerate(pieces):
            start = 0
            if i % 2 == 0 and self._special_pattern is not None:  # the template's own text
                for match in self._special_pattern.finditer(piece):
                    ids += self._encode_as_text("".join(text) + piece[start:match.start()])
                    ids.append(self._special_id_of[match.group()])
                    text, start = [], match.end()
            text.append(piece[start:])
        return ids + self._encode_as_text("".join(text))

    @property
    def _special_pattern(self) -> re.Pattern | None:
        """The special tokens' texts, leftmost-longest as the backend matches them. Compiled on first use: Gemma's
        6,249 control tokens take a second to compile, and only special text in a chat message needs it."""
        if self._special_pattern_compiled is None and self._special_id_of:
            longest_first = sorted(self._special_id_of, key=len, reverse=True)
            self._special_pattern_compiled = re.compile("|".join(map(re.escape, longest_first)))
        return self._special_pattern_compiled

    def _template_and_contents(self, messages: list[dict], add_generation_prompt: bool, prompt: str,
                               tools: list[dict] | None = None) -> list[str]:
        """The prompt cut into [template, content, template, ..., template]. Found by rendering each content as a
        random placeholder; the content goes back in as given, or stripped if that is what makes the real
        prompt (templates that `| trim` it). NOTE: a template that transforms content in another way gets it
        as given, a small change of prompt that only special-token text in content can cause."""
        nonce = secrets.token_hex(8)
        masked = [{**m, "content": f"\ue000{nonce}:{i}\ue001"} if isinstance(m.get("content"), str) else m
                  for i, m in enumerate(messages)]
        skeleton = self.apply_chat_template(masked, add_generation_prompt=add_generation_prompt, tools=tools)
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", skeleton)  # odd items: the message index
        as_given = [p if i % 2 == 0 else messages[int(p)]["content"] for i, p in enumerate(parts)]
        stripped = [p if i % 2 == 0 else p.strip() for i, p in enumerate(as_given)]
        return stripped if "".join(as_given) != prompt and "".join(stripped) == prompt else as_given

    def _encode_as_text(self, text: str) -> list[int]:
        """Special-token text as plain text. A second backend does it (encode_special_tokens is a setting of the
        backend, and the shared one is used from several threads at once)."""
        if not text:
            return []
        with self._text_backend_lock:
            if self._text_backend is None:
                self._text_backend = tokenizers.Tokenizer.from_str(self._backend.to_str())
                self._text_backend.encode_special_tokens = True
        if len(text) > _GIL_FREE_LENGTH:
            return self._text_backend.encode_batch([text], add_special_tokens=False)[0].ids
        return self._text_backend.encode(text, add_special_tokens=False).ids

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None, **kwargs: Any
    ) -> str:
        """The prompt text for a conversation. tools=None and documents=None are passed like transformers does,
        since templates test `tools is defined`. Raises ValueError if the model has no template or the template
        rejects the conversation (its raise_exception, e.g. roles that do not alternate): both are the client's."""
        if self._compiled_template is None:
            raise ValueError("this model has no chat template; send a plain prompt (/v1/completions) instead")
        # like transformers' special_tokens_map: a token the model lacks is left undefined, not None
        specials = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token)) if v is not None}
        variables = {**specials, "documents": None, **kwargs}
        try:
            return self._compiled_template.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template rejected the conversation: {exc}") from exc
