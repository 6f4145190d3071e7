"""The web page `llmkit serve` shows at `/` (unless --no-ui): a chat with the model and a view of the engine.

The page is three files in `ui/`, plain HTML, CSS and JavaScript with no build step and no library: it fetches
nothing from outside the server. Its files hold no data, so they are served without a key, like /health; every
call the page makes goes through the API (`/v1/models`, `/v1/chat/completions`) and `/metrics.json` (the samples
of `/metrics` as JSON, and the last steps), behind the API key and the metrics key like any client's. Where the
server has a key, the page asks for it once and keeps it in the tab's session storage only.

The page's policy allows scripts, styles and connections to this origin only (no inline script, no eval), so text
from the model, which the page inserts as text and never as HTML, cannot run as code even if it tried.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from llmkit.serve.calls import APIError

_FILES = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


def page_routes() -> APIRouter:
    """GET / (the page) and GET /ui/{file} (its script and style), read once from the package."""
    folder = resources.files("llmkit.serve") / "ui"
    files = {name: (folder / name).read_bytes() for name in _FILES}
    router = APIRouter()

    def answer(name: str) -> Response:
        return Response(files[name], media_type=_FILES[name], headers=_HEADERS)

    @router.get("/", include_in_schema=False)
    async def index() -> Response:
        return answer("index.html")

    @router.get("/ui/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in files:
            raise APIError(404, f"the page has no file {name!r}", "not_found_error")
        return answer(name)

    return router
