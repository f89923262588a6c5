"""Scheduler at toy sizes, driven by a fake model that reads its context back from a mirrored KV cache:
a wrong block table, prefix hit or fork changes the generated tokens."""

import random
import time

import pytest

from tinyserve.config import SchedulerConfig
from tinyserve.engine.scheduling.block_manager import BlockManager
from tinyserve.engine.scheduling.scheduler import Scheduler
from tinyserve.engine.loop.request import Request, RequestStatus, SchedulerOutput
from tinyserve.types import FinishReason, SamplingParams

BLOCK_SIZE = 4
EOS = 2


def next_token(context: list[int], salt: int = 0) -> int:
    """The fake model: deterministic in the token history (and the sample index), never EOS."""
    return 3 + (sum(t * (i + 1) for i, t in enumerate(context)) * 7 + 13 * salt) % 97


def reference(prompt: list[int], max_tokens: int, salt: int = 0) -> list[int]:
    context = list(prompt)
    for _ in range(max_tokens):
        context.append(next_token(context, salt))
    return context[len(prompt) :]


class FakeRunner:
    """Executes a SchedulerOutput: writes each scheduled token into its (block, slot), then samples from
    the context read back through the block table."""

    def __init__(self, scheduler: Scheduler, model=next_token):
        self.scheduler = scheduler
        self.bm = scheduler.block_manager
        self.model = model
        self.kv: dict[tuple[int, int], int] = {}

    def step(self) -> tuple[SchedulerOutput, list[Request]]:
        output = self.scheduler.schedule()
        sampled = {}
        for request, num_new in output.scheduled:
            table = BlockManager.block_table(request)
            start = request.num_computed_tokens
            for pos in range(start, start + num_new):
                block_id = table[pos // BLOCK_SIZE]
                assert self.bm.ref_count(block_id) == 1, "write into a shared block"
                self.kv[(block_id, pos % BLOCK_SIZE)] = request.all_token_ids[pos]
            if start + num_new == request.num_tokens:
                context = [self.kv[(table[p // BLOCK_SIZE], p % BLOCK_SIZE)] for p in range(request.num_tokens)]
                sampled[request] = [self.model(context, request.index)]
        for request in output.outgrown:  # the engine's part: it finishes what outgrew the pool
            request.finish_reason = FinishReason.LENGTH
        updates = self.scheduler.update(output, sampled)
        for request, reason, _ in updates:
            if reason is not None:
                finish(self.scheduler, request, reason)
        return output, output.outgrown + [request for request, _, _ in updates]

    def run(self, max_steps: int = 1000) -> list[SchedulerOutput]:
        outputs = []
        while self.scheduler.has_unfinished_requests():
            outputs.append(self.step()[0])
            assert len(outputs) < max_steps, "no progress"
        return outputs


def make_scheduler(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, prefix_caching=True, **kw) -> Scheduler:
    bm = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=prefix_caching, hash_seed="fake")
    return Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, **kw), bm)


def finish(scheduler: Scheduler, request: Request, reason: FinishReason) -> bool:
    """The engine's part of finishing (LLMEngine._end_request): out of the scheduler, its blocks freed.
    False if it had finished already."""
    was_finished = request.is_finished
    scheduler.remove(request)
    request.finish_reason = request.finish_reason if was_finished else reason
    return not was_finished


def abort(scheduler: Scheduler, request: Request) -> bool:
    return finish(scheduler, request, FinishReason.ABORT)


def ids(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


def make_request(request_id, prompt, max_tokens=8, priority=0, eos=(), index=0, parent=None,
                 max_total_tokens=None, **params) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **params)
    return Request(request_id, list(prompt), params, priority=priority, index=index, parent=parent,
                   eos_token_ids=frozenset(eos), max_total_tokens=max_total_tokens)


def add(scheduler: Scheduler, *requests: Request) -> None:
    for request in requests:
        scheduler.add_request(request)


def prompt_of(length: int, start: int = 10) -> list[int]:
    return list(range(start, start + length))


def assert_all_free(scheduler: Scheduler) -> None:
    bm = scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and not scheduler.has_unfinished_requests()


def test_single_request_runs_to_max_tokens():
    scheduler = make_scheduler()
    request = make_request("a", prompt_of(6), max_tokens=5)
    scheduler.add_request(request)
    outputs = FakeRunner(scheduler).run()
    assert [[n for _, n in o.scheduled] for o in outputs] == [[6], [1], [1], [1], [1]]
    assert request.output_token_ids == reference(prompt_of(6), 5)
    assert request.finish_reason is FinishReason.LENGTH and request.first_token_time is not None
    assert request.is_finished and not scheduler.has_unfinished_requests()
    assert_all_free(scheduler)


def test_budget_and_seq_cap_hold_every_step():
    scheduler = make_scheduler(max_num_seqs=3, max_num_batched_tokens=8)
    requests = [make_request(f"r{i}", prompt_of(3 + 2 * i, i), max_tokens=4 + i) for i in range(7)]
    add(scheduler, *requests)
    runner = FakeRunner(scheduler)
    while scheduler.has_unfinished_requests():
        output, _ = runner.step()
        assert output.num_batched_tokens == sum(n for _, n in output.scheduled) <= 8
        assert len(output.scheduled) <= 3 and scheduler.num_running <= 3
    for i, request in enumerate(requests):
        assert request.output_token_ids == reference(prompt_of(3 + 2 * i, i), 4 + i)
    assert_all_free(scheduler)


def test_long_prompt_is_chunked_while_decodes_go_first_every_step():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    decoders = [make_request(f"d{i}", prompt_of(3, 50 * i), max_tokens=20) for i in range(2)]
    add(scheduler, *decoders)
    runner = FakeRunner(scheduler)
    runner.step()  # both prompts in one step
    long = make_request("long", prompt_of(40), max_tokens=2)
    scheduler.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        output, _ = runner.step()
        assert [(r.request_id, n) for r, n in output.scheduled[:2]] == [("d0", 1), ("d1", 1)]
        chunks.append(dict((r.request_id, n) for r, n in output.scheduled)["long"])
    assert chunks == [6, 6, 6, 6, 6, 6, 4]
    scheduler.add_request(make_request("late", prompt_of(20, 7), max_tokens=1))
    output, _ = runner.step()
    assert [(r.request_id, n) for r, n in output.scheduled] == [("d0", 1), ("d1", 1), ("long", 1), ("late", 5)]
    output, _ = runner.step()  # long finished; late is mid-prompt, still after the decodes
    assert [(r.request_id, n) for r, n in output.scheduled] == [("d0", 1), ("d1", 1), ("late", 6)]
    runner.run()
    assert long.output_token_ids == reference(prompt_of(40), 2)
    assert_all_free(scheduler)


def test_admission_by_priority_then_fcfs():
    scheduler = make_scheduler(max_num_seqs=1)
    for request_id, priority in [("a", 2), ("b", 0), ("c", 1), ("d", 0), ("e", 2)]:
        scheduler.add_request(make_request(request_id, prompt_of(3), max_tokens=1, priority=priority))
    order = [o.scheduled[0][0].request_id for o in FakeRunner(scheduler).run()]
    assert order == ["b", "d", "c", "a", "e"]


def test_preemption_by_recompute_keeps_tokens_and_matches_unconstrained_run():
    # 6 blocks; each request needs up to 5 (8 prompt + 12 output tokens): the newer one must yield
    scheduler = make_scheduler(num_blocks=6, prefix_caching=False)
    a = make_request("a", prompt_of(8, 0), max_tokens=12)
    b = make_request("b", prompt_of(8, 30), max_tokens=12)
    c = make_request("c", prompt_of(8, 60), max_tokens=2)
    add(scheduler, a, b)
    runner = FakeRunner(scheduler)
    runner.step()
    scheduler.add_request(c)  # waits: no free block for its prompt
    while not scheduler.num_preemptions:
        tokens_before = list(b.output_token_ids)
        output, _ = runner.step()
    assert ids(output.preempted) == ["b"] and [r.request_id for r, _ in output.scheduled] == ["a"]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.output_token_ids == tokens_before and len(tokens_before) > 0
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]  # front of its level, before c
    assert b.block_tables == []
    runner.run()
    assert a.output_token_ids == reference(prompt_of(8, 0), 12)
    assert b.output_token_ids == reference(prompt_of(8, 30), 12)
    assert c.output_token_ids == reference(prompt_of(8, 60), 2)
    assert_all_free(scheduler)


def test_preemption_victim_is_lowest_priority_even_if_older():
    scheduler = make_scheduler(num_blocks=6, prefix_caching=False)
    low = make_request("low", prompt_of(8, 0), max_tokens=12, priority=1)
    high = make_request("high", prompt_of(8, 30), max_tokens=12, priority=0)
    add(scheduler, low, high)
    runner = FakeRunner(scheduler)
    preempted = []
    while scheduler.has_unfinished_requests():
        preempted += ids(runner.step()[0].preempted)
    assert preempted and set(preempted) == {"low"} and high.num_preemptions == 0
    assert low.output_token_ids == reference(prompt_of(8, 0), 12)
    assert_all_free(scheduler)


def test_waiting_higher_priority_preempts_the_newest_lowest_when_the_cap_is_full():
    scheduler = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(scheduler)
    low_old = make_request("low_old", prompt_of(4, 0), max_tokens=10, priority=5)
    low_new = make_request("low_new", prompt_of(4, 20), max_tokens=10, priority=5)
    add(scheduler, low_old, low_new)
    runner.step()
    runner.step()
    high = make_request("high", prompt_of(4, 40), max_tokens=3, priority=0)
    same = make_request("same", prompt_of(4, 60), max_tokens=3, priority=5)  # an equal never preempts
    add(scheduler, same, high)
    output, _ = runner.step()
    assert ids(output.preempted) == ["low_new"]
    assert [r.request_id for r, _ in output.scheduled] == ["low_old", "high"]
    # the victim keeps its arrival: it goes back ahead of the later request of its own priority
    assert ids(scheduler.waiting) == ["low_new", "same"] and low_new.num_computed_tokens == 0
    runner.run()
    for request, start, max_tokens in [(low_old, 0, 10), (low_new, 20, 10), (high, 40, 3), (same, 60, 3)]:
        assert request.output_token_ids == reference(prompt_of(4, start), max_tokens), request
    assert scheduler.num_preemptions == 1
    assert_all_free(scheduler)


def test_waiting_higher_priority_preempts_for_blocks_and_never_preempts_equals():
    # 6 blocks: two running 8-token prompts hold 4 (and grow); a 12-token prompt needs 3 more
    scheduler = make_scheduler(num_blocks=6, prefix_caching=False)
    runner = FakeRunner(scheduler)
    low = make_request("low", prompt_of(8, 0), max_tokens=12, priority=1)
    mid = make_request("mid", prompt_of(8, 30), max_tokens=12, priority=0)
    add(scheduler, mid, low)
    runner.step()
    equal = make_request("equal", prompt_of(12, 60), max_tokens=2, priority=0)
    scheduler.add_request(equal)
    output, _ = runner.step()
    assert ids(output.preempted) == ["low"] and "equal" in ids([r for r, _ in output.scheduled])
    assert mid.num_preemptions == 0  # the equal priority waits for mid rather than preempting it
    runner.run()
    assert low.output_token_ids == reference(prompt_of(8, 0), 12)
    assert equal.output_token_ids == reference(prompt_of(12, 60), 2)
    assert_all_free(scheduler)


def test_aging_bounds_how_long_better_priorities_overtake_and_preempt():
    scheduler = make_scheduler(max_num_seqs=1, priority_aging_s=10.0)
    runner = FakeRunner(scheduler)
    old_low = Request("old_low", prompt_of(4), SamplingParams(max_tokens=4), priority=2, arrival_time=100.0)
    scheduler.add_request(old_low)
    runner.step()
    # two levels better but 25 s later: 2 x 10 s of aging makes old_low first, so it is not preempted
    late_high = Request("late_high", prompt_of(4, 20), SamplingParams(max_tokens=1), priority=0, arrival_time=125.0)
    # two levels better and 15 s later: it still comes first, and preempts
    early_high = Request("early_high", prompt_of(4, 40), SamplingParams(max_tokens=1), priority=0, arrival_time=115.0)
    scheduler.add_request(late_high)
    output, _ = runner.step()
    assert not output.preempted and ids([r for r, _ in output.scheduled]) == ["old_low"]
    scheduler.add_request(early_high)
    output, _ = runner.step()
    assert ids(output.preempted) == ["old_low"] and ids([r for r, _ in output.scheduled]) == ["early_high"]
    assert ids(scheduler.waiting) == ["old_low", "late_high"]
    runner.run()
    assert old_low.output_token_ids == reference(prompt_of(4), 4)
    assert_all_free(scheduler)


def test_request_needing_the_block_preempts_itself_and_stops():
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=8, prefix_caching=False)
    low = make_request("low", prompt_of(7, 0), max_tokens=6, priority=1)
    scheduler.add_request(low)
    runner = FakeRunner(scheduler)
    runner.step()  # low: 2 blocks, 8 tokens
    high = make_request("high", prompt_of(14, 30), max_tokens=2, priority=0)
    scheduler.add_request(high)
    output, _ = runner.step()  # low decodes token 8; high's first chunk takes the last 2 blocks
    assert [(r.request_id, n) for r, n in output.scheduled] == [("low", 1), ("high", 7)]
    output, _ = runner.step()  # low needs a 3rd block and is itself the lowest priority: it yields, and
    assert ids(output.preempted) == ["low"] and output.is_empty  # the step stops there
    assert scheduler.waiting == [low] and scheduler.block_manager.num_free_blocks == 2
    runner.run()
    assert low.output_token_ids == reference(prompt_of(7, 0), 6)
    assert high.output_token_ids == reference(prompt_of(14, 30), 2)
    assert_all_free(scheduler)


