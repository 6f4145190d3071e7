"""Prefix-cache tiers (llmkit.serve.tiers): blocks the pool evicts kept in host memory and on disk, brought back on a
hit with the keys and values the prompt would compute; the disk tier across a restart, through the server too; files
that are damaged, of another model or unwritable cost a recomputation and a log line, never a wrong token."""

from __future__ import annotations

import logging

import pytest
import torch

import llmkit
from llmkit.serve.engine import Engine, EngineConfig
from llmkit.serve.paged import PagedCache
from llmkit.serve.request import SamplingParams
from llmkit.serve.tiers import BlockStore, cache_key

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
BLOCK = 4


def _model(seed: int = 0) -> llmkit.DecoderLM:
    torch.manual_seed(seed)
    return llmkit.build_model(llmkit.get_preset("llama2-7b-tiny")).eval()


def _engine(model, blocks: int = 12, **kw) -> Engine:
    per_block = PagedCache.bytes_per_block(model, BLOCK, torch.float32)
    return Engine(model, None, EngineConfig(kv_memory=per_block * blocks, block_size=BLOCK, step_tokens=64, **kw))


def _prompt(seed: int, n: int = 26) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine: Engine, prompt: list[int]):
    """The completion, and how many of the prompt's tokens the engine computed for it."""
    before = engine.stats.prompt_tokens
    [done] = engine.generate([prompt], GREEDY)
    return done, engine.stats.prompt_tokens - before


def _evict(engine: Engine) -> None:
    """Run other prompts until every block cached so far has been reused."""
    for seed in (101, 102, 103):
        engine.generate([_prompt(seed, 40)], GREEDY)


# ---- the store


def _payload(i: int, n: int = 64) -> torch.Tensor:
    return torch.full((n,), i, dtype=torch.uint8)


def test_host_memory_spills_its_least_recently_used_blocks_to_disk(tmp_path):
    store = BlockStore("k" * 32, host_bytes=128, directory=tmp_path, disk_bytes=1 << 20)
    for i in range(3):
        store.put(bytes([i]) * 16, _payload(i))
    assert list(store.host) == [bytes([1]) * 16, bytes([2]) * 16] and list(store.disk) == [bytes([0]) * 16]
    assert torch.equal(store.take(bytes([0]) * 16), _payload(0))  # from disk
    assert torch.equal(store.take(bytes([2]) * 16), _payload(2)) and bytes([2]) * 16 not in store  # host: gone
    assert store.restored == {"host": 1, "disk": 1}
    store.flush()
    again = BlockStore("k" * 32, host_bytes=0, directory=tmp_path, disk_bytes=1 << 20)  # a restart
    assert set(again.disk) == {bytes([0]) * 16, bytes([1]) * 16}
    assert torch.equal(again.take(bytes([1]) * 16), _payload(1))


def test_the_disk_tier_keeps_within_its_bytes_oldest_first(tmp_path):
    probe = BlockStore("p" * 32, host_bytes=0, directory=tmp_path, disk_bytes=1 << 20)
    probe.put(b"\x00" * 16, _payload(0, 100))
    size = probe.on_disk  # one file: a header and the 100 bytes
    store = BlockStore("k" * 32, host_bytes=0, directory=tmp_path, disk_bytes=3 * size)
    for i in range(5):
        store.put(bytes([i]) * 16, _payload(i, 100))
    assert list(store.disk) == [bytes([i]) * 16 for i in (2, 3, 4)]
    files = list((tmp_path / ("k" * 32)).iterdir())
    assert sorted(p.name for p in files) == sorted(f"{d.hex()}.kvb" for d in store.disk)
    assert store.on_disk == sum(p.stat().st_size for p in files) == 3 * size


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "garbage"])
def test_a_bad_file_is_ignored_with_a_log_line_and_removed(tmp_path, caplog, damage):
    digest = b"\x07" * 16
    BlockStore("k" * 32, 0, tmp_path, 1 << 20).put(digest, _payload(7))
    path = tmp_path / ("k" * 32) / f"{digest.hex()}.kvb"
    data = path.read_bytes()
    if damage == "flip":
        data = data[:-1] + bytes([data[-1] ^ 1])
    elif damage == "truncate":
        data = data[:-10]
    elif damage == "foreign":  # another model's block, under this key's name
        data = data.replace(b"k" * 32, b"j" * 32)
    else:
        data = b"\x00" * 40
    path.write_bytes(data)
    store = BlockStore("k" * 32, 0, tmp_path, 1 << 20)
    with caplog.at_level(logging.WARNING, logger="llmkit.serve"):
        assert store.take(digest) is None
    assert "ignoring" in caplog.text and path.name in caplog.text
    assert not path.exists() and digest not in store


