"""Per-request LoRA adapters (llmkit.serve.adapters): requests for different adapters and the base in one step, each
equal to generating with that adapter merged; the prefix cache keyed by adapter; the resident bound; and through the
server, chosen by `model` with the `openai` SDK, listed in /v1/models, loaded and unloaded at run time behind the
API key."""

from __future__ import annotations

import copy

import pytest
import torch

import llmkit
from llmkit.adapters.lora import add_lora, merge_lora
from llmkit.errors import InputError
from llmkit.generate import generate
from llmkit.interop.peft import save_peft
from llmkit.serve.engine import Engine, EngineConfig
from llmkit.serve.request import Refused, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _base() -> llmkit.DecoderLM:
    torch.manual_seed(0)
    cfg = llmkit.get_preset("llama2-7b-tiny")
    return llmkit.build_model(cfg).eval()


def _adapter(base: llmkit.DecoderLM, seed: int, targets: tuple[str, ...], directory) -> llmkit.DecoderLM:
    """An adapter with random (nonzero) updates saved in PEFT's layout; returns the base with it merged."""
    model = copy.deepcopy(base)
    add_lora(model, r=4, alpha=8, targets=targets)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    save_peft(model, model.cfg, directory)
    merge_lora(model)
    return model.eval()


def _served(engine: Engine, prompts: list[list[int]], choices: list[str | None]) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their log-probabilities, the requests under their adapters in one batch."""
    ids = [
        engine.add(p, SamplingParams(max_tokens=8, temperature=0.0, adapter=c))
        for p, c in zip(prompts, choices, strict=True)
    ]
    out: dict[str, tuple[list[int], list[float]]] = {i: ([], []) for i in ids}
    while engine.has_work:
        for d in engine.step():
            out[d.request_id][0].extend(d.token_ids)
            out[d.request_id][1].extend(d.logprobs)
    return [out[i] for i in ids]


def _reference(model: llmkit.DecoderLM, prompt: list[int]) -> list[int]:
    return generate(model, torch.tensor([prompt]), max_new_tokens=8).tokens[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    base = _base()
    a_dir, b_dir = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    merged_a = _adapter(base, 1, ("wq", "wv"), a_dir)
    merged_b = _adapter(base, 2, ("wo", "w2"), b_dir)
    return base, {"a": (str(a_dir), merged_a), "b": (str(b_dir), merged_b)}


def _serving(base, adapters, most=2, **kw) -> Engine:
    engine = Engine(base, None, EngineConfig(kv_memory=8 << 20, block_size=4, max_adapters=most, **kw))
    assert engine.adapters is not None
    for name, (path, _) in adapters.items():
        engine.adapters.register(name, path)
    return engine


@pytest.mark.parametrize("long", [False, True], ids=["gathered", "grouped"])
def test_two_adapters_and_the_base_in_one_batch_each_equal_their_merged_model(adapters, long):
    """Short prompts: every step gathers each token's adapter (BGMV); long ones (over GATHER_TOKENS together): the
    prompt step groups tokens by adapter, the decoding steps gather."""
    base, known = adapters
    engine = _serving(base, known)
    prompts = [[5, 9, 11, 3, 7, 2], [5, 9, 11, 3, 7, 2, 8, 8, 1], [4, 4, 6]]
    if long:
        prompts = [p * 8 for p in prompts]
    choices = ["a", "b", None]
    ids = [
        engine.add(p, SamplingParams(max_tokens=8, temperature=0.0, adapter=c))
        for p, c in zip(prompts, choices, strict=True)
    ]
    done = {}
    while engine.has_work:
        for d in engine.step():
            done.setdefault(d.request_id, []).extend(d.token_ids)
    for request_id, prompt, choice in zip(ids, prompts, choices, strict=True):
        model = known[choice][1] if choice is not None else base
        assert done[request_id] == _reference(model, prompt), choice
    assert _reference(known["a"][1], prompts[0]) != _reference(base, prompts[0])  # (the adapters change the output)


@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "native"])
def test_adapted_decoding_rows_keep_the_cpp_step(adapters, invariant, monkeypatch):
    """On the C++ step's runners the adapters' updates are added inside the step (cpu_decode.cpp's add_low_rank):
    no decoding row leaves it for the PyTorch hooks (with the batch-invariant runner, no prompt either), and each
    request still gets its merged model's tokens."""
    from llmkit.quant import native
    from llmkit.serve.model_runner import InvariantRunner, NativeRunner

    if not native.available():
        pytest.skip("needs llmkit's AVX2 kernels")
    base, known = adapters
    engine = _serving(base, known, batch_invariant=invariant)
    assert isinstance(engine.runner, InvariantRunner if invariant else NativeRunner)
    hooked: list[int] = []
    plain = engine.runner.adapted
    monkeypatch.setattr(engine.runner, "adapted", lambda rows: hooked.append(len(rows[0].tokens)) or plain(rows))
    prompts, choices = [[5, 9, 11, 3, 7, 2], [4, 4, 6], [5, 9, 11, 3]], ["a", "b", None]
    for (tokens, _), prompt, choice in zip(_served(engine, prompts, choices), prompts, choices, strict=True):
        assert tokens == _reference(known[choice][1] if choice else base, prompt), choice
    assert all(n > 1 for n in hooked) and (not hooked if invariant else hooked)  # prompts only, and not invariant


def test_an_adapted_row_gets_the_same_bits_alone_and_beside_other_rows(adapters):
    """The batch-invariant runner keeps its promise for adapted rows: a request's log-probabilities are the same
    bits served alone and beside the other adapter's and the base's requests."""
    from llmkit.serve.model_runner import InvariantRunner

    base, known = adapters
    engine = _serving(base, known)
    if not isinstance(engine.runner, InvariantRunner):
        pytest.skip("needs llmkit's C++ step")
    prompts, choices = [[5, 9, 11, 3, 7, 2], [4, 4, 6, 1, 2], [8, 3]], ["a", "b", None]
    together = _served(engine, prompts, choices)
    for i in range(3):
        assert _served(engine, [prompts[i]], [choices[i]]) == [together[i]], choices[i]


def test_the_prefix_cache_is_keyed_by_adapter(adapters):
    base, known = adapters
    engine = _serving(base, known)
    prompt = list(range(3, 40))
    [plain] = engine.generate([prompt], GREEDY)
    before = engine.stats.prompt_tokens
    [with_a] = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, adapter="a"))
    assert engine.stats.prompt_tokens - before == len(prompt)  # the base's blocks are not adapter a's
    assert with_a.token_ids == _reference(known["a"][1], prompt) and with_a.token_ids != plain.token_ids
    before = engine.stats.prompt_tokens
    [again] = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, adapter="a"))
    assert engine.stats.prompt_tokens - before < len(prompt) and again.token_ids == with_a.token_ids


