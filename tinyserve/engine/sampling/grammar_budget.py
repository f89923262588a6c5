"""Grammar budgets: a structural walk of every structured-output spec before llguidance sees it.

Why: llguidance compiles recursively. A JSON schema whose `$ref`s chain ~1,100 deep, or a Lark grammar of
~2,700 chained rules, overflows the 8 MiB stack of the thread compiling it, and the SIGSEGV kills the
server (issue 44); a regex like `(a{1000}){1000}` exhausts the lexer after one mask; a choice of 10,000
strings overflows a parser row at the second token. Each limit below sits at no more than a quarter of the
smallest value measured to fail (benchmarks/grammar_crash_depth.py, docs/PERFORMANCE.md "Grammar
budgets"), and is a constant: the crash depth depends on the stack of whatever thread compiles, the limit
must not.

Every walk is iterative (an explicit stack), so a spec nested past any depth is refused, never a
RecursionError. Depth counts levels where llguidance recurses: a subschema (inline or through `$ref`), a
rule a rule names, a group in a regex or a rule. A violation is InvalidRequest, code `invalid_grammar`,
naming the limit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from tinyserve.types import InvalidRequest, StructuredOutput

# the smallest crashes measured on an 8 MiB thread stack: 464 $ref hops (4 levels each, 1,856 levels),
# 1,104 hops of 2 levels (2,210), 2,688 chained Lark rules; limits at most a quarter of them
MAX_NESTING_DEPTH = 400
MAX_REF_HOPS = 100
MAX_JSON_NESTING = 128  # llguidance's JSON reader refuses deeper text anyway (serde_json's limit)
MAX_SCHEMA_NODES = 20_000  # distinct subschemas in one schema
MAX_RULES = 2_000  # rules and terminals in one grammar
MAX_ALTERNATIVES = 1_000  # a choice's strings, an anyOf/oneOf/enum's entries, a rule's `|`s: half a parser row
MAX_REGEX_EXPANSION = 20_000  # a regex's size with its bounded repetitions unrolled: (a{100}){200} is 20,000
MAX_ECHO_CHARS = 256  # of what the client sent, in an error message or a log line


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """text cut to `limit` characters, saying how much was left out."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def check_budget(spec: StructuredOutput) -> None:
    """InvalidRequest (code invalid_grammar) where the spec exceeds a limit above."""
    if spec.kind == "json_schema":
        check_schema(_load_json(spec.spec, "JSON schema"))
    elif spec.kind == "regex":
        check_regex(spec.spec)
    elif spec.kind == "choice":
        choices = _load_json(spec.spec, "choice list")
        if isinstance(choices, list):
            _at_most(len(choices), MAX_ALTERNATIVES, "strings in a choice list", "MAX_ALTERNATIVES")
    else:
        check_grammar(spec.spec)


def _refuse(what: str, limit: int, name: str, found: int | None = None) -> InvalidRequest:
    got = "" if found is None else f", got {found}"
    return InvalidRequest(f"the grammar exceeds a budget ({name}): at most {limit} {what}{got}",
                          param="structured_output", code="invalid_grammar")


def _at_most(value: int, limit: int, what: str, name: str) -> None:
    if value > limit:
        raise _refuse(what, limit, name, value)


def _load_json(text: str, kind: str) -> Any:
    """The parsed JSON, its nesting checked first (Python's parser recurses); None if it is not JSON."""
    _at_most(json_nesting(text), MAX_JSON_NESTING, "levels of JSON nesting", "MAX_JSON_NESTING")
    try:
        return json.loads(text)
    except ValueError:
        return None  # not JSON: the compile says so in its own words


_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def json_nesting(text: str) -> int:
    """The deepest bracket nesting of JSON text (strings skipped), in one pass without parsing."""
    return _deepest((token.group() for token in _JSON_TOKENS.finditer(text)), "[{", "]}")


def _deepest(tokens: Iterable[str], opening: str, closing: str) -> int:
    depth = deepest = 0
    for token in tokens:
        if token in opening:
            depth += 1
            deepest = max(deepest, depth)
        elif token in closing:
            depth -= 1
    return deepest


# where a schema holds subschemas (by keyword: a property named "items" is a name, not a subschema)
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                  "unevaluatedProperties", "unevaluatedItems")


