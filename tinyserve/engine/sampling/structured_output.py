"""Constrained decoding: the output of a request with a StructuredOutput stays in its language.

The grammar library is llguidance (docs/PERFORMANCE.md, "Choosing the grammar library"): it turns a JSON
schema, a regex, a choice list or a GBNF / Lark grammar into a matcher that follows a sequence's tokens
and, before each draw, gives the set of tokens allowed next as a bitmask (one bit per vocabulary entry).
What is ours: the budgets a spec meets before llguidance sees it (engine/sampling/grammar_budget.py), the compile
on a large-stack thread with its first mask, the compile cache (engine/sampling/grammar_cache.py), where the
matchers live (one per sequence, `Request.matcher`), when the masks are computed (on a worker thread while
the forward pass runs: a sequence's mask depends only on the tokens it already has), and applying them to
the logits (engine/sampling/sampler.py, layers/ops.py).

JSON is generated in the layout `json.dumps` writes (", " and ": ", no other whitespace), and an object
schema that lists `properties` but says nothing of `additionalProperties` admits no others (as vLLM's
default backend and OpenAI's strict mode): a small model given free whitespace or free keys can fill its
whole budget with them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from typing import Any

import llguidance
import torch

from tinyserve.engine.sampling.big_stack_worker import BigStackWorker
from tinyserve.engine.sampling.grammar_budget import SCHEMA_LISTS, SCHEMA_MAPS, SCHEMA_VALUES, check_budget, clip
from tinyserve.engine.sampling.grammar_cache import GrammarCache
from tinyserve.engine.memory.host_heap import heap_bytes_in_use
from tinyserve.loader.tokenizer import Tokenizer
from tinyserve.types import InvalidRequest, StructuredOutput

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's own limits (its defaults in brackets): the per-step lexer fuel halved (200k), so one
# sequence's mask cannot take a step hostage; the fuel for a lexer's first regexes (1M) a fifth, so that
# a regex of large repetitions fails its compile in ~0.2 s rather than 2 s; lexer states (250k, 1-2 kB
# each) a fifth, to bound what one grammar can hold; errors without the grammar and parser state in them
# (they reach logs and 400 bodies). Rows of over 2,000 items still fail (grammar_budget keeps choices and
# rules to half that).
PARSER_LIMITS = llguidance.LLParserLimits(step_lexer_fuel=100_000, initial_lexer_fuel=200_000,
                                          max_lexer_states=50_000, verbose_errors=False)
# compiled grammars kept, least recently used dropped first, by count and by the heap each compile kept
CACHE_ENTRIES = 256
CACHE_BYTES = 256 << 20
MIN_ENTRY_BYTES = 64 << 10  # what an entry is taken to cost at least (the heap reading is noisy)
# compiles run here: llguidance recurses, and an overflow of a thread's stack kills the process
COMPILE_WORKER = BigStackWorker()


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
        self._compiled: GrammarCache[StructuredOutput, llguidance.LLMatcher] = GrammarCache(CACHE_ENTRIES, CACHE_BYTES)
        self._executor: llguidance.LLExecutor | None = None
        self._unwritable: frozenset[int] | None = None  # bytes no token holds (built on first use)

    def compile(self, spec: StructuredOutput) -> None:
        """Compile and cache the spec, or raise InvalidRequest (param "structured_output") saying why: a
        spec over a budget (engine/sampling/grammar_budget.py), one llguidance refuses, or one whose first mask
        fails (so the refusal comes before the request is queued, and the same every time)."""
        if self._compiled.get(spec) is not None:  # checked when it was compiled (the engine checks again)
            return
        check_budget(spec)  # first: what follows parses the spec with Python's recursive parser
        self._refuse_unwritable(spec)
        self._refuse_special_text(spec)
        self._pristine(spec)

    def _refuse_special_text(self, spec: StructuredOutput) -> None:
        """InvalidRequest when the spec spells a special token's text ("<|endoftext|>"). NOTE: llguidance
        then allows only the special token itself at that point, and refuses it when it is consumed, so
        the request failed mid-output (found by the fuzz of issue 44). A regex's escapes are read through."""
        text = _spelled_text(spec)
        spelled = sorted(special for special in self._tokenizer.special_texts if special in text)
        if spelled:
            raise InvalidRequest(f"the {_NAMES[spec.kind]} spells the special token {clip(spelled[0])!r}, which "
                                 "constrained output cannot write as text", param="structured_output",
                                 code="invalid_grammar")

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
        pristine = self._compiled.get(spec)
        if pristine is not None:
            return pristine
        if self._lltokenizer is None:
            self._lltokenizer = COMPILE_WORKER.run(self._llg_tokenizer)
        pristine, cost = COMPILE_WORKER.run(_compile, self._lltokenizer, spec)
        self._compiled.put(spec, pristine, cost)
        return pristine

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._lltokenizer is None:
            self._lltokenizer = llguidance.LLTokenizer(self._tokenizer.backend_json(), n_vocab=self.vocab_size,
                                                       eos_token=self._eos_token_ids)
        return self._lltokenizer


