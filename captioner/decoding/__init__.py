"""Features -> words: greedy and batched beam search (search.py: `decode` picks one), the same beam search with
fixed shapes for a GPU (device_beam.py), evidence-aware word rules (evidence.py, rules.py), sampling
(sampling.py: with gradients for SCST; temperature, top-k, nucleus and a seed for Photo.sample), features ->
Caption (captions.py) and teacher-forcing a typed sentence (explain.py).

Every path below runs the one decoder step, model/decoder.py's `Decoder.step` (attention, gate beta, LSTM
cell, deep output), or its `recur` + `output` halves; none has a copy of the model. How that step computes
(eq. 4 through sigmoid in cache-sized blocks, each product the fastest way timed on this CPU, the W_z a_i and
W_e E y tables) is decided inside it by device and autograd, or by the caller passing the W_z a_i table;
`Decoder.step(..., literal=True)` with plain products and no table is the paper written out, the oracle. tests/test_one_step.py patches
AdditiveAttention and sees every path change.

The paths (path: code; when it runs; why this way; the test that proves it equal to the equations):

    greedy, CPU       search.greedy_decode
        runs: decode() with beam_size 1 on a CPU; SCST's greedy baseline (training/objectives.py)
        why:  finished images leave the batch (the least work); no W_z table (one row per image)
        test: test_fast_decoding.py::test_beam_search_on_real_photos_equals_the_literal_step (greedily too),
              test_model.py::test_beam_one_equals_greedy
    beam, CPU         search.beam_search
        runs: decode() with beam_size > 1 on a CPU: the API's caption at stored settings, evaluation, validation
        why:  K rows per image read the W_z a_i table; finished images leave the batch
        test: test_fast_decoding.py::test_the_step_equals_the_literal_step,
              test_fast_decoding.py::test_beam_search_on_real_photos_equals_the_literal_step,
              test_model.py::test_wide_beam_equals_brute_force
    device beam       device_beam.beam_search_on_device
        runs: decode() off the CPU, any beam size (1 = greedy)
        why:  fixed shapes: the host reads the device once every few steps, not every step
        test: test_device_beam.py (beam_search's hypotheses; the bundled model at its stored settings; beam 1 = greedy)
    sampling          sampling.sample, scores = rules.word_logp
        runs: Photo.sample, captioner-caption --sample
        why:  drawn, not searched; every decode rule holds
        test: test_sampling_api.py::test_the_limits_of_sampling_are_greedy_decoding; test_sampling_on_device.py
    SCST sample       sampling.sample with autograd, scores = sampling.renormalised
        runs: training.objectives.SelfCritical
        why:  gradients flow through each drawn word's log p (no tables: they hold no gradient)
        test: test_scst.py::test_samples_are_well_formed_and_their_log_probs_match_teacher_forcing
    explain           explain.force_sentences -> Decoder.teacher_force
        runs: Photo.explain, grounding
        why:  a given sentence: no search, one batched pass; the W_z a_i table (a few rows a step)
        test: test_explain.py::test_explain_reproduces_greedy_on_real_photos, ::test_tiny_model_explain_equals_greedy
    teacher forcing   Decoder.teacher_force: `recur` per step, `output` once
        runs: training.objectives (CrossEntropy, SCST's scst_xent)
        why:  the batch shrinks as captions end; the deep output for every token in one product
        test: test_model.py::test_teacher_forcing_equals_manual_steps_and_naive_path

The step itself: test_model.py::test_attention_equals_equations_4_to_6 (eq. 4-6 written out row by row, in
each form) and test_fast_decoding.py::test_the_step_equals_the_literal_step (every trick against literal=True).
"""
