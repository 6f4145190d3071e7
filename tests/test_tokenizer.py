from helpers import tiny_tokenizer

from llmkit.tokenizer import Tokenizer, byte_alphabet


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
