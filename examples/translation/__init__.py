"""Multilingual Transformer translation (Multi30k en<->de, en<->fr, en<->cs) with GPipe pipeline parallelism."""
