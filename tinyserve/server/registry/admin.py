"""The admin API (mounted only with --enable-admin-api, behind the API key; ServerConfig refuses it beyond
loopback without one): load, unload and swap the models a server serves while it runs.

Each replies with the model's card as /v1/models shows it, after the operation has finished: a load
once the model has loaded (and warmed up), an unload once its in-flight requests have drained and its
memory is freed, a swap once new requests go to the new weights and the old ones are freed. A load that
fails replies 422 model_load_failed with the loader's message (507 model_too_large, from the registry,
when it does not fit in memory), and a swap that fails leaves the old weights serving. A swap's path that is missing, not a regular file or folder of them, or no model at a
first look (loader/model_files.py) is one 400 model_not_found, whichever it is: no file-system oracle.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from tinyserve.loader.model_files import looks_like_model
from tinyserve.loader.model_loader import ModelLoadError, resolve_model_path, unknown_model
from tinyserve.server.errors import APIError, BadRequest
from tinyserve.server.intake.request_checks import parse_body, require_api_key, server_state
from tinyserve.server.registry.model_slot import ModelSlot
from tinyserve.server.openai_api.protocol import ModelAdminRequest, ModelSwapRequest
from tinyserve.server.routes import model_card
from tinyserve.server.state import ServerState

M = TypeVar("M", bound=BaseModel)
router = APIRouter(prefix="/admin/models", dependencies=[Depends(require_api_key)])
PATH_CHECK_TIMEOUT_S = 1.0  # a swap's path is refused when its first look inside takes longer


class ModelLoadFailed(APIError):
    status, type = 422, "invalid_request_error"


@router.post("/load")
async def load(request: Request) -> dict:
    state, slot, body = await _target(request, ModelAdminRequest)
    await _run(slot, state.registry.load(slot))
    return model_card(state, slot, body.model).dump()


@router.post("/unload")
async def unload(request: Request) -> dict:
    state, slot, body = await _target(request, ModelAdminRequest)
    await state.registry.unload(slot)
    return model_card(state, slot, body.model).dump()


@router.post("/swap")
async def swap(request: Request) -> dict:
    state, slot, body = await _target(request, ModelSwapRequest)
    if state.engine_config.parallel.world_size > 1:
        # the new model would need a second group of ranks beside the serving one, and a process belongs
        # to one torch.distributed group
        raise BadRequest("hot swap is not available with tensor or pipeline parallel: restart the server on "
                         "the new model", param="path", code="unsupported_with_parallel")
    try:
        path = resolve_model_path(body.path)
        # a first look inside, on a worker thread and bounded: a file on a hung mount stalls only that thread
        is_model = await asyncio.wait_for(asyncio.to_thread(looks_like_model, path), PATH_CHECK_TIMEOUT_S)
    except (ModelLoadError, asyncio.TimeoutError):
        is_model = False
    if not is_model:  # one answer for a missing path and for every file or folder that is no model
        raise BadRequest(f"path: {unknown_model(body.path)}", param="path",
                         code="model_not_found")
    await _run(slot, state.registry.swap(slot, body.path))
    return model_card(state, slot, body.model).dump()


async def _target(request: Request, kind: type[M]) -> tuple[ServerState, ModelSlot, M]:
    state = server_state(request)
    state.check_phase()
    body = await parse_body(request, kind)
    return state, state.registry.resolve(body.model), body


async def _run(slot: ModelSlot, operation) -> None:
    """Await a load or swap; a failure is a 422 naming the model and the loader's reason."""
    try:
        await operation
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - a bad file or setting: the admin reads why
        raise ModelLoadFailed(f"loading the model {slot.name!r} failed: {exc}", param="model",
                              code="model_load_failed") from None
