"""The one decoder step computes what the paper's equations say however it computes them (eq. 4 through
sigmoid in cache-sized blocks, few-row products, W_z a_i once per image instead of W_z z_t per step, W_e E y
looked up): checked against `Decoder.step(..., literal=True)` with plain products and no table. Also the
evidence bias as a lookup, the copy-less preprocessing, and captioning or explaining from precomputed
features."""
from __future__ import annotations

import os

import pytest
import torch
from PIL import Image

from captioner.config import DecodeConfig
from captioner.decoding.rules import Evidence, word_categories
from captioner.decoding.photo import caption_photos
from captioner.images import load_image, preprocess
from captioner.model import attention, packed_linear
from captioner.model.decoder import Decoder
from .conftest import B, D, P, tiny_decoder
from .rules_oracle import evidence_bias

VAL_PHOTOS = 3


def val_photos(root, n: int = VAL_PHOTOS) -> list:
    names = (root / "Flickr_8k.devImages.txt").read_text().split()[:n]
    return [root / "Images" / name for name in names]


def literal_step(dec: Decoder, state, words: torch.Tensor, feats: torch.Tensor, context: str = "expected"):
    """The oracle: Decoder.step with eq. 4 as the paper writes it, every product made now, no table."""
    emb = dec.embedding(words)  # (N, E)
    return dec.step(state, emb, dec.gates_embed(emb), feats, dec.attention.project(feats), context, literal=True)


@torch.no_grad()
def test_literal_ignores_both_tables():
    """Decoder.step(..., literal=True) is the whole oracle: the word-gate and W_z a_i tables a caller passes are not
    read (garbage in them changes nothing), so a test reaches the equations without avoiding the tables itself."""
    dec = tiny_decoder(12).eval()
    feats, words = torch.rand(2, P, D), torch.tensor([4, 5])
    state, proj = dec.init_state(feats), dec.attention.project(feats)
    emb, gates = dec.embed(words)
    want = dec.step(state, emb, gates, feats, proj, literal=True)
    got = dec.step(state, emb, torch.full_like(gates, 1e3), feats, proj, ctx_gates=torch.full((2, P, gates.shape[1]),
                   -1e3), literal=True)
    for a, b in zip(want[:3], got[:3]):
        assert torch.equal(a, b)


def test_the_context_table_refuses_a_bias():
    """The W_z a_i table holds only because W_z has no bias: a decoder given one is refused, not silently wrong."""
    dec = tiny_decoder(12)
    dec.gates_context.bias = torch.nn.Parameter(torch.zeros(dec.gates_context.out_features))
    with pytest.raises(ValueError, match="without a bias"):
        dec.context_gates(torch.rand(1, P, D))


def test_inference_mode_and_ordinary_calls_mix():
    """The word-gate table made under torch.inference_mode serves later no_grad calls and autograd calls still get
    gradients, in any order (the table is never an inference tensor that autograd would have to read)."""
    dec = tiny_decoder(12)
    words = torch.tensor([[4, 5, 4], [7, 4, 11]])
    want = lambda: dec.gates_embed(dec.embedding(words))  # noqa: E731 - the plain product
    with torch.inference_mode():
        torch.testing.assert_close(dec.embed(words)[1], want())
    with torch.no_grad():
        torch.testing.assert_close(dec.embed(torch.tensor([5, 6, 9]))[1], dec.gates_embed(dec.embedding(
            torch.tensor([5, 6, 9]))))
    dec.embed(words)[1].sum().backward()
    assert dec.gates_embed.weight.grad is not None
    with torch.no_grad():
        dec.gates_embed.weight.add_(0.25)
        torch.testing.assert_close(dec.embed(words)[1], want())
    with torch.inference_mode():
        torch.testing.assert_close(dec.embed(words)[1], want())


