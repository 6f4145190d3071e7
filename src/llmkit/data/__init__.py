"""Corpora and their preparation into token shards."""
