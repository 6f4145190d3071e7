"""Scoring translations the way the field does: sacreBLEU's corpus BLEU and chrF (standard tokenisation, with a
signature that says exactly how the number was computed), and the test-split evaluation of a trained model."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmkit.errors import InputError
from llmkit.train.config import TranslateConfig


def corpus_scores(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, Any]:
    """BLEU and chrF of hypotheses against one reference each (sacreBLEU defaults: 13a tokenisation, exp smoothing)."""
    import sacrebleu

    if len(hypotheses) != len(references):
        raise InputError(f"{len(hypotheses)} translations for {len(references)} references: they must pair up")
    if not hypotheses:
        raise InputError("no translations to score")
    bleu = sacrebleu.metrics.BLEU()
    chrf = sacrebleu.metrics.CHRF()
    b = bleu.corpus_score(list(hypotheses), [list(references)])
    c = chrf.corpus_score(list(hypotheses), [list(references)])
    return {
        "bleu": round(b.score, 2),
        "chrf": round(c.score, 2),
        "bleu_precisions": [round(p, 2) for p in b.precisions],
        "brevity_penalty": round(b.bp, 4),
        "sys_len": b.sys_len,
        "ref_len": b.ref_len,
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "sentences": len(hypotheses),
    }


def score_test(
    checkpoint: str | os.PathLike[str],
    data_dir: str | os.PathLike[str],
    *,
    settings: TranslateConfig | None = None,
    out: str | os.PathLike[str] | None = None,
    progress: bool = True,
    samples: int = 3,
) -> dict[str, Any]:
    """Translate the test split of a prepared parallel folder with `checkpoint` (a run folder or a checkpoint),
    decoding as `settings` say (beams, length penalty, how many pairs, batch size; the paper's beam 4 and length
    penalty 0.6 by default), score it, print the scores and a few sample translations, and save test_scores.json
    and test.hyp.txt in `out`."""
    from llmkit.data.bitexts import ParallelData
    from llmkit.runs import resolve_checkpoint
    from llmkit.translate.translator import Translator

    data = ParallelData(data_dir)
    s = settings or TranslateConfig()
    beams, length_penalty = s.beams, s.length_penalty
    sources, references = data.texts("test", "src"), data.texts("test", "tgt")
    if s.test_pairs:
        sources, references = sources[: s.test_pairs], references[: s.test_pairs]
    if not sources:
        raise InputError(f"{data_dir} has no test pairs to score")
    translator = Translator.load(checkpoint)
    start = time.perf_counter()
    hyps = [
        t.text
        for t in translator.translate(
            sources, beams=beams, length_penalty=length_penalty, batch_size=s.batch_size, progress=progress
        )
    ]
    seconds = time.perf_counter() - start
    result = corpus_scores(hyps, references)
    result.update(
        checkpoint=str(resolve_checkpoint(checkpoint)),
        data=str(data_dir),
        beams=beams,
        length_penalty=length_penalty,
        decode_seconds=round(seconds, 1),
    )
    result["samples"] = [
        {"source": s, "reference": r, "translation": h}
        for s, r, h in list(zip(sources, references, hyps, strict=True))[:samples]
    ]
    if out is not None:
        o = Path(out)
        o.mkdir(parents=True, exist_ok=True)
        (o / "test.hyp.txt").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
        (o / "test_scores.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    print(
        f"test BLEU {result['bleu']:.2f}  chrF {result['chrf']:.2f}  ({len(hyps)} sentences, beam {beams}, "
        f"length penalty {length_penalty}, {seconds:.0f} s)\n  {result['bleu_signature']}"
    )
    for s in result["samples"]:
        print(f"  source:      {s['source']}\n  reference:   {s['reference']}\n  translation: {s['translation']}")
    return result