def _compile(lltokenizer: llguidance.LLTokenizer, spec: StructuredOutput) -> tuple[llguidance.LLMatcher, int]:
    """(the pristine matcher, the heap bytes its compile kept). The first mask is computed twice, on two
    copies: llguidance's lexer is shared by a matcher's copies and one that ran out of room building the
    first mask fails every later sequence's first mask."""
    before = heap_bytes_in_use()
    grammar = _grammar_text(spec)
    try:
        # NOTE: the matcher compiles the grammar against the vocabulary (llguidance drops the GIL meanwhile)
        pristine = llguidance.LLMatcher(lltokenizer, grammar, log_level=0, limits=PARSER_LIMITS)
    except ValueError as exc:  # a grammar over max_grammar_size, say
        raise _cannot_compile(spec, str(exc)) from None
    probes = [pristine]
    for probe in (pristine.deep_copy(), pristine.deep_copy()):
        if not probes[-1].is_error():
            probe.compute_bitmask()
            probes.append(probe)
    failed = next((p for p in probes if p.is_error()), None)
    if failed is not None:
        raise _cannot_compile(spec, failed.get_error())
    after = heap_bytes_in_use()
    kept = after - before if before is not None and after is not None else 0
    return pristine, max(kept, MIN_ENTRY_BYTES, len(spec.spec) * 16)


def _cannot_compile(spec: StructuredOutput, error: str) -> InvalidRequest:
    return InvalidRequest(f"the {_NAMES[spec.kind]} cannot be compiled: {clip(error.strip())}",
                          param="structured_output", code="invalid_grammar")


def _spelled_text(spec: StructuredOutput) -> str:
    """The spec's text as its outputs could spell it: JSON's escapes decoded, a regex's escapes dropped."""
    if spec.kind in ("json_schema", "choice"):
        try:
            return json.dumps(json.loads(spec.spec), ensure_ascii=False)
        except ValueError:
            return spec.spec
    return re.sub(r"\\(.)", r"\1", spec.spec) if spec.kind == "regex" else spec.spec


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
        raise InvalidRequest(f"the {_NAMES[spec.kind]} is not valid: {clip(str(exc))}", param="structured_output",
                             code="invalid_grammar") from None


def closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that has `properties` and
    leaves extra keys unsaid."""
    def closed(out: dict) -> dict:
        if "properties" in out and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & out.keys():
            out["additionalProperties"] = False
        return out

    return each_subschema(schema, closed)


def each_subschema(schema: Any, change: Callable[[dict], dict]) -> Any:
    """A copy of the schema with `change` applied to it and to every subschema (each given a copy of its own
    keys); subschemas are found by keyword, so a property named "properties" is a name."""
    if not isinstance(schema, dict):
        return schema
    out = change(dict(schema))
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: each_subschema(sub, change) for name, sub in out[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [each_subschema(sub, change) for sub in out[key]]
    for key in SCHEMA_VALUES:
        if key in out:
            value = out[key]
            out[key] = [each_subschema(s, change) for s in value] if isinstance(value, list) else each_subschema(value, change)
    return out
