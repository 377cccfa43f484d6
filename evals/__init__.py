"""Evaluation: task files and built-in item sets, their scoring, and lm-evaluation-harness's adapter."""
