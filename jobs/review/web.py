"""The review web application (FastAPI, Jinja2 templates): `clipmill review`.

Security:
- it binds to 127.0.0.1 unless told otherwise, and refuses another address without a token;
- with a token, every request needs it (the cookie set by ``/?token=...``, or an
  ``Authorization: Bearer`` header), else 401;
- state changes are POSTs that carry a CSRF token equal to the page's cookie, and whose Origin
  (when the browser sends one) is this server;
- without a token it answers only requests whose Host is a loopback name (127.0.0.1, localhost,
  [::1]): a page whose own name was pointed at 127.0.0.1 (DNS rebinding) gets a 403;
- a preview stream (a render session, started by a GET: an EventSource cannot POST) starts only
  for this server's own pages: a request whose Origin is another, or with no Origin whose
  Sec-Fetch-Site is neither same-origin nor none, is a 403 (another site's page cannot make the operator's
  browser start, steer or queue a preview on the loopback server, which has no token);
- files are served by job id and attempt number, from keys in the job table, and only when the
  resolved path lies under that batch's storage root.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import secrets
from dataclasses import fields, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Callable
from urllib.parse import parse_qsl, urlencode, urlsplit

from fastapi import FastAPI, Form, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from fastapi.templating import Jinja2Templates
from sqlalchemy import select

from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Batch
from clipmill.jobs.core.preflight import BadOption
from clipmill.jobs.core.prompts import BatchInvalid
from clipmill.jobs.core.queue import now
from clipmill.jobs.review import LOOPBACK
from clipmill.jobs.review import ads as ad_review
from clipmill.jobs.review.decisions import (FILTERS, SORTS, DecisionConflict, ReviewError, View, decide, decide_many,
                                            last_decision_id, matching, media_key, operator_summary, page_of)
from clipmill.jobs.review.preview import PreviewError, Previews
from clipmill.pipeline.pacing import Pacer
from clipmill.jobs.runner.checks import VERDICT_KINDS
from clipmill.storage import LocalStorage, open_storage

if TYPE_CHECKING:
    from clipmill.jobs.runner.background import BackgroundRunner

TEMPLATES = Jinja2Templates(directory=str(Path(__file__).with_name("templates")))
CSRF_COOKIE = "clipmill_csrf"
TOKEN_COOKIE = "clipmill_token"
MEDIA_TYPES = {"clip": "video/mp4", "poster": "image/jpeg", "sheet": "image/png"}



def _same(given: str, token: str) -> bool:
    """A constant-time comparison of any text: hmac.compare_digest takes ASCII str only, and a
    token typed with another character raised (a 500 instead of a 401)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), token.encode("utf-8", "surrogatepass"))


def _netloc(url: str, part: str = "netloc") -> str | None:
    """``urlsplit(url)``'s netloc (or hostname), from a header; None for one that does not parse
    (a Host or Origin of ``[::1`` raised ValueError: a 500 instead of the 403)."""
    try:
        return getattr(urlsplit(url), part)
    except ValueError:
        return None


def same_origin(request: Request) -> None:
    """Refuse (403) a request that another site's page made the browser send: its Origin must be
    this server's host:port; without an Origin (a browser's GET from its own page, an address
    typed, a client that is no browser), Sec-Fetch-Site, when sent, must be same-origin or none."""
    host = request.headers.get("host", "")
    origin = request.headers.get("origin")
    if origin is not None:
        if not host or _netloc(origin) != host:
            raise HTTPException(403, f"cross-site request from {origin} refused: only this server's own pages "
                                     f"({host}) may do that")
        return
    site = request.headers.get("sec-fetch-site")
    if site not in (None, "same-origin", "none"):
        raise HTTPException(403, f"{site} request (Sec-Fetch-Site: {site}) refused: only this server's own "
                                 f"pages ({host}) may do that")


