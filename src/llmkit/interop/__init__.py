"""Checkpoints in and out: Hugging Face directories, GGUF files and llmkit's own format."""
