import random

from helpers import tiny_tokenizer

from llmkit.tokenizer import IncrementalDecoder, Tokenizer, byte_alphabet


def test_encode_decode_and_special_ids():
    tok = tiny_tokenizer()
    ids = tok.encode("to be or not")
    assert ids[0] == tok.bos_id and tok.decode(ids) == "to be or not"
    assert tok.encode("to be", add_bos=False)[0] != tok.bos_id
    assert tok.decode(tok.encode("ünïcode 中文", add_bos=False)) == "ünïcode 中文"


def test_save_and_load_directory(tmp_path):
    tok = tiny_tokenizer()
    tok.save(tmp_path)
    back = Tokenizer.from_dir(tmp_path)
    assert back is not None
    assert (back.bos_id, back.eos_id, back.add_bos, back.chat_template) == (0, 1, True, "{{ messages }}")
    assert back.encode("that is the question") == tok.encode("that is the question")
    assert Tokenizer.from_dir(tmp_path / "missing") is None


def test_byte_alphabet_is_a_bijection():
    table = byte_alphabet()
    assert len(set(table.values())) == 256 and table[ord("A")] == "A" and table[ord(" ")] == "Ġ"


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    decoder = IncrementalDecoder(tok, prompt or [])
    return [decoder.push(i) for i in ids] + [decoder.finish()]


def test_a_character_split_over_two_tokens_streams_whole():
    tok = tiny_tokenizer()  # byte-level BPE trained on English: 'ü' (bytes C3 BC) is two tokens
    ids = tok.encode("für", add_bos=False)
    assert len(ids) == 4 and tok.decode(ids[:2]) == "f\ufffd"  # decoding token by token would print U+FFFD
    assert _stream(tok, ids) == ["f", "", "ü", "r", ""]
    prompt = tok.encode("to be ü", add_bos=False)
    assert _stream(tok, ids, prompt) == ["f", "", "ü", "r", ""]


def test_streamed_text_is_the_decoded_text():
    tok = tiny_tokenizer()
    rng = random.Random(0)
    for _ in range(200):  # any ids, including special tokens and bytes that never complete a character
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))]
        assert "".join(_stream(tok, ids)) == tok.decode(ids)
        prompt = tok.encode(rng.choice(["to be", "für", "中文 or", "ü"]))
        assert tok.decode(prompt) + "".join(_stream(tok, ids, prompt)) == tok.decode(prompt + ids)
    text = "ünïcode 中文: to be or not"
    pieces = _stream(tok, tok.encode(text))
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
