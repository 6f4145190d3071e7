import dataclasses
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from llmkit import InputError, build_model, get_preset
from llmkit.config.presets import PRESETS
from llmkit.models import DecoderLM, shift_right

DECODERS = [n for n in PRESETS if n.endswith("-tiny") and PRESETS[n].config.encoder is None]


def model_for(name: str) -> DecoderLM:
    cfg = get_preset(name)
    if cfg.moe is not None:  # route every token: capacity limits would couple tokens across the batch
        cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=None))
    m = build_model(cfg)
    assert isinstance(m, DecoderLM)
    return m.eval()


@pytest.mark.parametrize("name", DECODERS)
def test_logits_at_t_do_not_depend_on_later_tokens(name):
    m = model_for(name)
    x = torch.randint(0, 256, (2, 20))
    y = x.clone()
    y[:, 12:] = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(m(x)[:, :12], m(y)[:, :12])


@pytest.mark.parametrize("name", DECODERS)
def test_cached_decoding_equals_full_forward_with_left_padded_prompts(name):
    m = model_for(name)
    lengths = [7, 4]
    T, gen = 7, 9
    prompts = torch.randint(0, 256, (2, T))
    valid = torch.zeros(2, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        valid[b, T - n :] = True  # left padding
    cont = torch.randint(0, 256, (2, gen))
    with torch.no_grad():
        cache = m.new_cache(2, T + gen)
        steps = [m(prompts, padding_mask=valid, cache=cache)[:, -1:]]
        for t in range(gen - 1):
            steps.append(m(cont[:, t : t + 1], cache=cache))
        cached = torch.cat(steps, 1)  # (2, gen, V): predictions after the prompt and after each new token
        for b, n in enumerate(lengths):
            seq = torch.cat([prompts[b : b + 1, T - n :], cont[b : b + 1, : gen - 1]], 1)
            full = m(seq)[:, n - 1 :]
            torch.testing.assert_close(cached[b : b + 1], full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["llama2-7b-tiny", "gpt2-tiny", "deepseek-v3-tiny"])
def test_left_padding_does_not_change_real_positions(name):
    m = model_for(name)
    seq = torch.randint(0, 256, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), seq], 1)
    valid = torch.tensor([[False] * 3 + [True] * 6])
    with torch.no_grad():
        torch.testing.assert_close(m(padded, padding_mask=valid)[:, 3:], m(seq), rtol=1e-5, atol=1e-5)


def test_loss_is_teacher_forcing_with_a_start_token():
    m = model_for("llama2-7b-tiny")
    targets = torch.randint(2, 256, (2, 10))
    inputs = shift_right(targets, 1)
    assert inputs[:, 0].tolist() == [1, 1] and torch.equal(inputs[:, 1:], targets[:, :-1])
    out = m.loss(targets, start_id=1)
    ref = F.cross_entropy(m(inputs).flatten(0, 1), targets.flatten())
    torch.testing.assert_close(out.ce, ref)
    torch.testing.assert_close(m.loss(targets, inputs=inputs).ce, ref)
    assert out.n_tokens == 20


def test_padded_targets_do_not_count():
    m = model_for("llama2-7b-tiny")
    targets = torch.randint(2, 256, (2, 10))
    valid = torch.ones(2, 10, dtype=torch.bool)
    valid[0, 6:] = False  # right padding
    out = m.loss(targets, start_id=1, padding_mask=valid)
    alone = m.loss(targets[:1, :6], start_id=1)
    second = m.loss(targets[1:], start_id=1)
    torch.testing.assert_close(out.ce, (alone.ce * 6 + second.ce * 10) / 16)
    assert out.n_tokens == 16


def test_left_padded_targets_give_the_unpadded_loss():
    m = model_for("deepseek-v3-tiny")  # includes the MTP loss, which must skip predictions made at pads
    targets = torch.randint(2, 256, (1, 8))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), targets], 1)
    valid = torch.tensor([[False] * 3 + [True] * 8])
    with torch.no_grad():
        a = m.loss(targets, start_id=1)
        b = m.loss(padded, start_id=1, padding_mask=valid)
    torch.testing.assert_close(b.ce, a.ce, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.mtp, a.mtp, rtol=1e-5, atol=1e-5)
    assert a.n_tokens == b.n_tokens == 8


def test_integer_padding_masks_are_accepted():
    m = model_for("llama2-7b-tiny")
    tokens = torch.randint(0, 256, (1, 4))
    torch.testing.assert_close(m(tokens, padding_mask=torch.ones(1, 4, dtype=torch.long)), m(tokens))


def test_explicit_inputs_with_ignored_targets():
    m = model_for("llama2-7b-tiny")
    inputs = torch.randint(0, 256, (1, 6))
    targets = torch.cat([torch.full((1, 3), -100), torch.randint(0, 256, (1, 3))], 1)  # e.g. a prompt not to learn
    out = m.loss(targets, inputs=inputs)
    ref = F.cross_entropy(m(inputs)[0, 3:], targets[0, 3:])
    torch.testing.assert_close(out.ce, ref)
    assert out.n_tokens == 3


def test_repeated_training_steps_with_moe_and_mtp():
    m = model_for("deepseek-v3-tiny").train()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    for _ in range(3):  # stale MoE statistics from an earlier step would break the second backward
        opt.zero_grad()
        out = m.loss(torch.randint(0, 256, (2, 10)), start_id=1)
        out.total.backward()
        opt.step()
    assert torch.isfinite(out.total)


