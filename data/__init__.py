"""Tokenizers, dataset preparation and the batch loader."""
