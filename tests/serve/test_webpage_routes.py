"""The web page's routes without a browser (tests/serve/test_webpage.py drives the page itself): its files, its
headers, --no-ui, and /metrics.json, which must say what /metrics says."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from llmkit.serve.engine import EngineConfig
from llmkit.serve.server import ServeOptions, Server

from .conftest import prometheus_samples

openai = pytest.importorskip("openai")


def _server(model_tok, **options):
    model, tok = model_tok
    return Server(model, tok, ServeOptions("m", **options), EngineConfig(kv_memory=64 << 20))


def _get(url: str, key: str | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_the_page_and_its_files_come_from_the_package_with_a_strict_policy(tiny):
    with _server(tiny, api_key="k") as server:
        status, headers, body = _get(server.url + "/")  # no key: the page holds no data, it asks for the key
        assert status == 200 and headers["content-type"].startswith("text/html")
        assert b'src="/ui/app.js"' in body and b'href="/ui/style.css"' in body
        assert "script-src 'self'" in headers["content-security-policy"]
        assert headers["x-content-type-options"] == "nosniff"
        for name, kind in (("app.js", "text/javascript"), ("style.css", "text/css")):
            status, headers, body = _get(f"{server.url}/ui/{name}")
            assert status == 200 and headers["content-type"].startswith(kind) and len(body) > 1000
        for path in ("/ui/../api.py", "/ui/webpage.py", "/ui/missing.js"):
            assert _get(server.url + path)[0] == 404
        assert _get(server.url + "/metrics.json")[0] == 401  # the page's data is behind the key
        assert _get(server.url + "/metrics.json", "k")[0] == 200


def test_no_ui_serves_no_page(tiny):
    with _server(tiny, ui=False) as server:
        assert _get(server.url + "/")[0] == 404
        assert _get(server.url + "/ui/app.js")[0] == 404
        assert _get(server.url + "/metrics.json")[0] == 200  # the data stays for other dashboards


def test_metrics_json_says_what_metrics_says_and_lists_the_steps(tiny):
    with _server(tiny, metrics_key="scrape") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        for i in range(3):
            client.completions.create(model="m", prompt=f"Once upon a time {i}", max_tokens=5, temperature=0)
        server.loop.wait_idle(60)
        status, _, body = _get(server.url + "/metrics.json", "scrape")
        assert status == 200
        snapshot = json.loads(body)
        text = prometheus_samples(_get(server.url + "/metrics", "scrape")[2])
        # (the engine is idle: the two reads see the same counts; the _created stamps are equal too)
        assert snapshot["samples"] == pytest.approx(text)
        assert snapshot["samples"]["llmkit_generated_tokens_total"] == 15
        steps = snapshot["steps"]
        assert len(steps) == text["llmkit_steps_total"]
        assert sum(s["decode_rows"] for s in steps) == text["llmkit_step_decode_rows_sum"]
        assert sum(s["prompt_tokens"] for s in steps) == text["llmkit_prompt_tokens_total"]
        assert steps[-1]["weight_bytes"] == text["llmkit_step_weight_read_bytes"]
        assert sum(s["flops"] for s in steps) == pytest.approx(text["llmkit_flops_total"])


@pytest.mark.parametrize(("flags", "ui"), [([], True), (["--no-ui"], False)])
def test_llmkit_serve_no_ui_turns_the_page_off(tmp_path, monkeypatch, flags, ui):
    """The flag reaches the server's options (the server is built, then returns instead of serving)."""
    import dataclasses

    import torch
    from helpers import tiny_tokenizer

    from llmkit import build_model, get_preset
    from llmkit.cli import main
    from llmkit.interop.checkpoint import save_llmkit
    from llmkit.serve.server import free_port

    torch.manual_seed(0)
    model = build_model(dataclasses.replace(get_preset("llama2-7b-tiny"), vocab_size=320)).eval()
    checkpoint = save_llmkit(model, tmp_path / "ck", tokenizer=tiny_tokenizer())
    served: list[ServeOptions] = []
    monkeypatch.setattr(Server, "run_foreground", lambda self: served.append(self.options))
    assert main(["serve", str(checkpoint), "--port", str(free_port()), *flags]) == 0
    assert [options.ui for options in served] == [ui]
