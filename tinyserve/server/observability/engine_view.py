"""GET /engine/stats: the live engine view the web page polls (JSON).

Cheap by construction: it reads what the engine thread already publishes (each AsyncEngine's newest
EngineStats, and the LLMEngine's RecentActivity deques, copied in C under the GIL) and computes the
windows here, on the event loop; the step loop does no work for a poll. Counters the engine keeps as
totals since start-up (prefix-cache tokens) get a last-minute rate from samples this view keeps of them,
one per poll at most every SAMPLE_EVERY_S.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tinyserve.engine.observability.recent_activity import ActivityWindow, StepRecord
from tinyserve.engine.observability.stats import EngineStats
from tinyserve.server.intake.request_checks import server_state
from tinyserve.server.registry.model_slot import ModelSlot

router = APIRouter()
WINDOW_S = 60.0
TIMELINE_STEPS = 120  # steps shown in the page's timeline
SAMPLE_EVERY_S = 0.5
_MAX_SAMPLES = int(WINDOW_S / SAMPLE_EVERY_S) + 2


class CounterSamples:
    """(time, prefix-cache queries, hits) of one model, sampled at polls: a rate over the last window."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int, int]] = deque(maxlen=_MAX_SAMPLES)

    def hit_rate(self, now: float, stats: EngineStats) -> float | None:
        """Hits / queries of the prompt tokens looked up in the last window (None: none looked up)."""
        if not self._samples or now - self._samples[-1][0] >= SAMPLE_EVERY_S:
            self._samples.append((now, stats.prefix_cache_queries, stats.prefix_cache_hits))
        base = next(s for s in self._samples if now - s[0] <= WINDOW_S)
        if base is self._samples[-1]:  # no earlier sample in the window: since start-up
            base = (now, 0, 0)
        queries = stats.prefix_cache_queries - base[1]
        return (stats.prefix_cache_hits - base[2]) / queries if queries else None


def _step_json(step: StepRecord, now: float) -> dict:
    return {"age_s": round(now - step.end_time, 3), "duration_ms": round(step.duration_s * 1000, 2),
            "num_seqs": step.num_seqs, "num_prefill_tokens": step.num_prefill_tokens,
            "num_decode_tokens": step.num_decode_tokens}


def _window_json(window: ActivityWindow) -> dict:
    return {"seconds": round(window.seconds, 2), "num_steps": window.num_steps,
            "num_finished": window.num_finished, "tokens_per_s": round(window.tokens_per_s, 2),
            "ttft_s": asdict(window.ttft), "tpot_s": asdict(window.tpot)}


def model_view(slot: ModelSlot, samples: CounterSamples, now: float) -> dict:
    view = {"name": slot.name, "state": slot.phase}
    loaded = slot.current
    if loaded is None:
        return view
    engine = loaded.engine
    stats, activity = engine.stats, engine.engine.activity
    view.update(
        is_alive=engine.is_alive, num_running=stats.num_running, num_waiting=engine.num_waiting,
        num_paused=stats.num_paused, num_blocks=stats.num_blocks,
        num_used_blocks=stats.num_blocks - stats.num_free_blocks, kv_cache_usage=stats.kv_cache_usage,
        num_preemptions=stats.num_preemptions, num_steps=stats.num_steps,
        prefix_cache_hit_rate=samples.hit_rate(now, stats),
        weight_bytes=loaded.weight_bytes, kv_bytes=loaded.kv_bytes, max_model_len=loaded.max_model_len,
        window=_window_json(activity.window(WINDOW_S, now)),
        steps=[_step_json(step, now) for step in activity.recent_steps(TIMELINE_STEPS)],
    )
    return view


@router.get("/engine/stats")
async def engine_stats(request: Request) -> JSONResponse:
    """Open, as /metrics is: it shows the same numbers, no request content. Returned as a JSONResponse:
    the view holds only JSON types, so FastAPI's jsonable_encoder walk over it would be pure overhead
    on the event loop (docs/PERFORMANCE.md, "The engine view's cost")."""
    state = server_state(request)
    samples: dict[str, CounterSamples] | None = getattr(request.app.state, "engine_view_samples", None)
    if samples is None:
        samples = request.app.state.engine_view_samples = {}
    now = time.monotonic()
    models = [model_view(slot, samples.setdefault(slot.name, CounterSamples()), now)
              for slot in state.registry.slots]
    return JSONResponse({"phase": state.phase, "window_s": WINDOW_S, "models": models})
