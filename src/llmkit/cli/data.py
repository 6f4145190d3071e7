"""The data command: a text corpus for language models, or sentence pairs for translation, made ready to train on."""

from __future__ import annotations

import json
from dataclasses import dataclass

from llmkit.errors import InputError


@dataclass(frozen=True)
class TextOptions:
    """A text corpus, for language models.

    tokenizer: reuse this tokenizer instead of training one: a checkpoint's (a folder with tokenizer.json, a run, a
        GGUF file) or a tokenizer.json file; a run that starts from that checkpoint needs it.
    text_field: the field holding the text in a .jsonl file.
    """

    tokenizer: str | None = None
    text_field: str = "text"


@dataclass(frozen=True)
class PairOptions:
    """Sentence pairs, for translation.

    parallel: the source is a file of sentence pairs (implied by bible:...).
    separate_vocab: one vocabulary per side instead of a shared one.
    test_fraction: the share of pairs held out for the test split (BLEU).
    src_field: the source field of a .jsonl file, or column of a .tsv file with a header.
    tgt_field: the target field or column.
    """

    parallel: bool = False
    separate_vocab: bool = False
    test_fraction: float = 0.02
    src_field: str = "source"
    tgt_field: str = "target"


@dataclass(frozen=True)
class PreferenceOptions:
    """Preference pairs, for DPO, IPO and SimPO.

    checkpoint: the checkpoint to fine-tune: its tokenizer and chat template read the pairs, and its log-probabilities
        of every answer are the reference DPO and IPO compare with (computed once, stored with the data).
    quantized: compute the reference with a GGUF file's quantized weights (for QLoRA, lora.quantized).
    max_tokens: leave out pairs with a prompt and answer longer than this many tokens (training never cuts them).
    skip_reference: no reference log-probabilities (SimPO needs none).
    """

    checkpoint: str | None = None
    quantized: bool = False
    max_tokens: int = 2048
    skip_reference: bool = False


def prepare(
    source: str = "shakespeare",
    conversations: str | None = None,
    *,
    out: str | None = None,
    vocab_size: int | None = None,
    val_fraction: float | None = None,
    overwrite: bool = False,
    text_corpus: TextOptions = TextOptions(),
    sentence_pairs: PairOptions = PairOptions(),
    preference_pairs: PreferenceOptions = PreferenceOptions(),
) -> int:
    """Turn a corpus into a tokenizer and memory-mapped token arrays with a deterministic split: a text corpus for
    language models, sentence pairs for translation, conversations for chat fine-tuning, or pairs of answers for
    preference optimisation.

    source: 'shakespeare' (the default corpus), a text file, a folder of text files or a .jsonl file; for translation
        'bible:SRC-TGT' (e.g. bible:de-en, the default parallel corpus) or, with --parallel, a .tsv / .jsonl file;
        'chat' for conversations (the file follows; needs --tokenizer CHECKPOINT for its chat template);
        'preferences' for pairs of answers (the file follows; needs --checkpoint CHECKPOINT); 'tasks' for
        llmkit's offline evaluation tasks (lm-evaluation-harness YAML and JSONL: `llmkit eval --include-path OUT`).
    conversations: with 'chat': a .jsonl file with one {"messages": [{"role": ..., "content": ...}, ...]} per line;
        the loss of fine-tuning counts only the assistant's tokens. With 'preferences': a .jsonl file with one
        {"prompt": ..., "chosen": ..., "rejected": ...} per line (three strings, or lists of messages).
    out: the folder to write (default runs/data/shakespeare, runs/data/bible-SRC-TGT for the Bible, runs/data/chat
        for conversations, runs/data/preferences for pairs of answers, runs/tasks for tasks); built beside it and
        renamed into place when complete. Never a checkpoint or a run.
    vocab_size: size of the byte-level BPE vocabulary to train (default 4096; 8000 for sentence pairs).
    val_fraction: language models: the share of every document, at its end, kept for validation (0.1);
        sentence pairs: the share of pairs, chosen by a hash of the source sentence (0.01); conversations and
        preference pairs: the share of lines, chosen by a hash of the line (0.05).
    overwrite: replace an existing data folder at OUT (never the corpus itself).
    """
    if source == "chat":
        prepare_conversations(conversations, out, val_fraction, text_corpus, overwrite)
    elif source == "preferences":
        prepare_preference_pairs(conversations, out, val_fraction, preference_pairs, overwrite)
    elif source == "tasks":
        prepare_tasks(out, overwrite)
    elif conversations is not None:
        raise InputError(
            f"a second argument ({conversations!r}) is only for 'llmkit prepare chat FILE.jsonl' or "
            "'llmkit prepare preferences FILE.jsonl'"
        )
    elif sentence_pairs.parallel or source == "bible" or source.startswith("bible:"):
        prepare_pairs(source, out, vocab_size, val_fraction, sentence_pairs, overwrite)
    else:
        prepare_text(source, out, vocab_size, val_fraction, text_corpus, overwrite)
    return 0


def prepare_tasks(out: str | None, overwrite: bool) -> None:
    """Write llmkit's offline evaluation tasks and print what they hold."""
    from llmkit.evaluate.tasks import write_tasks

    target = write_tasks(out or "runs/tasks", overwrite=overwrite)
    meta = json.loads((target / "meta.json").read_text(encoding="utf-8"))
    counts = ", ".join(f"{name} ({t['questions']:,} questions)" for name, t in meta["tasks"].items())
    print(f"wrote {counts} to {target}: llmkit eval CHECKPOINT --tasks NAME --include-path {target}")


