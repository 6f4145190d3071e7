"""Speculative decoding: greedy output is the target's; sampled output has the target's distribution."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmkit import InputError, build_model, get_preset
from llmkit.generate import Sampling, generate
from llmkit.generate.drafters import MTPDraft, MTPDrafter
from llmkit.generate.speculative import speculative_generate
from llmkit.models import DecoderLM
from llmkit.models.cache import whole_sequence
from llmkit.quant.native_step import NativeDecoder

PROMPTS = [[5, 17, 33, 2, 41, 9], [60, 12, 7], [3]]


def tiny(preset: str, seed: int, **changes):
    torch.manual_seed(seed)
    return build_model(dataclasses.replace(get_preset(preset), **changes)).eval()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculation_equals_plain_greedy(k):
    target = tiny("llama2-7b-tiny", 0)
    weak = tiny("llama2-7b-tiny", 1, n_layers=1)
    expected = generate(target, PROMPTS, max_new_tokens=25).new_tokens
    out = speculative_generate(target, PROMPTS, draft=weak, max_new_tokens=25, k=k)
    assert out.new_tokens == expected
    same = speculative_generate(target, PROMPTS, draft=target, max_new_tokens=25, k=k)
    assert same.new_tokens == expected
    assert same.acceptance_rate == 1.0  # a draft equal to the target is always right
    assert same.target_passes == -(-24 // (k + 1))  # the prefill gives the first token, then k + 1 per pass


def test_eos_stops_rows_independently():
    target = tiny("llama2-7b-tiny", 0)
    plain = generate(target, PROMPTS, max_new_tokens=25).new_tokens
    eos = plain[0][3]
    expected = generate(target, PROMPTS, max_new_tokens=25, eos_id=eos).new_tokens
    weak = tiny("llama2-7b-tiny", 1, n_layers=1)
    out = speculative_generate(target, PROMPTS, draft=weak, max_new_tokens=25, k=3, eos_id=eos)
    assert out.new_tokens == expected and out.new_tokens[0][-1] == eos


def test_mtp_self_speculation_equals_plain_greedy():
    model = tiny("deepseek-v3-tiny", 0)
    expected = generate(model, PROMPTS, max_new_tokens=20).new_tokens
    out = speculative_generate(model, PROMPTS, max_new_tokens=20)
    assert out.new_tokens == expected


def test_mtp_drafter_computes_the_training_path():
    # drafting with the MTP module's own cache gives what the training-time MTP forward gives at every position
    model = tiny("deepseek-v3-tiny", 0)
    tokens = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        h = model.run(tokens, whole_sequence(12, None, tokens.device))
        h_norm = model.norm(h)
        emb = model.inputs(model.embed, tokens[:, 1:], torch.arange(1, 12).unsqueeze(0))
        from llmkit.layers.attention import AttentionInputs, AttentionMask

        rope = model.rope(torch.arange(11).unsqueeze(0))
        full = model.mtp[0](h_norm[:, :11], emb, AttentionInputs(AttentionMask(causal=True), rope))  # (2, 11, C)
        drafter = MTPDrafter(MTPDraft(model), 2, 32)
        drafter.run(tokens[:, 1:6], h[:, :5], None)  # positions 0..4
        step = drafter.run(tokens[:, 6:8], h[:, 5:7], None)  # positions 5, 6
    torch.testing.assert_close(step, full[:, 5:7], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("preset", ["deepseek-v3-tiny", "llama2-7b-tiny"])
@pytest.mark.parametrize("k", [2, 4])
def test_chained_mtp_speculation_equals_plain_greedy(preset, k):
    # k > 1: the module drafts from its own output; whatever it drafts, the output is the target's (with the
    # one-token prompt, whose first round has no state to draft from)
    model = tiny(preset, 0, mtp_depth=1)
    expected = generate(model, PROMPTS, max_new_tokens=20).new_tokens
    out = speculative_generate(model, PROMPTS, max_new_tokens=20, k=k)
    assert out.new_tokens == expected
    assert out.drafted >= k * out.target_passes - k * len(PROMPTS)


def test_chained_mtp_drafter_redoes_accepted_positions_from_true_states():
    """After a round that accepted a (per row) of k chained drafts, the drafter's next first step reads the same MTP
    positions as the training-time forward over the accepted text: positions computed from drafted states are
    forgotten, the accepted ones redone from the target's states (carried into the next call)."""
    model = tiny("deepseek-v3-tiny", 0)
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        h = model.run(tokens, whole_sequence(16, None, tokens.device))
        emb = model.inputs(model.embed, tokens[:, 1:], torch.arange(1, 16).unsqueeze(0))
        from llmkit.layers.attention import AttentionInputs, AttentionMask

        rope = model.rope(torch.arange(15).unsqueeze(0))
        full = model.mtp[0](model.norm(h[:, :15]), emb, AttentionInputs(AttentionMask(causal=True), rope))
        drafter = MTPDrafter(MTPDraft(model), 2, 64, k=3)
        seen: list[torch.Tensor] = []
        drafter.head = lambda x: (seen.append(x.clone()), model.logits(x))[1]
        drafter.start(tokens[:, :5], torch.ones(2, 5, dtype=torch.bool), h[:, :5])  # positions 0..3, last h_4
        drafter.propose(tokens[:, 5], Sampling(), None)  # position 4 from (h_4, t_5), then two chained ones
        torch.testing.assert_close(seen[0], full[:, 4], rtol=1e-4, atol=1e-5)
        # row 0 accepted two drafts (t_6, t_7; next cur t_8), row 1 none (next cur t_6)
        drafter.settle(tokens[:, 5], tokens[:, 6:9], torch.tensor([2, 0]), h[:, 5:9])
        seen.clear()
        drafter.propose(torch.stack([tokens[0, 8], tokens[1, 6]]), Sampling(), None)
    torch.testing.assert_close(seen[0][0], full[0, 7], rtol=1e-4, atol=1e-5)  # reads (h_7, t_8) after (h_5..6)
    torch.testing.assert_close(seen[0][1], full[1, 5], rtol=1e-4, atol=1e-5)  # reads (h_5, t_6)
    assert len(seen) == 3


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_mtp_speculation_with_a_native_block_and_a_quantized_draft_head_keeps_the_output(bits):
    """A LLaMA-style model with an MTP module: its block runs as a C++ step where the extension exists, and the
    drafter may read an int8 / int4 copy of the head; the output stays plain greedy decoding's, and the quantized
    head drafts what the float head drafts nearly always."""
    model = tiny("llama2-7b-tiny", 0, mtp_depth=1)
    expected = generate(model, PROMPTS, max_new_tokens=20).new_tokens
    exact = speculative_generate(model, PROMPTS, max_new_tokens=20)
    out = speculative_generate(model, PROMPTS, max_new_tokens=20, draft_head_bits=bits)
    assert out.new_tokens == exact.new_tokens == expected
    assert abs(out.acceptance_rate - exact.acceptance_rate) <= 0.2


