"""Beam search: one beam is greedy; more beams find sequences greedy misses; caches follow the beams."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmkit import InputError, build_model, get_preset
from llmkit.generate import generate
from llmkit.generate.beam import beam_search, beam_search_seq2seq
from llmkit.models import EncoderDecoder


def test_one_beam_is_greedy():
    torch.manual_seed(0)
    model = build_model(get_preset("llama2-7b-tiny")).eval()
    prompts = [[5, 17, 33, 2], [60, 12, 7, 9]]
    greedy = generate(model, prompts, max_new_tokens=12).new_tokens
    assert beam_search(model, prompts, num_beams=1, max_new_tokens=12).sequences == greedy


class MarkovLM(torch.nn.Module):
    """A constructed model whose next-token log-probabilities depend only on the last token (a table), behind the
    same interface as DecoderLM (forward with a cache, new_cache). Greedy takes token 1 (p 0.6) after the start,
    then can only continue with p 0.3 each step; token 2 (p 0.4) leads to a continuation of p 0.9 each step."""

    def __init__(self) -> None:
        super().__init__()
        V = 5
        table = torch.full((V, V), 1e-6)
        table[0, 1], table[0, 2] = 0.6, 0.4  # after the start token 0
        table[1, 3], table[1, 4] = 0.3, 0.3  # after 1: two so-so choices
        table[1, 1] = 0.4 - 2e-6
        table[3, 3], table[4, 4] = 0.3, 0.3
        table[3, 1], table[4, 1] = 0.7 - 1e-6, 0.7 - 1e-6
        table[2, 2] = 0.9  # after 2: a confident continuation
        table[2, 3] = 0.1 - 3e-6
        self.logp = torch.log(table / table.sum(-1, keepdim=True))
        self.cfg = dataclasses.replace(get_preset("llama2-7b-tiny"), vocab_size=V)
        self.embed = torch.nn.Embedding(V, 1)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, batch: int, max_len: int):
        return build_model(self.cfg).new_cache(batch, max_len)

    def run(self, tokens, step, layers=None, extras=None):  # the decode step's entry point: hidden = log-probs
        return self.logp[tokens]

    def norm(self, h):
        return h

    def logits(self, h):
        return h


def test_beam_search_finds_a_higher_scoring_sequence_than_greedy():
    model = MarkovLM()
    greedy, prev = [], 0
    for _ in range(3):
        prev = int(model.logp[prev].argmax())
        greedy.append(prev)
    beam = beam_search(model, [[0]], num_beams=2, max_new_tokens=3, length_penalty=0.0)  # type: ignore[arg-type]

    def logprob(seq: list[int]) -> float:
        prev, total = 0, 0.0
        for t in seq:
            total += float(model.logp[prev, t])
            prev = t
        return total

    assert greedy[0] == 1 and beam.sequences[0][0] == 2
    assert logprob(beam.sequences[0]) > logprob(greedy)
    assert beam.scores[0] == pytest.approx(logprob(beam.sequences[0]), abs=1e-5)


def test_beams_end_at_eos_and_length_penalty_prefers_longer():
    torch.manual_seed(0)
    model = build_model(get_preset("gpt2-tiny")).eval()
    out = beam_search(model, [[1, 2, 3]], num_beams=3, max_new_tokens=8, eos_id=7)
    assert len(out.sequences[0]) <= 8
    assert 7 not in out.sequences[0][:-1]


def test_seq2seq_one_beam_is_greedy_decoding():
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(get_preset("transformer-base-tiny"), dropout=0.0)).eval()
    assert isinstance(model, EncoderDecoder)
    src = torch.randint(3, 256, (2, 7))
    memory = model.encode(src)
    tokens = torch.ones(2, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(6):
            nxt = model.decode(tokens, memory)[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], 1)
    out = beam_search_seq2seq(model, src, start_id=1, num_beams=1, max_new_tokens=6)
    assert out.sequences == tokens[:, 1:].tolist()
    wide = beam_search_seq2seq(model, src, start_id=1, num_beams=4, max_new_tokens=6, length_penalty=0.0)
    assert [len(s) for s in wide.sequences] == [6, 6]
    with torch.no_grad():  # the reported score is the sequence's log-probability under the model
        for b, seq in enumerate(wide.sequences):
            target = torch.tensor([[1, *seq]])
            logp = model.decode(target[:, :-1], memory[b : b + 1]).log_softmax(-1)[0]
            total = float(logp.gather(-1, target[0, 1:].unsqueeze(-1)).sum())
            assert wide.scores[b] == pytest.approx(total, abs=1e-4)


def test_bad_arguments():
    model = build_model(get_preset("llama2-7b-tiny"))
    with pytest.raises(InputError, match="num_beams=0 must be an int >= 1"):
        beam_search(model, [[1]], num_beams=0)
