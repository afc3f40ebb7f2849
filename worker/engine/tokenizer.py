"""The engine's tokenizer lives in shared/tokenizer.py: the router tokenizes requests the
way the worker does (issue 26), with the same code. Kept here so old imports work."""

from shared.tokenizer import ChatTemplate, IncrementalDetokenizer, Tokenizer

__all__ = ["ChatTemplate", "IncrementalDetokenizer", "Tokenizer"]