def prepare_conversations(
    conversations: str | None, out: str | None, val_fraction: float | None, options: TextOptions, overwrite: bool
) -> None:
    """Prepare a .jsonl file of conversations with a checkpoint's chat template and print what it came to."""
    from llmkit.data.chat import prepare_chat

    if conversations is None:
        raise InputError("llmkit prepare chat needs the .jsonl file of conversations: llmkit prepare chat FILE.jsonl")
    if options.tokenizer is None:
        raise InputError(
            "llmkit prepare chat needs --tokenizer CHECKPOINT: the conversations are rendered with its chat template"
        )
    target = out or "runs/data/chat"
    meta = prepare_chat(
        conversations,
        target,
        tokenizer=options.tokenizer,
        val_fraction=0.05 if val_fraction is None else val_fraction,
        overwrite=overwrite,
    )
    s = meta["splits"]
    print(
        f"prepared {conversations} -> {target}: train {s['train']['examples']:,} conversations "
        f"({s['train']['tokens']:,} tokens, {s['train']['target_tokens']:,} of them the assistant's), "
        f"val {s['val']['examples']:,}; longest {max(v['longest'] for v in s.values()):,} tokens, "
        f"{meta['seconds']:.1f} s"
    )


def prepare_preference_pairs(
    file: str | None, out: str | None, val_fraction: float | None, options: PreferenceOptions, overwrite: bool
) -> None:
    """Prepare a .jsonl file of preference pairs with a checkpoint and print what it came to."""
    from llmkit.data.preferences import prepare_preferences

    usage = "llmkit prepare preferences FILE.jsonl --checkpoint CHECKPOINT"
    if file is None:
        raise InputError(f"llmkit prepare preferences needs the .jsonl file of pairs: {usage}")
    if options.checkpoint is None:
        raise InputError(
            f"llmkit prepare preferences needs --checkpoint: its tokenizer reads the pairs and its log-probabilities "
            f"are the reference ({usage})"
        )
    target = out or "runs/data/preferences"
    meta = prepare_preferences(
        file,
        target,
        checkpoint=options.checkpoint,
        quantized=options.quantized,
        reference=not options.skip_reference,
        max_tokens=options.max_tokens,
        val_fraction=0.05 if val_fraction is None else val_fraction,
        overwrite=overwrite,
    )
    s = meta["splits"]
    left = f", {meta['left_out']:,} left out (longer than {meta['max_tokens']:,} tokens)" if meta["left_out"] else ""
    reference = "with" if meta["reference"] else "without"
    print(
        f"prepared {file} -> {target}: train {s['train']['pairs']:,} pairs, val {s['val']['pairs']:,}{left}; "
        f"longest {max(v['longest'] for v in s.values()):,} tokens; {reference} the reference's log-probabilities, "
        f"{meta['seconds']:.1f} s"
    )


def prepare_text(
    source: str,
    out: str | None,
    vocab_size: int | None,
    val_fraction: float | None,
    options: TextOptions,
    overwrite: bool,
) -> None:
    """Prepare a text corpus for a language model and print what it came to (None: the default)."""
    from llmkit.data.prepare import prepare as run_prepare

    target = out or "runs/data/shakespeare"
    meta = run_prepare(
        source,
        target,
        vocab_size=vocab_size or 4096,
        tokenizer=options.tokenizer,
        val_fraction=0.1 if val_fraction is None else val_fraction,
        text_field=options.text_field,
        overwrite=overwrite,
    )
    s = meta["splits"]
    print(
        f"prepared {source} -> {target}: vocab {meta['vocab_size']}, train {s['train']['tokens']:,} tokens "
        f"({s['train']['chars']:,} chars), val {s['val']['tokens']:,} tokens, "
        f"{meta['chars_per_token']:.2f} chars/token, {meta['seconds']:.1f} s"
    )


def prepare_pairs(
    source: str,
    out: str | None,
    vocab_size: int | None,
    val_fraction: float | None,
    options: PairOptions,
    overwrite: bool,
) -> None:
    """Prepare sentence pairs (the Bible, or a .tsv / .jsonl file) for translation and print what they came to
    (None: the default)."""
    from llmkit.data.bitexts import DEFAULT, prepare_parallel

    name = DEFAULT if source == "bible" else source
    target = out or ("runs/data/" + name.replace(":", "-") if name.startswith("bible:") else "runs/data/pairs")
    meta = prepare_parallel(
        name,
        target,
        vocab_size=vocab_size or 8000,
        shared_vocab=not options.separate_vocab,
        val_fraction=0.01 if val_fraction is None else val_fraction,
        test_fraction=options.test_fraction,
        src_field=options.src_field,
        tgt_field=options.tgt_field,
        overwrite=overwrite,
    )
    sp = meta["splits"]
    print(
        f"prepared {meta['source']} -> {target}: {sum(v['pairs'] for v in sp.values()):,} pairs "
        f"(train {sp['train']['pairs']:,}, val {sp['val']['pairs']:,}, test {sp['test']['pairs']:,}), "
        f"{'shared' if meta['shared_vocab'] else 'separate'} vocab {meta['vocab_size']}, "
        f"train {sp['train']['src_tokens']:,} source + {sp['train']['tgt_tokens']:,} target tokens, "
        f"{meta['seconds']:.1f} s\nlicence: {meta['licence']}"
    )
