"""The live web view in headless Chromium (Debian's `chromium`, driven by Playwright):
submit a prompt, wait for the end, and check the marked tokens and the stats against the
API's answer for the same seed. Saves docs/server-webview.png."""

from pathlib import Path

import httpx
import pytest
from playwright.sync_api import sync_playwright

from specdec import load
from specdec.server import create_app
from tests.server_fixtures import serve_in_thread, sse_chunks

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def url():
    # the small pair: a code model whose prophet is accepted often; policy fixed, so that it
    # drafts every round whatever the startup timings say (auto K failed it once under load)
    decoder = load("bundled", policy="fixed")
    with serve_in_thread(create_app(decoder, "bundled")) as base:
        yield base


def test_web_view_marks_every_round_like_the_api(url, tmp_path):
    settings = {"prompt": "def fibonacci(n):\n", "max_tokens": 48, "temperature": 0, "seed": 3,
                "specdec": {"draft_tokens": 4}}
    with httpx.Client(base_url=url, timeout=60) as c:  # noqa: SIM117
        # Greedy: a decoder's sampled answers for one seed can differ in float rounding from
        # request to request while its cache buffers grow (an engine matter), greedy ones cannot.
        with c.stream("POST", "/v1/completions", json={**settings, "stream": True}) as r:
            rounds = [ch for ch in sse_chunks(r.iter_lines()) if ch != "[DONE]"]
    text = "".join(ch["choices"][0]["text"] for ch in rounds)

    assert Path(CHROMIUM).exists(), "install Debian's chromium (scripts/test does)"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 860})
            page.goto(url + "/")
            page.wait_for_function("document.getElementById('prophet').options.length > 0", timeout=10_000)
            page.fill("#prompt", settings["prompt"])
            page.fill("#k", "4")
            page.fill("#max-tokens", "48")
            page.fill("#temperature", "0")
            page.fill("#seed", "3")
            with page.expect_response(lambda r: r.url.endswith("/v1/completions")) as answer:
                page.click("#run")
            page.wait_for_function("document.getElementById('status').dataset.state === 'done'", timeout=60_000)
            seen = [ch for ch in sse_chunks(iter(answer.value.text().splitlines())) if ch != "[DONE]"]
            count = {kind: page.locator(f"#output .tok.{kind}").count()
                     for kind in ("accepted", "rejected", "recovered", "bonus")}
            shown = {k: page.inner_text(f"#{k}") for k in ("stat-acceptance", "stat-tpr", "stat-rounds",
                                                              "stat-tokens", "stat-prophets")}
            titles = set(page.locator("#output .tok.accepted, #output .tok.rejected").evaluate_all(
                "spans => spans.map((s) => s.title)"))
            shown_text = page.text_content("#text")
            # again, with plain decoding side by side, for the picture
            page.check("#side-by-side")
            page.click("#run")
            page.wait_for_function("document.getElementById('status').dataset.state === 'done'", timeout=60_000)
            plain_tokens = int(page.inner_text("#plain-tokens"))
            page.screenshot(path=str(tmp_path / "webview.png"), full_page=True)
        finally:
            browser.close()

    # The text is the API's for the same settings; the marks are those of the rounds the page
    # received (a prophet's proposals may differ in rounding between runs; the text cannot).
    assert shown_text == text
    marks = [ch["specdec"] for ch in seen if ch["choices"]]
    drafted = sum(len(m["drafted"]) for m in marks)
    accepted = sum(m["accepted"] for m in marks)
    assert count["accepted"] == accepted and count["rejected"] == drafted - accepted
    assert count["recovered"] == sum(m["next_kind"] == "recovered" and m["drafted"] != [] for m in marks)
    assert count["bonus"] == sum(m["next_kind"] == "bonus" and m["drafted"] != [] for m in marks)
    assert shown["stat-rounds"] == str(len(marks))
    assert shown["stat-tokens"] == str(sum(m["committed"] for m in marks))
    assert shown["stat-acceptance"] == f"{100 * accepted / drafted:.1f}%"
    assert shown["stat-tpr"] == f"{sum(m['committed'] for m in marks) / len(marks):.2f}"
    drafting = [m for m in marks if m["drafted"]]
    assert titles == {f"drafted by {m['prophet']}" for m in drafting}  # every draft says whose it was
    assert shown["stat-prophets"] == f"prophet: {len(drafting)} rounds, {100 * accepted / drafted:.0f}% accepted"
    assert plain_tokens > 0
    assert (tmp_path / "webview.png").stat().st_size > 10_000  # docs/: scripts/webview-screenshot
