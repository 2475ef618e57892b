"""`qlite serve`'s chat page: served at / (and not with --no-webui), open without the API key, and in a
real browser (Debian's chromium driven by playwright) it streams an answer from the server's own chat
endpoint with the key the user gives it, renders code blocks escaped, and logs no errors."""
import os
import shutil
import urllib.error
import urllib.request

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from qlite.pipeline import load  # noqa: E402
from qlite.serve.engine import Engine  # noqa: E402
from serving_checks import running  # noqa: E402


@pytest.fixture(scope="module")
def lm(tiny_ckpt):
    return load(tiny_ckpt, dtype="float32")


def get(port: int, path: str, headers=None):
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_the_page_is_served_open_and_can_be_turned_off(lm):
    with running(lm, Engine(lm, max_batch=2, ctx=128).start(), api_key="sesame") as (port, _):
        status, headers, body = get(port, "/")
        assert status == 200 and headers["content-type"] == "text/html; charset=utf-8"
        assert "connect-src 'self'" in headers["content-security-policy"] and b"/v1/chat/completions" in body
        assert b"<script src" not in body and b"https://" not in body  # nothing from elsewhere: it works offline
        assert get(port, "/v1/models")[0] == 401  # the API keeps its key
    with running(lm, Engine(lm, max_batch=2, ctx=128).start(), webui=False) as (port, _):
        status, headers, body = get(port, "/")
        assert status == 404 and headers["content-type"] == "application/json"


def browser():
    """(playwright's sync API, chromium's path), or a skip saying what is missing."""
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("no chromium on PATH (.ci/setup installs Debian's where it runs as root with apt)")
    return playwright, path


def test_a_question_typed_in_the_page_gets_a_streamed_answer(lm, tmp_path):
    playwright, chromium = browser()
    with running(lm, Engine(lm, max_batch=2, ctx=128).start(), api_key="sesame") as (port, _), \
            playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-dev-shm-usage"])
        page = b.new_page()
        problems = []
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto(f"http://127.0.0.1:{port}/")
        playwright.expect(page.locator("#model")).to_contain_text("API key")  # (no eval: the page's CSP forbids it)
        problems.clear()  # the 401 before the key is given is the page's to show, not an error of its own
        page.click("summary")  # the settings
        page.fill("#key", "sesame")
        page.dispatch_event("#key", "change")
        playwright.expect(page.locator("#model")).to_have_text("tiny")
        page.fill("#temperature", "0")
        page.fill("#input", "the")
        page.press("#input", "Enter")
        page.wait_for_selector(".msg.assistant[data-done=true]", timeout=60_000)
        answer = page.inner_text(".msg.assistant")
        assert page.inner_text(".msg.user") == "the" and answer.strip()
        assert "error" not in page.get_attribute(".msg.assistant", "class")
        assert "tokens/s" in page.inner_text("#speed")
        rendered = page.evaluate("render('use `x`\\n\\n```python\\nif a < b: print(\"<b>\")\\n```')")
        assert rendered == ('<p>use <code>x</code></p><pre><code>if a &lt; b: print(&quot;&lt;b&gt;&quot;)'
                            '</code></pre>')
        shot = tmp_path / "chat-page.png"
        page.screenshot(path=str(shot))
        assert shot.stat().st_size > 10_000
        if os.environ.get("QLITE_SCREENSHOTS"):
            shutil.copy(shot, os.environ["QLITE_SCREENSHOTS"])
        b.close()
        assert not [m for m in problems if "401" not in m], problems
