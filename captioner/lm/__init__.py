"""A concept-conditioned language model for words the paired data lacks (trained by
`captioner-train-lm`). Not used by decoding yet: fusion.py holds the rule a beam search would apply."""
