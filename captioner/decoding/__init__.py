"""Features -> captions, as one line of stages (docs/architecture.md, "Decoding as one line of stages"):
read (reading.py: the encoder's heads, once per photo), constrain (rules.py: the rules and the photo's evidence,
built once and handed to every search and to sampling), search (search.py: the beam, greedy as its beam 1;
device_beam.py: the same beam with fixed shapes for a GPU; sampling.py), decide (choice.py orders the candidates,
confidence.py judges how sure), dress (captions.py: the frozen Caption; photo.py: a Photo read once, and
explaining a typed sentence).

Every path runs the one decoder step, model/decoder.py's `Decoder.step`; none has a copy of the model.
`Decoder.step(..., literal=True)` is the paper written out, the oracle.
"""
