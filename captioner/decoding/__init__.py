"""Features -> words: greedy and batched beam search (search.py, one `decode`), evidence-aware word rules
(evidence.py), sampling with gradients for SCST (sampling.py), features -> Caption (captions.py) and
teacher-forcing a typed sentence (explain.py)."""
