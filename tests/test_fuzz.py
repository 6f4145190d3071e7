"""Property-based tests (Hypothesis): whatever bytes, configs or text a careless or hostile user hands llmkit, the
answer is a correct result or a clear LLMKitError, never another exception, a hang or a crash.

- the checkpoint readers: random and mutated bytes in model.safetensors (a byte changed, the file cut, the header
  rewritten), in llmkit.json, and in a GGUF file;
- ModelConfig.from_dict on presets with fields replaced by random JSON values;
- random Unicode (Chinese, emoji, combining marks, controls, lone surrogates) through the tokenizer, the streaming
  detokenizer and `prepare`.

The number of examples is bounded (40; LLMKIT_FUZZ_EXAMPLES=N for more) so the suite stays fast in CI, and
the examples are the same every run (a failure in CI is a failure on every machine); LLMKIT_FUZZ_RANDOM=1 draws
new ones, for a longer hunt.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import fuzz_settings, tiny_tokenizer

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from llmkit import build_model, get_preset  # noqa: E402
from llmkit.config import ModelConfig  # noqa: E402
from llmkit.errors import LLMKitError  # noqa: E402
from llmkit.interop.checkpoint import FORMAT_FILE, save_llmkit  # noqa: E402
from llmkit.interop.load import load_model  # noqa: E402
from llmkit.tokenizer import IncrementalDecoder  # noqa: E402

FUZZ = fuzz_settings()
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def clear_error_or_result(fn: Callable[[], object]) -> object | None:
    """fn's result, or None when it raised an LLMKitError; any other exception fails the test."""
    try:
        return fn()
    except LLMKitError as e:
        assert str(e), "an error must say what was wrong"
        return None


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = get_preset("llama2-7b-tiny")
    return build_model(ModelConfig.from_dict({**cfg.to_dict(), "vocab_size": 300, "d_model": 32, "n_layers": 1})).eval()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llmkit(tiny_model(), tmp_path_factory.mktemp("fuzz") / "ckpt", tokenizer=tiny_tokenizer())


def copy_of(src: Path) -> Path:
    dst = Path(tempfile.mkdtemp(prefix="llmkit-fuzz-")) / src.name
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copy(src, dst)
    return dst


MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 2**31), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, 2**31), st.just(0)),
    st.tuples(st.just("splice"), st.integers(0, 2**31), st.binary(min_size=1, max_size=64)),
)


def mutate(path: Path, mutations: list[tuple[str, int, object]]) -> None:
    """Byte flips, a truncation, bytes spliced in, at positions biased towards the header (where the structure is)."""
    raw = bytearray(path.read_bytes())
    for kind, where, what in mutations:
        if not raw:
            break
        # half of the positions fall in the first 1 KiB (lengths, header JSON, GGUF metadata)
        at = where % min(len(raw), 1024) if where % 2 else where % len(raw)
        if kind == "flip":
            raw[at] ^= int(what)  # type: ignore[call-overload]
        elif kind == "cut":
            del raw[at:]
        else:
            raw[at : at + len(what)] = what  # type: ignore[arg-type]
    path.write_bytes(bytes(raw))


@FUZZ
@given(mutations=st.lists(MUTATION, min_size=1, max_size=3), verify=st.booleans())
def test_mutated_safetensors_give_weights_or_a_clear_error(pristine, mutations, verify):
    ckpt = copy_of(pristine)
    try:
        before = (ckpt / "model.safetensors").read_bytes()
        mutate(ckpt / "model.safetensors", mutations)
        changed = (ckpt / "model.safetensors").read_bytes() != before
        loaded = clear_error_or_result(lambda: load_model(ckpt, verify=verify))
        if verify and changed:
            assert loaded is None  # the checksum catches every change
    finally:
        shutil.rmtree(ckpt.parent, ignore_errors=True)


@FUZZ
@given(value=JSON, field=st.sampled_from(["config", "format", "version", "hf", "checksums", "quantization", "adapter"]))
def test_a_mangled_llmkit_json_is_a_clear_error(pristine, value, field):
    ckpt = copy_of(pristine)
    try:
        meta = json.loads((ckpt / FORMAT_FILE).read_text())
        meta[field] = value
        (ckpt / FORMAT_FILE).write_text(json.dumps(meta))
        clear_error_or_result(lambda: load_model(ckpt))
    finally:
        shutil.rmtree(ckpt.parent, ignore_errors=True)


@FUZZ
@given(data=st.binary(max_size=512))
def test_random_bytes_as_any_checkpoint_are_a_clear_error(tmp_path, data):
    for name in ("x.gguf", "model.safetensors"):
        d = Path(tempfile.mkdtemp(prefix="llmkit-fuzz-"))
        try:
            path = d / name
            path.write_bytes(data)
            if name.endswith(".safetensors"):
                (d / FORMAT_FILE).write_text(json.dumps({"format": "llmkit", "version": 1, "config": {}}))
                path = d
            assert clear_error_or_result(lambda p=path: load_model(p)) is None
        finally:
            shutil.rmtree(d, ignore_errors=True)


