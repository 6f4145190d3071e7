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


def test_token_bytes_join_to_the_text_with_characters_split_across_tokens():
    tok = tiny_tokenizer()  # byte-level: 'ü' and each CJK character are two or three tokens
    text = "für 中文 ünïcode"
    ids = tok.encode(text, add_bos=False)
    assert any(tok.decode([i]) == "\ufffd" for i in ids)  # a token's text alone cannot show its bytes
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == text
    assert tok.token_bytes(tok.bos_id) == tok.backend.id_to_token(tok.bos_id).encode()  # special: its own text


def test_token_bytes_of_a_sentencepiece_vocabulary_with_byte_fallback():
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    pieces = ["\u2581", "t", "o", "b", "e", "\u2581t", "\u2581to", "\u2581b", "\u2581be"]
    vocab = {"<unk>": 0, **{p: 1 + i for i, p in enumerate(pieces)}}
    vocab |= {f"<0x{b:02X}>": len(vocab) + b for b in range(256)}
    merges = [("\u2581", "t"), ("\u2581t", "o"), ("\u2581", "b"), ("\u2581b", "e")]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = Tokenizer(backend)
    ids = tok.encode("to be ü")
    assert ids[:2] == [vocab["\u2581to"], vocab["\u2581be"]]
    assert [backend.id_to_token(i) for i in ids[2:]] == ["\u2581", "<0xC3>", "<0xBC>"]  # 'ü' falls back to bytes
    assert b"".join(tok.token_bytes(i) for i in ids).decode() == tok.decode(ids) == " to be ü"
