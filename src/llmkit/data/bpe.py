"""Training a byte-level BPE tokenizer (GPT-2's scheme, Radford et al. 2019): the 256 bytes are the base alphabet, so
there are no unknown tokens and any UTF-8 text round-trips.

Language-model data and sentence pairs use the same trainer and differ only in their special tokens (one
end-of-text token, or <pad> <s> </s>) and in whether a leading space is added to the first word.
"""

from __future__ import annotations

from llmkit.errors import InputError
from llmkit.tokenizer import Tokenizer

# The largest vocabulary trained here: above published tokenizers' (Gemma's 256k), and the BPE trainer's memory grows
# with it (a vocabulary of 10^9 aborts inside the tokenizers library for want of memory).
MAX_VOCAB = 1 << 20


def check_vocab_size(vocab_size: object, n_special: int) -> None:
    """An InputError with the valid range unless a byte-level BPE vocabulary of `vocab_size` (with n_special special
    tokens) can be trained here: called before any work, and again by train_bpe."""
    least = 256 + n_special
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not least <= vocab_size <= MAX_VOCAB:
        raise InputError(
            f"vocab_size={vocab_size!r} is out of range: byte-level BPE here takes {least} to {MAX_VOCAB:,} "
            f"(256 bytes and {n_special} special token(s) at least)"
        )


def train_bpe(
    texts: list[str],
    vocab_size: int,
    *,
    bos: str,
    eos: str,
    pad: str | None = None,
    add_prefix_space: bool = False,
) -> Tokenizer:
    """A byte-level BPE tokenizer with `vocab_size` entries, trained on `texts`.

    The special tokens take the first ids in the order pad, bos, eos; a token named twice (bos == eos, as GPT-2's
    <|endoftext|>) gets one id. With `add_prefix_space` every word, the first included, is encoded with its leading
    space, so a word has one spelling wherever it stands in a sentence.
    """
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    specials = list(dict.fromkeys(t for t in (pad, bos, eos) if t is not None))
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    check_vocab_size(vocab_size, len(specials))
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(
        backend,
        bos_id=backend.token_to_id(bos),
        eos_id=backend.token_to_id(eos),
        pad_id=backend.token_to_id(pad) if pad is not None else None,
    )