@pytest.mark.parametrize("hard", [False, True])
def test_the_step_equals_the_literal_step(hard, monkeypatch):
    """Decoder.step as decoding runs it on a CPU (sigmoid form in blocks, few-row products, word-gate lookup,
    with and without the context-gate table) == the literal step (tanh, plain products) for G beams per image."""
    monkeypatch.setattr(attention, "BLOCK_ELEMENTS", 2 * 4 * P * 7)  # 2 images per block, a partial last block
    torch.manual_seed(0)
    dec = tiny_decoder(attention="hard" if hard else "soft")
    G = 4  # rows per image, as beams: 12 rows, within the few-row products' range
    feats = torch.randn(B, P, D)
    state = (torch.randn(B * G, 10), torch.randn(B * G, 10))
    words = torch.randint(4, 12, (B * G,))
    with torch.no_grad():
        ctx = dec.context_gates(feats)
        assert ctx.shape == (B, P, 40)
        for context in (["expected", "argmax"] if hard else ["expected"]):
            want = literal_step(dec, state, words, feats, context)
            proj = dec.attention.project(feats)
            for table in (ctx, None):
                got = dec.step(state, *dec.embed(words), feats, proj, context, table)
                for a, b in zip([*want[:3], *want[3]], [*got[:3], *got[3]]):
                    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_evidence_bias_lookup_equals_the_formula(bundled):
    """Evidence.bias_after (through the literal tests/rules_oracle.evidence_bias) == the bonus of the categories the
    row has not named yet, written out from the settings, with a bonus and without one (no bias at all); the veto,
    Evidence.ruled_out, is the words of the categories below the floor."""
    vocab = bundled.vocab
    words = word_categories(vocab)  # (V, C)
    torch.manual_seed(0)
    probs = torch.rand(2, words.shape[1])  # (2, C)
    named_cat = int(words.sum(0).argmax())  # a category with words, named in the rows' history below
    probs[:, named_cat] = 0.9
    tokens = torch.randint(4, len(vocab), (6, 3))
    tokens[:2, 1] = int(words[:, named_cat].nonzero()[0])
    images = torch.tensor([0, 0, 0, 1, 1, 1])
    for bonus in (0.7, 0.0):
        s = DecodeConfig(evidence_bonus=bonus, evidence_floor=0.3)
        ev = Evidence(probs, words, s)
        assert ev.has_bonus == (bonus > 0)
        assert torch.equal(ev.ruled_out, (probs < s.evidence_floor).float() @ words.t() > 0)  # (2, V)
        earned = bonus * probs * (probs >= s.evidence_floor).float()  # (2, C)
        named = words[tokens].amax(1)  # (6, C): categories each row has named
        full = (earned[images] * (1 - named)) @ words.t()  # (6, V): the general formula
        got = evidence_bias(ev, images, tokens)
        torch.testing.assert_close(got, full)
        if bonus:  # the bonus is really there, and withheld from a category a row has named
            assert float(got.abs().max()) > 0.1
            assert float(got[:2][:, words[:, named_cat] > 0].abs().max()) < 1e-6
    assert word_categories(vocab) is not word_categories(vocab)  # built once, but each caller owns its copy


@pytest.mark.slow
def test_beam_search_on_real_photos_equals_the_literal_step(bundled, flickr, one_torch_thread, monkeypatch):
    """At the stored settings (beam 5, trigram blocking, evidence) and greedily, the same words and maps
    as decoding through the literal step (eq. 4 with tanh, W_z z_t and W_e E y multiplied every step)."""
    photos = bundled.read_batch(val_photos(flickr))  # read once, captioned four times (decoding/photo.py)
    fast_beam, fast_greedy = caption_photos(bundled, photos), caption_photos(bundled, photos, beam_size=1)
    step = Decoder.step

    def literal(self, state, emb, emb_gates, feats, feat_proj, context="expected", ctx_gates=None):
        return step(self, state, emb, emb_gates, feats, feat_proj, context, ctx_gates, literal=True)  # tables ignored
    monkeypatch.setattr(Decoder, "step", literal)
    ref_beam, ref_greedy = caption_photos(bundled, photos), caption_photos(bundled, photos, beam_size=1)
    for a, b in zip(fast_beam + fast_greedy, ref_beam + ref_greedy):
        assert a.words == b.words and len(a.words) > 0
        assert abs(a.log_prob - b.log_prob) < 1e-4
        assert float(abs(a.alphas - b.alphas).max()) < 1e-5


