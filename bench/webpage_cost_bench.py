"""What the web page costs the server: output tokens/s of `llmkit serve` under the same load with no page open, with
/metrics.json read once a second by a plain client (the server's share of the page's cost), and with the page's
engine view open in headless Chromium (reading /metrics.json once a second and redrawing), in one run, the three
taking turns round by round.

    .venv/bin/python bench/webpage_cost_bench.py [--rounds 3] [--requests 36] [--concurrency 4] [--gguf FILE]
        [--screenshots docs/images]

The browser runs on the same machine as the server, as it does when someone opens the page on the machine that
serves: its CPU time is part of the cost measured (on 2 cores, the larger part). The default model,
SmolLM2-135M-Instruct, takes a few milliseconds a step, which makes any fixed cost of the page the largest share it
can be. Load (seeded): prompts of 32 to 256 tokens cut from Shakespeare's plays, 64 to 128 output tokens each,
greedy and `ignore_eos`, a closed loop at --concurrency; a fresh request set each round (no prompt cached).

`--screenshots DIR` also saves the page's two views at 1280 and 375 pixels wide while a load runs (the chat view
with an answer and one token's alternatives shown), untimed, after the rounds: docs/images holds the ones
docs/serving.md shows.

Needs Chromium and chromedriver (`bash tests/install_browser.sh`) and selenium (in the dev extra).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import threading
import urllib.request
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from common import measure_limits, report, smollm2_gguf
from serve_bench import MODEL, Load, ServerProcess, closed_loop, corpus_tokens, request_set

from llmkit.serve.server import free_port


def chromium() -> Any:
    """Headless Chromium through chromedriver (Debian's), with the page's console log kept."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = shutil.which("chromium") or shutil.which("google-chrome"), shutil.which("chromedriver")
    if binary is None or driver is None:
        raise SystemExit("needs chromium and chromedriver: bash tests/install_browser.sh")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(driver), options=options)


class EngineViewOpen(AbstractContextManager["EngineViewOpen"]):
    """The page open on its engine view for the length of a `with` block; counts the readings it made."""

    def __init__(self, browser: Any, url: str) -> None:
        self.browser, self.url, self.readings = browser, url, 0

    def __enter__(self) -> EngineViewOpen:
        from selenium.webdriver.common.by import By
        from selenium.webdriver.support.ui import WebDriverWait

        self.browser.get(self.url + "/")
        self.browser.find_element(By.ID, "tab-engine").click()
        WebDriverWait(self.browser, 60).until(lambda d: d.find_element(By.ID, "m-generated").text != "-")
        self.browser.execute_script("""
            window.readings = 0;
            new MutationObserver(() => { window.readings += 1; })
                .observe(document.getElementById('engine-status'), {childList: true, subtree: true});
        """)
        return self

    def __exit__(self, *exc: object) -> None:
        self.readings = int(self.browser.execute_script("return window.readings"))
        self.browser.get("about:blank")


class Reader(AbstractContextManager["Reader"]):
    """/metrics.json read once a second by a thread of this process, as the page reads it: the server's share of
    the page's cost, without a browser on the machine."""

    def __init__(self, url: str) -> None:
        self.url, self.readings, self.stop = url, 0, threading.Event()
        self.thread = threading.Thread(target=self.run)

    def run(self) -> None:
        while not self.stop.wait(1.0):
            with urllib.request.urlopen(self.url + "/metrics.json", timeout=60) as r:
                r.read()
            self.readings += 1

    def __enter__(self) -> Reader:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


CASES = ("closed", "read", "open")  # no page; /metrics.json read without a browser; the page open in Chromium


def rounds(port: int, url: str, browser: Any, sets: list[list[tuple[str, int]]], concurrency: int) -> dict[str, Any]:
    """Each round: the load (a third of the round's requests each) with the page closed, with /metrics.json read
    once a second without a browser, and with the page open; the order turns round by round."""
    loads: dict[str, list[Load]] = {case: [] for case in CASES}
    readings: dict[str, list[float]] = {"read": [], "open": []}
    for i, requests in enumerate(sets):
        third = len(requests) // 3
        order = CASES[i % 3 :] + CASES[: i % 3]
        for k, case in enumerate(order):
            part = requests[k * third : (k + 1) * third]
            if case == "closed":
                loads[case].append(closed_loop(port, part, concurrency))
                continue
            watcher: EngineViewOpen | Reader = EngineViewOpen(browser, url) if case == "open" else Reader(url)
            with watcher:
                loads[case].append(closed_loop(port, part, concurrency))
            readings[case].append(watcher.readings / loads[case][-1].seconds)
    rows = {case: [load.row() for load in runs] for case, runs in loads.items()}
    median = {case: {key: statistics.median(r[key] for r in case_rows) for key in ("output_tok_s", "ttft_p50",
              "itl_p50")} for case, case_rows in rows.items()}  # fmt: skip
    ratios = {case: [o["output_tok_s"] / c["output_tok_s"] for o, c in zip(rows[case], rows["closed"], strict=True)]
              for case in ("read", "open")}  # fmt: skip
    return {"rounds": rows, "median": median, "over_closed": ratios, "readings_per_s": readings}


