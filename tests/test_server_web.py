"""The web page at / and the /engine/stats endpoint it polls: over HTTP, and in a real headless browser
(Debian's chromium driven by Selenium through Debian's chromedriver; skipped, with the reason printed,
where either is missing)."""

import re
import shutil
import threading
import time

import httpx
import pytest

from conftest import start_default_model_server

KEY = "web-key"
MODEL = "smollm2-135m"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


class HeldSteps:
    """While `release` is clear, the engine runs one step and then waits before the next: a request is
    seen running (its first token already streamed) for as long as the test needs."""

    def __init__(self):
        self.release = threading.Event()
        self.release.set()
        self.num_steps_held = 0

    def hold(self):
        self.num_steps_held = 0
        self.release.clear()

    def wrap(self, engine):
        step = engine.step

        def held_step():
            if not self.release.is_set():
                if self.num_steps_held >= 1:
                    assert self.release.wait(60), "the test never released the step"
                self.num_steps_held += 1
            return step()

        engine.step = held_step
        return engine


@pytest.fixture(scope="module")
def web_server(smollm2_loaded):
    held = HeldSteps()
    srv = start_default_model_server(smollm2_loaded, held.wrap, api_key=KEY)
    yield srv, held
    held.release.set()
    srv.stop()


def _wait_until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_page_and_its_files_are_served_and_load_nothing_from_elsewhere(web_server):
    srv, _ = web_server
    page = httpx.get(srv.base_url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/static/app.js">' in page.text and 'href="/static/style.css"' in page.text
    for name, media_type in (("app.js", "text/javascript"), ("style.css", "text/css")):
        r = httpx.get(f"{srv.base_url}/static/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(media_type), name
        # no CDN: every URL in the files is the page's own (the SVG namespace names, it loads nothing)
        assert re.findall(r"https?://[^\s\"')]+", r.text) in ([], ["http://www.w3.org/2000/svg"]), name
    assert re.findall(r"(?:src|href)=\"(https?:[^\"]*)\"", page.text) == []
    missing = httpx.get(srv.base_url + "/static/index.py")
    assert missing.status_code == 404 and "index.py" in missing.json()["error"]["message"]
    assert httpx.get(srv.base_url + "/static/..%2Fweb.py").status_code == 404


def test_engine_stats_counts_a_finished_request(web_server):
    srv, _ = web_server
    before = httpx.get(srv.base_url + "/engine/stats").json()
    r = httpx.post(srv.base_url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200
    view = httpx.get(srv.base_url + "/engine/stats").json()  # open, as /metrics is: no key
    assert view["phase"] == "ready" and view["window_s"] == 60.0
    (model,) = view["models"]
    (old,) = before["models"]
    assert model["name"] == MODEL and model["state"] == "loaded" and model["is_alive"] is True
    assert model["num_running"] == 0 and model["num_waiting"] == 0 and model["num_used_blocks"] == 0
    assert model["num_blocks"] > 0 and model["weight_bytes"] > 0 and model["kv_bytes"] > 0
    assert model["window"]["num_finished"] == old["window"]["num_finished"] + 1
    assert model["num_steps"] == old["num_steps"] + 5  # one prefill step (its first token) and 4 decodes
    newest = model["steps"][-5:]
    assert [s["num_seqs"] for s in newest] == [1] * 5
    assert [s["num_decode_tokens"] for s in newest] == [0, 1, 1, 1, 1]
    assert newest[0]["num_prefill_tokens"] == int(r.json()["usage"]["prompt_tokens"])
    ttft = model["window"]["ttft_s"]
    assert 0 < ttft["p50"] <= ttft["p95"] <= ttft["p99"]
    assert model["window"]["tokens_per_s"] > 0


def _browser(tmp_path):
    """A headless Debian chromium through Selenium, or a skip saying what is missing."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if shutil.which(path) is None]
    if missing:
        pytest.skip(f"no headless browser: {', '.join(missing)} not installed "
                    "(apt-get install chromium chromium-driver; .ci/run does)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("no headless browser: the selenium package is not installed (pip install selenium)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000", f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def test_browser_chat_streams_and_engine_view_follows_the_request(web_server, tmp_path):
    srv, held = web_server
    from selenium.webdriver.common.by import By

    driver = _browser(tmp_path)
    try:
        driver.get(srv.base_url + "/?poll_ms=100")
        find = lambda css: driver.find_element(By.CSS_SELECTOR, css)  # noqa: E731
        # without the key /v1/models is refused and the picker says so; with it, the picker fills
        _wait_until(lambda: "401" in find("#model").text, 10, "the model picker to show the 401")
        find("#api-key").send_keys(KEY)
        find("#temperature").clear()
        find("#temperature").send_keys("0")  # also blurs the key field: its change event reloads the models
        _wait_until(lambda: find("#model").get_attribute("value") == MODEL, 10, "the model picker")
        find("#max-tokens").clear()
        find("#max-tokens").send_keys("24")
        _wait_until(lambda: find("#stat-running").text == "0", 10, "the engine view's first poll")
        held.hold()  # the reply's first step runs, then the engine waits for the test
        find("#chat-input").send_keys("Name three colours.")
        find("#send").click()
        _wait_until(lambda: find("#stat-running").text == "1", 15, "running 1 in the engine view")
        partial = _wait_until(lambda: find(".msg.assistant .text").get_attribute("textContent"), 10,
                              "the first streamed text")
        assert "done" not in find(".msg.assistant").get_attribute("class")  # mid-reply
        used = find("#stat-kv").text
        assert re.fullmatch(r"[1-9]\d* of \d+ used", used), used
        held.release.set()
        _wait_until(lambda: "done" in find(".msg.assistant").get_attribute("class"), 30, "the reply's end")
        reply = find(".msg.assistant .text").get_attribute("textContent")
        meta = find(".msg.assistant .meta").text
        assert "error" not in find(".msg.assistant").get_attribute("class"), meta
        assert reply.startswith(partial) and len(reply) > len(partial)
        assert re.search(r"TTFT \d+ ms · [\d.]+ tok/s · 24 tokens · finish: length", meta), meta
        _wait_until(lambda: find("#stat-running").text == "0", 10, "running back to 0")
        _wait_until(lambda: find("#stat-finished").text not in ("–", "0"), 10, "a finished request counted")
        assert driver.find_elements(By.CSS_SELECTOR, "#timeline rect"), "no steps drawn in the timeline"
        assert find("#ttft-p50").text.endswith("ms")
        shot = tmp_path / "page.png"
        driver.save_screenshot(str(shot))
        print(f"\nscreenshot of the page: {shot}")
    finally:
        held.release.set()
        driver.quit()
    # the page streamed what the API answers for the same greedy request
    expected = httpx.post(srv.base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": MODEL, "messages": [{"role": "user", "content": "Name three colours."}],
                                "temperature": 0, "top_p": 1, "max_tokens": 24}).json()
    assert reply == expected["choices"][0]["message"]["content"]
