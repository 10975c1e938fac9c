"""Standard caption metrics through pycocoevalcap (the COCO caption evaluation code).

Captions and references go through its PTB tokenizer, then BLEU-1..4, METEOR, ROUGE-L and CIDEr are
computed against ALL references of each image. SPICE runs only when its Java models are already
present (it would otherwise download Stanford CoreNLP); else it is skipped with a message.

Two tokenizers: "java" (pycocoevalcap's, Stanford's PTBTokenizer: the reported scores of captioner-evaluate)
and "python" (evaluation/ptb.py, the same tokens without Java: training's validation, so that a machine
without Java trains and picks its best epoch). BLEU, ROUGE-L and CIDEr are pycocoevalcap's own Python code
with either; METEOR always needs Java.
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
from typing import Callable, Mapping, Sequence

from ..config import METRICS
from .ptb import ptb_tokenize
from ..vocab import FUNCTION_WORDS, is_salad, repeats, tokenize

METRIC_KEYS = METRICS  # the one list, in config.py (train.val_metric is checked against it)
# a val set of fewer photos cannot tell two epochs (or two models) apart: one photo's caption moves its CIDEr by a
# twentieth or more. Training then keeps the last epoch rather than choose by it (training/engine.py), and the
# app labels such a figure (ui/page_state.py: "5 photos: too few to compare")
MIN_VAL_PHOTOS = 20


def val_photos(record: Mapping) -> tuple[int, int]:
    """(photos in all, photos of the smallest caption set) that a validation record's scores rest on: its
    n_images, or each set's "<set>/n_images" in a mix; (0, 0) when the record does not say (older files)."""
    counts = [int(v) for k, v in record.items() if (k == "n_images" or k.endswith("/n_images"))
              and isinstance(v, (int, float))]
    return (sum(counts), min(counts)) if counts else (0, 0)


def _spice_available() -> bool:
    try:
        import pycocoevalcap.spice.spice as spice_mod
    except ImportError:
        return False
    lib = os.path.join(os.path.dirname(spice_mod.__file__), "lib")
    return os.path.isfile(os.path.join(lib, "stanford-corenlp-3.6.0.jar"))


def score_captions(predictions: Mapping[str, str], references: Mapping[str, Sequence[str]],
                   metrics: Sequence[str] = METRIC_KEYS, spice: bool = False,
                   log: Callable[[str], None] = print, tokenizer: str = "java") -> dict[str, float]:
    """predictions {image_id: caption}, references {image_id: [captions]} -> {metric: score}.
    Scores use pycocoevalcap's scale (0..1 for BLEU/METEOR/ROUGE-L, CIDEr around 0..3). `tokenizer`: "java"
    or "python" (module docstring); METEOR and SPICE need Java with either."""
    if tokenizer == "python" and ("METEOR" in metrics or spice) and not java_available():
        raise RuntimeError(missing_java("METEOR"))
    gts, res = _ptb_tokenized(predictions, references, tokenizer)
    out: dict[str, float] = {}
    if any(m.startswith("Bleu") for m in metrics):
        from pycocoevalcap.bleu.bleu import Bleu

        with contextlib.redirect_stdout(io.StringIO()):
            bleu, _ = Bleu(4).compute_score(gts, res)
        for n in range(4):
            if f"Bleu_{n + 1}" in metrics:
                out[f"Bleu_{n + 1}"] = float(bleu[n])
    if "METEOR" in metrics:
        from pycocoevalcap.meteor.meteor import Meteor

        m = Meteor()
        try:
            out["METEOR"] = float(m.compute_score(gts, res)[0])
        finally:
            _close_meteor(m)
    if "ROUGE_L" in metrics:
        from pycocoevalcap.rouge.rouge import Rouge

        out["ROUGE_L"] = float(Rouge().compute_score(gts, res)[0])
    if "CIDEr" in metrics:
        from pycocoevalcap.cider.cider import Cider

        out["CIDEr"] = float(Cider().compute_score(gts, res)[0])
    if spice:
        if _spice_available():
            from pycocoevalcap.spice.spice import Spice

            out["SPICE"] = float(Spice().compute_score(gts, res)[0])
        else:
            log("SPICE skipped: its Stanford CoreNLP models are not installed (pycocoevalcap would download "
                "them, and this machine may be offline). Other metrics are unaffected.")
    return out