def test_a_disk_that_cannot_be_written_costs_the_blocks_only(tmp_path, caplog, monkeypatch):
    store = BlockStore("k" * 32, 0, tmp_path, 1 << 20)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("builtins.open", full)
    with caplog.at_level(logging.WARNING, logger="llmkit.serve"):
        store.put(b"\x01" * 16, _payload(1))
        store.put(b"\x02" * 16, _payload(2))
    monkeypatch.undo()
    assert caplog.text.count("cannot write") == 1 and not store.disk
    assert not list((tmp_path / ("k" * 32)).iterdir())  # no temporary file left behind


def test_the_key_tells_models_and_layouts_apart():
    a, b = _model(0), _model(0)
    assert cache_key(a, torch.float32, 4, "x") == cache_key(b, torch.float32, 4, "x")
    with torch.no_grad():
        b.blocks[1].ffn.w2.weight.mul_(1.001)  # a fine-tune's change, in one layer
    keys = {
        cache_key(a, torch.float32, 4, "x"),
        cache_key(b, torch.float32, 4, "x"),
        cache_key(a, torch.bfloat16, 4, "x"),
        cache_key(a, torch.float32, 8, "x"),
        cache_key(a, torch.float32, 4, "y"),
    }
    assert len(keys) == 5


# ---- through the engine


def test_evicted_blocks_come_back_from_host_memory_with_the_same_tokens():
    """A prompt's blocks evicted by later prompts: without tiers they are computed again; with host memory they are
    copied back, and the tokens and log-probabilities are those of the first run."""
    model, prompt = _model(), _prompt(1)
    plain = _engine(model)
    first, computed = _run(plain, prompt)
    assert computed == len(prompt)
    _evict(plain)
    assert _run(plain, prompt)[1] == len(prompt)  # the pool alone lost them

    tiered = _engine(model, host_cache=1 << 30)
    _run(tiered, prompt)
    _evict(tiered)
    again, computed = _run(tiered, prompt)
    cached = (len(prompt) - 1) // BLOCK * BLOCK
    assert computed == len(prompt) - cached and tiered.store.restored["host"] == cached // BLOCK
    assert again.token_ids == first.token_ids and again.logprobs == first.logprobs


def test_a_restart_finds_the_blocks_on_disk_and_a_changed_model_does_not(tmp_path, caplog):
    model, prompt = _model(), _prompt(2)
    before = _engine(model, cache_dir=str(tmp_path))
    first, _ = _run(before, prompt)
    before.close()  # what the server's engine thread does when it stops
    after = _engine(model, cache_dir=str(tmp_path))
    again, computed = _run(after, prompt)
    cached = (len(prompt) - 1) // BLOCK * BLOCK
    assert computed == len(prompt) - cached and after.store.restored["disk"] == cached // BLOCK
    assert again.token_ids == first.token_ids and again.logprobs == first.logprobs

    changed = _model(0)
    with torch.no_grad():
        changed.blocks[0].attn.wq.weight.add_(1e-3)
    other = _engine(changed, cache_dir=str(tmp_path))
    assert not other.store.disk and _run(other, prompt)[1] == len(prompt)  # its own key: none of those files

    victim = next((tmp_path / after.store.key).glob("*.kvb"))
    victim.write_bytes(victim.read_bytes()[:-3])
    third = _engine(model, cache_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="llmkit.serve"):
        damaged, computed = _run(third, prompt)
    assert damaged.token_ids == first.token_ids and computed > len(prompt) - cached
    assert "ignoring" in caplog.text


def test_tiers_are_refused_where_other_caches_share_the_blocks():
    from llmkit.errors import InputError

    model = _model()
    config = EngineConfig(kv_memory=1 << 22, block_size=BLOCK, host_cache=1 << 20, draft_tokens=2)
    with pytest.raises(InputError, match="--mtp or --draft"):
        Engine(model, None, config, draft=_model(1))
    with pytest.raises(InputError, match="prefix caching"):
        EngineConfig(cache_dir="x", prefix_caching=False)


def test_a_restarted_server_answers_from_the_disk_tier(tiny, tmp_path):
    """Two servers in turn over one directory: the second answers a long repeated prompt with the first's tokens,
    reporting the prompt tokens the tier held as cached and computing only the rest (its /metrics count)."""
    openai = pytest.importorskip("openai")
    from llmkit.serve.server import ServeOptions, Server

    model, tok = tiny
    config = EngineConfig(kv_memory=64 << 20, cache_dir=str(tmp_path))
    system = " ".join(f"rule {i}: answer briefly." for i in range(60))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    answers = []
    for _ in range(2):
        with Server(model, tok, ServeOptions("m"), config) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
            r = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
            metrics = server.engine.stats.prompt_tokens
            answers.append((r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens, metrics))
    (text, cached, computed), (text2, cached2, computed2) = answers
    prompt = computed
    assert cached == 0 and text2 == text
    assert cached2 == (prompt - 1) // 16 * 16 > 300 and computed2 == prompt - cached2
