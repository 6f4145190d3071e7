"""Translation: a model with its tokenizers (Translator), sacreBLEU scoring, attention pictures."""

from llmkit.translate.scores import corpus_scores, score_test
from llmkit.translate.translator import AttentionMap, Translation, Translator

__all__ = ["AttentionMap", "Translation", "Translator", "corpus_scores", "score_test"]