def test_at_most_the_resident_bound_least_recently_used_unloaded_and_reloaded(adapters):
    base, known = adapters
    engine = _serving(base, known, most=1)
    assert engine.adapters is not None and list(engine.adapters.resident) == ["b"]  # registering a unloaded it
    [out] = engine.generate([[5, 9, 11]], SamplingParams(max_tokens=8, temperature=0.0, adapter="a"))
    assert list(engine.adapters.resident) == ["a"] and out.token_ids == _reference(known["a"][1], [5, 9, 11])
    with pytest.raises(Refused, match="no adapter"):
        engine.add([1, 2], SamplingParams(adapter="c"))
    with pytest.raises(InputError, match=r"adapter_config\.json"):
        engine.adapters.register("c", str(known["a"][0]) + "-missing")
    engine.add([5, 9, 11], SamplingParams(max_tokens=8, adapter="a"))  # in flight: "a" cannot be unloaded
    with pytest.raises(InputError, match="in use by requests in flight"):
        engine.add([5, 9, 11], SamplingParams(max_tokens=8, adapter="b"))
    with pytest.raises(InputError, match="in use"):
        engine.adapters.unregister("a")
    while engine.has_work:
        engine.step()
    engine.adapters.unregister("b")
    with pytest.raises(Refused, match="no adapter"):
        engine.add([1, 2], SamplingParams(adapter="b"))


