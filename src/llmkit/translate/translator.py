"""A translation model with its tokenizers and decoding settings: text in, text out.

    Translator.load(path)       a training run folder (its averaged checkpoint if any, else the latest), an llmkit
                                checkpoint, or a Hugging Face Marian directory
    .translate(texts)           greedy (beams=1) or beam search with a length penalty, in length-sorted batches
    .attention(text)            the cross-attention weights of one sentence, source words against target words

Decoding follows the checkpoint's generation settings: the decoder starts from `decoder_start_token_id` (<s> for
llmkit's translation models, the padding token for Marian), stops at `eos_token_id`, never emits the tokens of
`bad_words_ids` (padding), and every source sentence ends with the end token, as in training.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from llmkit.errors import InputError, LLMKitError
from llmkit.generate.beam import search
from llmkit.generate.decode import run_session
from llmkit.generate.prompts import pad
from llmkit.generate.sessions import Seq2SeqSession
from llmkit.generate.stops import StopRule, eos_ids
from llmkit.layers.extras import Extras
from llmkit.models import EncoderDecoder, RNNSeq2Seq
from llmkit.runs import resolve_checkpoint


class TextCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def piece(self, token_id: int) -> str: ...


class _Fast:
    """llmkit's Tokenizer (HF tokenizers) as a codec."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_bos=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids))).strip()

    def piece(self, token_id: int) -> str:
        return str(self.tok.backend.id_to_token(token_id))


