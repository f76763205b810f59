"""The web console of a server with API keys, in a real browser (Debian's headless Chromium driven by selenium, as
tests/e2e/test_console.py): the app of :func:`miaohui.server.app.build_app` with ``api_keys`` (a key file written
by the real ``miaohui keys add``) on localhost, serving a tiny random BERT intent model and a tiny random chat model
(2 layers × 64, SmolLM2's tokenizer and chat template, fp32 ONNX).

Checked: without a key the page shows the server's 401 message and asks for one; a wrong key shows "not valid";
with the key pasted the chat targets load, a chat reply streams and the models page lists the repository (every
API call carried ``Authorization: Bearer``: the server refuses them otherwise); the key is in the tab's
sessionStorage only (not in the URL, not in cookies, not in localStorage); "Forget" drops it and the 401 is back.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.e2e.test_console import browser, wait_for  # noqa: F401  (browser: the headless Chromium fixture)
from tests.integration.test_auth import add_key
from tests.servers import UvicornThread
from tests.tiny_decoders import save_tiny_decoder, smollm_tokenizer

from miaohui.config import BuildConfig
from miaohui.engines.store import build_artifact
from miaohui.generation.build.artifact import build_causal_lm
from miaohui.server.app import build_app

pytestmark = pytest.mark.slow

CHAT = "tinychat"


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    file = tmp_path_factory.mktemp("console-keys") / "keys.yaml"
    return file, add_key(file, "console")


@pytest.fixture(scope="module")
def server(
    tiny_model: Path, key_file: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[UvicornThread]:
    repo = tmp_path_factory.mktemp("console-keys-repo")
    build_artifact(tiny_model, "intent", BuildConfig(precision="fp32"), repo, log=lambda m: None)
    staging = tmp_path_factory.mktemp("console-keys-chat")
    source = save_tiny_decoder("qwen2", staging / "hf", smollm_tokenizer())
    build_causal_lm(repo, CHAT, "fp32", source=source, log=lambda m: None)
    with UvicornThread(build_app(repo, api_keys=key_file[0])) as srv:
        yield srv


def banner(page: Any) -> str:
    node = page.find_element("css selector", "#key-needed")
    return str(node.text) if node.is_displayed() else ""


def use_key(page: Any, key: str) -> None:
    box = page.find_element("css selector", "#api-key")
    box.clear()
    box.send_keys(key)
    page.find_element("css selector", "#key-use").click()


def test_the_console_asks_for_a_key_and_sends_it(
    browser: Any,  # noqa: F811  (the fixture imported above)
    server: UvicornThread,
    key_file: tuple[Path, str],
) -> None:
    from selenium.webdriver.common.keys import Keys

    key = key_file[1]
    assert httpx.get(f"{server.url}/v1/console/models").status_code == 401  # the API behind the page needs a key
    assert httpx.get(f"{server.url}/ui/").status_code == 200  # the static page does not

    browser.get(f"{server.url}/ui/#chat")
    shown = wait_for(lambda: banner(browser), "the 401 message")
    assert shown.startswith("no API key: the request has no Authorization header"), shown
    errors = [e.text for e in browser.find_elements("css selector", ".msg.error .bubble")]
    assert any(e.startswith("no API key") for e in errors), errors
    assert browser.find_element("css selector", "#key-state").text == "no key"

    use_key(browser, "mh-not-a-key")
    wait_for(lambda: "the API key is not valid" in banner(browser), "the wrong key's 401")

    use_key(browser, key)
    options = wait_for(lambda: browser.find_elements("css selector", "#chat-model option"), "the chat targets")
    assert f"llm:{CHAT}" in [o.get_attribute("value") for o in options]
    assert banner(browser) == "" and browser.find_element("css selector", "#key-state").text == "key set (this tab)"
    assert browser.find_element("css selector", "#api-key").get_attribute("value") == ""  # not left in the field

    from selenium.webdriver.support.ui import Select

    Select(browser.find_element("css selector", "#chat-model")).select_by_value(f"llm:{CHAT}")
    box = browser.find_element("css selector", "#chat-input")
    box.send_keys("hello")
    box.send_keys(Keys.ENTER)
    reply = wait_for(
        lambda: browser.find_elements("css selector", ".msg.bot:not(.streaming)[data-chunks]"), "the streamed reply"
    )[0]
    assert int(reply.get_attribute("data-chunks")) >= 1

    browser.get(f"{server.url}/ui/#models")  # a new page load: the key stays for the tab
    rows = wait_for(lambda: browser.find_elements("css selector", "#models-table tbody tr[data-model]"), "the models")
    assert "intent" in [r.get_attribute("data-model") for r in rows]
    assert banner(browser) == ""

    assert browser.execute_script("return sessionStorage.getItem('miaohui.apiKey')") == key
    assert browser.execute_script("return localStorage.length") == 0
    assert key not in browser.current_url and key not in browser.execute_script("return document.cookie")
    assert key not in browser.page_source

    browser.find_element("css selector", "#key-forget").click()
    wait_for(lambda: banner(browser).startswith("no API key"), "the 401 after forgetting the key")
    assert browser.execute_script("return sessionStorage.getItem('miaohui.apiKey')") is None

    refused = server.sample("miaohui_rejected_requests_total", tenant="(none)", code="401", reason="unauthorized")
    assert refused >= 3  # the page's calls before the key, with the wrong one and after forgetting it