def test_preempting_a_request_already_scheduled_this_step_gives_its_tokens_back():
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=6, prefix_caching=False)
    low = make_request("low", prompt_of(4, 0), max_tokens=6, priority=1)
    scheduler.add_request(low)
    runner = FakeRunner(scheduler)
    runner.step()
    high = make_request("high", prompt_of(12, 30), max_tokens=2, priority=0)
    scheduler.add_request(high)
    output, _ = runner.step()
    assert [(r.request_id, n) for r, n in output.scheduled] == [("low", 1), ("high", 5)]
    output, _ = runner.step()  # low's decode is scheduled first, then high's chunk needs low's blocks
    assert ids(output.preempted) == ["low"]
    # the chunk was sized before the refund; the budget no longer counts low's token
    assert [(r.request_id, n) for r, n in output.scheduled] == [("high", 5)] and output.num_batched_tokens == 5
    runner.run()
    assert low.output_token_ids == reference(prompt_of(4, 0), 6)
    assert_all_free(scheduler)


def test_request_that_outgrows_the_whole_pool_finishes_with_length():
    scheduler = make_scheduler(num_blocks=2)
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        scheduler.add_request(make_request("huge", prompt_of(9)))
    request = make_request("a", prompt_of(6), max_tokens=10)
    scheduler.add_request(request)
    outputs = FakeRunner(scheduler).run()
    assert request.finish_reason is FinishReason.LENGTH and request.num_tokens == 9
    assert request.output_token_ids == reference(prompt_of(6), 3)
    assert ids(outputs[-1].outgrown) == ["a"]
    assert_all_free(scheduler)


