"""Public API and checkpoints: save -> load gives identical outputs; Caption's contract."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import captioner
from captioner.checkpoint import CheckpointError, load_checkpoint
from captioner.config import Config

from .conftest import WORDS, photo, tiny_captioner


def test_caption_contract():
    cap = tiny_captioner().caption(photo(), beam_size=3, max_len=8)
    assert isinstance(cap, captioner.Caption)
    assert cap.words and cap.text == " ".join(cap.words)
    assert all(w in WORDS + ["<unk>"] for w in cap.words)
    assert cap.alphas.shape == (len(cap.words), 7, 7)
    assert np.allclose(cap.alphas.reshape(len(cap.words), -1).sum(-1), 1.0, atol=1e-5)
    assert isinstance(cap.log_prob, float) and cap.log_prob <= 0


def test_inputs_pil_path_bytes_agree(tmp_path):
    model = tiny_captioner()
    img = photo()
    path = tmp_path / "p.png"
    img.save(path)
    a = model.caption(img, beam_size=2, max_len=6)
    b = model.caption(str(path), beam_size=2, max_len=6)
    c = model.caption(path.read_bytes(), beam_size=2, max_len=6)
    assert a.words == b.words == c.words
    assert a.log_prob == pytest.approx(b.log_prob, abs=1e-5)


def test_batch_equals_single():
    model = tiny_captioner()
    imgs = [photo(100 + 30 * i, 80) for i in range(3)]
    batch = model.caption_batch(imgs, beam_size=3, max_len=8)
    for img, cap in zip(imgs, batch):
        single = model.caption(img, beam_size=3, max_len=8)
        assert single.words == cap.words and single.log_prob == pytest.approx(cap.log_prob, abs=1e-4)


def test_a_list_of_images_in_gives_a_list_of_captions_out():
    """`Captioner.caption([a, b])` said "expected a PIL image, a path or bytes, got list": a list (or tuple) in gives
    one Caption per image, in order, the same as caption_batch and as each image alone."""
    model = tiny_captioner()
    imgs = [photo(120, 80), photo(60, 200)]
    caps = model.caption(imgs, beam_size=2, max_len=6)
    assert isinstance(caps, list) and len(caps) == 2 and all(isinstance(c, captioner.Caption) for c in caps)
    assert [c.words for c in caps] == [c.words for c in model.caption_batch(imgs, beam_size=2, max_len=6)]
    assert [c.words for c in caps] == [model.caption(i, beam_size=2, max_len=6).words for i in imgs]
    assert [c.words for c in model.caption(tuple(imgs), beam_size=2, max_len=6)] == [c.words for c in caps]
    assert model.caption([], beam_size=2) == []


def test_image_error_is_a_value_error():
    with pytest.raises(captioner.ImageError, match="not an image") as e:
        tiny_captioner().caption(b"this is text, not a picture")
    assert isinstance(e.value, ValueError)


def test_save_load_roundtrip_gives_identical_outputs(tmp_path):
    model = tiny_captioner()
    path = tmp_path / "m.safetensors"
    model.save(path, metrics={"Bleu_4": 0.5})
    loaded = captioner.load(path)
    img = photo()
    a, b = model.caption(img, beam_size=3, max_len=8), loaded.caption(img, beam_size=3, max_len=8)
    assert a.words == b.words and a.log_prob == b.log_prob and np.array_equal(a.alphas, b.alphas)
    assert loaded.metrics == {"Bleu_4": 0.5} and loaded.vocab.itos == model.vocab.itos
    assert loaded.config == model.config
    # fp16 file: same captions
    half = tmp_path / "h.safetensors"
    model.save(half, half=True)
    assert captioner.load(half).caption(img, beam_size=3, max_len=8).words == a.words


def test_half_file_rounds_the_decoder_but_never_a_frozen_encoder(tmp_path):
    """A frozen encoder keeps its exact weights in an fp16 file: the features (and the feature cache key,
    which hashes the encoder's weights) stay those of training. A fine-tuned encoder is rounded too."""
    from safetensors import safe_open

    from captioner.data.features import encoder_fingerprint

    model = tiny_captioner()
    with torch.no_grad():  # values fp16 cannot hold exactly, as real BN statistics are
        for p in model.model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    frozen = tmp_path / "frozen.safetensors"
    model.save(frozen, half=True)
    with safe_open(str(frozen), "pt") as f:
        dtypes = {k: f.get_tensor(k).dtype for k in f.keys()}
    enc = {d for k, d in dtypes.items() if k.startswith("encoder.") and d.is_floating_point}
    dec = {d for k, d in dtypes.items() if k.startswith("decoder.") and d.is_floating_point}
    assert enc == {torch.float32} and dec == {torch.float16}
    assert encoder_fingerprint(captioner.load(frozen).model.encoder) == encoder_fingerprint(model.model.encoder)

    model.config.model.fine_tune_encoder = True
    tuned = tmp_path / "tuned.safetensors"
    model.save(tuned, half=True)
    with safe_open(str(tuned), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys() if f.get_tensor(k).is_floating_point()} == {torch.float16}
    assert encoder_fingerprint(captioner.load(tuned).model.encoder) != encoder_fingerprint(model.model.encoder)


def test_bfloat16_captioner_keeps_the_contract_and_round_trips(tmp_path):
    fp32 = tiny_captioner()
    path = tmp_path / "m.safetensors"
    fp32.save(path)
    bf16 = captioner.load(path, dtype="bfloat16")
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    cap = bf16.caption(photo(), beam_size=3, max_len=8)
    assert cap.alphas.dtype == np.float32 and cap.alphas.shape == (len(cap.words), 7, 7)
    assert np.allclose(cap.alphas.reshape(len(cap.words), -1).sum(-1), 1.0, atol=1e-2)  # bf16 softmax
    assert cap.log_prob <= 0 and cap.text == " ".join(cap.words)
    # saved as float32 and loaded back in bf16: the same numbers, so the same outputs
    again = tmp_path / "bf16.safetensors"
    bf16.save(again)
    assert {v.dtype for v in load_checkpoint(again).model_state.values() if v.is_floating_point()} == {torch.float32}
    b = captioner.load(again, dtype=torch.bfloat16).caption(photo(), beam_size=3, max_len=8)
    assert b.words == cap.words and b.log_prob == cap.log_prob and np.array_equal(b.alphas, cap.alphas)
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16"):
        captioner.load(path, dtype="float16")
    assert captioner.preferred_dtype("cpu") in ("float32", "bfloat16")


def test_checkpoint_never_unpickles(tmp_path):
    bad = tmp_path / "model.pt"
    torch.save({"w": torch.zeros(2)}, bad)
    with pytest.raises(CheckpointError, match="never unpickles"):
        load_checkpoint(bad)


def test_default_model_or_clear_error():
    if captioner.DEFAULT_CHECKPOINT.is_file():
        model = captioner.load()
        assert model.caption(photo(), beam_size=3).words
    else:
        with pytest.raises(CheckpointError, match="default model is missing"):
            captioner.load()


def test_decode_settings_default_to_the_model_files(tmp_path, monkeypatch):
    model = tiny_captioner()
    model.config.decode.beam_size, model.config.decode.max_len, model.config.decode.length_penalty = 5, 7, 0.5
    path = tmp_path / "beam5.safetensors"
    model.save(path)
    loaded = captioner.load(path)
    calls = []
    from captioner.decoding import captions

    real = captions.decode

    def spy(decoder, feats, ids, settings, rules=None, recorded=None):
        calls.append((settings.beam_size, settings.max_len, settings.length_penalty))
        return real(decoder, feats, ids, settings, rules, recorded)

    monkeypatch.setattr(captions, "decode", spy)
    img = photo()
    stored = loaded.caption(img)
    explicit = loaded.caption(img, beam_size=5)
    greedy = loaded.caption(img, beam_size=1, max_len=3, length_penalty=0.0)
    assert calls == [(5, 7, 0.5), (5, 7, 0.5), (1, 3, 0.0)]  # None = the file's; an argument overrides
    assert stored.words == explicit.words and stored.log_prob == explicit.log_prob
    assert len(stored.alternatives) == 4 and greedy.alternatives == []  # beam 5 keeps 5 hypotheses, greedy 1
    assert loaded.caption_batch([img])[0].words == stored.words and calls[-1] == (5, 7, 0.5)
    used = loaded.decode_settings(beam_size=2)
    assert (used.beam_size, used.max_len, used.length_penalty, used.forbid_unk) == (2, 7, 0.5, True)
    assert loaded.config.decode.beam_size == 5  # resolving settings never changes the stored ones
    with pytest.raises(ValueError, match=r"decode.beam_size must lie in \[1, 16\], got 0"):
        loaded.decode_settings(beam_size=0)
    with pytest.raises(ValueError, match="decode.person_floor must lie in"):  # every limit beside its field
        loaded.decode_settings(person_floor=1.5)
    with pytest.raises(TypeError, match="unknown decode setting"):
        loaded.caption(img, beam_sise=2)  # a typo is an error, not a silently ignored keyword
    with pytest.raises(ValueError, match="hard_context must be one of"):
        loaded.decode_settings(hard_context="foo")
    # typed like a config file: text is read as its type, a wrong type is an error naming key and value
    assert loaded.decode_settings(block_trigrams="false").block_trigrams is False
    assert loaded.decode_settings(beam_size="3").beam_size == 3
    with pytest.raises(ValueError, match=r"decode.beam_size expects int, got 2.5"):
        loaded.decode_settings(beam_size=2.5)
    with pytest.raises(ValueError, match=r"decode.block_trigrams expects true/false, got 'ture'"):
        loaded.decode_settings(block_trigrams="ture")
    with pytest.raises(ValueError, match=r"decode.evidence expects bool, got 1"):
        loaded.decode_settings(evidence=1)


def test_captioner_never_changes_the_model_it_is_given():
    """The model a Captioner is built from keeps its mode, device and dtype; the Captioner converts a copy."""
    import torch

    tiny = tiny_captioner()
    model = tiny.model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bf16 = captioner.Captioner(model, tiny.vocab, tiny.config, dtype="bfloat16")
    assert model.training and next(model.parameters()).dtype == torch.float32
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert bf16.model is not model and next(bf16.model.parameters()).dtype == torch.bfloat16
    same = captioner.Captioner(model.eval(), tiny.vocab, tiny.config)
    assert same.model is model  # already ready: no copy


def test_preprocess_belongs_to_the_model_recipe():
    from captioner.images import load_image, preprocess
    from captioner.model.encoder import Preprocess, build_preprocess, normalization

    model = tiny_captioner()
    prep = model.preprocess
    assert isinstance(prep, Preprocess) and prep == build_preprocess(model.config.model)
    assert (prep.encoder, prep.image_size, prep.grid_size) == ("efficientnet_lite0", 224, 7)
    assert (prep.mean, prep.std) == normalization("efficientnet_lite0")
    img = photo()
    x = model.preprocess(img)  # still callable as before
    assert x.shape == (3, 224, 224) and x.dtype == torch.float32
    assert torch.equal(x, preprocess(load_image(img), 224, prep.mean, prep.std))
    with pytest.raises(captioner.ImageError):
        prep(b"not a picture")
    with pytest.raises(AttributeError):
        prep.image_size = 100  # frozen: one recipe, never edited in place
    # cache names: the recipe's, bf16 features are another cache, and features.cache_name agrees
    from captioner.data.features import cache_name

    assert prep.cache_name("flickr8k", "train") == "flickr8k-train-efficientnet_lite0-224px-g7"
    assert prep.cache_name("flickr8k", "train", "float32") == prep.cache_name("flickr8k", "train")
    assert prep.cache_name("coco", "val2017", "bfloat16").endswith("-bfloat16")
    assert cache_name("flickr8k", "train", "efficientnet_lite0", 224, 7) == prep.cache_name("flickr8k", "train")
    resnet = Config().model
    resnet.encoder, resnet.image_size = "resnet101", 256
    assert build_preprocess(resnet).mean == normalization("resnet101")[0]
    resnet.encoder = "vgg16"
    with pytest.raises(ValueError, match="unknown encoder 'vgg16'"):
        build_preprocess(resnet)


def test_default_device():
    assert captioner.default_device() == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("beam_size", [1, 3])
def test_caption_betas_are_the_gates_of_its_words(beam_size):
    """Caption.betas: one gate value per word, in [0, 1], the ones decoding computed for those words."""
    from captioner.decoding.rules import Lexicon, Rules
    from captioner.decoding.search import decode
    from captioner.vocab import SpecialIds

    model = tiny_captioner()
    with torch.no_grad():
        model.model.decoder.attention.gate.bias.fill_(-1.0)  # gates away from 1, so a mix-up would show
    cap = model.caption(photo(), beam_size=beam_size, max_len=8)
    assert cap.betas.shape == (len(cap.words),) and cap.betas.dtype == np.float32
    assert ((cap.betas >= 0) & (cap.betas <= 1)).all()
    with torch.no_grad():
        feats = model.model.encode(model.preprocess(photo())[None])
    ids, settings = SpecialIds.of(model.vocab), model.decode_settings(beam_size=beam_size, max_len=8)
    (best, *_), = decode(model.model.decoder, feats, ids, settings, Rules(ids, settings, lexicon=Lexicon.of(model.vocab)))
    assert np.allclose(cap.betas, best.betas.numpy(), atol=1e-6)
    # captions built without gates (older code) still construct, with no betas
    assert captioner.Caption("a", ["a"], np.ones((1, 7, 7)) / 49, -1.0).betas.shape == (0,)


def test_a_photo_far_smaller_than_the_input_gets_a_note():
    """A 10x10 photo got a confident caption and no word that the model enlarged it 22x: a photo whose shorter
    side is below half the model's input side (images are resized to image_size x image_size) gets a note, in
    Caption.notes and in the JSON (to_dict), from caption, caption_batch and explain alike."""
    from captioner.images import SMALL_PHOTO

    model = tiny_captioner()
    side = model.config.model.image_size  # 224
    tiny = model.caption(photo(10, 10), beam_size=1, max_len=4)
    note = "The photo is only 10x10 pixels, far smaller than the model's 224x224 input"
    assert tiny.photo_size == (10, 10) and tiny.input_side == side
    assert any(n.startswith(note) for n in tiny.notes) and tiny.to_dict(maps=False)["notes"] == tiny.notes
    limit = int(SMALL_PHOTO * side)  # 112: a shorter side below it gets the note, at or above it does not
    narrow, enough = model.caption_batch([photo(300, limit - 1), photo(300, limit)], beam_size=1, max_len=4)
    assert any("300x111 pixels" in n for n in narrow.notes) and enough.notes == []
    assert model.caption(photo(), beam_size=1, max_len=4).notes == []  # 320x200: no note
    assert any(n.startswith(note) for n in model.explain(photo(10, 10), "a dog").notes)


def test_a_single_flat_colour_photo_gets_a_note():
    """A plain orange 10000x10000 image got "a person sitting in a blue sky" and no note: a photo of one flat
    colour (images.flat_colour) says there is nothing to caption, in Caption.notes, the JSON and Photo.notes;
    a photo with anything in it (noise, a gradient, one small mark) does not."""
    import io

    from PIL import Image, ImageDraw

    model = tiny_captioner()
    flat_note = "The photo is a single flat colour"
    jpeg = io.BytesIO()
    Image.new("RGB", (3000, 2000), (255, 140, 0)).save(jpeg, "JPEG", quality=75)
    orange, png = model.caption([jpeg.getvalue(), Image.new("RGB", (300, 300), (20, 30, 200))], beam_size=1, max_len=4)
    for cap in (orange, png):
        assert any(n.startswith(flat_note) for n in cap.notes) and cap.to_dict(maps=False)["notes"] == cap.notes
    assert any(n.startswith(flat_note) for n in model.read(jpeg.getvalue()).notes)
    gradient = Image.fromarray(np.tile(np.linspace(0, 255, 300, dtype=np.uint8)[None, :, None], (300, 1, 3)))
    marked = Image.new("RGB", (300, 300), (255, 140, 0))
    ImageDraw.Draw(marked).ellipse((100, 100, 160, 160), fill=(0, 0, 0))  # one dark spot on the orange
    for img in (photo(), gradient, marked):
        assert not any(n.startswith(flat_note) for n in model.caption(img, beam_size=1, max_len=4).notes)
    see_through = io.BytesIO()
    Image.new("RGBA", (300, 300), (0, 0, 0, 0)).save(see_through, "PNG")
    notes = model.caption(see_through.getvalue(), beam_size=1, max_len=4).notes
    assert any("fully transparent" in n for n in notes) and not any(n.startswith(flat_note) for n in notes)


def test_alternatives_carry_the_score_they_were_ranked_by():
    """Beam search ranks by log_prob / (words + 1) ** length_penalty; the app listed only log-probs, so a
    lower-ranked alternative with a better log-prob looked like a mistake."""
    def length(text: str) -> int:  # words, + <end> unless the caption was cut at max_len
        n = len(text.split())
        return n + 1 if n < 8 else n

    model = tiny_captioner()
    cap = model.caption(photo(), beam_size=4, max_len=8, length_penalty=1.0)
    assert cap.alternatives and cap.score == pytest.approx(cap.log_prob / length(cap.text), rel=1e-5)
    scores = [cap.score] + [a.score for a in cap.alternatives]
    assert scores == sorted(scores, reverse=True)  # the order shown is the ranking
    for a in cap.alternatives:
        assert a.score == pytest.approx(a.log_prob / length(a.text), rel=1e-5)
    rec = cap.to_dict(maps=False)
    assert rec["score"] == cap.score and [r["score"] for r in rec["alternatives"]] == scores[1:]


@pytest.mark.slow
def test_one_json_everywhere_names_the_settings_and_the_model_file(capsys):
    """The app's download and Caption.to_dict() wrote "settings": {} while captioner-caption --json wrote the
    settings: a Caption now knows the settings it was made with and the model file, and every JSON says them."""
    import dataclasses
    import json
    from pathlib import Path

    from captioner.cli.caption import main as caption_main
    from captioner.ui.visualize import caption_json_bytes

    model = captioner.load()
    cat = Path(captioner.DEFAULT_CHECKPOINT).parent / "examples" / "cat.jpg"
    cap = model.caption(cat, beam_size=2)
    rec = cap.to_dict(str(cat), maps=False)
    assert rec["settings"] == {**dataclasses.asdict(model.decode_settings(beam_size=2)), "precision": "float32"}
    assert rec["settings"]["beam_size"] == 2
    assert rec["model"] == str(captioner.DEFAULT_CHECKPOINT)
    app_rec = json.loads(caption_json_bytes(cap, str(cat)))
    assert {k: app_rec[k] for k in ("settings", "model")} == {k: rec[k] for k in ("settings", "model")}
    assert caption_main([str(cat), "--json", "--beam-size", "2"]) == 0
    cli_rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(cli_rec) == set(app_rec) - {"alphas"} or set(cli_rec) == set(app_rec)
    assert cli_rec["settings"] == rec["settings"] and cli_rec["model"] == rec["model"] and cli_rec["caption"] == rec["caption"]
    explained = model.explain(cat, "a cat on a wall").to_dict(maps=False)
    assert explained["settings"] == {**dataclasses.asdict(model.decode_settings()), "precision": "float32"}
    assert explained["model"] == rec["model"]


def test_one_answer_for_concepts_without_an_imagenet_head():
    """Asked of the Photo, of the Captioner or read off a Caption, an encoder without the ImageNet head
    sees nothing, the same way: no error, no None, an empty list."""
    cap = tiny_captioner()
    assert cap.read(photo()).concepts.classes  # precondition: the Lite encoder's head reads the photo
    cap.model.encoder.backbone._fc = torch.nn.Identity()  # as ResNet: the classifier dropped
    read = cap.read(photo())
    assert read.concepts.top == [] and read.concepts.classes == []
    assert [c.top for c in cap.concepts([photo(), photo(64, 64)])] == [[], []]
    assert read.caption(max_len=5).concepts == [] and read.explain("a dog").concepts == []
    with pytest.raises(KeyError, match="no ImageNet head"):
        read.concepts.prob("dog")


def test_decode_rules_are_stored_with_the_model(tmp_path):
    """What decodes is what the model file says: a saved file stores every rule; a recipe that leaves a rule
    out decodes without it; a file written before a rule was stored decodes as it always has."""
    import json

    from captioner.checkpoint import read_safetensors
    from captioner.config import DecodeConfig

    assert not DecodeConfig().block_repeats and not DecodeConfig().block_content_repeats  # a recipe turns them on
    model = tiny_captioner()
    for on in (False, True):
        model.config.decode.block_repeats = model.config.decode.block_content_repeats = on
        path = tmp_path / f"rules_{on}.safetensors"
        model.save(path)
        stored = json.loads(read_safetensors(path)[1]["config"])["decode"]
        assert stored["block_repeats"] is on and stored["block_content_repeats"] is on
        loaded = captioner.load(path)
        assert (loaded.config.decode.block_repeats, loaded.config.decode.block_content_repeats) == (on, on)
    if captioner.DEFAULT_CHECKPOINT.is_file():  # the bundled file was trained before them: it decodes with them
        stored = json.loads(read_safetensors(captioner.DEFAULT_CHECKPOINT)[1]["config"])["decode"]
        assert all(stored.get(k, v) == v for k, v in DecodeConfig.UNSTORED.items())  # stored since, or read as so
        bundled = captioner.load().config.decode
        assert all(getattr(bundled, k) == v for k, v in DecodeConfig.UNSTORED.items())


# the bundled file's decode section as it was stored before a model file kept what it fitted apart (its "fitted"
# entry): the choice's weights and the confidence map were decode settings then
OLD_LAYOUT_DECODE = {
    "beam_size": 5, "max_len": 30, "length_penalty": 1.0, "forbid_unk": True, "block_trigrams": True,
    "block_bigrams": True, "block_salad": True, "block_repeats": True, "block_content_repeats": True,
    "hard_context": "expected", "evidence": True, "evidence_floor": 0.05, "evidence_penalty": 10.0,
    "evidence_bonus": 3.0, "person_floor": 0.2, "dog_floor": 0.2, "evidence_detectors": False, "consensus_k": 5,
    "consensus_weight": 0.0, "select_wide": 3.82069, "select_agreement": 0.0, "select_log_prob": 0.0,
    "select_length": 0.0, "select_objects": 3.0, "select_top_object": 0.0, "confidence_fitted": True,
    "confidence_bias": -0.123361, "confidence_wide": 1.66427, "confidence_consensus": 1.50423,
    "confidence_nearest": 0.0, "confidence_agreement": 0.0, "confidence_margin": 0.0, "confidence_log_prob": 1.39193,
    "confidence_min_word": 0.0, "confidence_objects": 0.0, "confidence_weakest_object": 0.0, "confidence_top_p": 0.0,
    "confidence_length": 0.0, "sure_at": 0.692609}


def test_a_model_file_in_the_old_layout_loads_and_decodes_the_same(tmp_path, bundled):
    """A file whose decode settings still hold the fitted numbers (decode.consensus_weight, select_*, confidence_*,
    sure_at) and that has no "fitted" entry, as the bundled file had, loads them as its fitted data
    (config.split_fitted): the same settings and fitted data as the bundled file now, and the same captions,
    choices and confidences, number for number. Saved again, it is in the new layout."""
    import json
    from pathlib import Path

    from captioner.checkpoint import read_safetensors, write_safetensors
    from captioner.decoding.confidence import ConfidenceMap
    from captioner.decoding.consensus import memory_path

    tensors, meta = read_safetensors(captioner.DEFAULT_CHECKPOINT)
    stored = {**json.loads(meta["config"]), "decode": OLD_LAYOUT_DECODE}
    old = tmp_path / "old.safetensors"
    write_safetensors(old, tensors, {**{k: v for k, v in meta.items() if k != "fitted"}, "config": json.dumps(stored)})
    if memory_path(captioner.DEFAULT_CHECKPOINT).is_file():
        memory_path(old).symlink_to(memory_path(captioner.DEFAULT_CHECKPOINT))
    then, now = load_checkpoint(old), load_checkpoint(captioner.DEFAULT_CHECKPOINT)
    # the old layout had no val means for the map (reasons then fall back to the first weak signal)
    unmeant = {**now.fitted, "confidence": {k: v for k, v in now.fitted["confidence"].items() if k != "means"}}
    assert then.config == now.config and then.fitted == unmeant
    assert then.fitted["choice"]["wide"] == 3.82069 and then.fitted["confidence"]["sure_at"] == 0.692609
    examples = sorted((Path(captioner.__file__).parent / "assets" / "examples").glob("*.jpg"))
    again = captioner.load(old)
    for a, b in zip(again.caption(examples), bundled.caption(examples)):
        assert {**a.to_dict(maps=False), "model": None, "doubt": None} == {**b.to_dict(maps=False), "model": None,
                                                                          "doubt": None}
        assert np.array_equal(a.alphas, b.alphas)
    again.save(tmp_path / "new.safetensors")
    saved = json.loads(read_safetensors(tmp_path / "new.safetensors")[1]["fitted"])  # every signal's weight written
    assert saved["choice"] == unmeant["choice"]
    assert ConfidenceMap.from_json(saved["confidence"]) == ConfidenceMap.from_json(unmeant["confidence"])


def test_an_old_file_without_a_fitted_choice_keeps_the_consensus_rerank_it_had():
    """A file written before the choice's select_* weights stored only consensus_weight (0.3 by default, where
    it did not store it): it decoded with the consensus rerank, (1 - w) x the beam's score + w x the consensus,
    and still does; no confidence_fitted: no map."""
    from captioner.config import split_fitted

    assert split_fitted({"beam_size": 3}) == ({"beam_size": 3}, {"choice": {"score": 1 - 0.3, "consensus": 0.3}})
    assert split_fitted({"consensus_weight": 0.5, "sure_at": 0.4}) == ({}, {"choice": {"score": 0.5, "consensus": 0.5}})
    assert split_fitted({"consensus_weight": 0.0, "select_wide": 0.0}) == ({}, {})  # the beam's order: nothing fitted


def test_a_caption_is_a_value_never_changed_after_it_is_made():
    """Caption is frozen: the decoding stages build it (dataclasses.replace), nobody writes into it afterwards."""
    import dataclasses

    from captioner.decoding.captions import Alternative

    cap = captioner.Caption("a cat", ["a", "cat"], np.full((2, 1, 1), 1.0), -1.0, [("a dog", -2.0)])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cap.text = "a dog"  # type: ignore[misc]
    moved = dataclasses.replace(cap, score=-0.5)
    assert moved.score == -0.5 and cap.score is None and moved.alternatives == cap.alternatives
    assert isinstance(cap.alternatives[0], Alternative) and cap.alternatives[0].text == "a dog"  # pairs made whole
