"""Benchmark helpers: prompt sets (Spec-Bench, HumanEval, JSONL/TXT files) and report writers."""
