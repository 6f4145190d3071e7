"""`llmkit serve --tensor-parallel 2` under torchrun (2 processes, gloo on 127.0.0.1) answers through the openai
client exactly what the same model answers served by one process: greedy completions one at a time and together,
a streamed chat, the prompt's log-probabilities (echo) and embeddings; for a dense grouped-query model and for
DeepSeek-V3.2's family (latent and sparse attention, mixture of experts). A rank that dies ends the server, with a
non-zero exit, instead of leaving it hanging."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import llmkit
from llmkit.interop.checkpoint import save_llmkit
from llmkit.serve.engine import EngineConfig
from llmkit.serve.server import ServeOptions, Server, free_port

from .conftest import wait_for

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow  # each test starts two processes under torchrun

PROMPTS = ["Once upon a time", "The capital of France is", "def add(a, b):", "1, 2, 3, 4,"]


class _SplitServer:
    """`torchrun --nproc_per_node 2 -m llmkit serve CHECKPOINT --tensor-parallel 2` on free ports."""

    def __init__(self, checkpoint: Path) -> None:
        self.port = free_port()
        self.log = checkpoint.parent / "split-server.log"  # a file, not a pipe: the server logs every request
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                   "127.0.0.1", "--master_port", str(free_port()), "-m", "llmkit", "serve", str(checkpoint),
                   "--port", str(self.port), "--model-name", "m", "--kv-memory", "32MiB",
                   "--tensor-parallel", "2"]  # fmt: skip
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        try:
            wait_for(self._healthy, timeout=300, what="the split server to answer /health")
        except BaseException:
            self.kill()
            raise
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0)

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, f"the split server exited: {self.log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def ranks(self) -> dict[int, int]:
        """The pids of the serving processes, by rank (torchrun's children, read from their environments)."""
        found = {}
        for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid:  # its parent is torchrun
                rank = [e for e in env if e.startswith(b"RANK=")]
                if rank:
                    found[int(rank[0][5:])] = pid
        return found

    def kill(self) -> None:
        """Stop torchrun and its ranks: torchrun stops its workers on SIGTERM; a rank it left behind (its workers
        are not in its process group) is killed by pid."""
        if self.proc.poll() is None:
            ranks = self.ranks()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
            for pid in ranks.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self.proc.wait()


def _model(preset: str, vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = llmkit.get_preset(preset)
    return llmkit.build_model(dataclasses.replace(cfg, vocab_size=vocab)).eval()


@pytest.fixture(scope="module", params=["llama2-7b-tiny", "deepseek-v3.2-tiny"])
def pair(request, smollm2, tmp_path_factory):
    """The same model served by one process (in this one) and split across two."""
    tok = smollm2[1]
    model = _model(request.param, smollm2[0].cfg.vocab_size)
    checkpoint = save_llmkit(model, tmp_path_factory.mktemp("tp-serve") / "model", tokenizer=tok)
    split = _SplitServer(checkpoint)
    try:
        with Server(model, tok, ServeOptions("m"), EngineConfig(kv_memory=32 << 20)) as one:
            yield openai.OpenAI(base_url=one.url + "/v1", api_key="none", max_retries=0), split
    finally:
        split.kill()


def _complete(client, prompt: str) -> str:
    r = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0)
    return r.choices[0].text


def test_greedy_completions_equal_one_process(pair):
    one, split = pair
    for prompt in PROMPTS:  # one at a time
        assert _complete(split.client, prompt) == _complete(one, prompt)
    with ThreadPoolExecutor(4) as pool:  # together: prompts of different lengths in one step
        together = list(pool.map(lambda p: _complete(split.client, p), PROMPTS))
    assert together == [_complete(one, p) for p in PROMPTS]


def test_streamed_chat_equals_one_process(pair):
    one, split = pair

    def chat(client) -> str:
        messages = [{"role": "user", "content": "Say something."}]
        stream = client.chat.completions.create(model="m", messages=messages, max_tokens=10, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    assert chat(split.client) == chat(one)


def test_prompt_logprobs_and_embeddings_equal_one_process(pair):
    one, split = pair
    kwargs = dict(model="m", prompt=PROMPTS[1], max_tokens=0, echo=True, logprobs=2, temperature=0)
    a, b = (
        one.completions.create(**kwargs).choices[0].logprobs,
        split.client.completions.create(**kwargs).choices[0].logprobs,
    )
    assert b.tokens == a.tokens
    assert b.token_logprobs[1:] == pytest.approx(a.token_logprobs[1:], abs=1e-4)
    e1 = one.embeddings.create(model="m", input=PROMPTS).data
    e2 = split.client.embeddings.create(model="m", input=PROMPTS).data
    for x, y in zip(e1, e2, strict=True):
        assert y.embedding == pytest.approx(x.embedding, abs=1e-4)


def test_a_rank_that_dies_ends_the_server(smollm2, tmp_path):
    tok = smollm2[1]
    checkpoint = save_llmkit(_model("llama2-7b-tiny", smollm2[0].cfg.vocab_size), tmp_path / "m", tokenizer=tok)
    split = _SplitServer(checkpoint)
    try:
        ranks = split.ranks()
        assert sorted(ranks) == [0, 1]
        os.kill(ranks[1], signal.SIGKILL)
        with pytest.raises(Exception):  # noqa: B017 - refused, reset or an error: anything but an answer
            split.client.completions.create(model="m", prompt="hi", max_tokens=5, timeout=120)
        code = split.proc.wait(timeout=300)  # a hang fails here
        err = split.log.read_text()
        assert code != 0
        assert "tensor-parallel step failed" in err or "local_rank: 1" in err, err[-3000:]
    finally:
        split.kill()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tensor-parallel", "2"], "start it with torchrun --nproc_per_node 2"),
        (["--tensor-parallel", "2", "--mtp"], "--tensor-parallel serves without --mtp"),
    ],
)
def test_a_wrong_tensor_parallel_launch_is_one_error_line(tmp_path, flags, message):
    missing = tmp_path / "never-loaded"  # the launch is checked before any model loads
    done = subprocess.run([sys.executable, "-m", "llmkit", "serve", str(missing), *flags], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr
