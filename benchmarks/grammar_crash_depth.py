"""The smallest nesting depth at which llguidance overflows a thread's stack, per kind of grammar (issue 44).

Each try compiles one grammar (the matcher and its first mask, as StructuredOutputs.compile does) in a
child process, on a thread with the default stack (what asyncio.to_thread gives), and records whether the
child died of a signal. A binary search between a depth that compiles and one that crashes finds the
threshold; engine/sampling/grammar_budget.py sets its limits at no more than a quarter of the smallest one.

    python benchmarks/grammar_crash_depth.py [--max-depth 100000] [--kinds json_ref,lark_chain]

Prints one JSON line per kind: {"kind", "crash_depth" (None: none up to --max-depth), "tries"}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def json_ref(depth: int) -> tuple[str, str]:
    defs = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(depth)}
    defs[f"d{depth}"] = {"type": "integer"}
    return "json", json.dumps({"$ref": "#/$defs/d0", "$defs": defs})


def json_ref_nested(depth: int) -> tuple[str, str]:
    """Each link two levels: an object whose property is an array of the next."""
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"anyOf": [{"type": "array", "items": {
        "$ref": f"#/$defs/d{i + 1}"}}, {"type": "null"}]}}} for i in range(depth // 2)}
    defs[f"d{depth // 2}"] = {"type": "integer"}
    return "json", json.dumps({"$ref": "#/$defs/d0", "$defs": defs})


def json_all_of_ref(depth: int) -> tuple[str, str]:
    defs = {f"d{i}": {"allOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "array"}]} for i in range(depth)}
    defs[f"d{depth}"] = {"type": "array", "items": {"type": "integer"}}
    return "json", json.dumps({"$ref": "#/$defs/d0", "$defs": defs})


def json_array(depth: int) -> tuple[str, str]:
    return "json", '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth


def json_object(depth: int) -> tuple[str, str]:
    return "json", '{"type": "object", "properties": {"a": ' * depth + '{"type": "integer"}' + "}}" * depth


def lark_chain(depth: int) -> tuple[str, str]:
    return "lark", "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(depth)) + f'r{depth}: "x"\n'


def lark_sequence_chain(depth: int) -> tuple[str, str]:
    return "lark", "start: r0\n" + "".join(f'r{i}: "a" r{i + 1} | "b"\n' for i in range(depth)) + f'r{depth}: "x"\n'


def lark_json_ref(depth: int) -> tuple[str, str]:
    return "lark", "start: %json " + json_ref(depth)[1] + "\n"


def lark_parens(depth: int) -> tuple[str, str]:
    return "lark", "start: " + "(" * depth + '"x"' + ")" * depth + "\n"


def gbnf_chain(depth: int) -> tuple[str, str]:
    return "gbnf", "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(depth)) + f'r{depth} ::= "x"\n'


def regex_groups(depth: int) -> tuple[str, str]:
    return "regex", "(" * depth + "a" + ")" * depth


KINDS = {f.__name__: f for f in (json_ref, json_ref_nested, json_all_of_ref, json_array, json_object, lark_chain, lark_sequence_chain,
                                      lark_json_ref, lark_parens, gbnf_chain, regex_groups)}

CHILD = r"""
import sys, threading, llguidance
tokenizer_json, fmt, path = sys.argv[1:4]
text = open(path).read()
tokenizer = llguidance.LLTokenizer(open(tokenizer_json).read(), n_vocab=49152, eos_token=[0, 2])
grammar = llguidance.grammar_from(fmt, text)

def compile_it():
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if not matcher.is_error():
        matcher.compute_bitmask()
    print("error" if matcher.is_error() else "ok", flush=True)

thread = threading.Thread(target=compile_it)  # the default stack, as asyncio.to_thread's workers have
thread.start()
thread.join()
"""


def crashes(tokenizer_json: str, kind: str, depth: int, timeout_s: float) -> bool:
    fmt, text = KINDS[kind](depth)
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as spec:
        spec.write(text)
        spec.flush()
        try:
            child = subprocess.run([sys.executable, "-c", CHILD, tokenizer_json, fmt, spec.name],
                                   capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False  # slow, not a crash
    return child.returncode < 0  # killed by a signal (SIGSEGV from the stack's guard page)


def smallest_crash(tokenizer_json: str, kind: str, max_depth: int, timeout_s: float) -> tuple[int | None, int]:
    low, high, tries = 1, 256, 0  # low compiles; high is the first guess that may crash
    while True:
        tries += 1
        if crashes(tokenizer_json, kind, high, timeout_s):
            break
        if high >= max_depth:
            return None, tries
        low, high = high, min(high * 2, max_depth)
    while high - low > max(1, low // 50):  # to within 2%
        middle = (low + high) // 2
        tries += 1
        if crashes(tokenizer_json, kind, middle, timeout_s):
            high = middle
        else:
            low = middle
    return high, tries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-depth", type=int, default=100_000)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per try")
    args = parser.parse_args()
    from tinyserve.loader.gguf.checkpoint import open_gguf
    from tinyserve.loader.model_loader import resolve_model_path
    from tinyserve.loader.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(open_gguf(resolve_model_path("smollm2-135m")))
    with tempfile.TemporaryDirectory() as folder:
        tokenizer_json = str(Path(folder) / "tokenizer.json")
        Path(tokenizer_json).write_text(tokenizer.backend_json())
        for kind in args.kinds.split(","):
            depth, tries = smallest_crash(tokenizer_json, kind, args.max_depth, args.timeout)
            print(json.dumps({"kind": kind, "crash_depth": depth, "tries": tries}), flush=True)


if __name__ == "__main__":
    main()