def test_abort_waiting_and_running_frees_blocks_at_once():
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=1)
    running = make_request("run", prompt_of(9), max_tokens=10)
    waiting = make_request("wait", prompt_of(5), max_tokens=10)
    add(scheduler, running, waiting)
    runner = FakeRunner(scheduler)
    runner.step()
    assert scheduler.num_running == 1 and scheduler.num_waiting == 1
    assert scheduler.block_manager.num_free_blocks == 5
    assert abort(scheduler, waiting) and not abort(scheduler, waiting)
    assert waiting.finish_reason is FinishReason.ABORT and scheduler.num_waiting == 0
    assert abort(scheduler, running)
    assert running.finish_reason is FinishReason.ABORT and running.is_finished
    assert scheduler.block_manager.num_free_blocks == 8
    output = scheduler.schedule()
    assert output.is_empty and waiting.block_tables == running.block_tables == []
    assert_all_free(scheduler)


def test_finishing_from_outside_the_step():
    scheduler = make_scheduler()
    stopped, aborted = make_request("a", prompt_of(5)), make_request("b", prompt_of(5, 40))
    add(scheduler, stopped, aborted)
    runner = FakeRunner(scheduler)
    runner.step()
    assert finish(scheduler, stopped, FinishReason.STOP) and stopped.finish_reason is FinishReason.STOP
    output = scheduler.schedule()
    assert stopped.block_tables == [] and [r.request_id for r, _ in output.scheduled] == ["b"]
    abort(scheduler, aborted)  # while the step runs: update must skip it
    assert scheduler.update(output, {aborted: [7]}) == [] and aborted.num_output_tokens == 1
    assert_all_free(scheduler)