def loopback_host(request: Request) -> str | None:
    """Why a request to a server without a token is refused, or None: such a server binds to
    loopback only (``clipmill review`` refuses another address without one), so the Host a
    browser names must be a loopback name. Another name that resolves here is DNS rebinding: a
    site whose name is pointed at 127.0.0.1 after its page loaded would be its own origin."""
    host = request.headers.get("host", "")
    if _netloc("//" + host, "hostname") in LOOPBACK:
        return None
    return (f"403: Host {host!r} refused: this review server has no token, so it answers only to "
            f"{', '.join(LOOPBACK)} (start it with --token to serve other names)\n")


def create_app(db: Database, token: str | None = None, default_batch: str | None = None,
               send_render: Callable[[list[int]], str] | None = None, runner: BackgroundRunner | None = None,
               previews: Previews | None = None) -> FastAPI:
    """The review app. A shot re-rendered from the page is sent to the farm's render queue by
    ``send_render(job_ids)`` (farm mode; it returns what to tell the operator), else rendered
    and its ad reassembled in this process by ``runner``. ``previews`` streams the /preview
    page and queues what it shows: ``jobs.review.preview.Previews`` in this process, or
    ``jobs.farm.preview.FarmPreviews`` (the same interface) on the farm's render workers."""
    app = FastAPI(title="clipmill review", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def require_token(request: Request, call_next):
        if not token and (refused := loopback_host(request)):
            return Response(refused, status_code=403, media_type="text/plain")
        if token:
            given = request.cookies.get(TOKEN_COOKIE) or ""
            auth = request.headers.get("authorization", "")
            if auth.lower().startswith("bearer "):
                given = auth[7:]
            query = request.query_params.get("token")
            if query and _same(query, token) and request.method == "GET":
                # log in: keep the token in an HttpOnly cookie, drop it from the address bar
                resp = RedirectResponse(request.url.path, status_code=303)
                resp.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict")
                return resp
            if not _same(given, token):
                return Response("401: this review server needs its token (open /?token=...)\n", status_code=401,
                                media_type="text/plain")
        return await call_next(request)

    def page(request: Request, name: str, ctx: dict) -> Response:
        csrf = request.cookies.get(CSRF_COOKIE) or secrets.token_urlsafe(24)
        resp = TEMPLATES.TemplateResponse(request, name, dict(ctx, csrf=csrf))
        resp.set_cookie(CSRF_COOKIE, csrf, httponly=True, samesite="strict")
        resp.headers["Content-Security-Policy"] = "default-src 'self'; style-src 'self' 'unsafe-inline'; script-src 'self' 'unsafe-inline'"
        resp.headers["X-Frame-Options"] = "DENY"
        return resp

    @app.get("/")
    def index(request: Request):
        if default_batch:
            return RedirectResponse(f"/batch/{default_batch}", status_code=303)
        with db.session() as s:
            batches = s.scalars(select(Batch).order_by(Batch.created_at.desc())).all()
        return page(request, "index.html", {"batches": batches})

    def check_post(request: Request, csrf: str) -> None:
        cookie = request.cookies.get(CSRF_COOKIE) or ""
        if not cookie or not hmac.compare_digest(cookie, csrf):
            raise HTTPException(403, "CSRF token missing or wrong; reload the page")
        same_origin(request)

    def answer(request: Request, call: Callable[[], dict]):
        try:
            result = call()
        except DecisionConflict as e:
            return JSONResponse({"error": str(e)}, status_code=409)
        except ReviewError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        if "application/json" in request.headers.get("accept", ""):
            return result
        return RedirectResponse(request.headers.get("referer") or "/", status_code=303)

    @app.get("/batch/{batch_id}")
    def batch(request: Request, batch_id: str, state: str | None = None, view: str = "ads"):
        try:
            if view != "shots" and ad_review.is_ad_batch(db, batch_id):
                state = state or "all"
                raw = request.query_params.get("page") or "1"
                if not raw.isdigit():
                    raise ReviewError(f"page {raw!r}: expected a whole number")
                n = int(raw)
                per = ad_review.AD_PER_PAGE
                counts = ad_review.counts(db, batch_id)
                return page(request, "ads.html", {
                    "batch": batch_id, "ads": ad_review.ads(db, batch_id, state, n, per), "state": state,
                    "filters": ad_review.AD_FILTERS, "counts": counts, "page_no": n,
                    "pages": max(1, -(-counts[state] // per)), "background": runner is not None and runner.busy})
            v = _view(request, state)
            loaded_at, snapshot = now().isoformat(), last_decision_id(db)  # before the page is read
            result = page_of(db, batch_id, v)
        except ReviewError as e:
            raise HTTPException(404 if "no such batch" in str(e) else 400, str(e))
        notice = None
        if result.nothing_passed and v.filter == "review" and result.total:
            # nothing survived QC: the rejects stay in view (decided or not) until a clip passes
            notice = "No clip of this batch passed QC. Showing the rejected ones: approving one overrides QC."
        return page(request, "batch.html", {
            "batch": batch_id, "p": result, "clips": result.clips, "state": v.filter, "filters": FILTERS,
            "notice": notice, "sorts": SORTS, "reasons": VERDICT_KINDS, "operators": operator_summary(db, batch_id),
            "loaded_at": loaded_at, "snapshot": snapshot, "query": _query(v), "query_for": lambda **kw: _query(replace(v, **kw))})

    @app.post("/bulk/{batch_id}")
    def post_bulk(request: Request, batch_id: str, decision: str = Form(...), csrf: str = Form(...),
                  note: str = Form(""), operator: str = Form(""), jobs: str = Form(""), matching_view: str = Form(""),
                  loaded_at: str = Form(""), snapshot: int = Form(0)):
        """One decision on the jobs listed (``jobs``: "id:version,..."), or on every job of a view
        (``matching_view``: its query string) that has not changed since ``loaded_at``."""
        check_post(request, csrf)

        def bulk() -> dict:
            skipped: list[dict] = []
            if matching_view:
                try:
                    seen = datetime.fromisoformat(loaded_at)
                except ValueError:
                    raise ReviewError(f"loaded_at {loaded_at!r}: not an ISO time; reload the page")
                items, skipped = matching(db, batch_id, _view_of(dict(parse_qsl(matching_view))), seen, snapshot)
            else:
                try:
                    items = [(int(a), int(b)) for a, b in (x.split(":") for x in jobs.split(",") if x)]
                except ValueError:
                    raise ReviewError(f"jobs {jobs[:80]!r}: expected id:version,id:version,...")
            if not items and not skipped:
                raise ReviewError("no jobs selected")
            res = decide_many(db, items, decision, note, operator)
            return {"changed": res.changed, "skipped": skipped + res.skipped}

        return answer(request, bulk)

    def need_previews() -> Previews:
        if previews is None:
            raise HTTPException(404, "this review server has no preview (start it with clipmill review or clipmill preview)")
        return previews

    @app.get("/preview")
    def preview_page(request: Request, prompt: str = ""):
        need_previews()
        return page(request, "preview.html", {"prompt": prompt})

    @app.get("/preview/stream")
    async def preview_stream(request: Request, prompt: str, seed: int = 0):
        """Server-Sent Events: one ``session`` event, then a ``frame`` event per frame (JPEG as
        base64, index, prompt, steps, tier); the stream ends when the page goes away. Only
        this server's own page may start one (same_origin)."""
        need_previews()
        same_origin(request)
        try:
            session = await asyncio.to_thread(previews.open, prompt, seed)
        except PreviewError as e:
            raise HTTPException(400, str(e))

        async def events():
            try:
                yield f"event: session\ndata: {json.dumps({'session': session.id, 'seed': seed})}\n\n"
                pacer = Pacer(previews.pace_s) if previews.pace_s else None
                while not session.closed:
                    if await request.is_disconnected():
                        break
                    # rendered ahead by the session here, or relayed from its render worker
                    data, info = await asyncio.to_thread(session.next_payload)
                    if data is None:
                        if "error" in info:
                            yield f"event: failed\ndata: {json.dumps(info)}\n\n"
                            break
                        if "waiting" in info:
                            yield f"event: waiting\ndata: {json.dumps(info)}\n\n"
                        continue
                    if pacer is not None:  # at the frame-time budget, not in bursts of a call's frames
                        await asyncio.sleep(pacer.delay())
                    yield f"event: frame\ndata: {json.dumps(data)}\n\n"
                if getattr(session, "ended", None):  # ended here, not by its page: say why, so the page stops
                    yield f"event: failed\ndata: {json.dumps({'error': f'this preview ended: {session.ended}'})}\n\n"
            finally:
                previews.close(session.id)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/preview/{sid}/prompt")
    def preview_steer(request: Request, sid: str, prompt: str = Form(...), csrf: str = Form(...)):
        check_post(request, csrf)
        try:
            return need_previews().steer(sid, prompt)
        except PreviewError as e:
            return JSONResponse({"error": str(e)}, status_code=400)

    @app.post("/preview/{sid}/queue")
    def preview_queue_this(request: Request, sid: str, tier: str = Form("fast"), csrf: str = Form(...)):
        check_post(request, csrf)
        try:
            return need_previews().queue(db, sid, tier)
        except (PreviewError, BadOption, BatchInvalid) as e:  # the batch's own option and row checks
            return JSONResponse({"error": str(e)}, status_code=400)

    @app.get("/api/preview")
    def preview_state():
        if previews is None:
            return {"active": 0, "sessions": []}
        return {"active": previews.active, "sessions": previews.describe()}

    @app.get("/api/operators/{batch_id}")
    def operators(batch_id: str):
        return {"batch": batch_id, "operators": operator_summary(db, batch_id)}

    @app.post("/decide/{job_id}")
    def post_decision(
        request: Request,
        job_id: int,
        version: int = Form(...),
        decision: str = Form(...),
        csrf: str = Form(...),
        note: str = Form(""),
        operator: str = Form(""),
    ):
        check_post(request, csrf)
        return answer(request, lambda: decide(db, job_id, version, decision, note, operator))

    @app.post("/ad/{ad_id}/decide")
    def post_ad_decision(request: Request, ad_id: int, version: int = Form(...), decision: str = Form(...),
                         csrf: str = Form(...), note: str = Form(""), operator: str = Form("")):
        check_post(request, csrf)
        return answer(request, lambda: ad_review.decide_ad(db, ad_id, version, decision, note, operator))

    @app.post("/ad/{ad_id}/rerender")
    def post_rerender(request: Request, ad_id: int, version: int = Form(...), shot: int = Form(...),
                      csrf: str = Form(...), note: str = Form(""), operator: str = Form("")):
        check_post(request, csrf)

        def rerender() -> dict:
            res = ad_review.rerender_shot(db, ad_id, shot, version, note, operator)
            if send_render is not None:
                res["message"] = send_render(res["jobs"])
            elif runner is not None:
                runner.submit(res["batch"])
                res["message"] = f"shot {shot} is rendering here; the ad is assembled again when it passes QC"
            else:
                res["message"] = f"shot {shot} is queued: clipmill run --resume {res['batch']} renders it"
            return res

        return answer(request, rerender)

    @app.get("/api/ads/{batch_id}")
    def ad_states(batch_id: str):
        try:
            ads = ad_review.states(db, batch_id)
        except ReviewError as e:
            raise HTTPException(404, str(e))
        return {"ads": ads,
                "background": runner is not None and runner.busy, "errors": list(runner.errors) if runner else []}

    @app.get("/ad-media/{ad_id}/{fmt}/{kind}")
    def ad_media(ad_id: int, fmt: str, kind: str, request: Request):
        found = ad_review.ad_media_key(db, ad_id, fmt, kind)
        if found is None:
            raise HTTPException(404, "no such file")
        return stored(*found, "video/mp4" if kind == "clip" else "image/jpeg", request.headers.get("range"))

    @app.get("/media/{job_id}/{attempt_no}/{kind}")
    def media(job_id: int, attempt_no: int, kind: str, request: Request):
        found = media_key(db, job_id, attempt_no, kind)
        if found is None:
            raise HTTPException(404, "no such file")
        return stored(*found, MEDIA_TYPES[kind], request.headers.get("range"))

    def stored(root: str, key: str, media_type: str, range_header: str | None = None):
        store = open_storage(root)
        if isinstance(store, LocalStorage):
            path = store.path(key).resolve()
            if not path.is_relative_to(store.root) or not path.is_file():
                raise HTTPException(404, "no such file")
            return FileResponse(path, media_type=media_type)  # answers Range requests itself
        st = store.stat(key)
        if st is None:
            raise HTTPException(404, "no such file")
        size, headers = st[0], {"Accept-Ranges": "bytes"}
        span = byte_range(range_header, size)
        if span is None:  # no range asked (or one this server does not serve): the whole object
            return Response(store.get_bytes(key), media_type=media_type, headers=headers)
        if span == "unsatisfiable":
            return Response(status_code=416, headers={**headers, "Content-Range": f"bytes */{size}"})
        start, end = span  # a browser seeking in a clip (Safari asks for ranges only)
        return Response(store.get_range(key, start, end), status_code=206, media_type=media_type,
                        headers={**headers, "Content-Range": f"bytes {start}-{end}/{size}"})

    return app


def byte_range(header: str | None, size: int) -> tuple[int, int] | str | None:
    """(first, last) byte of an HTTP ``Range: bytes=A-B`` (or ``bytes=-N``, the last N) within
    ``size``; "unsatisfiable" when it starts past the end; None when there is none, or it is not
    one range of bytes (several ranges, other units), which the whole object answers."""
    m = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header or "")
    if m is None or not (m[1] or m[2]):
        return None
    if m[1]:
        start, end = int(m[1]), min(int(m[2]) if m[2] else size - 1, size - 1)
        if m[2] and int(m[2]) < start:
            return None  # malformed: ignored, as RFC 9110 says
    else:
        start, end = max(0, size - int(m[2])), size - 1
    return "unsatisfiable" if start >= size or end < start else (start, end)


def _view_of(params: dict) -> View:
    """A View from query parameters (unknown ones are ignored); ReviewError on a bad value."""
    params = dict(params)
    if "state" in params:  # the page's own name for the state filter
        params.setdefault("filter", params.pop("state"))
    kw: dict = {}
    for f in fields(View):
        if f.name in params and params[f.name] != "":
            raw = params[f.name]
            try:
                kw[f.name] = int(raw) if f.type in ("int", int) else (raw in ("1", "true", "on") if f.type in ("bool", bool)
                                                                        else str(raw))
            except ValueError:
                raise ReviewError(f"{f.name} {raw!r}: expected a whole number")
    return View(**kw)  # page_of and matching check it


def _view(request: Request, state: str | None) -> View:
    params = dict(request.query_params)
    params.pop("state", None)
    params["filter"] = state or params.get("filter") or "review"
    return _view_of(params)


def _query(v: View) -> str:
    """The query string of a view: its non-default parameters, for links and bulk actions."""
    default = View()
    out = {("state" if f.name == "filter" else f.name): (int(getattr(v, f.name)) if f.type in ("bool", bool)
                                                         else getattr(v, f.name))
           for f in fields(View) if getattr(v, f.name) != getattr(default, f.name)}
    return urlencode(out)


def serve(db: Database, host: str, port: int, token: str | None, batch: str | None,
          send_render: Callable[[list[int]], str] | None = None, runner: BackgroundRunner | None = None,
          previews: Previews | None = None) -> None:
    import uvicorn

    uvicorn.run(create_app(db, token, batch, send_render, runner, previews), host=host, port=port, log_level="warning")
