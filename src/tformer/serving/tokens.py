"""The text of single tokens, as the API shows them: in log-probabilities (`tokens`,
`top_logprobs`) and to remote-tokenizer clients (/tokenizer_info, /tokenize, /detokenize).

A special token shows its name (`</s>`), since decoding drops it; every other token shows
what decoding it alone gives (a byte-level BPE token that is part of a character shows
U+FFFD)."""

from __future__ import annotations

from typing import Any

from tformer.data.tokenizers import special_names


class TokenTexts:
    """Token id -> its text, remembered (a request shows the same tokens many times)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        names = special_names(tokenizer)
        self.specials = {getattr(tokenizer, f"{key}_id"): name
                         for key, name in names.items() if name is not None}
        self.by_name = {name: token for token, name in self.specials.items()}
        self._seen: dict[int, str] = {}
        self._pieces: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._seen.get(token)
        if text is None:
            text = self.specials.get(token)
            if text is None:
                text = self.tokenizer.decode([token])
            self._seen[token] = text
        return text

    def piece(self, token: int) -> str:
        """What the token adds to a decoded text (nothing, for a special token): what
        text offsets count."""
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self.tokenizer.decode([token])
        return text

    def encode(self, text: str) -> list[int]:
        """The text's ids; a special token's name alone is that token (as remote-tokenizer
        clients look up the end-of-text token's id)."""
        if text in self.by_name:
            return [self.by_name[text]]
        return self.tokenizer.encode(text)
