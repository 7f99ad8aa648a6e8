"""``GET /``: the inspector page (SPEC §12), its CSS and JavaScript from ``static/`` inlined under a
Content-Security-Policy that allows only those, by hash (docs/inspector.md, "How it is built").
"""

from __future__ import annotations

import base64
import hashlib
from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

router = APIRouter(tags=["inspector"])

STYLE_SLOT = "/* inspector.css */"
SCRIPT_SLOT = "/* inspector.js */"


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode() + "'"


@cache
def inspector_page() -> tuple[str, str]:
    """The inspector document with its CSS and JS inlined, and its Content-Security-Policy."""
    static = resources.files("service.api") / "static"
    html = (static / "inspector.html").read_text(encoding="utf-8")
    css = (static / "inspector.css").read_text(encoding="utf-8")
    js = (static / "inspector.js").read_text(encoding="utf-8")
    # An inline script or style ends at the first closing tag, wherever it is.
    if "</script" in js.lower() or "</style" in css.lower():
        raise RuntimeError("inspector assets must not contain closing script/style tags")
    if STYLE_SLOT not in html or SCRIPT_SLOT not in html:
        raise RuntimeError("inspector.html lost its style or script slot")
    css_block, js_block = "\n" + css, "\n" + js
    html = html.replace(STYLE_SLOT, css_block).replace(SCRIPT_SLOT, js_block)
    csp = "; ".join(
        [
            "default-src 'none'",
            f"script-src {_sha256(js_block)}",
            f"style-src {_sha256(css_block)}",
            "connect-src 'self'",  # fetch and EventSource to this origin's /v1 routes only
            "img-src 'self' data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )
    return html, csp


@router.get("/", response_class=HTMLResponse, include_in_schema=True, summary="Inspector page")
async def inspector() -> Response:
    """The inspector page (SPEC §12): sessions, history, budgets, stages and live answers."""
    html, csp = inspector_page()
    return HTMLResponse(
        html,
        headers={
            "Content-Security-Policy": csp,
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-cache",
        },
    )
