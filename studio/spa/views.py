"""The SPA's files, straight from `settings.SPA_DIST_DIR` (Vite's output).

`index` answers every page path with `index.html` (the app routes on the client) and
serves the few top-level public files (`favicon.svg`); `asset` serves `assets/<name>`,
whose names carry a content hash, so they are cached for a year. Nothing here is
collected into STATIC_ROOT: the same code serves embedded and distributed setups.
"""

from __future__ import annotations

import mimetypes
from pathlib import Path

from django.conf import settings
from django.http import FileResponse, Http404, HttpRequest, HttpResponse
from django.views.decorators.csrf import ensure_csrf_cookie
from django.views.decorators.http import require_safe

IMMUTABLE = "public, max-age=31536000, immutable"

NOT_BUILT = """<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Omni-Flow Studio</title></head>
<body style="font-family:system-ui,sans-serif;max-width:640px;margin:80px auto;color:#101828">
<h1>The studio frontend is not built</h1>
<p>The API is up (<a href="/api/docs/">/api/docs/</a>), but <code>frontend/dist</code> is missing.
Build it with <code>bash scripts/frontend.sh build</code> (that is <code>npm ci &amp;&amp; npm run build</code>
in <code>frontend/</code>) and reload.</p></body></html>
"""


def dist_dir() -> Path:
    return Path(settings.SPA_DIST_DIR)


def _file_under(root: Path, relative: str) -> Path | None:
    """`root/relative` when it is a file inside `root` (no `..` escapes), else None."""
    base = root.resolve()
    candidate = (base / relative).resolve()
    if not candidate.is_relative_to(base) or not candidate.is_file():
        return None
    return candidate


def _send(path: Path, cache_control: str) -> FileResponse:
    content_type, encoding = mimetypes.guess_type(path.name)
    response = FileResponse(path.open("rb"), content_type=content_type or "application/octet-stream")
    if encoding:
        response["Content-Encoding"] = encoding
    response["Cache-Control"] = cache_control
    response["X-Content-Type-Options"] = "nosniff"
    return response


@require_safe
def asset(request: HttpRequest, path: str) -> FileResponse:
    found = _file_under(dist_dir() / "assets", path)
    if found is None:
        raise Http404(f"no asset {path}")
    return _send(found, IMMUTABLE)


@require_safe
@ensure_csrf_cookie
def index(request: HttpRequest, path: str = "") -> HttpResponse:
    last = path.rsplit("/", 1)[-1]
    if "." in last:  # a file name, not a page: serve it from the build root or 404
        found = _file_under(dist_dir(), path) if "/" not in path and last != "index.html" else None
        if found is None:
            raise Http404(f"no file {path}")
        return _send(found, "public, max-age=3600")
    page = dist_dir() / "index.html"
    if not page.is_file():
        return HttpResponse(NOT_BUILT, status=503, content_type="text/html; charset=utf-8")
    response = HttpResponse(page.read_bytes(), content_type="text/html; charset=utf-8")
    response["Cache-Control"] = "no-cache"
    return response