def test_an_adapter_for_another_model_is_refused(adapters, tmp_path):
    base, _ = adapters
    wide = copy.deepcopy(base)  # an adapter whose A takes twice the model's width
    add_lora(wide, r=4, alpha=8, targets=("wq",))
    save_peft(wide, wide.cfg, tmp_path)
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "adapter_model.safetensors"))
    save_file({k: torch.cat([v, v], dim=-1) if "lora_A" in k else v for k, v in state.items()},
              str(tmp_path / "adapter_model.safetensors"))  # fmt: skip
    engine = Engine(base, None, EngineConfig(kv_memory=8 << 20, block_size=4, max_adapters=2))
    with pytest.raises(InputError, match="another base model"):
        engine.adapters.register("wide", str(tmp_path))


def test_the_openai_client_chooses_adapters_by_model(adapters):
    """Through the server: /v1/models lists them; three requests at once, each its adapter's answer; runtime load
    and unload need the API key; an unknown model is a 404."""
    openai = pytest.importorskip("openai")
    from concurrent.futures import ThreadPoolExecutor

    from llmkit.serve.server import ServeOptions, Server

    from .conftest import post

    base, known = adapters
    config = EngineConfig(kv_memory=8 << 20, block_size=4, max_adapters=2)
    with Server(base, None, ServeOptions("base", api_key="k"), config) as server:
        for name, (path, _) in known.items():
            code, body = post(server.url + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path},
                              {"Authorization": "Bearer k"})  # fmt: skip
            assert code == 200, body
        code, body = post(server.url + "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/"})
        assert code == 401
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
        listed = {m.id: m for m in client.models.list().data}
        assert set(listed) == {"base", "a", "b"} and listed["a"].parent == "base"
        prompt = [5, 9, 11, 3, 7, 2]

        def ask(model: str) -> list[int]:
            r = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=0)
            return [int(t.strip("<>")) for t in r.choices[0].logprobs.tokens]

        with ThreadPoolExecutor(3) as pool:
            answers = dict(zip(["a", "b", "base"], pool.map(ask, ["a", "b", "base"]), strict=True))
        for name, tokens in answers.items():
            assert tokens == _reference(known[name][1] if name != "base" else base, prompt), name
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="c", prompt=prompt, max_tokens=2)
        code, body = post(server.url + "/v1/unload_lora_adapter", {"lora_name": "b"}, {"Authorization": "Bearer k"})
        assert code == 200 and {m.id for m in client.models.list().data} == {"base", "a"}


def test_an_adapter_s_blocks_come_back_from_the_disk_tier_as_its_own(adapters, tmp_path):
    """The tiers key blocks by their digest chains, which start from each adapter's root: after a restart the
    adapter's prompt finds its blocks, and the same prompt for the base or the other adapter finds none."""
    base, known = adapters
    prompt = list(range(7, 47))
    params = SamplingParams(max_tokens=8, temperature=0.0, adapter="a")
    first = _serving(base, known, cache_dir=str(tmp_path))
    [before] = first.generate([prompt], params)
    first.close()
    second = _serving(base, known, cache_dir=str(tmp_path))
    for choice in (None, "b"):
        computed = second.stats.prompt_tokens
        second.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, adapter=choice))
        assert second.stats.prompt_tokens - computed == len(prompt)  # not adapter a's blocks
    computed = second.stats.prompt_tokens
    [after] = second.generate([prompt], params)
    assert second.stats.prompt_tokens - computed < len(prompt) and after.token_ids == before.token_ids
    assert after.token_ids == _reference(known["a"][1], prompt)