def run_one(model, max_tokens=10, max_model_len=None, **kw) -> Request:
    scheduler = make_scheduler(max_model_len=max_model_len)
    request = make_request("a", prompt_of(5), max_tokens=max_tokens, **kw)
    scheduler.add_request(request)
    FakeRunner(scheduler, model).run()
    assert_all_free(scheduler)
    return request


def always(token):
    return lambda context, salt: token


@pytest.mark.parametrize(
    ("model", "kw", "num_output", "reason"),
    [
        (always(EOS), {"eos": {EOS}}, 1, FinishReason.STOP),
        (always(EOS), {"eos": {EOS}, "min_tokens": 3}, 4, FinishReason.STOP),  # 3 tokens, then EOS counts
        (always(EOS), {"eos": {EOS}, "ignore_eos": True}, 10, FinishReason.LENGTH),
        (always(EOS), {"eos": {EOS}, "ignore_eos": True, "stop_token_ids": (EOS,)}, 1, FinishReason.STOP),
        (always(5), {"stop_token_ids": (5,)}, 1, FinishReason.STOP),
        (always(5), {"stop_token_ids": (5,), "min_tokens": 2}, 3, FinishReason.STOP),
        (always(5), {"eos": {EOS}}, 10, FinishReason.LENGTH),
        (always(5), {"max_total_tokens": 8}, 3, FinishReason.LENGTH),
        (always(5), {"max_tokens": 4}, 4, FinishReason.LENGTH),
        (always(5), {"max_model_len": 7}, 2, FinishReason.LENGTH),
    ],
)
def test_finishing_rules(model, kw, num_output, reason):
    request = run_one(model, **kw)
    assert request.num_output_tokens == num_output and request.finish_reason is reason


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n_samples_fork_the_prompt_blocks(prefix_caching):
    scheduler = make_scheduler(prefix_caching=prefix_caching)
    prompt = prompt_of(10)
    samples = [make_request("s0", prompt, max_tokens=6)]
    samples += [make_request(f"s{i}", prompt, max_tokens=6, index=i, parent=samples[0]) for i in (1, 2)]
    add(scheduler, *samples)
    runner = FakeRunner(scheduler)
    output, _ = runner.step()
    assert [(r.request_id, n) for r, n in output.scheduled] == [("s0", 10)]  # children wait for the prompt
    output, _ = runner.step()
    assert [(r.request_id, n) for r, n in output.scheduled] == [("s0", 1), ("s1", 2), ("s2", 2)]
    bm = scheduler.block_manager
    tables = [bm.block_table(r) for r in samples]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2] and len({t[2] for t in tables}) == 3
    assert [bm.ref_count(b) for b in tables[0]] == [3, 3, 1]
    assert samples[1].num_cached_tokens == 8
    runner.run()
    outputs = [r.output_token_ids for r in samples]
    assert outputs == [reference(prompt, 6, salt=i) for i in range(3)] and len({tuple(o) for o in outputs}) == 3
    assert_all_free(scheduler)


