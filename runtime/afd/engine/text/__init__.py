"""Prompt and text handling: the checkpoint's tokenizer and chat template, incremental detokenization and stop
strings."""
