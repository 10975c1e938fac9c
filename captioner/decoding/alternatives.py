"""The alternatives worth showing beside an unsure caption: those that say something else.

A beam's five candidates often differ in a word or two ("a white dog sitting on a plate", "a white dog sitting on
top of a plate"): five near-identical lines give a person nothing to choose between. `different` keeps, in the
beam's order, each candidate that names another set of things than the caption and every alternative kept before
it: the object words of the grounding table and the word detectors (concepts/words.py CATEGORY_WORDS,
concepts/detectors.py GROUP_WORDS: "woman", "dog", "table", "snow"; plurals as their singular). Where no candidate
names other things, those that name another content word (vocab.FUNCTION_WORDS and a few fillers aside) instead. `Caption.alternatives` itself
keeps every candidate (the workbench's table of hypotheses, the JSON's "alternatives"); the app's line under an
unsure caption, its JSON "different_alternatives" and its "hesitated" reason read this.
"""
from __future__ import annotations

from typing import Sequence

from ..concepts.detectors import GROUP_WORDS
from ..concepts.words import CATEGORY_WORDS
from ..vocab import FUNCTION_WORDS

FILLERS = frozenset("top front side middle next near up down there it that while some other two one".split())
SHOWN = 3  # alternatives shown beside an unsure caption
THINGS = frozenset(w for table in (CATEGORY_WORDS, GROUP_WORDS) for names in table.values() for w in names.split()
                   if "_" not in w)


def content_words(text: str) -> frozenset[str]:
    """The words of a caption that say what it shows: no function word or filler, plurals as their singular
    ("dogs" -> "dog")."""
    words = [w for w in text.lower().split() if w not in FUNCTION_WORDS and w not in FILLERS]
    return frozenset(w[:-1] if w.endswith("s") and not w.endswith("ss") and len(w) > 3 else w for w in words)


def things(text: str) -> frozenset[str]:
    """The object words of a caption (THINGS), plurals as their singular."""
    return content_words(" ".join(w for w in text.lower().split() if w in THINGS))


def different(caption: str, alternatives: Sequence[str], n: int = SHOWN) -> list[str]:
    """Up to n of `alternatives` (in their order), each naming another set of things than the caption and the ones
    kept before it; where none does, each naming a content word that the caption and the ones before it do not."""
    shown, out = [things(caption)], []
    for alt in alternatives:
        if len(out) < n and things(alt) not in shown:
            out.append(alt)
            shown.append(things(alt))
    if out:
        return out
    said = set(content_words(caption))
    for alt in alternatives:
        words = content_words(alt)
        if words - said and len(out) < n:
            out.append(alt)
            said |= words
    return out


__all__ = ["content_words", "things", "different", "SHOWN"]