def write_tiny_gguf(path: Path) -> None:
    """A llama-architecture GGUF file of the tiny model (F32 tensors, no tokenizer), written with the gguf library."""
    from gguf import GGUFWriter

    model = tiny_model()
    cfg = model.cfg
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.position.max_seq_len)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.ffn.hidden_dim)
    w.add_head_count(cfg.attention.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(cfg.vocab_size)
    names = {
        "embed.weight": "token_embd.weight",
        "norm.weight": "output_norm.weight",
        "head.weight": "output.weight",
        "attn_residual.norm.weight": "attn_norm.weight",
        "attn.wq.weight": "attn_q.weight",
        "attn.wk.weight": "attn_k.weight",
        "attn.wv.weight": "attn_v.weight",
        "attn.wo.weight": "attn_output.weight",
        "ffn_residual.norm.weight": "ffn_norm.weight",
        "ffn.w1.weight": "ffn_gate.weight",
        "ffn.w3.weight": "ffn_up.weight",
        "ffn.w2.weight": "ffn_down.weight",
    }
    for name, t in model.state_dict().items():
        block = name.startswith("blocks.0.")
        gguf_name = "blk.0." + names[name.removeprefix("blocks.0.")] if block else names[name]
        w.add_tensor(gguf_name, t.detach().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    assert load_model(path).model.cfg.d_model == 32  # the pristine file loads
    return path


@FUZZ
@given(mutations=st.lists(MUTATION, min_size=1, max_size=3))
def test_mutated_gguf_gives_a_model_or_a_clear_error(tiny_gguf, mutations):
    path = copy_of(tiny_gguf)
    try:
        mutate(path, mutations)
        clear_error_or_result(lambda: load_model(path))
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)


PRESETS = ["llama2-7b-tiny", "gpt2-tiny", "deepseek-v3-tiny", "mixtral-8x7b-tiny"]


@FUZZ
@given(
    preset=st.sampled_from(PRESETS),
    changes=st.lists(st.tuples(st.integers(0, 63), JSON), min_size=1, max_size=3),
)
def test_model_configs_with_random_fields_are_valid_or_a_config_error(preset, changes):
    """Replace random fields (nested sections included) of a preset with random JSON values: from_dict returns a
    config whose own validation holds (it round-trips through to_dict), or raises ConfigError."""
    data = get_preset(preset).to_dict()
    for index, value in changes:
        paths = [(k,) for k in data] + [(k, s) for k, v in data.items() if isinstance(v, dict) for s in v]
        path = paths[index % len(paths)]
        target = data
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    cfg = clear_error_or_result(lambda: ModelConfig.from_dict(data))
    if cfg is not None:
        assert isinstance(cfg, ModelConfig)
        assert ModelConfig.from_dict(cfg.to_dict()) == cfg


TEXT = st.text(
    alphabet=st.one_of(
        st.characters(codec="utf-8"),  # anything encodable, controls and combining marks included
        st.sampled_from(list("中文字符汉语😀🎉👍🏽\u0301\u0308\u200d\ufeffÖüß")),
    ),
    max_size=60,
)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@FUZZ
@given(text=TEXT, prompt=TEXT)
def test_any_text_round_trips_and_streams_without_splitting_a_character(tok, text, prompt):
    """encode/decode is the identity on any UTF-8 text (byte-level BPE), and the streaming detokenizer's pieces add
    up to the decoded text, none of them holding half a character."""
    ids = tok.encode(text, add_bos=False)
    assert tok.decode(ids) == text
    context = tok.encode(prompt, add_bos=False)
    decoder = IncrementalDecoder(tok, context)
    pieces = [decoder.push(i) for i in ids] + [decoder.finish()]
    assert "".join(pieces) == tok.decode(context + ids)[len(tok.decode(context)) :]
    assert all("\ufffd" not in p for p in pieces[:-1] if "\ufffd" not in text)


@FUZZ
@given(text=st.text(alphabet=st.characters(categories=["Cs"]), min_size=1, max_size=4) | TEXT)
def test_lone_surrogates_are_a_clear_error_or_encoded(tok, text):
    """Python strings may hold lone surrogates, which are not Unicode scalar values and have no UTF-8 form."""
    clear_error_or_result(lambda: tok.encode(text, add_bos=False))


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(docs=st.lists(TEXT, min_size=1, max_size=3))
def test_prepare_takes_any_text_or_says_why_not(docs):
    from llmkit.data.prepare import prepare

    root = Path(tempfile.mkdtemp(prefix="llmkit-fuzz-"))
    try:
        (root / "corpus").mkdir()
        for k, doc in enumerate(docs):
            (root / "corpus" / f"d{k}.txt").write_text(doc, encoding="utf-8")
        meta = clear_error_or_result(lambda: prepare(root / "corpus", root / "out", vocab_size=300, progress=False))
        if meta is not None:
            assert isinstance(meta, dict) and meta["vocab_size"] <= 300
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_header_length_beyond_the_file_is_named(tmp_path):
    """A hand-made case the fuzzer also finds: a safetensors header length of 2^63."""
    ckpt = copy_of(save_llmkit(tiny_model(), tmp_path / "c"))
    raw = bytearray((ckpt / "model.safetensors").read_bytes())
    raw[:8] = struct.pack("<Q", 2**63)
    (ckpt / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(LLMKitError, match="truncated"):
        load_model(ckpt, verify=False)
