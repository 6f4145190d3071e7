"""Generation commands: `generate` continues a prompt, `chat` answers through the model's chat template.

`generate` decodes in one of four modes, chosen by its option groups and checked once (`_mode`):

    sample      plain decoding: greedy at --temperature 0, else sampling (the default)
    stream      the same, each sample printed while it is generated (--stream)
    beam        beam search (--beams N, N > 1)
    speculate   speculative decoding with a draft model (--draft) or the model's MTP module (--mtp)
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal

from llmkit.cli.common import DType, invariance, load_decoder, print_streamed
from llmkit.errors import LLMKitError

if TYPE_CHECKING:
    from llmkit.generate import DecodeStep, Sampling
    from llmkit.models import DecoderLM
    from llmkit.parallel import launch
    from llmkit.tokenizer import Tokenizer


@dataclass(frozen=True)
class SamplingOptions:
    """How each next token is chosen in plain decoding (speculative decoding reads --temperature, --top-k, --top-p
    and --seed).

    temperature: 0 for greedy decoding; higher is more random.
    top_k: sample among the k most likely tokens (0 for no limit).
    top_p: sample among the most likely tokens whose probabilities add up to p.
    min_p: sample among tokens at least min_p times as likely as the most likely one.
    repetition_penalty: above 1 discourages tokens already in the text.
    seed: makes sampling repeatable.
    """

    temperature: float = 0.8
    top_k: int | None = 50
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None

    def rule(self) -> Sampling:
        """The sampling rule these flags describe (--top-k 0: no limit)."""
        from llmkit.generate import Sampling

        return Sampling(self.temperature, self.top_k or None, self.top_p, self.min_p, self.repetition_penalty)


@dataclass(frozen=True)
class OutputOptions:
    """How plain decoding hands out its text (not with --beams, --draft or --mtp).

    stop: stop a continuation at this text (repeatable; \\n and \\t are read as newline and tab).
    stream: print tokens as they are generated.
    """

    stop: list[str] | None = None
    stream: bool = False

    @property
    def stop_strings(self) -> list[str]:
        return [_unescape(s) for s in self.stop or ()]


@dataclass(frozen=True)
class BeamOptions:
    """The most likely continuations among the best N kept at every step: deterministic, no sampling options.

    beams: beam search with this many beams (1: no beam search).
    length_penalty: length ** penalty divides a hypothesis' log-probability.
    """

    beams: int = 1
    length_penalty: float = 1.0


@dataclass(frozen=True)
class SpeculationOptions:
    """A drafter proposes tokens and the model checks them in one pass: its own distribution, in fewer passes.

    draft: draft with this smaller model (same tokenizer).
    mtp: draft with the model's own multi-token-prediction module.
    speculate: tokens drafted per round (default 4 with --draft; 1 with --mtp, whose module drafts more in a chain
        when it was trained for it: llmkit graft-mtp).
    draft_head_bits: with --mtp, draft from an int8 (8) or int4 (4) copy of the output head (and of the module's
        block): cheaper drafts, the same output (the model checks every draft with its own weights).
    draft_dtype: the draft's precision (default: the model's --dtype); "file" keeps the draft checkpoint's own, so a
        GGUF file stays quantized: `--dtype fp32 --draft FILE.gguf --draft-dtype file` drafts with the file's int4
        weights for its fp32 model, the fp32 output exactly (BENCHMARKS.md: what it gains depends on how fast the
        file's block type decodes).
    """

    draft: str | None = None
    mtp: bool = False
    speculate: int | None = None
    draft_head_bits: int | None = None
    draft_dtype: Literal["fp32", "bf16", "fp16", "file"] | None = None


Mode = Literal["sample", "stream", "beam", "speculate"]

# The ranges of the counts a command line gives, checked before the model loads. Beyond them a run would only
# exhaust memory (samples and beams are batch rows, each with its own cache) or draft for nothing.
SAMPLES = (1, 1024)
BEAMS = (1, 256)
SPECULATE = (1, 16)
# what torch.Generator.manual_seed takes (a 64-bit integer), with room for seed + i, the seed of sample or turn i
SEEDS = (-(2**63), 2**63 - 1 - 2**20)


def check_range(name: str, value: int, bounds: tuple[int, int], what: str) -> None:
    """An LLMKitError naming the option and its valid range unless bounds[0] <= value <= bounds[1]."""
    lo, hi = bounds
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise LLMKitError(f"{name} {value!r} is out of range: {what} must be between {lo} and {hi}")


def _check_counts(samples: int, max_new_tokens: int, beam: BeamOptions, speculation: SpeculationOptions) -> None:
    check_range("--samples", samples, SAMPLES, "the number of continuations")
    check_range("--beams", beam.beams, BEAMS, "the number of beams (1: no beam search)")
    if speculation.speculate is not None:
        check_range("--speculate", speculation.speculate, SPECULATE, "the tokens drafted per round")
    if max_new_tokens < 1:
        raise LLMKitError(f"--max-new-tokens {max_new_tokens} is out of range: it must be at least 1")
    if speculation.draft_head_bits not in (None, 4, 8):
        raise LLMKitError(f"--draft-head-bits {speculation.draft_head_bits} is out of range: it must be 4 or 8")


def _check_seed(seed: int | None) -> None:
    if seed is not None:
        check_range("--seed", seed, SEEDS, "the seed (a 64-bit integer)")


def _check_stops(output: OutputOptions) -> None:
    """An empty stop text would end every continuation before its first token (the server refuses it too)."""
    if any(not s for s in output.stop_strings):
        raise LLMKitError("--stop '' is empty: a stop text must hold at least one character")


def _mode(output: OutputOptions, beam: BeamOptions, speculation: SpeculationOptions) -> Mode:
    """The decoding mode the options choose, or an error that names the options that contradict each other."""
    beam_search, speculate = beam.beams > 1, speculation.draft is not None or speculation.mtp
    if beam_search and speculate:
        raise LLMKitError("--beams cannot be combined with --draft or --mtp: choose beam search or speculation")
    if speculation.draft is not None and speculation.mtp:
        raise LLMKitError("--draft and --mtp both choose the drafter: give one of them")
    if speculation.draft_dtype is not None and speculation.draft is None:
        raise LLMKitError("--draft-dtype is the precision of a --draft model: give --draft too")
    if (beam_search or speculate) and (output.stream or output.stop):
        raise LLMKitError("--stream and --stop apply to plain decoding, not to --beams, --draft or --mtp")
    if beam_search:
        return "beam"
    if speculate:
        return "speculate"
    return "stream" if output.stream else "sample"


@dataclass(frozen=True)
class _Request:
    """What every mode decodes: `samples` continuations of the prompt `ids`, the model's steps run by `step` (its
    decoding backend, chosen once: compiled with --compile, else the C++ step where the model allows it)."""

    model: DecoderLM
    tok: Tokenizer
    ids: list[int]
    eos: int | None
    samples: int
    max_new_tokens: int
    step: DecodeStep

    def print_samples(self, rows: Iterable[Sequence[int]]) -> None:
        for i, row in enumerate(rows):
            self.print_header(i)
            print(self.tok.decode(self.ids + list(row)))

    def print_header(self, i: int) -> None:
        if self.samples > 1:
            print(f"--- sample {i + 1}")


def generate(
    checkpoint: str,
    *,
    prompt: str = "",
    max_new_tokens: int = 200,
    samples: int = 1,
    sampling: SamplingOptions = SamplingOptions(),
    output: OutputOptions = OutputOptions(),
    beam_search: BeamOptions = BeamOptions(),
    speculation: SpeculationOptions = SpeculationOptions(),
    compile: bool = False,
    batch_invariant: bool = False,
    no_batch_invariant: bool = False,
    dtype: DType | None = None,
    device: str | None = None,
    no_verify: bool = False,
    tp: int = 1,
) -> int:
    """Generate text from a training run folder (its latest checkpoint), an llmkit checkpoint, a Hugging Face
    directory or a GGUF file.

    checkpoint: the model to load.
    prompt: the text to continue (empty: start from the beginning-of-text token).
    max_new_tokens: how many tokens to generate at most.
    samples: how many continuations to generate (a batch).
    compile: decode through torch.compile (a one-time compilation, then faster steps).
    batch_invariant: require the batch-invariant mode, the default wherever the C++ decode step runs and nothing is
      compiled: every token, the prompt's too, through the C++ step, so that the output equals `llmkit serve`'s
      whatever else it serves, and does not depend on --samples. An error where the step cannot run.
    no_batch_invariant: the prompt through PyTorch instead (faster on long prompts, see BENCHMARKS.md).
    dtype: load the weights in this precision (default: the checkpoint's; a bf16 / fp16 checkpoint on the CPU
        keeps its weights at that width, read by llmkit's kernels, with fp32 activations).
    device: cpu, cuda, cuda:1, ... (default: the CPU); a draft model goes to the same device.
    no_verify: load an llmkit checkpoint without checking its files against the checksums saved with them.
    tp: split the model across this many processes (tensor parallelism), started by torchrun --nproc_per_node TP;
      each holds about 1/TP of the weights and of the key/value cache (see docs/parallelism.md).
    """
    from llmkit.parallel import launch

    _check_counts(samples, max_new_tokens, beam_search, speculation)
    _check_seed(sampling.seed)
    _check_stops(output)
    sampling.rule()  # its values checked (finite, in range) before the model loads
    mode = _mode(output, beam_search, speculation)
    if tp > 1 and mode in ("beam", "speculate"):
        raise LLMKitError("--tp runs plain decoding (sampled, greedy or streamed); not with --beams, --draft or --mtp")
    ranks = launch.start(tp, device)
    try:
        where = device if ranks is None else str(ranks.device)
        _generate(checkpoint, prompt, max_new_tokens, samples, sampling, output, beam_search, speculation, mode,
                  compile, invariance(batch_invariant, no_batch_invariant), dtype, where, no_verify, ranks)  # fmt: skip
    except BaseException:
        launch.end(ranks, finished=False)
        raise
    launch.end(ranks, finished=True)
    return 0


def _generate(
    checkpoint: str,
    prompt: str,
    max_new_tokens: int,
    samples: int,
    sampling: SamplingOptions,
    output: OutputOptions,
    beam_search: BeamOptions,
    speculation: SpeculationOptions,
    mode: Mode,
    compile: bool,
    batch_invariant: bool | None,
    dtype: DType | None,
    device: str | None,
    no_verify: bool,
    ranks: launch.Ranks | None,
) -> None:
    model, tok = load_decoder(checkpoint, dtype, device, verify=not no_verify, split=ranks is not None)
    if ranks is not None:  # each rank loaded its part of every layer; all ranks sample with one seed
        sampling = dataclasses.replace(sampling, seed=ranks.shared_seed(sampling.seed))
    ids = tok.encode(prompt) if prompt else []
    if not ids:
        start = tok.bos_id if tok.bos_id is not None else tok.eos_id
        if start is None:
            raise LLMKitError("the prompt is empty and the tokenizer has no beginning-of-text token to start from")
        ids = [start]
    eos = tok.eos_id if prompt else None
    from llmkit.generate import choose_step

    request = _Request(model, tok, ids, eos, samples, max_new_tokens, choose_step(model, compile, batch_invariant))
    if mode == "beam":
        _beam_search(request, beam_search)
    elif mode == "speculate":
        draft_dtype = dtype if speculation.draft_dtype is None else speculation.draft_dtype
        precision = None if draft_dtype == "file" else draft_dtype
        draft = (
            load_decoder(speculation.draft, precision, device, verify=not no_verify)[0] if speculation.draft else None
        )
        draft_step = None if draft is None else choose_step(draft, compile)
        _speculate(request, sampling, draft, draft_step, speculation)
    elif mode == "stream":
        _stream(request, sampling, output.stop_strings)
    else:
        _sample(request, sampling, output.stop_strings)


def _sample(r: _Request, sampling: SamplingOptions, stop: list[str]) -> None:
    """Plain decoding, the samples as one batch."""
    from llmkit.generate import generate as run_generate

    out = run_generate(
        r.model,
        [r.ids] * r.samples,
        max_new_tokens=r.max_new_tokens,
        **asdict(sampling.rule()),  # temperature, top_k, top_p, min_p, repetition_penalty
        eos_id=r.eos,
        stop_strings=stop,
        tokenizer=r.tok,
        seed=sampling.seed,
        step=r.step,
    )
    r.print_samples(out.new_tokens)


def _stream(r: _Request, sampling: SamplingOptions, stop: list[str]) -> None:
    """Plain decoding, one sample after the other, each printed as it is generated (sample i seeded seed + i)."""
    from llmkit.generate import StopRule, stream

    rule = StopRule.of(r.eos, stop_strings=stop, tokenizer=r.tok)
    for i in range(r.samples):
        r.print_header(i)
        print(r.tok.decode(r.ids), end="", flush=True)
        seed = None if sampling.seed is None else sampling.seed + i
        steps = stream(
            r.model,
            [r.ids],
            max_new_tokens=r.max_new_tokens,
            sampling=sampling.rule(),
            stop=rule,
            seed=seed,
            step=r.step,
        )
        print_streamed(r.tok, steps, prompt=r.ids)


def _beam_search(r: _Request, options: BeamOptions) -> None:
    from llmkit.generate import beam_search

    result = beam_search(
        r.model,
        [r.ids] * r.samples,
        num_beams=options.beams,
        max_new_tokens=r.max_new_tokens,
        length_penalty=options.length_penalty,
        eos_id=r.eos,
    )
    r.print_samples(result.sequences)


def _speculate(
    r: _Request,
    sampling: SamplingOptions,
    draft: DecoderLM | None,
    draft_step: DecodeStep | None,
    options: SpeculationOptions,
) -> None:
    """Speculative decoding, drafting with `draft` (its steps run by `draft_step`), or with the model's MTP module
    when it is None."""
    from llmkit.generate import speculative_generate

    rule = sampling.rule()
    prompts = [r.ids] * r.samples
    out = speculative_generate(
        r.model,
        prompts,
        draft=draft,
        max_new_tokens=r.max_new_tokens,
        k=options.speculate,
        sampling=dataclasses.replace(rule, repetition_penalty=1.0),
        eos_id=r.eos,
        seed=sampling.seed,
        step=r.step,
        draft_step=draft_step,
        draft_head_bits=options.draft_head_bits,
    )
    r.print_samples(out.new_tokens)
    print(
        f"[speculative: {out.accepted}/{out.drafted} drafted tokens accepted ({100 * out.acceptance_rate:.0f}%), "
        f"{out.target_passes} target passes]",
        file=sys.stderr,
    )


def chat(
    checkpoint: str,
    *,
    system: str | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.7,
    top_p: float | None = 0.9,
    seed: int | None = None,
    dtype: DType | None = None,
    device: str | None = None,
    no_verify: bool = False,
) -> int:
    """Chat with a model through its chat template (from its tokenizer files or GGUF metadata). One message per line
    on standard input; the answers stream out. Ctrl-D ends the conversation.

    checkpoint: a model with a chat template (e.g. SmolLM2-135M-Instruct).
    system: an optional system message.
    max_new_tokens: the longest answer.
    temperature: 0 for greedy decoding.
    top_p: sample among the most likely tokens whose probabilities add up to p.
    seed: makes the answers repeatable (answer i is seeded seed + i).
    dtype: load the weights in this precision (default: the checkpoint's; a bf16 / fp16 checkpoint on the CPU
        keeps its weights at that width, read by llmkit's kernels, with fp32 activations).
    device: cpu, cuda, cuda:1, ... (default: the CPU).
    no_verify: load an llmkit checkpoint without checking its files against the checksums saved with them.
    """
    from llmkit.generate import Sampling, StopRule, stream
    from llmkit.tokenizer import render_chat

    _check_seed(seed)
    sampling = Sampling(temperature, None, top_p)  # its values checked before the model loads
    model, tok = load_decoder(checkpoint, dtype, device, verify=not no_verify)
    if not tok.chat_template:
        raise LLMKitError(f"{checkpoint} has no chat template; use `llmkit generate` for plain continuation")
    messages = [{"role": "system", "content": system}] if system else []
    rule = StopRule.of(tok.eos_id)
    turn = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = tok.encode(render_chat(tok, messages), add_bos=False)
        turn_seed = None if seed is None else seed + turn
        steps = stream(model, [ids], max_new_tokens=max_new_tokens, sampling=sampling, stop=rule, seed=turn_seed)
        answer = print_streamed(tok, steps, end_id=tok.eos_id)
        messages.append({"role": "assistant", "content": tok.decode(answer)})
        turn += 1
    return 0


def _unescape(text: str) -> str:
    """Read the escapes a shell passes through literally: \\n, \\t and \\\\."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "nt\\":
            out.append({"n": "\n", "t": "\t", "\\": "\\"}[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)
