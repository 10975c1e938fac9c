"""The PTB tokenisation of captions in Python, so that validation needs no Java.

pycocoevalcap scores captions after Stanford CoreNLP's PTBTokenizer (a Java program: `-preserveLines
-lowerCase`) and then drops the punctuation tokens of PUNCTUATION. Training validates every epoch, often on
machines without Java (GPU containers), so `ptb_tokenize` reproduces that tokenisation for caption text:
lowercase; quotes, brackets and punctuation split off and dropped; clitics split off and kept ("man's" ->
"man 's", "don't" -> "do n't"); numbers ("3.5", "1,000"), abbreviations ("mr.", "u.s.") and hyphenated
words ("t-shirt") kept whole. tests/test_ptb.py compares it with the Java tokenizer on every Flickr8k and
COCO caption at hand; BLEU, ROUGE-L and CIDEr (pycocoevalcap's own Python code) then score the same tokens.
METEOR stays Java-only.
"""
from __future__ import annotations

import re

# what pycocoevalcap's PTBTokenizer removes after tokenising
# (its list spells the bracket tokens in capitals, -LRB-, which -lowerCase output never matches: they stay)
PUNCTUATION = {'"', "''", "'", "``", "`", ".", "?", "!", ",", ":", "-", "--", "...", ";"}
BRACKETS = {"(": "-lrb-", ")": "-rrb-", "[": "-lsb-", "]": "-rsb-", "{": "-lcb-", "}": "-rcb-"}

# clitics PTB splits off the word before them ("n't" takes the consonant: "ca n't", "wo n't")
_CLITIC = re.compile(r"(?i)^(.+?)(n't|'s|'re|'ve|'ll|'d|'m|'t)$")
# a token: a number with inner , or . ; a word of letters/digits with inner ' - . & / ; or one other character
_TOKEN = re.compile(r"""
    '(?:s|re|ve|ll|d|m|t)\b | n't\b | 'n'   # a clitic typed apart: "man 's", "do n't"; slip 'n' slide
  | \d+(?:[.,:]\d+)+                       # 3.5, 1,000, 11:20
  | [a-z](?:\.[a-z])+\.?                   # u.s., a.m., d.v.d
  | (?:mrs|mr|ms|dr|st|jr|sr|vs|etc|inc|ltd|mt|ft|ave|blvd|rd)\.   # abbreviations keep their period
  | [a-z]\.(?=\s+\S)                       # an initial inside a sentence: "u. miami"
  | \w+(?:['\-/.]\w+)*'?                   # words, t-shirt, man's, and/or, dogs'
  | \.\.\.|--|[^\w\s]                       # ellipsis, dash, any other symbol
""", re.X)


def ptb_tokens(text: str) -> list[str]:
    """One caption -> its PTB tokens, lowercased, punctuation dropped (pycocoevalcap's tokens)."""
    out: list[str] = []
    for tok in _TOKEN.findall(text.lower().replace("\n", " ")):
        if tok.endswith("'") and not tok.endswith("n't") and len(tok) > 1 and tok != "'n'":  # dogs' -> dogs '
            tok = tok[:-1]
        m = None if tok[0] == "'" or tok == "n't" else _CLITIC.match(tok)
        parts = [m.group(1), m.group(2)] if m else ["can", "not"] if tok == "cannot" else [tok]
        for p in parts:
            if p not in PUNCTUATION:
                out.append(BRACKETS.get(p, p))
    return out


def ptb_tokenize(text: str) -> str:
    """One caption -> its PTB tokens joined by spaces (what pycocoevalcap's scorers read)."""
    return " ".join(ptb_tokens(text))