READINGS = "return Number(document.getElementById('view-engine').dataset.polls || 0)"  # the page's reading count


def screenshots(port: int, url: str, browser: Any, requests: list[tuple[str, int]], folder: Path) -> None:
    """Both views at 1280 and 375 px while `requests` run (the chat view after one answer, a token's alternatives
    shown)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    folder.mkdir(parents=True, exist_ok=True)
    browser.set_window_size(1280, 900)
    browser.get(url + "/")
    wait = WebDriverWait(browser, 120)
    wait.until(lambda d: d.find_element(By.ID, "model").get_attribute("value"))
    for field, value in (("temperature", "0"), ("max-tokens", "60"), ("system", "You are a concise assistant.")):
        element = browser.find_element(By.ID, field)
        element.clear()
        element.send_keys(value)
    prompt = browser.find_element(By.ID, "prompt")
    prompt.send_keys("Explain in two sentences what a KV cache is.", Keys.ENTER)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".message.assistant .finish")
               and d.find_element(By.CSS_SELECTOR, ".message.assistant .finish").text)  # fmt: skip
    tokens = browser.find_elements(By.CSS_SELECTOR, ".message.assistant .token")
    load = threading.Thread(target=closed_loop, args=(port, requests, 4))
    load.start()
    try:
        for width in (1280, 375):
            browser.set_window_size(width, 900 if width > 375 else 812)
            browser.find_element(By.ID, "tab-chat").click()
            min(tokens[5:], key=lambda t: float(t.get_attribute("data-logprob"))).click()  # an uncertain one
            browser.save_screenshot(str(folder / f"serve-chat-{width}.png"))
            polls = browser.execute_script(READINGS)
            browser.find_element(By.ID, "tab-engine").click()
            # a rate needs two readings since the view opened (what it showed before is stale), a chart a few more
            wait.until(lambda d, since=polls: d.execute_script(READINGS) >= since + 3)
            wait.until(lambda d: d.find_element(By.ID, "m-tps").text not in ("-", "0.0"))
            wait.until(lambda d: d.execute_script("return document.querySelectorAll('#chart-rows rect').length") > 60)
            if width > 375:  # the whole view, charts and all (the window is taller than its viewport)
                height = browser.execute_script("return document.documentElement.scrollHeight")
                browser.set_window_size(width, height)
                browser.set_window_size(width, 2 * height - browser.execute_script("return window.innerHeight"))
            browser.save_screenshot(str(folder / f"serve-engine-{width}.png"))
    finally:
        load.join()
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    if errors:
        raise SystemExit(f"the page logged errors: {errors}")
    print(f"screenshots in {folder}", file=sys.stderr)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None, help="the GGUF file served (default SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=36, help="requests a round (a third for each case)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--screenshots", type=Path, default=None, help="save the views here too (untimed)")
    p.add_argument("--only-screenshots", action="store_true", help="with --screenshots: no timed rounds")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    gguf = args.gguf or str(smollm2_gguf())
    tok, ids = corpus_tokens(gguf)
    lengths = {"prompt": (32, 256), "output": (64, 128)}
    sets = [request_set(ids, tok, args.requests, seed=r, **lengths) for r in range(args.rounds)]
    limits = measure_limits(("fp32",))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "llmkit", "serve", gguf, "--port", str(port), "--model-name", MODEL]
    browser = chromium()
    try:
        with ServerProcess("webpage", command, port):
            summary = rounds(port, url, browser, sets, args.concurrency) if not args.only_screenshots else {}
            if args.screenshots is not None:
                extra = request_set(ids, tok, 16, seed=99, **lengths)
                screenshots(port, url, browser, extra, args.screenshots)
    finally:
        browser.quit()
    if args.only_screenshots:
        return
    summary |= {"limits": limits.as_dict(), "model": Path(gguf).name, "concurrency": args.concurrency,
                "requests_per_case_per_round": args.requests // 3}  # fmt: skip

    def table() -> None:
        m = summary["median"]
        print(f"{Path(gguf).name}, concurrency {args.concurrency}, {args.rounds} rounds; {limits}")
        print("| page | output tok/s | ratio to closed (median of rounds) | TTFT p50 | ITL p50 | readings/s |")
        print("|---|---|---|---|---|---|")
        labels = {"closed": "closed", "read": "/metrics.json read once a second, no browser",
                  "open": "engine view open in Chromium on the same machine"}  # fmt: skip
        for case in CASES:
            r = m[case]
            ratio = statistics.median(summary["over_closed"][case]) if case != "closed" else 1.0
            reads = statistics.median(summary["readings_per_s"][case]) if case != "closed" else 0.0
            print(
                f"| {labels[case]} | {r['output_tok_s']:.1f} | {ratio:.3f} | {r['ttft_p50'] * 1e3:.0f} ms "
                f"| {r['itl_p50'] * 1e3:.1f} ms | {reads:.2f} |"
            )
        for case in ("read", "open"):
            print(f"{case} / closed by round: {', '.join(f'{x:.3f}' for x in summary['over_closed'][case])}")

    report(summary, args.json, table)


if __name__ == "__main__":
    main()