def mtp_model_with_native() -> tuple[DecoderLM, NativeDecoder]:
    """A tiny LLaMA with an MTP module, and its C++ step (the test is skipped without llmkit's AVX2 extension)."""
    model = tiny("llama2-7b-tiny", 0, mtp_depth=1)
    native = NativeDecoder.of(model)
    if native is None:
        pytest.skip("needs llmkit's AVX2 extension")
    return model, native


def test_the_mtp_drafters_native_block_equals_its_module():
    model, native = mtp_model_with_native()
    tokens = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        h = model.run(tokens, whole_sequence(9, None, tokens.device))
        fast, slow = MTPDrafter(MTPDraft(model, native), 2, 32), MTPDrafter(MTPDraft(model), 2, 32)
        assert fast.block is not None
        for a, b in [(0, 5), (5, 6), (6, 8)]:  # a prompt, one step, a two-token step
            torch.testing.assert_close(
                fast.run(tokens[:, a + 1 : b + 1], h[:, a:b], None),
                slow.run(tokens[:, a + 1 : b + 1], h[:, a:b], None),
                rtol=1e-4,
                atol=2e-5,
            )


def test_the_mtp_drafters_quantized_block_reads_a_low_bit_copy():
    # draft_head_bits also gives the module's block an int8 / int4 copy in its C++ step: close to the float block's
    # outputs (not equal: the copy is rounded), the module's own weights untouched
    model, native = mtp_model_with_native()
    tokens = torch.randint(0, 256, (2, 9))
    before = {k: v.clone() for k, v in model.mtp[0].state_dict().items()}
    with torch.no_grad():
        h = model.run(tokens, whole_sequence(9, None, tokens.device))
        exact = MTPDrafter(MTPDraft(model, native), 2, 32).run(tokens[:, 1:], h[:, :-1], None)
        for bits, tol in [(8, 0.05), (4, 0.3)]:
            low = MTPDrafter(MTPDraft(model, native, head_bits=bits), 2, 32).run(tokens[:, 1:], h[:, :-1], None)
            assert not torch.equal(low, exact)
            torch.testing.assert_close(low, exact, rtol=0, atol=tol)
    assert all(torch.equal(model.mtp[0].state_dict()[k], v) for k, v in before.items())