def java_available() -> bool:
    return shutil.which("java") is not None


def missing_java(what: str = "the PTB tokenizer and METEOR") -> str:
    """The one-line refusal where Java is needed and missing."""
    return (f"pycocoevalcap needs Java for {what}: install a JRE (e.g. 'apt-get install default-jre-headless'); "
            "training validates without it (train.val_metric other than METEOR)")


def _ptb_tokenized(predictions: Mapping[str, str], references: Mapping[str, Sequence[str]],
                   tokenizer: str = "java") -> tuple[dict, dict]:
    """Checked inputs -> pycocoevalcap's (gts, res), both PTB-tokenised and keyed by sorted image id."""
    if not predictions:
        raise ValueError("no predictions to score")
    missing = [k for k in predictions if not references.get(k)]
    if missing:
        raise ValueError(f"{len(missing)} predicted images have no references, e.g. {missing[:3]}")
    ids = sorted(predictions)
    if tokenizer == "python":
        return ({i: [ptb_tokenize(c) for c in references[i]] for i in ids},
                {i: [ptb_tokenize(predictions[i])] for i in ids})
    if tokenizer != "java":
        raise ValueError(f"tokenizer must be 'java' or 'python', got '{tokenizer}'")
    if not java_available():  # the PTB tokenizer and METEOR are Java programs
        raise RuntimeError(missing_java())
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    gts = {i: [{"caption": c} for c in references[i]] for i in ids}
    res = {i: [{"caption": predictions[i] or "."}] for i in ids}  # empty caption: still scorable
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        tok = PTBTokenizer()
        return tok.tokenize(gts), tok.tokenize(res)


def cider_per_image(predictions: Mapping[str, str], references: Mapping[str, Sequence[str]],
                    tokenizer: str = "java") -> dict[str, float]:
    """{image_id: that caption's CIDEr} (pycocoevalcap's, document frequencies from these images' references):
    their mean is score_captions' corpus CIDEr for the same captions."""
    from pycocoevalcap.cider.cider import Cider

    gts, res = _ptb_tokenized(predictions, references, tokenizer)
    _, per_image = Cider().compute_score(gts, res)
    return {i: float(s) for i, s in zip(gts, per_image)}


def _close_meteor(m) -> None:
    # pycocoevalcap's Meteor keeps a Java subprocess; end it so repeated evaluations do not leak
    with contextlib.suppress(Exception):
        with m.lock:
            m.meteor_p.stdin.close()
            m.meteor_p.kill()
            m.meteor_p.wait()


# Words a finished caption should not end with ("a man in a", "a dog with the"): the classic
# failure of captioners optimised for CIDEr.


def caption_defects(captions: Sequence[str]) -> dict[str, float]:
    """Shares of captions that end in a function word, that repeat a bigram ("a red uniform is
    wearing a red uniform"), that are word salad (vocab.is_salad), and that say a word twice back to
    back, "X and X", or a content word twice (vocab.repeats), over whitespace tokens."""
    n = max(len(captions), 1)
    bad_end = repeat = salad = 0
    kinds = {"adjacent": 0, "x_and_x": 0, "content": 0}
    for c in captions:
        words = c.split()
        bad_end += bool(words) and words[-1] in FUNCTION_WORDS
        bigrams = list(zip(words, words[1:]))
        repeat += len(set(bigrams)) < len(bigrams)
        salad += is_salad(words)
        for kind, found in repeats(words).items():
            kinds[kind] += found
    return {"bad_ending": bad_end / n, "repeated_bigram": repeat / n, "salad": salad / n,
            **{f"repeat_{kind}": k / n for kind, k in kinds.items()}}


def reference_repeats(references: Sequence[Sequence[str]]) -> dict[str, float]:
    """The people's rates of the same repeats, over every reference caption (tokenised like the
    generated ones): what decoding is compared with."""
    refs = [" ".join(tokenize(r)) for rs in references for r in rs]
    return {f"references_{k}": v for k, v in caption_defects(refs).items() if k.startswith("repeat_")}