def check_schema(schema: Any) -> tuple[int, int]:
    """(levels, $ref hops) of the schema's deepest path, $refs followed; InvalidRequest past a limit.

    A depth-first walk with an explicit stack; each subschema's (levels, hops) below it is kept once
    found, so a subschema many paths reach is walked once, and a `$ref` back to a subschema on the path
    (a recursive schema) is a loop llguidance compiles as a rule, not a level."""
    if not isinstance(schema, dict):
        return 0, 0
    below: dict[int, tuple[int, int]] = {}
    on_path: set[int] = set()
    # frames: [schema, its children iterator, levels below, hops below, reached through a $ref]
    stack: list[list] = [[schema, _subschemas(schema, schema), 0, 0, False]]
    on_path.add(id(schema))
    while stack:
        frame = stack[-1]
        child = next(frame[1], None)
        if child is not None:
            sub, is_ref = child
            if id(sub) in below:
                _raise_to(frame, below[id(sub)], is_ref)
            elif id(sub) not in on_path:
                _at_most(len(below) + len(stack) + 1, MAX_SCHEMA_NODES, "subschemas", "MAX_SCHEMA_NODES")
                stack.append([sub, _subschemas(sub, schema), 0, 0, is_ref])
                on_path.add(id(sub))
            continue
        stack.pop()
        on_path.discard(id(frame[0]))
        shape = below[id(frame[0])] = (frame[2] + 1, frame[3])
        if stack:
            _raise_to(stack[-1], shape, frame[4])
    return below[id(schema)]


def _raise_to(parent: list, shape: tuple[int, int], is_ref: bool) -> None:
    parent[2] = max(parent[2], shape[0])
    parent[3] = max(parent[3], shape[1] + is_ref)
    _at_most(parent[2] + 1, MAX_NESTING_DEPTH, "levels of nested subschemas ($refs followed)", "MAX_NESTING_DEPTH")
    _at_most(parent[3], MAX_REF_HOPS, "$refs in a chain", "MAX_REF_HOPS")


def _subschemas(schema: dict, root: dict):
    """(subschema, reached through $ref) for each dict the schema holds by keyword; patterns checked."""
    for key in ("anyOf", "oneOf", "enum"):
        if isinstance(schema.get(key), list):
            _at_most(len(schema[key]), MAX_ALTERNATIVES, f"entries in an {key}", "MAX_ALTERNATIVES")
    if isinstance(schema.get("pattern"), str):
        check_regex(schema["pattern"])
    ref = schema.get("$ref")
    if isinstance(ref, str):
        target = _resolve(root, ref)
        if isinstance(target, dict):
            yield target, True
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                if key == "patternProperties":
                    check_regex(name)
                if isinstance(sub, dict):
                    yield sub, False
    for key in (*SCHEMA_LISTS, *SCHEMA_VALUES):
        value = schema.get(key)
        for sub in value if isinstance(value, list) else [value]:
            if isinstance(sub, dict):
                yield sub, False


def _resolve(root: dict, ref: str) -> Any:
    """The target of a local `#/...` JSON pointer, or None (remote or dangling: llguidance refuses it)."""
    if not ref.startswith("#"):
        return None
    node: Any = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


_QUANTIFIER = re.compile(r"\{(\d{1,9})(,(\d{0,9}))?\}")


def check_regex(regex: str) -> int:
    """The regex's group nesting; InvalidRequest past MAX_NESTING_DEPTH or MAX_REGEX_EXPANSION.

    The expansion is the regex's size with each bounded repetition unrolled: `(a{1000}){1000}` is a
    million, which llguidance's lexer builds out of derivatives until it gives up. A frame per open group
    holds (its size so far, the size of its last atom)."""
    frames = [[0, 0]]
    deepest, i = 0, 0
    while i < len(regex):
        char = regex[i]
        if char == "(":
            frames.append([0, 0])
            deepest = max(deepest, len(frames) - 1)
            _at_most(deepest, MAX_NESTING_DEPTH, "levels of nested groups", "MAX_NESTING_DEPTH")
        elif char == ")" and len(frames) > 1:
            size = frames.pop()[0]
            frames[-1][0] += size
            frames[-1][1] = size
        elif char == "{" and (quantifier := _QUANTIFIER.match(regex, i)):
            low, comma, high = quantifier.groups()
            times = int(high) if high else int(low)  # {m,} is a loop after m copies: m
            frames[-1][0] += frames[-1][1] * (times - 1)
            frames[-1][1] *= times
            i = quantifier.end()
            _at_most(frames[-1][0], MAX_REGEX_EXPANSION, "characters with bounded repetitions unrolled",
                     "MAX_REGEX_EXPANSION")
            continue
        else:
            i = _skip_atom(regex, i)
            frames[-1][0] += 1
            frames[-1][1] = 1
            continue
        i += 1
    return deepest


