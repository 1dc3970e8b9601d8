"""The playground page in a real browser: headless Chromium, driven by selenium, against a live
server on the demo model (SmolLM2-135M-Instruct) with two stages and an API key. The page must
load without the key, ask for it, chat over the websocket under its Content-Security-Policy with
readable replies, and draw both stages at work. The screenshot it leaves is the one the README
shows (benchmarks/results/playground.png).

Uses the system's /usr/bin/chromium and /usr/bin/chromedriver, both named explicitly, so that
selenium never looks for a browser or a driver on its own; skipped where they are missing.
"""

from __future__ import annotations

import re
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import alive
from live_server import ROOT, LiveServer
from procs import descendants

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.chrome.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
SCREENSHOT = ROOT / "benchmarks" / "results" / "playground.png"
WAIT_S = 60.0  # generous: two cores run the server, its two stages and the browser
FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,900",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()),
        reason=f"needs {CHROMIUM} and {CHROMEDRIVER} (Debian: apt-get install chromium chromium-driver)",
    ),
]


@pytest.fixture(scope="module")
def server(smollm2_gguf: Path) -> Iterator[LiveServer]:
    flags = ["--pp-size", "2", "--kv-cache-gb", "0.1", "--tensor-transport", "shm"]
    server = LiveServer(smollm2_gguf, *flags, "--served-model-name", "SmolLM2-135M-Instruct")
    try:
        yield server
    finally:
        code = server.stop()
    assert code == 0, "".join(server.output)


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, for CSP reports
    with tempfile.TemporaryDirectory(prefix="ppserve-chromium-") as profile:
        for flag in [*FLAGS, f"--user-data-dir={profile}"]:
            options.add_argument(flag)
        service = Service(executable_path=str(CHROMEDRIVER))
        driver = webdriver.Chrome(service=service, options=options)
        processes = descendants(service.process.pid)
        try:
            yield driver
        finally:
            driver.quit()
            # chromedriver and every browser process it started are gone (chromium's helpers
            # exit once their parent does; wait for that, bounded).
            WebDriverWait(driver, 30).until(lambda _: not any(alive(pid) for pid in processes))


def _wait(driver: WebDriver, condition: Callable[[WebDriver], Any], what: str) -> Any:
    return WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(condition, f"timed out waiting for {what}")


def _text(driver: WebDriver, selector: str) -> str:
    return str(driver.find_element(By.CSS_SELECTOR, selector).text)


def _texts(driver: WebDriver, selector: str) -> list[str]:
    return [str(e.text) for e in driver.find_elements(By.CSS_SELECTOR, selector)]


def _rects(driver: WebDriver, stage: int, kind: str = "") -> int:
    return len(driver.find_elements(By.CSS_SELECTOR, f'.lane[data-stage="{stage}"] rect{kind}'))


def _replies(driver: WebDriver) -> list[str]:
    """The text of each finished assistant reply (its meta line says how it ended; not failed ones)."""
    return [str(b.text) for b in driver.find_elements(By.CSS_SELECTOR, ".bubble.assistant:not(.failed):has(.meta)")]


def _streaming(driver: WebDriver) -> str:
    """The text of the reply streaming now ("" if none)."""
    found = driver.find_elements(By.CSS_SELECTOR, ".bubble.streaming .text")
    return str(found[0].text) if found else ""


def _set(driver: WebDriver, field_id: str, value: str) -> None:
    field = driver.find_element(By.ID, field_id)
    field.clear()
    field.send_keys(value)


def _chat(driver: WebDriver, prompt: str, max_tokens: int) -> None:
    _set(driver, "max-tokens", str(max_tokens))
    driver.find_element(By.ID, "prompt").send_keys(prompt)
    driver.find_element(By.ID, "send").click()


def _load(server: LiveServer) -> list[threading.Thread]:
    """Long prompts decoding at once, beside the chat: prefill, mixed and decode micro-batches
    for a few seconds."""
    body = {"prompt": "The pipeline " * 200, "max_tokens": 300, "ignore_eos": True}
    threads = [threading.Thread(target=server.request, args=("POST", "/v1/completions", body)) for _ in range(3)]
    for t in threads:
        t.start()
    return threads


def _assert_readable(text: str) -> None:
    """A trained model's English: mostly ASCII letters and spaces, and no broken characters."""
    letters = sum(c.isascii() and (c.isalpha() or c.isspace()) for c in text)
    assert len(text) > 20 and letters >= 0.8 * len(text) and "\ufffd" not in text, text