def test_an_mtp_draft_makes_its_low_bit_copies_once_for_every_generation_it_serves(monkeypatch):
    """The int4 head and block copies are made with the MTPDraft and reused by each generation given it (quantizing
    SmolLM2's took 13% of a 128-token call); one made after the weights changed copies the new weights, and the
    output stays the target's."""
    import llmkit.quant.linear as formats  # where Int4Linear calls it

    model = tiny("llama2-7b-tiny", 0, mtp_depth=1)
    calls: list[int] = []
    real = formats.quantize_int4
    monkeypatch.setattr(formats, "quantize_int4", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    draft = MTPDraft(model, NativeDecoder.of(model), head_bits=4)
    made = len(calls)
    assert made >= 1
    first = speculative_generate(model, PROMPTS, draft=draft, max_new_tokens=8)
    again = speculative_generate(model, PROMPTS, draft=draft, max_new_tokens=8)
    assert len(calls) == made and again.new_tokens == first.new_tokens  # reused
    assert first.new_tokens == speculative_generate(model, PROMPTS, max_new_tokens=8, draft_head_bits=4).new_tokens
    with torch.no_grad():
        (model.embed.weight if model.head is None else model.head.weight).mul_(1.5)  # the head, in place
    fresh = MTPDraft(model, NativeDecoder.of(model), head_bits=4)
    assert not torch.equal(fresh.head(torch.ones(1, model.cfg.d_model)), draft.head(torch.ones(1, model.cfg.d_model)))
    out = speculative_generate(model, PROMPTS, draft=fresh, max_new_tokens=8)
    assert out.new_tokens == generate(model, PROMPTS, max_new_tokens=8).new_tokens
    with pytest.raises(InputError, match="MTPDraft"):
        speculative_generate(model, PROMPTS, draft=fresh, max_new_tokens=8, draft_head_bits=8)


def test_speculative_sampling_reproduces_the_target_distribution():
    """Chi-square goodness of fit, 7 degrees of freedom, significance 0.001: critical value 24.32."""
    target = tiny("llama2-7b-tiny", 0, vocab_size=8)
    draft = tiny("llama2-7b-tiny", 7, vocab_size=8, n_layers=1)
    prompt = [1, 2, 3]
    n = 4000
    sampled = Sampling(temperature=1.0)
    out = speculative_generate(target, [prompt] * n, draft=draft, max_new_tokens=2, k=3, sampling=sampled, seed=0)
    first = torch.tensor([r[0] for r in out.new_tokens])
    second = torch.tensor([r[1] for r in out.new_tokens])
    with torch.no_grad():
        p1 = target(torch.tensor([prompt]))[0, -1].softmax(-1)
        cont = torch.tensor([[*prompt, t] for t in range(8)])
        p2_given = target(cont)[:, -1].softmax(-1)  # (8, 8): p(t2 | t1)
        p2 = p1 @ p2_given
        q1 = draft(torch.tensor([prompt]))[0, -1].softmax(-1)

    def chi2(samples: torch.Tensor, probs: torch.Tensor) -> float:
        observed = torch.bincount(samples, minlength=8).double()
        expected = probs.double() * len(samples)
        return float(((observed - expected) ** 2 / expected).sum())

    assert chi2(first, p1) < 24.32
    assert chi2(second, p2) < 24.32
    assert chi2(first, q1) > 24.32  # the test can tell the draft's distribution from the target's
    assert 0 < out.acceptance_rate < 1


def test_bad_arguments():
    target = tiny("llama2-7b-tiny", 0)
    with pytest.raises(InputError, match="no draft model given and the target has no MTP module"):
        speculative_generate(target, PROMPTS, max_new_tokens=3)
    with pytest.raises(InputError, match="the draft's vocabulary"):
        speculative_generate(target, PROMPTS, draft=tiny("llama2-7b-tiny", 0, vocab_size=128), max_new_tokens=3)
    with pytest.raises(InputError, match="k=0 must be an int >= 1"):
        speculative_generate(target, PROMPTS, draft=target, max_new_tokens=3, k=0)
    with pytest.raises(InputError, match="draft_head_bits=3"):
        speculative_generate(tiny("llama2-7b-tiny", 0, mtp_depth=1), PROMPTS, max_new_tokens=3, draft_head_bits=3)
