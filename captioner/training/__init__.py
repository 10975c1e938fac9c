"""Training: a run built once (run.py), the loops (engine.py), objectives (cross-entropy, SCST), the
loss of eq. 14 and CIDEr-D for the SCST reward."""
