"""Benchmark decontamination: a training prompt that shares text with a benchmark prompt is dropped.

Normalisation: a text becomes its word tokens, lower-cased, where a word is a maximal run of
letters and digits (`[^\\W_]+`, Unicode-aware): whitespace, punctuation, underscores and markup
are ignored, so "def has_close_elements(numbers: List[float])" and "def has close elements
numbers list float" are the same 8 words.

A prompt is contaminated by a benchmark prompt when
  - both normalise to the same word sequence (an exact copy, whatever the spacing), or
  - they share any 13 consecutive words (a 13-gram: the length used by the GPT-3 and later
    decontamination studies; long enough that common phrases such as "please reason step by step,
    and put your final answer within" (10 words) do not match by themselves).
A benchmark prompt shorter than 13 words can only match exactly.

Speed. The benchmark 13-grams are hashed into a set once. A prompt's own 13-grams are not all
looked up: every 13-gram contains a 7-gram starting at a multiple of 7 of the prompt, and a
13-gram shared with a benchmark contains only 7-grams of that benchmark, so the prompt's 7-grams
at positions 0, 7, 14, ... are checked against the benchmark 7-grams first, and only a prompt with
a hit has its 13-grams checked (exact, no false negatives: a 7-gram hit without a shared 13-gram is
a near miss and the prompt is kept). That is one set lookup per 7 words for a clean prompt.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

NGRAM = 13
_ANCHOR = 7  # NGRAM - _ANCHOR + 1 >= _ANCHOR: every 13-gram holds an aligned 7-gram (see the module doc)
_WORD = re.compile(r"[^\W_]+")

assert NGRAM - _ANCHOR + 1 >= _ANCHOR


def normalized_words(text: str) -> list[str]:
    """The lower-cased word tokens the overlap rules compare (see the module doc)."""
    return _WORD.findall(text.lower())


def normalized_key(text: str) -> str:
    """One string per normalised text: equal keys are exact matches (and duplicates)."""
    return " ".join(normalized_words(text))


@dataclass(frozen=True)
class Contamination:
    benchmark: str  # the benchmark's name
    kind: str  # "exact" or "13-gram"
    words: str  # the shared text, normalised (the whole prompt for an exact match)


class Decontaminator:
    """Built once from the benchmarks' prompt texts; `match(text)` says whether a text overlaps one."""

    def __init__(self, benchmarks: Mapping[str, Iterable[str]]):
        self.exact: dict[str, str] = {}
        self.grams: dict[tuple[str, ...], str] = {}
        self.anchors: set[tuple[str, ...]] = set()
        self.prompts = 0
        for name, texts in benchmarks.items():
            for text in texts:
                words = normalized_words(text)
                if not words:
                    continue
                self.prompts += 1
                self.exact.setdefault(" ".join(words), name)
                for start in range(len(words) - NGRAM + 1):
                    self.grams.setdefault(tuple(words[start:start + NGRAM]), name)
                for start in range(len(words) - _ANCHOR + 1):
                    self.anchors.add(tuple(words[start:start + _ANCHOR]))

    def match(self, text: str) -> Contamination | None:
        """The first benchmark overlap of `text`, or None if it is clean."""
        return self.match_words(normalized_words(text))

    def match_words(self, words: list[str]) -> Contamination | None:
        """`match` of a text whose `normalized_words` are `words` (`normalized_key(text).split()`)."""
        # A copy of a benchmark prompt of 13+ words also hits the anchors, so the exact test
        # (which needs the joined key) waits for a hit, except for texts too short for a 13-gram.
        if len(words) >= NGRAM:
            anchors = self.anchors
            if not any(tuple(words[p:p + _ANCHOR]) in anchors for p in range(0, len(words) - _ANCHOR + 1, _ANCHOR)):
                return None
        key = " ".join(words)
        if key in self.exact:
            return Contamination(self.exact[key], "exact", key)
        grams = self.grams
        for start in range(len(words) - NGRAM + 1):
            gram = tuple(words[start:start + NGRAM])
            if gram in grams:
                return Contamination(grams[gram], f"{NGRAM}-gram", " ".join(gram))
        return None
