"""What the app's sidebar says about its switches, written from what the model file stores (testable without
Streamlit): a help text claims only what the setting does with this file's values."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..decoding.confidence import shown

if TYPE_CHECKING:
    from ..config import DecodeConfig

PRECISION_HELP = (
    "float32 is the reference. bfloat16 may be faster, mostly on CPUs that compute it natively (AVX512-BF16 "
    "or AMX) or on a GPU with bf16; the gain depends on the machine and the thread count (measured on a CPU "
    "without native bf16: 85 -> 79 ms per caption on 1 thread, 71 -> 52 ms on 2, i.e. 1.1-1.4x). It can "
    "change captions: in that measurement 6 of 20 differed from float32's, although corpus scores stay close "
    "(Flickr8k test, beam 5: METEOR 0.204 in both, BLEU-4 0.208 vs 0.213). int8 keeps float32's model and "
    "computes the decoder step's large products in int8, each row with its own scale, on a CPU (float32 "
    "elsewhere): a photo's caption stays the same alone, in a gallery and at any thread count, and a few "
    "captions differ from float32's (docs/performance.md, \"Precision\").")


def precision_label(dtype: str, native_bf16: bool) -> str:
    """The precision menu's entry: the dtype, and for bfloat16 whether this machine computes it natively
    (no speed claim: the gain depends on the machine, see PRECISION_HELP)."""
    return "bfloat16 (native on this machine)" if dtype == "bfloat16" and native_bf16 else dtype


def evidence_help(decode: "DecodeConfig") -> str:
    """The evidence switch's help, from the model file's stored evidence settings: it says the switch adds
    words only when the file's evidence_bonus is above 0, and mentions person words only when the file
    sets a person floor."""
    out = ("The encoder's own ImageNet classifier vetoes object words it rules out, so the caption never writes "
           f"them (a category below P={decode.evidence_floor:g}, e.g. a dog it sees no sign of)")
    if decode.person_floor > 0:
        out += (f", and person words where the model file's person detector gives P(person) below "
                f"{decode.person_floor:g}")
    if decode.evidence_bonus > 0:
        out += (f"; it also favours the words of objects it does see (a bonus of {decode.evidence_bonus:g} x P, "
                "until the caption has named the object once)")
    else:
        out += ("; it never brings a word in (this model file's evidence bonus is 0): it only keeps words out, "
                "so the caption may simply leave an object unnamed")
    return out + ". Off: the decoder alone, for comparison. Starts at the model file's own setting."


NO_CONFIDENCE = ("This model file has no fitted confidence map, so its captions carry no confidence "
                 "(captioner-fit-selector --confidence fits one).")


ADVICE = {"probably right": "read it before you publish it", "may be wrong": "check the alternatives",
          "probably wrong": "do not use it as it is"}  # what a person should do with an unsure caption, by level


def level_head(confidence: float, level: str) -> str:
    """"Probably right (66% likely to be a good description of this photo)"; "Sure: 78% likely ..." when sure."""
    chance = f"{shown(confidence):.0%} likely to be a good description of this photo"  # the number the level reads
    return f"Sure: {chance}" if level == "sure" else f"{level.capitalize()} ({chance})"


def level_advice(level: str, doubt: str | None) -> str:
    """What to do with an unsure caption and why: "check the alternatives; it hesitated between ..."."""
    return f"{ADVICE[level]}; {doubt}"


def sure_line(confidence: float | None, level: str | None, doubt: str | None) -> str:
    """The plain-words line under a caption: its level (Caption.level) with the chance that it is good, what a
    person should do with it and, when unsure, why (NO_CONFIDENCE without a confidence). Confidence is the
    probability that the caption is good (decoding/confidence.py); "sure" is said only at the file's threshold,
    never below 60%."""
    if confidence is None or level is None:
        return NO_CONFIDENCE
    head = level_head(confidence, level)
    return f"{head}." if level == "sure" else f"{head}: {level_advice(level, doubt)}."
