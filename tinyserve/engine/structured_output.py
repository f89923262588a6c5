"""Constrained decoding: the output of a request with a StructuredOutput stays in its language.

The grammar library is llguidance (docs/PERFORMANCE.md, "Choosing the grammar library"): it turns a JSON
schema, a regex, a choice list or a GBNF / Lark grammar into a matcher that follows a sequence's tokens
and, before each draw, gives the set of tokens allowed next as a bitmask (one bit per vocabulary entry).
What is ours: the compile cache, where the matchers live (one per sequence, `Request.matcher`), when the
masks are computed (on a worker thread while the forward pass runs: a sequence's mask depends only on the
tokens it already has), and applying them to the logits (engine/sampler.py, layers/ops.py).

JSON is generated in the layout `json.dumps` writes (", " and ": ", no other whitespace), and an object
schema that lists `properties` but says nothing of `additionalProperties` admits no others (as vLLM's
default backend and OpenAI's strict mode): a small model given free whitespace or free keys can fill its
whole budget with them.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import llguidance
import torch

from tinyserve.loader.tokenizer import Tokenizer
from tinyserve.types import InvalidRequest, StructuredOutput

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's own defaults, but for the per-step lexer fuel, halved: one sequence's mask must not take a
# step hostage (a grammar that needs more is refused when it is compiled or fails its request).
PARSER_LIMITS = llguidance.LLParserLimits(step_lexer_fuel=100_000)
# compiled grammars kept, least recently used dropped first; their texts are capped (types.py), so this
# bounds the cache's memory
CACHE_ENTRIES = 256


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class StructuredOutputs:
    """One engine's grammar compiler and cache. `compile` may run on any thread (the server runs it on a
    worker thread before queueing a request, so that a slow compile never stalls a step); `matcher`,
    `fill_bitmask` and the matchers themselves belong to the engine thread."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]):
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._eos_token_ids = sorted(eos_token_ids)
        self._lltokenizer: llguidance.LLTokenizer | None = None  # built on first use (the vocabulary's slices)
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._executor: llguidance.LLExecutor | None = None
        self._unwritable: frozenset[int] | None = None  # bytes no token holds (built on first use)

    def compile(self, spec: StructuredOutput) -> None:
        """Compile and cache the spec, or raise InvalidRequest (param "structured_output") saying why."""
        self._refuse_unwritable(spec)
        self._pristine(spec)

    def _refuse_unwritable(self, spec: StructuredOutput) -> None:
        """InvalidRequest when the spec names a character this vocabulary cannot write. SmolLM2's has no
        token holding the byte 0xF1 or 0xF2 (the lead bytes of U+40000-U+BFFFF), and llguidance, which
        takes every byte to be writable, would then let a wrong token through the mask mid-output."""
        if self._unwritable is None:
            held: set[int] = set()
            for token_id in range(self._tokenizer.vocab_size):
                held.update(self._tokenizer.token_bytes(token_id))
            self._unwritable = frozenset(range(256)) - held
        if not self._unwritable:
            return
        text = spec.spec
        if spec.kind in ("json_schema", "choice"):  # the characters its JSON's escapes stand for
            try:
                text = json.dumps(json.loads(spec.spec), ensure_ascii=False)
            except ValueError:
                return  # not JSON: _grammar_text says so
        # JSON output writes a control character as an escape; a regex, choice or grammar writes it as it is
        lowest = 0x20 if spec.kind == "json_schema" else 0
        for char in sorted({c for c in text if ord(c) >= lowest}):
            missing = set(char.encode("utf-8", "surrogatepass")) & self._unwritable
            if missing:
                raise InvalidRequest(
                    f"the {_NAMES[spec.kind]} needs {char!r} (U+{ord(char):04X}), which this model's vocabulary "
                    f"cannot write (no token holds the byte 0x{min(missing):02X})",
                    param="structured_output", code="invalid_grammar")

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the spec's language, for one sequence."""
        return self._pristine(spec).deep_copy()

    def fill_bitmask(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """[len(matchers), words] int32: bit t of row i set where matchers[i] allows token t next."""
        words = bitmask_words(self.vocab_size)
        bitmask = torch.empty(len(matchers), words, dtype=torch.int32)
        row_bytes = words * 4
        if len(matchers) == 1:
            matchers[0].unsafe_compute_mask_ptr(bitmask.data_ptr(), row_bytes)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(num_threads=2)
            self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                                   row_bytes, len(matchers))
        return bitmask

    def _pristine(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        with self._lock:
            pristine = self._compiled.get(spec)
            if pristine is not None:
                self._compiled.move_to_end(spec)
                return pristine
            lltokenizer = self._llg_tokenizer()
        grammar = _grammar_text(spec)
        # NOTE: the matcher compiles the grammar against the vocabulary (llguidance drops the GIL meanwhile)
        pristine = llguidance.LLMatcher(lltokenizer, grammar, log_level=0, limits=PARSER_LIMITS)
        if pristine.is_error():
            raise InvalidRequest(f"the {_NAMES[spec.kind]} cannot be compiled: {pristine.get_error()}",
                                 param="structured_output", code="invalid_grammar")
        with self._lock:
            self._compiled[spec] = pristine
            while len(self._compiled) > CACHE_ENTRIES:
                self._compiled.popitem(last=False)
        return pristine

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._lltokenizer is None:
            self._lltokenizer = llguidance.LLTokenizer(self._tokenizer.backend_json(), n_vocab=self.vocab_size,
                                                       eos_token=self._eos_token_ids)
        return self._lltokenizer


_NAMES = {"json_schema": "JSON schema", "regex": "regex", "choice": "choice list", "grammar": "grammar"}


def _grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for the spec; InvalidRequest where the text is not one of its kind."""
    try:
        if spec.kind == "json_schema":
            schema = closed_objects(json.loads(spec.spec))
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.spec)
        # "choice": a JSON list of strings; "grammar": GBNF (llama.cpp's) or Lark, told apart by llguidance
        return llguidance.grammar_from(spec.kind, spec.spec)
    except (ValueError, TypeError) as exc:
        raise InvalidRequest(f"the {_NAMES[spec.kind]} is not valid: {exc}", param="structured_output",
                             code="invalid_grammar") from None


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                  "unevaluatedProperties", "unevaluatedItems")


def closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that has `properties` and
    leaves extra keys unsaid; subschemas are found by keyword, so a property named "properties" is a name."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & out.keys():
        out["additionalProperties"] = False
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    for key in _SCHEMA_VALUES:
        if key in out:
            out[key] = [closed_objects(s) for s in out[key]] if isinstance(out[key], list) else closed_objects(out[key])
    return out
