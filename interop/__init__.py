"""Models in and out of other programs: Hugging Face folders, the family table, GGUF files."""
