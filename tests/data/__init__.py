"""Data the tests share with the tools (tests/data/chat_formats.py: also the GPU check's)."""
