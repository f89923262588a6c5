"""Per-step token-mask cost of llguidance vs xgrammar on SmolLM2's 49,152-token vocabulary (docs/PERFORMANCE.md,
"Choosing the grammar library"). Needs both libraries and xgrammar's dependencies in a venv of its own,
and the vocabulary written first by the project's venv:
    .venv/bin/python benchmarks/grammar_mask_cost.py dump      # -> /tmp/smollm2_tokenizer.json, _vocab.json
    /tmp/gvenv/bin/python benchmarks/grammar_mask_cost.py      # a venv with torch, xgrammar, llguidance

Each matcher follows a valid output (the target text, tokenized), so every step's mask is computed in a
realistic state. Batch B: B matchers (different targets), one batched fill per step. Median over steps.
"""
import json, statistics, sys, time
import torch, tokenizers


def dump_vocabulary():
    from tinyserve.loader.gguf.checkpoint import open_gguf
    from tinyserve.loader.model_loader import resolve_model_path
    from tinyserve.loader.tokenizer import Tokenizer

    t = Tokenizer.from_gguf(open_gguf(resolve_model_path("smollm2-135m")))
    open("/tmp/smollm2_tokenizer.json", "w").write(t.backend_json())
    json.dump({"vocab_size": t.vocab_size, "eos": sorted(t.eos_token_ids),
               "bytes": [t.token_bytes(i).hex() for i in range(t.vocab_size)]}, open("/tmp/smollm2_vocab.json", "w"))


if sys.argv[1:] == ["dump"]:
    dump_vocabulary()
    sys.exit(0)
VOCAB = json.load(open("/tmp/smollm2_vocab.json"))
TOK_JSON = open("/tmp/smollm2_tokenizer.json").read()
tok = tokenizers.Tokenizer.from_str(TOK_JSON)
V = VOCAB["vocab_size"]
EOS = VOCAB["eos"]

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]},
    "kind": {"enum": ["person", "robot", "alien"]}},
    "required": ["name", "age", "tags", "address", "kind"], "additionalProperties": False}

def target(i):
    return json.dumps({"name": f"Person number {i} of the town", "age": 20 + i, "tags": ["a", f"tag{i}", "long tag text"],
                       "address": {"city": "Paris on the river", "zip": f"{10000 + i}"}, "kind": "robot"})

def ids_of(text):
    return tok.encode(text, add_special_tokens=False).ids

def bench_llg(kind, batch, steps_cap=60):
    import llguidance, llguidance.torch as lt
    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(TOK_JSON, n_vocab=V, eos_token=EOS[0])
    t_tok = time.perf_counter() - t0
    grammar = (llguidance.LLMatcher.grammar_from_json_schema(SCHEMA) if kind == "schema"
               else llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}))
    t0 = time.perf_counter()
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    t_compile = (time.perf_counter() - t0) / batch
    for m in matchers:
        assert not m.is_error(), m.get_error()
    executor = llguidance.LLExecutor(num_threads=2)
    mask = lt.allocate_token_bitmask(batch, V)

    def fill():
        if batch == 1:
            lt.fill_next_token_bitmask(matchers[0], mask, 0)
        else:
            lt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)

    return t_tok, t_compile, follow(matchers, mask, fill, lambda m, t: m.consume_token(t), steps_cap)


def follow(matchers, mask, fill, consume, steps_cap):
    """Each matcher follows its target output; the time of each step's mask fill."""
    targets = [ids_of(target(i)) for i in range(len(matchers))]
    times = []
    for step in range(min(steps_cap, min(map(len, targets)))):
        t0 = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t0)
        for i, m in enumerate(matchers):
            t = targets[i][step]
            assert (mask[i, t // 32] >> (t % 32)) & 1, (step, t, tok.decode([t]))
            assert consume(m, t)
    return times

def bench_xgr(kind, batch, steps_cap=60):
    import xgrammar as xgr
    t0 = time.perf_counter()
    vocab = [bytes.fromhex(h) for h in VOCAB["bytes"]]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=V, stop_token_ids=EOS)
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = (compiler.compile_json_schema(json.dumps(SCHEMA)) if kind == "schema" else compiler.compile_builtin_json_grammar())
    t_compile = time.perf_counter() - t0
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    batcher = xgr.BatchGrammarMatcher(max_threads=2)
    mask = xgr.allocate_token_bitmask(batch, V)

    def fill():
        if batch == 1:
            matchers[0].fill_next_token_bitmask(mask, 0)
        else:
            batcher.batch_fill_next_token_bitmask(matchers, mask)

    return t_tok, t_compile, follow(matchers, mask, fill, lambda m, t: m.accept_token(t), steps_cap)

def apply_cost(batch):
    logits = torch.randn(batch, V)
    mask = torch.randint(-2**31, 2**31 - 1, (batch, (V + 31) // 32), dtype=torch.int32)
    bits = torch.arange(32, dtype=torch.int32)
    ts = []
    for _ in range(50):
        t0 = time.perf_counter()
        allowed = ((mask.unsqueeze(-1) >> bits) & 1).bool().view(batch, -1)[:, :V]
        logits.masked_fill_(~allowed, float("-inf"))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)

if __name__ == "__main__":
    torch.set_num_threads(1)
    for lib, fn in (("llguidance", bench_llg), ("xgrammar", bench_xgr)):
        for kind in ("schema", "json_object"):
            for batch in (1, 16):
                t_tok, t_comp, times = fn(kind, batch)
                print(f"{lib:10s} {kind:11s} batch {batch:2d}: tokenizer setup {t_tok*1e3:7.1f} ms, compile {t_comp*1e3:6.1f} ms, "
                      f"mask/step median {statistics.median(times)*1e3:6.3f} ms, p90 {sorted(times)[int(.9*len(times))]*1e3:6.3f} ms, max {max(times)*1e3:6.2f} ms ({len(times)} steps)")
    for b in (1, 16):
        print(f"apply bitmask to [{b}, {V}] float32 logits: {apply_cost(b)*1e3:.3f} ms")
