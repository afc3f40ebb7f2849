"""The sim engine's tokenizer lives in shared/text_tokenizer.py: the router tokenizes a sim
fleet's requests the way its workers do (issue 26). Kept here so old imports work."""

from shared.text_tokenizer import VOCAB_SIZE, ByteDetokenizer, TextTokenizer

__all__ = ["VOCAB_SIZE", "ByteDetokenizer", "TextTokenizer"]