class _Transformers:
    """A transformers tokenizer (e.g. MarianTokenizer with its SentencePiece models) as a codec."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=True)).strip()

    def piece(self, token_id: int) -> str:
        return str(self.tok.convert_ids_to_tokens(token_id))


@dataclass
class Translation:
    text: str
    tokens: list[int]  # generated target tokens, without the end token


@dataclass
class AttentionMap:
    source: list[str]  # source words (the end token last)
    target: list[str]  # target words (the end token last)
    weights: Tensor  # (target words, source words): attention mass, rows sum to 1


class Translator:
    def __init__(
        self,
        model: EncoderDecoder | RNNSeq2Seq,
        source: TextCodec,
        target: TextCodec,
        *,
        start_id: int,
        eos_id: int,
        suppress_ids: Sequence[int] = (),
    ) -> None:
        self.model = model.eval()
        self.source, self.target = source, target
        self.start_id, self.eos_id = start_id, eos_id
        self.suppress_ids = tuple(i for i in suppress_ids if i != eos_id)

    @property
    def max_len(self) -> int:
        return self.model.max_seq_len

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> Translator:
        from llmkit.interop.load import load_model

        ckpt = resolve_checkpoint(path)
        loaded = load_model(ckpt, dtype=dtype, device=device)
        if not isinstance(loaded.model, (EncoderDecoder, RNNSeq2Seq)):
            raise LLMKitError(f"{ckpt} is a decoder-only language model, not a translation (encoder-decoder) model")
        target: TextCodec | None = _Fast(loaded.tokenizer) if loaded.tokenizer is not None else None
        source: TextCodec | None = _Fast(loaded.source_tokenizer) if loaded.source_tokenizer is not None else target
        if target is None and loaded.source == "hf":
            source, target = _marian_tokenizers(Path(ckpt))
        if target is None or source is None:
            raise LLMKitError(f"{ckpt} has no tokenizer (tokenizer.json) to read and write text with")
        gen, hf = loaded.generation_config or {}, loaded.hf_config or {}

        def setting(key: str) -> Any:
            return gen.get(key, hf.get(key))

        pad = setting("pad_token_id")
        eos = setting("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
        start = setting("decoder_start_token_id")
        if start is None or eos is None:
            raise LLMKitError(
                f"{ckpt} does not say which token starts and ends a translation (decoder_start_token_id, eos_token_id)"
            )
        banned = [w[0] for w in setting("bad_words_ids") or [] if isinstance(w, list) and len(w) == 1]
        if pad is not None and pad not in banned:
            banned.append(pad)
        return cls(loaded.model, source, target, start_id=int(start), eos_id=int(eos), suppress_ids=banned)

    # ---- translating

    def encode_source(self, text: str, index: int = 0) -> list[int]:
        if not isinstance(text, str) or not text.strip():
            raise InputError(f"sentence {index + 1} is empty: give some text to translate")
        ids = self.source.encode(" ".join(text.split()))
        limit = self.max_len - 1
        if len(ids) > limit:
            print(
                f"llmkit translate: sentence {index + 1} has {len(ids)} tokens; the model reads at most {limit}: "
                "the rest is cut",
                file=sys.stderr,
            )
            ids = ids[:limit]
        return [*ids, self.eos_id]

    @torch.no_grad()
    def translate(
        self,
        texts: Sequence[str],
        *,
        beams: int = 4,
        length_penalty: float = 0.6,
        batch_size: int = 32,
        max_ratio: float = 1.5,
        max_extra: int = 10,
        progress: bool = False,
    ) -> list[Translation]:
        """Translate sentences, in batches of similar lengths; output in input order. At most
        max_ratio * source tokens + max_extra target tokens each (within the model's length)."""
        from tqdm import tqdm

        if isinstance(texts, str):
            raise InputError("translate expects a list of sentences; wrap one sentence in a list")
        encoded = [self.encode_source(t, i) for i, t in enumerate(texts)]
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
        results: list[Translation | None] = [None] * len(encoded)
        bar = tqdm(total=len(encoded), unit="sentence", disable=not progress, desc="translate")
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            source, mask = pad([encoded[i] for i in rows], "right", device=self.device)
            budget = max(1, min(int(max_ratio * source.shape[1]) + max_extra, self.max_len - 1))
            outs = self._decode(source, mask, budget, beams, length_penalty)
            for i, out in zip(rows, outs, strict=True):
                tokens = out[:-1] if out and out[-1] == self.eos_id else out
                results[i] = Translation(self.target.decode(tokens), tokens)
            bar.update(len(rows))
        bar.close()
        return [r for r in results if r is not None]

    def _decode(self, source: Tensor, mask: Tensor, budget: int, beams: int, length_penalty: float) -> list[list[int]]:
        """Greedy decoding for one beam, beam search for more, over one session; each row up to its end token."""
        session = Seq2SeqSession(self.model, source, mask, self.start_id, budget, self.suppress_ids, copies=beams)
        if beams == 1:
            return run_session(session, budget, StopRule.of(self.eos_id))
        return search(session, source.shape[0], beams, budget, length_penalty, eos_ids(self.eos_id)).sequences

    # ---- attention

    @torch.no_grad()
    def attention(self, text: str, translation: Sequence[int] | None = None, *, beams: int = 4) -> AttentionMap:
        """Cross-attention of the last decoder layer (mean over heads) while the model reads its own translation
        of `text` (or the given target tokens), grouped into words: a source word's weight is the sum over its
        pieces, a target word's row the mean over its pieces."""
        src = self.encode_source(text)
        tgt = list(translation) if translation is not None else self.translate([text], beams=beams)[0].tokens
        tgt = [*tgt, self.eos_id]
        source = torch.tensor([src], device=self.device)
        inputs = torch.tensor([[self.start_id, *tgt[:-1]]], device=self.device)
        extras = Extras(attention_weights=True)
        self.model(source, inputs, extras=extras)
        last = extras.cross_attention[-1][0].float()  # (H, T, S) for a Transformer layer, (T, S) for the RNN
        weights = last.mean(0) if last.dim() == 3 else last  # mean over heads -> (T, S)
        src_words, src_groups = _words(self.source, src, self.eos_id)
        tgt_words, tgt_groups = _words(self.target, tgt, self.eos_id)
        cols = torch.stack([weights[:, g].sum(1) for g in src_groups], dim=1)  # (T, source words)
        rows = torch.stack([cols[g].mean(0) for g in tgt_groups], dim=0)  # (target words, source words)
        return AttentionMap(src_words, tgt_words, rows.cpu())


def _words(codec: TextCodec, ids: list[int], eos_id: int) -> tuple[list[str], list[list[int]]]:
    """Group token positions into words: a piece starting with a space marker ('Ġ' byte-level, '▁' SentencePiece)
    starts a word; the end token is a word of its own."""
    groups: list[list[int]] = []
    for pos, token in enumerate(ids):
        piece = codec.piece(token)
        if token == eos_id or not groups or piece.startswith(("Ġ", "▁")) or ids[groups[-1][0]] == eos_id:
            groups.append([pos])
        else:
            groups[-1].append(pos)
    words = ["</s>" if ids[g[0]] == eos_id else codec.decode([ids[p] for p in g]) for g in groups]
    return words, groups


def _marian_tokenizers(path: Path) -> tuple[TextCodec, TextCodec]:
    """A Marian directory without tokenizer.json: its SentencePiece models through transformers' MarianTokenizer."""
    if not (path / "source.spm").is_file():
        raise LLMKitError(f"{path} has no tokenizer (tokenizer.json, or Marian's source.spm / target.spm)")
    try:
        from transformers import MarianTokenizer

        tok = MarianTokenizer.from_pretrained(str(path))
    except ImportError as e:
        raise LLMKitError(
            f"reading {path}'s SentencePiece tokenizer needs transformers and sentencepiece ({e})"
        ) from None
    target = _TargetSide(tok)
    return _Transformers(tok), target


class _TargetSide(_Transformers):
    """MarianTokenizer's target-language side (its second SentencePiece model)."""

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text_target=text, add_special_tokens=False)["input_ids"])
