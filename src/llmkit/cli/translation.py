"""The translate command: a sentence, a file of sentences, or a prepared test split scored with BLEU and chrF."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from llmkit.cli.common import DType, torch_dtype
from llmkit.errors import LLMKitError
from llmkit.outputs import Output, building, claim

if TYPE_CHECKING:
    from llmkit.translate import Translator


def translate(
    checkpoint: str,
    text: str | None = None,
    *,
    file: str | None = None,
    output: str | None = None,
    beams: int = 4,
    length_penalty: float = 0.6,
    batch_size: int = 32,
    plot_attention: str | None = None,
    score_test: str | None = None,
    test_pairs: int = 0,
    dtype: DType | None = None,
    overwrite: bool = False,
) -> int:
    """Translate with an encoder-decoder model: a training run folder (its averaged checkpoint if any, else the
    latest), an llmkit checkpoint or a Hugging Face Marian directory.

    checkpoint: the translation model.
    text: a sentence to translate.
    file: translate this file instead, one sentence per line (a progress bar shows on standard error).
    output: with --file, write the translations here, one per line (default: standard output).
    beams: beam size (1: greedy decoding; the paper used 4).
    length_penalty: beam search: log-probability / length ** penalty ranks hypotheses (the paper used 0.6).
    batch_size: sentences decoded together.
    plot_attention: save the cross-attention heat map of the sentence (source words against target words) here.
    score_test: translate the test split of this prepared parallel data folder and print BLEU and chrF.
    test_pairs: with --score-test, only the first N test pairs (0: all).
    dtype: load the weights in this precision.
    overwrite: replace an existing --output file (never the --file read).
    """
    from llmkit.translate import Translator
    from llmkit.translate import score_test as run_score

    if sum(x is not None for x in (text, file, score_test)) != 1:
        raise LLMKitError("give exactly one of: a sentence, --file FILE, or --score-test DATA_DIR")
    if plot_attention is not None and text is None:
        raise LLMKitError("--plot-attention draws one sentence: give the sentence as the text argument")
    if output is not None and file is None:
        raise LLMKitError("--output goes with --file")
    target = claim(output, "file", inputs=[file, checkpoint], overwrite=overwrite) if output is not None else None
    if score_test is not None:
        from llmkit.runs import is_run

        out = Path(checkpoint) if is_run(checkpoint) else None
        from llmkit.train.config import TranslateConfig

        settings = TranslateConfig(
            beams=beams, length_penalty=length_penalty, test_pairs=test_pairs, batch_size=batch_size
        )
        run_score(checkpoint, score_test, settings=settings, out=out)
        return 0
    translator = Translator.load(checkpoint, dtype=torch_dtype(dtype))
    if text is not None:
        result = translator.translate([text], beams=beams, length_penalty=length_penalty)[0]
        print(result.text)
        if plot_attention is not None:
            from llmkit.translate.plot import plot_attention as draw

            amap = translator.attention(text, result.tokens)
            title = f"cross-attention: {Path(checkpoint).name}"
            print(f"attention map: {draw(amap, plot_attention, title=title)}", file=sys.stderr)
        return 0
    assert file is not None
    _translate_file(translator, Path(file), target, beams=beams, length_penalty=length_penalty, batch_size=batch_size)
    return 0


def _translate_file(
    translator: Translator, path: Path, output: Output | None, *, beams: int, length_penalty: float, batch_size: int
) -> None:
    """Translate a file, one sentence per line, to `output` or standard output."""
    if not path.is_file():
        raise LLMKitError(f"{path} does not exist")
    lines = path.read_text(encoding="utf-8").splitlines()
    empty = [i + 1 for i, line in enumerate(lines) if not line.strip()]
    if empty:
        shown = ", ".join(map(str, empty[:10])) + (" ..." if len(empty) > 10 else "")
        raise LLMKitError(f"{path}: line(s) {shown} are empty; give one sentence per line")
    if not lines:
        raise LLMKitError(f"{path} is empty")
    results = translator.translate(
        lines, beams=beams, length_penalty=length_penalty, batch_size=batch_size, progress=True
    )
    text_out = "".join(r.text + "\n" for r in results)
    if output is None:
        sys.stdout.write(text_out)
        return
    with building(output) as tmp:
        tmp.write_text(text_out, encoding="utf-8")
    print(f"{len(results)} sentences -> {output.path}", file=sys.stderr)
