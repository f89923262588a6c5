"""The built-in web page: GET / (a chat playground and a live engine view) and its few static files.

The files ship inside the package (tinyserve/server/static, package data) and load nothing from the
network: no build step, no CDN, so the page works on a machine without internet. The page calls the
server's own API (/v1/models, /v1/chat/completions with the key the user types) and polls
/engine/stats (server/observability/engine_view.py). Only the names below are served: no path from a URL reaches the
file system.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from tinyserve.server.errors import NotFound

router = APIRouter()
STATIC_DIR = Path(__file__).parent / "static"
_FILES = {"app.js": "text/javascript", "style.css": "text/css"}
# the page is ours and small; a browser may keep it a minute (a new version shows after a reload)
_HEADERS = {"Cache-Control": "max-age=60"}


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=_HEADERS)


@router.get("/static/{name}", include_in_schema=False)
async def static_file(name: str) -> FileResponse:
    media_type = _FILES.get(name)
    if media_type is None:
        raise NotFound(f"no static file {name!r}")
    return FileResponse(STATIC_DIR / name, media_type=media_type, headers=_HEADERS)
