"""Output text of one request: incremental detokenization, stop strings, and the hold-back that keeps a
partial stop string out of streamed text."""

from __future__ import annotations

from pdserve.model.tokenizer import IncrementalDetokenizer, Tokenizer


class TextTracker:
    def __init__(self, tokenizer: Tokenizer | None, stop: tuple[str, ...], prompt_token_ids: list[int]) -> None:
        # the prompt's tail is left context, so the first output token keeps its leading space
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids) if tokenizer is not None else None
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1  # chars that may start a stop string
        self.text = ""
        self.stopped = False

    def add(self, token_id: int) -> bool:
        """Append one generated token; True when a stop string appeared (the text is then cut before it)."""
        if self._detok is None or self.stopped:
            return False
        search_from = max(0, len(self.text) - self._holdback)
        self.text += self._detok.add([token_id])
        hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        return self.stopped

    def visible(self, finished: bool) -> str:
        """Text safe to show: while running, the tail that could begin a stop string is held back."""
        if finished or self._holdback == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self._holdback)]