def test_moe_losses_and_mtp_enter_the_total():
    m = model_for("deepseek-v3-tiny").train()
    out = m.loss(torch.randint(0, 256, (2, 12)), start_id=1, mtp_weight=0.5)
    assert out.mtp > 0 and out.aux > 0
    torch.testing.assert_close(out.total, out.ce + out.aux + 0.5 * out.mtp)


def test_mtp_prediction_at_depth_k_sees_tokens_up_to_i_plus_k_only():
    m = model_for("deepseek-v3-tiny")
    captured = {}
    handle = m.mtp[0].register_forward_hook(lambda mod, args, out: captured.__setitem__("h", out))
    targets = torch.randint(0, 256, (1, 12))
    changed = targets.clone()
    changed[0, 8] = (changed[0, 8] + 1) % 256  # inputs[9] changes
    with torch.no_grad():
        m.loss(targets, start_id=1)
        h1 = captured["h"]
        m.loss(changed, start_id=1)
        h2 = captured["h"]
    handle.remove()
    # depth 1 at position i uses the embedding of inputs[i + 1]: positions i <= 7 are unaffected by inputs[9]
    assert h1.shape == (1, 11, 64)
    torch.testing.assert_close(h1[:, :8], h2[:, :8])
    assert not torch.allclose(h1[:, 8], h2[:, 8])


def test_tied_head_shares_the_embedding_and_bf16_runs():
    m = build_model(get_preset("gpt2-tiny"), dtype=torch.bfloat16)
    assert isinstance(m, DecoderLM) and m.head is None
    out = m(torch.randint(0, 256, (1, 5)))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda m: m(torch.tensor([[1, 300]])), "tokens contains id 300, outside the vocabulary [0, 256)"),
        (lambda m: m(torch.tensor([[1, -2]])), "tokens contains id -2"),
        (lambda m: m(torch.tensor([1, 2])), "tokens must have shape (batch, seq_len), got (2,)"),
        (
            lambda m: m(torch.tensor([[1.0, 2.0]])),
            "tokens must hold integer token ids, got dtype torch.float32",
        ),
        (lambda m: m([[1, 2]]), "tokens must be a torch.Tensor"),
        (lambda m: m(torch.zeros(1, 0, dtype=torch.long)), "tokens is empty"),
        (
            lambda m: m(torch.tensor([[1, 2]]), padding_mask=torch.ones(1, 3)),
            "padding_mask must be a (batch, seq_len)",
        ),
        (
            lambda m: m(torch.zeros(1, 300, dtype=torch.long)),
            "position 299 is beyond the model's context: position.max_seq_len=256",
        ),
        (lambda m: m(torch.tensor([[1]]), positions=torch.tensor([[1, 2, 3]])), "positions must have shape"),
        (
            lambda m: m(torch.zeros(1, 5, dtype=torch.long), cache=m.new_cache(1, 4)),
            "the cache holds max_len=4 tokens",
        ),
        (
            lambda m: m(torch.zeros(2, 5, dtype=torch.long), cache=m.new_cache(1, 8)),
            "the cache was made for batch 1",
        ),
        (lambda m: m.loss(torch.tensor([[1, 2]]), start_id=999), "start_id=999 is outside the vocabulary"),
        (lambda m: m.loss(torch.tensor([[1, 2]])), "give exactly one of start_id"),
        (lambda m: m.new_cache(0, 4), "new_cache needs batch to be an int >= 1, got 0"),
        (lambda m: m.new_cache(1, 4.0), "new_cache needs max_len to be an int >= 1, got 4.0"),
        (lambda m: m.new_cache(1, 4, dtype=torch.bfloat16), "cache dtype torch.bfloat16 differs from the model's"),
        (lambda m: m(torch.tensor([[1, 2]]), positions=torch.tensor([-1, 0])), "positions must be >= 0, got -1"),
        (lambda m: m(torch.tensor([[1, 2]]), positions=torch.tensor([0.0, 1.0])), "positions must be integers"),
        (lambda m: m(torch.tensor([[1, 2]]), padding_mask=torch.ones(1, 2)), "must be bool (True = real token) or 0/1"),
        (lambda m: m(torch.tensor([[1, 2]]), padding_mask=torch.tensor([[1, 2]])), "must hold only 0 and 1"),
        (lambda m: m.loss(torch.tensor([[1, -100]]), start_id=1), "targets contain ignore_index=-100"),
        (lambda m: m.loss(torch.tensor([[1, 2]]), start_id=1, label_smoothing=1.5), "label_smoothing=1.5 must be"),
    ],
)
def test_bad_inputs_raise_clear_errors(call, fragment):
    m = model_for("llama2-7b-tiny")
    with pytest.raises(InputError) as e:
        call(m)
    assert fragment in str(e.value)


def test_a_model_built_on_the_meta_device_fills_nothing_and_imports_no_compiler():
    """A model to be loaded is built on the meta device; nn.Embedding's own fill of its table there ran through
    torch._refs, which imports torch._dynamo: 1.4 s of every checkpoint load (layers.tables.token_table)."""
    code = (
        "import sys\n"
        "from llmkit import build_model, get_preset\n"
        "from llmkit.config.presets import PRESETS\n"
        "for name in [n for n in PRESETS if n.endswith('-tiny')]:\n"
        "    model = build_model(get_preset(name), device='meta')\n"
        "    assert model.embed.weight.is_meta\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
