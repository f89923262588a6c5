"""The compiled-grammar cache (engine/sampling/grammar_cache.py): least recently used out first, by count and by
cost; an entry over the whole budget is not kept; eviction hands freed memory back (the trim is called)."""

from tinyserve.engine.sampling import grammar_cache
from tinyserve.engine.sampling.grammar_cache import GrammarCache


def test_eviction_by_count_and_by_cost_least_recently_used_first(monkeypatch):
    trims = []
    monkeypatch.setattr(grammar_cache, "return_freed_host_memory", lambda: trims.append(1))
    cache = GrammarCache(max_entries=3, max_bytes=100)
    for key in "abc":
        cache.put(key, key.upper(), 10)
    assert trims == [] and cache.total_bytes == 30
    assert cache.get("a") == "A"  # now the most recent
    cache.put("d", "D", 10)  # a fourth entry: b (least recent) goes
    assert "b" not in cache and [k in cache for k in "acd"] == [True] * 3 and len(trims) == 1
    cache.put("e", "E", 85)  # 30 + 85 > 100: c, then a (least recent first) go until it fits
    assert [k in cache for k in "acde"] == [False, False, True, True] and cache.total_bytes == 95
    assert cache.num_evicted == 3 and len(trims) == 2
    cache.put("huge", "H", 101)  # over the whole budget: not kept, nothing else dropped
    assert "huge" not in cache and "e" in cache and cache.total_bytes == 95 and len(trims) == 3
    cache.put("e", "E2", 5)  # a replaced entry's cost is replaced too
    assert cache.get("e") == "E2" and cache.total_bytes == 15
