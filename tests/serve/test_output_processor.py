"""The output processor alone, without a model: logits in, tokens, stops, verdicts on drafts and deltas out."""

from __future__ import annotations

import math

import torch
from helpers import tiny_tokenizer

from llmkit.serve.config import EngineStats
from llmkit.serve.output_processor import OutputProcessor
from llmkit.serve.request import FinishReason, Request, SamplingParams, Sequence, Status
from llmkit.serve.runner_base import RunnerOutput
from llmkit.serve.scheduler import Work
from llmkit.serve.speculation import Drafts, NoDrafts
from llmkit.serve.text import TextOutput
from llmkit.tokenizer import IncrementalDecoder

V = 16
EOS = 1


class Kept:
    """A drafter's bookkeeping of verdicts (what the processor reports to it)."""

    drafted = accepted = 0

    def record(self, drafted: int, accepted: int, seq: object = None) -> None:
        self.drafted += drafted
        self.accepted += accepted


def _processor(drafter=None, max_len: int = 64):
    finished: dict[str, FinishReason] = {}

    def finish(seq: Sequence, reason: FinishReason) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        finished[seq.request.id] = reason

    stats = EngineStats()
    return OutputProcessor(drafter or NoDrafts(), {EOS}, max_len, stats, finish), finished, stats


def _seq(name: str, prompt: list[int], params: SamplingParams, text: TextOutput | None = None) -> Sequence:
    request = Request(name, prompt, params, 0.0)
    seq = Sequence(request, 0, list(prompt), output=text or TextOutput(None, params.stop))
    seq.status, seq.computed = Status.RUNNING, len(prompt) - 1
    return seq


def _peaked(*tokens: int) -> torch.Tensor:
    """Logits (len(tokens), V) whose argmax in row i is tokens[i]."""
    x = torch.zeros(len(tokens), V)
    for i, t in enumerate(tokens):
        x[i, t] = 5.0
    return x


def test_greedy_tokens_the_end_of_sequence_the_length_limit_and_bad_logits():
    processor, finished, stats = _processor()
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    seqs = [_seq(n, [3, 4], greedy) for n in ("goes-on", "eos", "nan")]
    rows = [Work(s, 1, 1) for s in seqs]
    logits = _peaked(7, EOS, 2)
    logits[2, 5] = math.nan
    out = processor.process(rows, RunnerOutput(logits=dict(enumerate(logits))), {})
    assert [d.token_ids for d in out.deltas] == [[], [7], [EOS]]  # the ended row's delta first
    assert finished == {"eos": "stop", "nan": "error"} and stats.failed == 1
    assert seqs[0].tokens == [3, 4, 7] and seqs[1].tokens == [3, 4, EOS]
    lp = torch.log_softmax(logits[0], -1)[7].item()
    assert out.deltas[1].logprobs == [lp] and out.deltas[1].finish_reason is None
    seqs[0].computed = 2
    out = processor.process([Work(seqs[0], 2, 1)], RunnerOutput(logits={0: _peaked(9)[0]}), {})
    assert out.deltas[0].token_ids == [9] and finished["goes-on"] == "length"


def test_a_stop_string_ends_the_sequence_and_is_withheld_from_the_text():
    tok = tiny_tokenizer()
    processor, finished, _ = _processor()
    prompt = tok.encode("to be", add_bos=False)
    params = SamplingParams(max_tokens=20, temperature=0.0, stop=("not",))
    seq = _seq("r", prompt, params, TextOutput(IncrementalDecoder(tok, prompt), params.stop))
    text = ""
    for token in tok.encode(" or not to be", add_bos=False):
        x = torch.zeros(tok.vocab_size)
        x[token] = 5.0
        [delta] = processor.process([Work(seq, len(seq.tokens) - 1, 1)], RunnerOutput(logits={0: x}), {}).deltas
        text += delta.text
        if delta.finish_reason is not None:
            break
    assert finished == {"r": "stop"} and text == " or "


def test_drafts_are_judged_and_the_kept_ones_are_computed():
    """Greedy verification: the drafts are kept while they are the target's argmax, then the target's token; the
    processor reports the verdict to the drafter and the slots now computed to the engine."""
    drafter = Kept()
    processor, finished, _ = _processor(drafter)
    seq = _seq("r", [3, 4, 5], SamplingParams(max_tokens=10, temperature=0.0))
    verified = _peaked(8, 9, 11)  # after the row's token: 8 (= d1), then 9 (d2 was 10: rejected), then 11
    drafts = Drafts(torch.tensor([8, 10]), None)
    out = processor.process([Work(seq, 2, 1)], RunnerOutput(verified={0: verified}), {0: drafts})
    [delta] = out.deltas
    assert delta.token_ids == [8, 9] and seq.tokens == [3, 4, 5, 8, 9] and not finished
    assert out.computed == [(seq, 2 + 1 + 1)]  # its token and the one kept draft
    assert (drafter.drafted, drafter.accepted) == (2, 1)
    lps = torch.log_softmax(verified, -1)
    assert delta.logprobs == [lps[0, 8].item(), lps[1, 9].item()]


def test_a_row_that_failed_in_the_runner_gets_no_token():
    processor, finished, _ = _processor()
    seq = _seq("r", [3, 4], SamplingParams(max_tokens=4, temperature=0.0))
    out = processor.process([Work(seq, 1, 1)], RunnerOutput(), {})
    assert out.deltas == [] and seq.tokens == [3, 4] and not finished
