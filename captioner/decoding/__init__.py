"""Features -> words: greedy and batched beam search (search.py, one `decode`), evidence-aware word rules
(evidence.py), sampling (sampling.py: with gradients for SCST; temperature, top-k, nucleus and a seed for
Photo.sample), features -> Caption (captions.py) and teacher-forcing a typed sentence (explain.py)."""
