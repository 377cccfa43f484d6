"""serve.py's room: the OpenAI-compatible HTTP server over a model (docs/serving.md)."""