def _span(driver: WebDriver, stage: int) -> float:
    """Seconds from the first interval drawn in a lane to the end of the last (rects are placed
    in seconds)."""
    return float(
        driver.execute_script(
            "const r = [...document.querySelectorAll(`.lane[data-stage='${arguments[0]}'] rect`)];"
            "return r.length ? Math.max(...r.map((e) => e.x.baseVal.value + e.width.baseVal.value))"
            " - Math.min(...r.map((e) => e.x.baseVal.value)) : 0;",
            stage,
        )
    )


def test_chat_and_pipeline_view(server: LiveServer, browser: WebDriver) -> None:
    driver = browser
    driver.get(server.url + "/")
    assert driver.title == "ppserve playground"
    # Without the key the page loads, says the server wants one, and a chat fails visibly.
    _wait(driver, lambda d: _text(d, "#health") == "API key needed", "the page to ask for the API key")
    assert "wanted" in str(driver.find_element(By.ID, "api-key").get_attribute("class"))
    assert "HTTP 401" in _text(driver, "#pipeline-note")
    _chat(driver, "Hello?", 8)
    (failed,) = _wait(driver, lambda d: _texts(d, ".bubble.assistant.failed .meta"), "the turn to fail")
    assert "needs an API key" in failed
    assert "missing or wrong API key" in _text(driver, "#error")  # the server's own words, in the banner

    key = driver.find_element(By.ID, "api-key")
    key.send_keys(str(server.api_key))
    driver.find_element(By.ID, "clear").click()  # leaving the field stores the key; a new chat
    _wait(driver, lambda d: _text(d, "#health") == "healthy", "the pipeline view to load with the key")
    assert not driver.find_element(By.ID, "error").is_displayed() and not _texts(driver, ".bubble")
    assert _text(driver, "#model") == "SmolLM2-135M-Instruct" and _text(driver, "#pp") == "2 stages"
    assert driver.execute_script("return sessionStorage.getItem('ppserve.apiKey')") == server.api_key

    driver.find_element(By.ID, "seed").send_keys("7")  # a reproducible reply
    _chat(driver, "What does a pipeline-parallel server do?", 64)
    _wait(driver, lambda d: any(b.text for b in d.find_elements(By.CSS_SELECTOR, ".bubble.assistant .text")), "text")
    (reply,) = _wait(driver, _replies, "the reply to finish")
    assert re.search(r"\d+ tokens · (length|stop)", reply), reply
    _assert_readable(_texts(driver, ".bubble.assistant .text")[-1])
    assert not driver.find_element(By.ID, "error").is_displayed()

    _wait(driver, lambda d: _rects(d, 0) > 0 and _rects(d, 1) > 0, "both lanes to show compute intervals")
    _wait(driver, lambda d: all(re.fullmatch(r"\d+%", b.text) for b in d.find_elements(By.CSS_SELECTOR, ".busy")), "%")

    # A longer reply while other requests prefill long prompts and decode: every kind of
    # micro-batch. The screenshot is taken while all of it runs, with a few seconds of it drawn.
    load = _load(server)
    try:
        _wait(driver, lambda d: _rects(d, 0, ".prefill") > 0 and _span(d, 0) > 4.0, "seconds of busy lanes")
        _chat(driver, "Tell me more about micro-batches.", 200)
        # (A short reply may finish before much of it is seen streaming.)
        _wait(driver, lambda d: len(_streaming(d)) > 60 or len(_replies(d)) == 2, "the second reply to stream")
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(SCREENSHOT))
        _wait(driver, lambda d: len(_replies(d)) == 2, "the second reply to finish")
        _assert_readable(_texts(driver, ".bubble.assistant .text")[-1])
    finally:
        for t in load:
            t.join()
    assert not driver.find_element(By.ID, "error").is_displayed()

    # A request the server refuses: its error shows, and the conversation is as before it.
    _set(driver, "temperature", "-1")
    _chat(driver, "This one fails.", 8)
    (error,) = _wait(driver, lambda d: _texts(d, ".bubble.assistant.failed .meta"), "the error")
    assert "temperature" in error
    assert driver.execute_script("return messages.length") == 4
    assert driver.find_element(By.ID, "send").is_enabled()
    _set(driver, "temperature", "0.7")

    # Stop: the reply ends where it got to, and stays in the conversation.
    _chat(driver, "Write a long story about a lighthouse keeper, in many paragraphs.", 1000)
    _wait(driver, lambda d: len(_streaming(d)) > 0, "the third reply to stream")
    driver.find_element(By.ID, "stop").click()
    replies = _wait(driver, lambda d: len(_replies(d)) == 3 and _replies(d), "the stopped reply to end")
    assert " · abort · " in replies[-1], replies[-1]
    assert driver.execute_script("return messages.map((m) => m.role)") == ["user", "assistant"] * 3

    csp = [e["message"] for e in driver.get_log("browser") if "Content Security Policy" in e["message"]]
    assert not csp, csp  # the page runs entirely within its own policy