def test_child_prefills_alone_when_the_parent_is_gone():
    scheduler = make_scheduler()
    parent = make_request("p", prompt_of(10), max_tokens=3)
    child = make_request("c", prompt_of(10), max_tokens=3, index=1, parent=parent)
    add(scheduler, parent, child)
    assert abort(scheduler, parent)
    output, _ = FakeRunner(scheduler).step()
    assert [(r.request_id, n) for r, n in output.scheduled] == [("c", 10)]


def test_prefix_cache_hits_are_counted_and_reused():
    scheduler = make_scheduler()
    runner = FakeRunner(scheduler)
    first = make_request("a", prompt_of(10), max_tokens=2)
    scheduler.add_request(first)
    runner.run()
    second = make_request("b", prompt_of(10) + [99], max_tokens=2)
    scheduler.add_request(second)
    output, _ = runner.step()
    assert [(r.request_id, n) for r, n in output.scheduled] == [("b", 3)]  # 8 of 11 from the cache
    assert second.num_cached_tokens == 8
    stats = scheduler.block_manager.prefix_stats
    assert (stats.num_hit_blocks, stats.num_hit_tokens, stats.num_query_tokens) == (2, 8, 21)
    runner.run()
    assert second.output_token_ids == reference(prompt_of(10) + [99], 2)
    assert_all_free(scheduler)


