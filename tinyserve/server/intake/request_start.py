"""Starting a generation request: the one way in for every endpoint that generates (chat, completions,
gRPC's Generate and GenerateStream, and any dialect added later), so that admission, the model, pinning,
metrics and the deadline exist once. An endpoint brings only its translation: how to read its body
(`read_body`) and how to turn it into prompt ids once the model and sampling parameters are known
(`encode`, which tokenizes and runs the engine's checks).

`start_request`, in order:
1. admission before any work (ServerState.admit): 503 while the server cannot take work, or while the one
   model's queue is full, before the body is parsed or tokenized;
2. the body, read and validated by the endpoint (400);
3. its deadline (ServerState.request_timeout: the body's `timeout` under --request-timeout), from arrival;
4. its model, resolved once (404 model_not_found), then loaded on demand within the deadline and admitted
   (ServerState.acquire_slot: 503 loading, failed, unloaded, engine dead);
5. pinned to the load it was admitted to (ServedModel.pending) until its stream is open, so a swap or an
   unload waits for it; unpinned on every way out;
6. its sampling parameters over the model's defaults, its grammar compiled, its prompts encoded (400);
7. admission again, counting every sample (prompts x n) with its priority, with no await before it is
   queued: the awaits above let other requests in (ModelSlot.admit: 503, or 400 when it alone is too big);
8. its metrics tagged with the API it came in by (metrics.API: `http`, or `grpc` in gRPC's handlers);
9. queued (Generation.start): the deadline's timer set, adaptive admission's ticket attached.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from tinyserve.server.intake.generation import Generation
from tinyserve.server.intake.request_checks import compile_structured_output
from tinyserve.server.observability.metrics import API
from tinyserve.server.registry.model_slot import ServedModel, ModelSlot
from tinyserve.server.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from tinyserve.server.state import ServerState
from tinyserve.types import SamplingParams

B = TypeVar("B", CompletionRequest, ChatCompletionRequest)
# (body, its load, its sampling parameters) -> each prompt's ids, checked by the engine (intake.validate_prompt)
Encoder = Callable[[B, ServedModel, SamplingParams], Awaitable[list[list[int]]]]


@dataclass
class StartedRequest(Generic[B]):
    """A request queued in the engine; the endpoint streams or collects its `generation`, which closes it."""

    body: B
    loaded: ServedModel  # the load the request was admitted to, kept to its end
    generation: Generation  # started: queued in the engine, its deadline running
    model_name: str  # as responses name it: the body's `model`, else the served model's name

    def head(self) -> dict:
        """The first fields of every response and chunk: id, created, model."""
        return {"id": self.generation.request_id, "created": int(time.time()), "model": self.model_name}


async def start_request(state: ServerState, read_body: Callable[[], Awaitable[B]], encode: Encoder,
                        id_prefix: str, client_request_id: str) -> StartedRequest[B]:
    """Admit, read, resolve, load, pin, encode, admit again, tag and queue a request (see the module's
    docstring); `id_prefix` starts its request id (chatcmpl, cmpl), `client_request_id` is the id the
    client can quote (X-Request-Id)."""
    arrival = time.monotonic()
    state.admit()
    body = await read_body()
    timeout = state.request_timeout(body.timeout)
    slot = state.registry.resolve(body.model)
    loaded = await state.acquire_slot(slot, arrival, timeout)
    with loaded.pending():  # a swap or unload waits for this request until its stream is open
        params = await sampling_params(body, loaded)
        prompts = await encode(body, loaded, params)
        generation = Generation(loaded.engine, f"{id_prefix}-{uuid.uuid4().hex}", prompts, params, body.priority,
                                arrival, timeout, client_request_id, body.cache_salt)
        _queue(slot, loaded, generation, body.priority)
    return StartedRequest(body, loaded, generation, body.model or state.model_name)


async def sampling_params(body: B, loaded: ServedModel) -> SamplingParams:
    """The body's sampling parameters over the model's defaults, its grammar compiled (400 naming its field)."""
    params = body.with_defaults(body.to_sampling_params(), loaded.sampling_defaults)
    await compile_structured_output(loaded.engine, params, body.structured_output_param())
    return params


def _queue(slot: ModelSlot, loaded: ServedModel, generation: Generation, priority: int) -> None:
    """Admission counting every sample, the API tag, and the request queued, with no await in between."""
    num_samples = len(generation.choices)
    slot.admit(num_samples, loaded, priority, generation.params.n)
    slot.metrics.track_api(generation.request_id, num_samples, API.get())
    try:
        generation.start(slot.ticket(num_samples))
    except BaseException:  # the engine died since admission: its ticket must not stay pending
        generation.close()
        raise