def _skip_atom(regex: str, i: int) -> int:
    """The index after the atom at i: an escape (with its {...} argument), a class (nested ones too), a char."""
    if regex[i] == "\\":
        if i + 2 < len(regex) and regex[i + 2] == "{":
            end = regex.find("}", i)
            return len(regex) if end < 0 else end + 1
        return i + 2
    if regex[i] != "[":
        return i + 1
    depth, i = 0, i
    while i < len(regex):
        if regex[i] == "\\":
            i += 2
            continue
        depth += {"[": 1, "]": -1}.get(regex[i], 0)
        i += 1
        if depth == 0:
            return i
    return i


_RULE_HEAD = re.compile(r"^[ \t]*[?!]?([A-Za-z_][\w-]*)(?:\.-?\d+)?[ \t]*(::=|:)", re.MULTILINE)
# what names no rule, blanked before names are read: Lark's strings, regexes and comments; GBNF's
# strings, character classes and comments; directives (%json's schema is taken out before)
_LARK_BLANKS = re.compile(r'"(?:[^"\\\n]|\\.)*"i?|/(?![/*])(?:[^/\\\n]|\\.)+/[imslux]*|//[^\n]*|%\w+')
_GBNF_BLANKS = re.compile(r'"(?:[^"\\\n]|\\.)*"|\[(?:[^\]\\\n]|\\.)*\]|#[^\n]*')
_LARK_REGEX = re.compile(r'/(?![/*])((?:[^/\\\n]|\\.)+)/[imslux]*')
_NAME = re.compile(r"[A-Za-z_][\w-]*")


def check_grammar(text: str) -> int:
    """The deepest chain of rules naming rules (each rule's own groups and %json schemas added), for a
    Lark or GBNF grammar; InvalidRequest past a limit. Rule counts, `|`s, regexes and schemas too."""
    heads = list(_RULE_HEAD.finditer(text))
    _at_most(len(heads), MAX_RULES, "rules", "MAX_RULES")
    is_gbnf = any(head.group(2) == "::=" for head in heads)
    bodies = {head.group(1): text[head.end(): after.start() if after else len(text)]
              for head, after in zip(heads, [*heads[1:], None])}
    weights, names = {}, {}
    for rule, body in bodies.items():
        body, schema_levels = _take_out_schemas(body)
        if not is_gbnf:
            for regex in _LARK_REGEX.finditer(body):
                check_regex(regex.group(1))
        body = (_GBNF_BLANKS if is_gbnf else _LARK_BLANKS).sub(" ", body)
        _at_most(body.count("|") + 1, MAX_ALTERNATIVES, "alternatives in a rule", "MAX_ALTERNATIVES")
        weights[rule] = 1 + _deepest(body, "([{", ")]}") + schema_levels
        names[rule] = [name for name in dict.fromkeys(_NAME.findall(body)) if name in bodies]
    return _deepest_chain(weights, names)


def _take_out_schemas(body: str) -> tuple[str, int]:
    """The body without its `%json {...}` schemas, and the most levels one of them has (each checked)."""
    levels = 0
    while (at := body.find("%json")) >= 0:
        start = at + len("%json")
        while start < len(body) and body[start].isspace():
            start += 1
        end = _json_end(body, start)
        schema_text = body[start:end]
        levels = max(levels, check_schema(_load_json(schema_text, "JSON schema"))[0])
        body = body[:at] + " " + body[end:]
    return body, levels


def _json_end(text: str, start: int) -> int:
    """The index after the bracketed JSON value starting at `start` (or the text's end)."""
    depth = 0
    for token in _JSON_TOKENS.finditer(text, start):
        bracket = token.group()
        depth += 1 if bracket in "[{" else -1 if bracket in "]}" else 0
        if depth == 0:
            return token.end()
    return len(text)


def _deepest_chain(weights: dict[str, int], names: dict[str, list[str]]) -> int:
    """The heaviest path of rules naming rules (a name back into the path is a loop, not a level),
    walked with an explicit stack, each rule's weight below it kept once found."""
    below: dict[str, int] = {}
    for start in weights:
        if start in below:
            continue
        stack, on_path = [[start, iter(names[start]), 0]], {start}
        while stack:
            frame = stack[-1]
            name = next(frame[1], None)
            if name is not None:
                if name in below:
                    frame[2] = max(frame[2], below[name])
                elif name not in on_path:
                    stack.append([name, iter(names[name]), 0])
                    on_path.add(name)
                continue
            stack.pop()
            on_path.discard(frame[0])
            below[frame[0]] = weights[frame[0]] + frame[2]
            _at_most(below[frame[0]], MAX_NESTING_DEPTH, "levels of rules naming rules (with their groups "
                     "and schemas)", "MAX_NESTING_DEPTH")
            if stack:
                stack[-1][2] = max(stack[-1][2], below[frame[0]])
    return max(below.values(), default=0)