def test_randomized_run_keeps_invariants():
    rng = random.Random(7)
    scheduler = make_scheduler(num_blocks=14, max_num_seqs=4, max_num_batched_tokens=10)
    runner = FakeRunner(scheduler)
    bases = [prompt_of(12, 100 * i) for i in range(3)]
    requests, expected, finished, aborted = {}, {}, set(), set()
    for step in range(1500):
        if step < 1200 and rng.random() < 0.25:
            prompt = rng.choice(bases)[: rng.randint(1, 12)] + [rng.randrange(90) for _ in range(rng.randint(0, 6))]
            n, max_tokens, priority = rng.choice([1, 1, 2, 3]), rng.randint(1, 12), rng.randint(0, 2)
            for i in range(n):
                request_id = f"q{step}.{i}"
                parent = requests[f"q{step}.0"] if i else None
                requests[request_id] = make_request(request_id, prompt, max_tokens, priority, index=i, parent=parent)
                scheduler.add_request(requests[request_id])
                expected[request_id] = reference(prompt, max_tokens, salt=i)
        live = [r.request_id for r in requests.values() if not r.is_finished]
        if live and rng.random() < 0.03:
            victim = rng.choice(sorted(live))
            assert abort(scheduler, requests[victim])
            aborted.add(victim)
        output, changed = runner.step()
        ids = [r.request_id for r, _ in output.scheduled]
        assert len(ids) == len(set(ids)) and not finished.intersection(ids)
        assert output.num_batched_tokens <= 10 and len(ids) <= 4 and scheduler.num_running <= 4
        finished.update(r.request_id for r in changed if r.is_finished)
        scheduler.block_manager.check_invariants()
        for request in scheduler.waiting:
            assert request.block_tables == []
        for request in scheduler.running:
            assert request.num_computed_tokens < request.num_tokens
        unfinished = {r.request_id for r in requests.values() if not r.is_finished}
        assert unfinished == {r.request_id for r in scheduler.waiting + scheduler.running}
        finished |= aborted
    assert_all_free(scheduler)
    assert scheduler.num_preemptions > 0 and scheduler.block_manager.prefix_stats.num_hit_blocks > 0
    completed = [i for i in expected if i not in aborted]
    assert len(completed) > 100
    for request_id in completed:
        assert request_id in finished and requests[request_id].output_token_ids == expected[request_id]