def test_packed_and_plain_products_give_the_same_captions(bundled, flickr, one_torch_thread, monkeypatch):
    """The fixed rule's packed products (model/packed_linear.py) and plain F.linear everywhere give the bundled
    model's same captions at its stored settings, beam and greedy."""
    photos = bundled.read_batch(val_photos(flickr, 3))
    texts = {}
    for rule in ("packed", "plain"):
        if rule == "packed" and not packed_linear.has_onednn():
            continue
        monkeypatch.setattr(packed_linear, "_has_onednn", rule == "packed")
        texts[rule] = [c.text for c in caption_photos(bundled, photos)] + [c.text for c in caption_photos(
            bundled, photos[:1], beam_size=1)]
    assert len(set(map(tuple, texts.values()))) == 1, texts


def test_a_photo_is_read_once_then_asked(bundled, flickr, one_torch_thread, monkeypatch):
    """Captioner.read runs the encoder once and the ImageNet head once; the Photo's captions (any settings),
    explanations and concepts then run neither again, and equal what the one-call API gives."""
    import captioner.decoding.reading as reading_mod
    from captioner.concepts import detectors as det_mod, maps as maps_mod

    photo = val_photos(flickr, 1)[0]
    runs = {"encoder": 0, "head": 0}
    real_encode, real_logits = type(bundled.model).encode, reading_mod.imagenet_logits

    def encode(self, x):
        runs["encoder"] += 1
        return real_encode(self, x)

    def logits(head, feats):
        runs["head"] += 1
        return real_logits(head, feats)

    monkeypatch.setattr(type(bundled.model), "encode", encode)
    for mod in (reading_mod, det_mod, maps_mod):  # every module that could run the head's classifier
        monkeypatch.setattr(mod, "imagenet_logits", logits)
    read = bundled.read(photo)
    assert runs == {"encoder": 1, "head": 1}
    assert read.features.shape == (1, bundled.grid_size ** 2, bundled.model.encoder.out_dim)
    text = "a dog runs on the grass"
    cap, greedy, exp, concepts = read.caption(), read.caption(beam_size=1), read.explain(text), read.concepts
    assert runs == {"encoder": 1, "head": 1}, runs  # asked four times, read once
    assert bundled.caption(photo).text == cap.text and bundled.caption(photo, beam_size=1).words == greedy.words
    assert runs == {"encoder": 3, "head": 3}  # each one-call caption reads the photo once (encoder + head)
    a = bundled.explain(photo, text)
    assert runs == {"encoder": 4, "head": 4}
    assert a.words == exp.words and abs(a.alphas - exp.alphas).max() < 1e-5
    assert abs(a.word_log_probs - exp.word_log_probs).max() < 1e-4
    # one list: the API's concepts, a caption's, an explained sentence's and the photo's
    assert bundled.concepts([photo])[0].top == cap.concepts == exp.concepts == concepts.top


def test_preprocess_equals_the_previous_formula(bundled, flickr, coco_mini):
    """The copy-less conversion gives bit-identical network input (Flickr8k and full-size COCO photos)."""
    pre = bundled.preprocess
    S = pre.image_size
    paths = val_photos(flickr, 2) + sorted((coco_mini / "train2017").glob("*.jpg"))[:2]
    for path in paths:
        img = load_image(path).resize((S, S), Image.BILINEAR, reducing_gap=None)
        x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(S, S, 3).permute(2, 0, 1).float() / 255
        want = (x - torch.tensor(pre.mean).view(3, 1, 1)) / torch.tensor(pre.std).view(3, 1, 1)
        assert torch.equal(pre(path), want)
        assert torch.equal(preprocess(load_image(path), S, pre.mean, pre.std), want)


def test_remembered_word_gates_follow_the_weights():
    """Without autograd the step looks W_e E y up in a table filled as words occur; a training step
    (an in-place update of either weight) or another dtype drops it."""
    dec = tiny_decoder(12)
    steps = dec
    words = torch.tensor([[4, 5, 4], [7, 4, 11]])
    want = lambda: dec.gates_embed(dec.embedding(words))  # noqa: E731 - the plain product
    with torch.no_grad():
        torch.testing.assert_close(steps.embed(words)[1], want())
        other = torch.tensor([5, 6])  # a remembered word and a new one
        torch.testing.assert_close(steps.embed(other)[1], dec.gates_embed(dec.embedding(other)))
        for weight in (dec.embedding.weight, dec.gates_embed.weight):
            weight.add_(0.5)  # as an optimiser step does
            torch.testing.assert_close(steps.embed(words)[1], want())
    opt = torch.optim.SGD(dec.parameters(), lr=1.0)
    steps.embed(words)[1].sum().backward()  # with autograd: the plain product, so gradients flow
    assert dec.gates_embed.weight.grad is not None and dec.embedding.weight.grad.abs().sum() > 0
    opt.step()
    with torch.no_grad():
        torch.testing.assert_close(dec.embed(words)[1], want())
        torch.testing.assert_close(dec.double().embed(words)[1], want())


