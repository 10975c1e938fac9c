"""Features -> words: batched beam search, greedy as its beam 1 (search.py: `decode`), the same beam search with
fixed shapes for a GPU (device_beam.py), evidence-aware word rules (rules.py), sampling
(sampling.py: with gradients for SCST; temperature, top-k, nucleus and a seed for Photo.sample), features ->
Caption (captions.py) and teacher-forcing a typed sentence (explain.py).

Every path runs the one decoder step, model/decoder.py's `Decoder.step` (attention, gate beta, LSTM cell, deep
output), or its `recur` + `output` halves; none has a copy of the model. How that step computes (eq. 4 through
sigmoid in cache-sized blocks, each product by a fixed rule in model/packed_linear.py, the W_z a_i and W_e E y
tables) is decided inside it by device and autograd, or by the caller passing the W_z a_i table;
`Decoder.step(..., literal=True)` with plain products and no table is the paper written out, the oracle.
tests/test_one_step.py patches AdditiveAttention and sees every path change.

The paths (which code, when it runs, why this way, the test that proves it equal to the equations) are one table,
in docs/architecture.md ("Decoding paths").
"""