def test_waiting_queue_at_scale_keeps_order_without_linear_work():
    """20,000 waiting requests added, half aborted, some paused and resumed: admission order is still
    (aged priority, arrival, add order), and no operation scans the queue (the deadline catches O(n) each)."""
    rng = random.Random(3)
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=8)
    deadline = time.monotonic() + 10.0
    keys, by_id, params = {}, {}, SamplingParams(max_tokens=1)
    for i in range(20_000):
        # many arrival ties: add order decides
        request = Request(f"r{i}", prompt_of(3), params, arrival_time=float(rng.randint(0, 500)),
                          priority=rng.randint(0, 3))
        scheduler.add_request(request)
        aged = request.priority * scheduler.config.priority_aging_s + request.arrival_time
        keys[request.request_id] = (aged, request.arrival_time, i)
        by_id[request.request_id] = request
        assert i % 1000 or time.monotonic() < deadline, f"adding slowed down at {i} waiting"
    for n, request_id in enumerate(rng.sample(sorted(keys), 10_000)):
        assert abort(scheduler, by_id[request_id])
        del keys[request_id]
        assert n % 1000 or time.monotonic() < deadline, f"aborting slowed down after {n}"
    paused = rng.sample(sorted(keys), 2_000)
    for request_id in paused:
        scheduler.set_paused(by_id[request_id], True)
    assert (scheduler.num_waiting, scheduler.num_paused) == (8_000, 2_000)
    for request_id in paused[:1_000]:
        scheduler.set_paused(by_id[request_id], False)
    still_paused = set(paused[1_000:])
    assert time.monotonic() < deadline
    expected = sorted(keys, key=keys.get)
    assert [r.request_id for r in scheduler.waiting] == expected
    admitted = [r.request_id for r, _ in scheduler.schedule().scheduled]
    assert admitted == [i for i in expected if i not in still_paused][:8]


def test_paused_waiting_request_blocks_nobody_and_resumes_in_its_place():
    scheduler = make_scheduler(max_num_seqs=1)
    a, b, c = (make_request(i, prompt_of(3, 10 * n), max_tokens=2) for n, i in enumerate("abc"))
    add(scheduler, a, b, c)
    scheduler.set_paused(a, True)
    runner = FakeRunner(scheduler)
    output, _ = runner.step()
    assert [r.request_id for r, _ in output.scheduled] == ["b"]
    assert (scheduler.num_waiting, scheduler.num_paused) == (1, 1)  # a holds no place in admission's queue
    scheduler.set_paused(a, False)
    order = [o.scheduled[0][0].request_id for o in runner.run()]
    assert order == ["b", "a", "a", "c", "c"]
    assert a.output_token_ids == reference(prompt_of(3, 0), 2)
    scheduler.set_paused(b, True)  # finished: no-op
    assert_all_free(scheduler)


def test_paused_running_request_is_preempted_and_recomputes_when_resumed():
    scheduler = make_scheduler(num_blocks=6, prefix_caching=False, max_num_seqs=1)
    a = make_request("a", prompt_of(8, 0), max_tokens=12)
    b = make_request("b", prompt_of(8, 30), max_tokens=12)
    add(scheduler, a, b)
    runner = FakeRunner(scheduler)
    runner.step()
    assert [r.request_id for r in scheduler.running] == ["a"]
    scheduler.set_paused(a, True)  # its seat (max_num_seqs=1) and blocks go to b at once
    assert a.status is RequestStatus.WAITING and a.num_computed_tokens == 0 and scheduler.is_paused(a)
    assert a.block_tables == [] and a.num_output_tokens == 1
    while not b.is_finished:
        output, _ = runner.step()
        assert [r.request_id for r, _ in output.scheduled] == ["b"]  # paused: a is not re-admitted
    assert b.output_token_ids == reference(prompt_of(8, 30), 12)
    assert (scheduler.num_waiting, scheduler.num_paused) == (0, 1) and runner.step()[0].is_empty
    scheduler.set_paused(a, False)
    runner.run()
    assert a.output_token_ids == reference(prompt_of(8, 0), 12)
    assert_all_free(scheduler)