@pytest.mark.parametrize("n", [1, 2, 5, 16, 17, 81])
def test_the_packed_product_equals_nn_linear(n):
    """packed_linear.linear gives nn.Linear's numbers to float rounding at any row count, with and without a bias
    and with leading dimensions; with autograd the product is plain and gradients flow."""
    for layer in (torch.nn.Linear(64, 300), torch.nn.Linear(64, 300, bias=False)):
        x = torch.randn(n, 64)
        with torch.no_grad():
            want = layer(x)
            torch.testing.assert_close(packed_linear.linear(layer, x), want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(packed_linear.linear(layer, x.view(1, n, 64)), want.view(1, n, 300),
                                       atol=1e-5, rtol=1e-5)
            assert torch.equal(packed_linear.linear(layer, x, plain=True), want)
        x.requires_grad_(True)
        y = packed_linear.linear(layer, x)
        torch.testing.assert_close(y, layer(x))
        y.sum().backward()
        torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(n, -1), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_row_gives_the_same_numbers_alone_or_among_others():
    """The fixed rule computes a row the same whether it is alone or one of a batch's rows, and the same on every
    call: a photo's numbers never depend on what else is decoded beside it or on a timing."""
    layer = torch.nn.Linear(512, 2048)
    x = torch.randn(40, 512)
    whole = packed_linear.linear(layer, x)
    for n in (1, 5, 17):
        assert torch.equal(packed_linear.linear(layer, x[:n]), whole[:n])
    assert torch.equal(packed_linear.linear(layer, x), whole)


def test_a_pointwise_convolution_as_rows_equals_conv2d():
    """packed_linear.pointwise gives a 1x1 convolution's numbers to float rounding for channels-last and contiguous
    input, a row alone or among others the same; only 1x1, stride-1, ungrouped, unpadded convolutions qualify."""
    conv = torch.nn.Conv2d(24, 40, 1)
    x = torch.randn(3, 24, 7, 5)
    with torch.no_grad():
        for inp in (x, x.contiguous(memory_format=torch.channels_last)):
            torch.testing.assert_close(packed_linear.pointwise(conv, inp), conv(inp), atol=1e-5, rtol=1e-5)
        assert torch.equal(packed_linear.pointwise(conv, x[1:2]), packed_linear.pointwise(conv, x)[1:2])
    assert packed_linear.pointwise(conv, x.requires_grad_(True)).requires_grad  # autograd: F.conv2d
    assert packed_linear.is_pointwise(conv)
    Conv = torch.nn.Conv2d
    for other in (Conv(24, 40, 3), Conv(24, 40, 1, stride=2), Conv(24, 40, 1, groups=8), Conv(24, 40, 1, padding=1),
                  torch.nn.Linear(24, 40)):
        assert not packed_linear.is_pointwise(other), other


@torch.no_grad()
def test_a_pointwise_convolution_with_its_batch_norm_folded_in_equals_the_three_layers():
    """pointwise(conv, x, bn, relu6=True) is relu6(bn(conv(x))) to float rounding, with the batch norm folded into
    the packed weight; the folded copy follows a change of the batch norm's statistics; a batch norm in training
    mode (batch statistics) is not folded: the three layers as written, bit for bit."""
    conv, bn = torch.nn.Conv2d(24, 40, 1, bias=False), torch.nn.BatchNorm2d(40).eval()
    for t, low, high in ((bn.running_mean, -1, 1), (bn.running_var, 0.5, 2), (bn.weight, 0.5, 2), (bn.bias, -3, 3)):
        t.uniform_(low, high)
    x = torch.randn(2, 24, 6, 6).contiguous(memory_format=torch.channels_last) * 4
    layers = lambda: torch.nn.functional.relu6(bn(conv(x)))  # noqa: E731
    for relu6 in (False, True):
        want = layers() if relu6 else bn(conv(x))
        torch.testing.assert_close(packed_linear.pointwise(conv, x, bn, relu6), want, atol=1e-5, rtol=1e-5)
    bn.running_mean.add_(1.0)  # as a training step's statistics do
    folded = packed_linear.pointwise(conv, x, bn, True)
    torch.testing.assert_close(folded, layers(), atol=1e-5, rtol=1e-5)
    assert torch.equal(packed_linear.pointwise(conv, x, bn, True, plain=True), layers())  # the oracle: as written
    bn.train()
    assert torch.equal(packed_linear.pointwise(conv, x, bn, True), layers())


@torch.no_grad()
def test_the_packed_copy_follows_the_weight():
    """The packed copy is made again when the weight changes in place or the layer is copied, and the module
    stays copyable (the copy lives beside the weight, not in the module)."""
    import copy

    layer = torch.nn.Linear(48, 96)
    packed_linear.prepare(torch.nn.Sequential(layer))
    x = torch.randn(5, 48)
    layer.weight.add_(0.5)  # as an optimiser step does
    torch.testing.assert_close(packed_linear.linear(layer, x), layer(x), atol=1e-5, rtol=1e-5)
    twin = copy.deepcopy(layer)
    twin.weight.mul_(-1)
    torch.testing.assert_close(packed_linear.linear(twin, x), twin(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_linear.linear(layer, x), layer(x), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_torch_without_onednn_computes_plain(monkeypatch):
    """Where this torch has no oneDNN the rule is F.linear: the same numbers, bit for bit, and the benchmark says
    so."""
    monkeypatch.setattr(packed_linear, "_has_onednn", False)
    layer, x = torch.nn.Linear(32, 64), torch.randn(5, 32)
    assert torch.equal(packed_linear.linear(layer, x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert packed_linear.way() == "plain"


@pytest.mark.parametrize("broken", ["none", "hardtanh"])
@torch.no_grad()
def test_a_torch_whose_private_op_fails_one_form_computes_plain(monkeypatch, broken):
    """The probe tries both forms the products call (the plain one and relu6's clamp, each with a bias): where either
    fails, has_onednn() says no and every product falls back to F.linear / F.conv2d, which give the packed
    product's numbers to float rounding."""
    if not packed_linear.has_onednn():
        pytest.skip("this torch has no oneDNN packed product to compare the fallback with")
    layer, x = torch.nn.Linear(32, 64), torch.randn(5, 32)
    conv, bn = torch.nn.Conv2d(32, 48, 1, bias=False), torch.nn.BatchNorm2d(48).eval()
    bn.running_var.uniform_(0.5, 2)
    img = torch.randn(2, 32, 4, 4) * 4
    packed = packed_linear.linear(layer, x), packed_linear.pointwise(conv, img, bn, True)
    real = torch.ops.mkldnn._linear_pointwise

    def failing(rows, w, b, attr, scalars, algorithm):
        if attr == broken:
            raise RuntimeError(f"mkldnn::_linear_pointwise: {attr} is not supported")
        return real(rows, w, b, attr, scalars, algorithm)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", failing)
    monkeypatch.setattr(packed_linear, "_has_onednn", None)  # probe again
    assert not packed_linear.has_onednn() and packed_linear.way() == "plain"
    plain = packed_linear.linear(layer, x), packed_linear.pointwise(conv, img, bn, True)
    assert torch.equal(plain[0], torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert torch.equal(plain[1], torch.nn.functional.relu6(bn(conv(img))))
    for got, want in zip(plain, packed):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (packed[1] == 6).any() and (packed[1] == 0).any()  # the clamp was exercised at both ends


@pytest.mark.parametrize("bonus", [0.0, 3.0])
def test_word_bias_at_once_equals_the_bias_of_each_step(bonus):
    """Evidence.word_bias (what a caption's log-probs are corrected by) computes every word's bias at once;
    it equals the bias asked step by step with the words before it, as decoding asked it."""
    from captioner.config import DecodeConfig
    from captioner.decoding.rules import Evidence

    gen = torch.Generator().manual_seed(0)
    probs, words = torch.rand(3, 6, generator=gen), (torch.rand(20, 6, generator=gen) > 0.7).float()
    ev = Evidence(probs, words, DecodeConfig(evidence=True, evidence_bonus=bonus))
    for image in range(3):
        t = torch.randint(0, 20, (9,), generator=gen)
        steps = torch.stack([evidence_bias(ev, torch.tensor([image]), t[None, :k])[0, t[k]] for k in range(len(t))])
        assert torch.allclose(ev.word_bias(image, t.tolist()), steps, atol=1e-6)
    assert ev.word_bias(0, []).shape == (0,)


@pytest.mark.parametrize("captions", [2, 20])
def test_teacher_forcing_without_autograd_equals_it_with_autograd(captions):
    """Without autograd a few sentences read the W_z a_i table, more take the product: either way the logits,
    maps and gates of teacher forcing equal those computed with autograd (the product, as training runs it)."""
    torch.manual_seed(0)
    dec = tiny_decoder(vocab_size=12)
    feats = torch.randn(2, P, D)
    lengths = torch.arange(captions, 0, -1).clamp(max=6) + 1  # (C,) descending
    inputs = torch.randint(3, 12, (captions, int(lengths[0])))
    image_index = torch.arange(captions) % 2
    want = dec.teacher_force(feats, inputs, lengths, image_index)
    with torch.no_grad():
        got = dec.teacher_force(feats, inputs, lengths, image_index)
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b.detach(), atol=1e-5, rtol=1e-5)


def test_mkl_sums_the_attentions_products_in_one_order_at_1_and_2_threads():
    """The products left to MKL (the attention's context: 5 beams x 81 locations x 1280, its W_z table, the evidence
    map) are the same at 1 and 2 threads under MKL's strict mode, which the commands, the app and these tests ask
    for before their first product (model/blas.py); MKL's default split them differently (5.7e-6 on an AMD EPYC)."""
    import subprocess
    import sys

    assert os.environ.get("MKL_CBWR") == "AUTO,STRICT"  # conftest asked, as every command does
    gen = torch.Generator().manual_seed(0)
    old, got = torch.get_num_threads(), {}
    try:
        for m, k, n in [(5, 81, 1280), (5, 81, 2048), (5, 61, 2847)]:
            a, b = torch.randn(1, m, k, generator=gen), torch.randn(1, k, n, generator=gen)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                got[threads] = torch.bmm(a, b)
            assert torch.equal(got[1], got[2]), (m, k, n)
    finally:
        torch.set_num_threads(old)
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    said = subprocess.run([sys.executable, "-c", "import os, captioner.cli, sys; print(os.environ['MKL_CBWR']); "
                           "print('torch' in sys.modules)"], env=env, capture_output=True, text=True, check=True)
    assert said.stdout.split() == ["AUTO,STRICT", "False"]  # a command asks before torch is even imported
    kept = subprocess.run([sys.executable, "-c", "import os, captioner.cli; print(os.environ['MKL_CBWR'])"],
                          env={**env, "MKL_CBWR": "AVX2"}, capture_output=True, text=True, check=True)
    assert kept.stdout.strip() == "AVX2"  # the user's own choice is kept


def test_the_one_prepare_step_makes_what_inference_reads_and_a_changed_weight_is_never_read_stale():
    """ShowAttendTell.prepare makes the word-gate table and the packed copies from the weights (the Captioner at
    load, training before each validation); a weight changed after it (a training step) gives the new numbers."""
    import copy

    from .conftest import tiny_captioner

    model = tiny_captioner().model.eval()
    words = torch.tensor([4, 5, 6])
    assert model.prepare() is model and model.decoder._word_gates is not None
    with torch.no_grad():
        before = model.decoder.embed(words)[1].clone()  # (3, 4H) from the table
        model.decoder.gates_embed.weight.mul_(2)  # a training step, in place
        after = model.decoder.embed(words)[1]
        want = model.decoder.gates_embed(model.decoder.embedding(words), True)  # the plain product
    torch.testing.assert_close(after, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(after, before)
    fresh = copy.deepcopy(model).prepare()
    with torch.no_grad():
        torch.testing.assert_close(fresh.decoder.embed(words)[1], after)
