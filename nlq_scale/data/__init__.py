"""Corpus readers, GPT-2 tokenizer, MDS preparation and the deterministic streaming loader."""
