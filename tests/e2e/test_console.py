"""The web console in a real browser: Debian's headless Chromium driven by selenium, against a real server on
localhost (the app of :func:`miaohui.server.app.build_app` in a background thread) that serves

* ``intent``: the real e5-small intent model as an ONNX Runtime int8 engine (the session's ``intent_engines``,
  as tests/e2e/test_dialogue.py uses it), for the ``bank_advisor`` pipeline;
* ``tiny``: a tiny random BERT (fp32 ONNX Runtime), the model that is unloaded and loaded again;
* ``smollm2``: SmolLM2-135M-Instruct (fp32 ONNX decoder, tests/e2e/test_openai.py's cached repository), the
  chat model whose reply streams.

Checked: the bank_advisor turn shows its reply with the risk disclaimer and the compliance rule that inserted it,
plus intent and slots; a chat reply arrives in several SSE chunks; a version is unloaded and loaded from the
models page; the live plots draw their series. Screenshots of the three pages go to ``$CONSOLE_SCREENSHOTS``
(``CONSOLE_SCREENSHOTS=docs/images`` refreshes the README's) or to the test's temp dir.

Chromium and chromedriver come from ``scripts/install_browser.sh`` (``make test`` runs it); without them the
tests skip and say so.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.artifacts import install_version, link_tree
from tests.e2e.test_openai import MODEL as LLM
from tests.e2e.test_openai import llm_repository  # noqa: F401  (the cached SmolLM2 repository, a fixture)
from tests.servers import UvicornThread

from miaohui.config import BuildConfig
from miaohui.dialogue.compliance import DISCLAIMER
from miaohui.engines.store import build_artifact
from miaohui.server.app import build_app

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
WAIT_S = 60.0
BANK_QUESTION = "我想买一只稳健型基金，年化收益5%左右"


@pytest.fixture(scope="module")
def repo(
    intent_engines: dict[str, Path],
    tiny_model: Path,
    llm_repository: Path,  # noqa: F811  (the fixture imported above)
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    repo = tmp_path_factory.mktemp("console-repo")
    install_version(intent_engines["int8"], repo, "intent")
    build_artifact(tiny_model, "tiny", BuildConfig(), repo, log=lambda m: None)
    link_tree(llm_repository / LLM, repo / LLM)
    return repo


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[UvicornThread]:
    with UvicornThread(build_app(repo)) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("Chromium/chromedriver are not installed: run scripts/install_browser.sh (make test does)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900", "--lang=zh-CN"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = os.environ.get("CONSOLE_SCREENSHOTS")
    path = Path(where) if where else tmp_path_factory.mktemp("console-screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def wait_for(check: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    """Poll ``check`` until it returns something true; an element re-rendered under it (stale) counts as not yet."""
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = check()
        except StaleElementReferenceException:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def open_page(browser: Any, server: UvicornThread, page: str) -> None:
    browser.get(f"{server.url}/ui/#{page}")
    wait_for(lambda: browser.execute_script("return document.readyState") == "complete", "the page to load")
    wait_for(lambda: browser.find_elements("css selector", "#chat-model option"), "the chat targets")


def pick(browser: Any, value: str) -> None:
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element("css selector", "#chat-model")).select_by_value(value)


def say(browser: Any, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    box = browser.find_element("css selector", "#chat-input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)  # Enter sends


def test_bank_advisor_turn_shows_the_disclaimer_and_its_rule(browser: Any, server: UvicornThread, shots: Path) -> None:
    open_page(browser, server, "chat")
    options = [o.get_attribute("value") for o in browser.find_elements("css selector", "#chat-model option")]
    assert "pipeline:bank_advisor" in options and f"llm:{LLM}" in options
    pick(browser, "pipeline:bank_advisor")
    say(browser, BANK_QUESTION)
    reply = wait_for(lambda: browser.find_elements("css selector", ".msg.bot .details"), "the bank_advisor reply")[0]
    bot = reply.find_element("xpath", "..")
    text = bot.find_element("css selector", ".bubble").text
    assert DISCLAIMER["zh"] in text and "5%" in text
    rules = [li.get_attribute("data-rule") for li in bot.find_elements("css selector", ".interventions li")]
    assert "risk_disclaimer" in rules
    intent = bot.find_element("css selector", "[data-intent]").get_attribute("data-intent")
    assert intent == "fund_recommendation"
    slots = {s.get_attribute("data-slot") for s in bot.find_elements("css selector", "[data-slot]")}
    assert {"risk_level", "product", "percent"} <= slots
    assert "total" in bot.find_element("css selector", ".timings").text
    # the session continues as the API keeps it: the second turn is turn 2 of the same session
    session = browser.find_element("css selector", "#chat-session").text
    say(browser, "五年定期存款利率是多少？")
    wait_for(lambda: len(browser.find_elements("css selector", ".msg.bot .details")) == 2, "the second reply")
    assert browser.find_element("css selector", "#chat-session").text == session
    assert "turn 2" in browser.find_elements("css selector", ".msg.bot .details")[1].text
    browser.save_screenshot(str(shots / "console-chat.png"))


def test_chat_model_reply_streams(browser: Any, server: UvicornThread, shots: Path) -> None:
    open_page(browser, server, "chat")
    browser.find_element("css selector", "#chat-new").click()
    pick(browser, f"llm:{LLM}")
    say(browser, "What is a bank deposit?")
    done = wait_for(lambda: browser.find_elements("css selector", ".msg.bot[data-chunks]"), "the streamed reply")[0]
    assert int(done.get_attribute("data-chunks")) > 1  # more than one SSE chunk reached the page
    assert done.find_element("css selector", ".bubble").text.strip()
    assert "first token" in done.find_element("css selector", ".details").text
    browser.save_screenshot(str(shots / "console-chat-llm.png"))


def row(browser: Any, model: str) -> tuple[str, str] | None:
    """The (version, state) the models table shows for ``model``."""
    found = browser.find_elements("css selector", f'#models-table tr[data-model="{model}"]')
    return (found[0].get_attribute("data-version"), found[0].get_attribute("data-state")) if found else None


def click(browser: Any, selector: str) -> bool:
    found = browser.find_elements("css selector", selector)
    if found and found[0].is_enabled():
        found[0].click()
        return True
    return False


def test_unload_and_load_a_version(browser: Any, server: UvicornThread, shots: Path) -> None:
    open_page(browser, server, "models")
    assert wait_for(lambda: row(browser, "tiny"), "the tiny model's row") == ("1", "READY")
    assert "load and unload act on this server" in browser.find_element("css selector", "#control-note").text
    browser.save_screenshot(str(shots / "console-models.png"))
    wait_for(lambda: click(browser, '#models-table tr[data-model="tiny"] button.unload'), "the Unload button")
    wait_for(lambda: row(browser, "tiny") == ("", "UNAVAILABLE"), "tiny to be unloaded")
    assert httpx.get(f"{server.url}/v2/models/tiny/ready").status_code == 404
    wait_for(lambda: click(browser, '#models-table tr[data-model="tiny"] button.load'), "the Load button")
    wait_for(lambda: row(browser, "tiny") == ("1", "READY"), "tiny version 1 to be loaded")
    assert httpx.get(f"{server.url}/v2/models/tiny/versions/1/ready").json() == {"name": "tiny", "ready": True}
    assert not browser.find_element("css selector", "#models-error").is_displayed()


COUNT_COLOURED = """
const c = document.querySelector(arguments[0]);
const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
let n = 0;
for (let i = 0; i < d.length; i += 4) {
  const [r, g, b, a] = [d[i], d[i + 1], d[i + 2], d[i + 3]];
  if (a > 128 && Math.max(r, g, b) - Math.min(r, g, b) > 80) n += 1;  // saturated: a series, not the grey grid
}
return n;
"""


def test_plots_draw(browser: Any, server: UvicornThread, shots: Path) -> None:
    from selenium.webdriver.support.ui import Select

    with httpx.Client(base_url=server.url, timeout=30) as http:
        started, i = time.monotonic(), 0
        while time.monotonic() - started < 8:  # 8 s of traffic: several 1 s samples see requests
            texts = ["查社保", "hello"] * (i % 4 + 1)
            assert http.post("/v1/intent", json={"model": "tiny", "texts": texts}).is_success
            time.sleep(0.03)
            i += 1
    open_page(browser, server, "metrics")
    Select(browser.find_element("css selector", "#metrics-window")).select_by_value("60")
    for plot in ("#plot-rps", "#plot-latency", "#plot-batch", "#plot-queue"):
        wait_for(lambda p=plot: int(browser.find_element("css selector", p).get_attribute("data-points") or 0) > 0,
                 f"{plot} to draw points")  # fmt: skip
    for plot in ("#plot-rps", "#plot-latency", "#plot-batch"):  # queue depth is mostly 0: its line lies on the axis
        assert browser.execute_script(COUNT_COLOURED, plot) > 50, f"{plot} has no series drawn"
    summary = httpx.get(f"{server.url}/v1/console/summary", params={"window_s": 60}).json()
    assert max(p["rps"] for p in summary["points"]) > 1
    assert any(p["batch_size"] for p in summary["points"])
    browser.save_screenshot(str(shots / "console-metrics.png"))
