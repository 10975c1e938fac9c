"""Evaluation: model -> captions -> scores once (scoring.py, metrics.py: pycocoevalcap), attention
grounding in COCO boxes (grounding.py, boxes.py) and object hallucination (hallucination.py: CHAIR)."""
