"""The single-photo fast path (issue 31) computes what the straightforward one does: W_z a_i once per
image instead of W_z z_t per step, the evidence bias as a lookup, the copy-less preprocessing, and
captioning or explaining from precomputed features."""
from __future__ import annotations

import pytest
import torch
from PIL import Image

import captioner
from captioner.config import DecodeConfig
from captioner.decoding.evidence import Evidence, word_categories
from captioner.images import load_image, preprocess
from captioner.model.decoder import Decoder
from tests.test_model import B, D, P, tiny_decoder

VAL_PHOTOS = 3


@pytest.fixture(scope="module")
def bundled() -> captioner.Captioner:
    if not captioner.DEFAULT_CHECKPOINT.is_file():
        pytest.skip("the bundled default model is missing")
    return captioner.load()


def val_photos(root, n: int = VAL_PHOTOS) -> list:
    names = (root / "Flickr_8k.devImages.txt").read_text().split()[:n]
    return [root / "Images" / name for name in names]


@pytest.mark.parametrize("hard", [False, True])
def test_step_with_context_gates_equals_the_plain_step(hard):
    dec = Decoder(12, D, embed_dim=8, hidden_dim=10, attention_dim=7, dropout=0.0,
                  attention="hard" if hard else "soft").eval()
    G = 4  # rows per image, as beams
    feats = torch.randn(B, P, D)
    proj, ctx = dec.attention.project(feats), dec.context_gates(feats)
    assert ctx.shape == (B, P, 40)
    state = (torch.randn(B * G, 10), torch.randn(B * G, 10))
    emb, eg = dec.embed(torch.randint(4, 12, (B * G,)))
    with torch.no_grad():
        for context in (["expected", "argmax"] if hard else ["expected"]):
            plain = dec.step(state, emb, eg, feats, proj, context)
            fast = dec.step(state, emb, eg, feats, proj, context, ctx)
            for a, b in zip([*plain[:3], *plain[3]], [*fast[:3], *fast[3]]):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_evidence_bias_lookup_equals_the_formula():
    vocab = captioner.load().vocab if captioner.DEFAULT_CHECKPOINT.is_file() else pytest.skip("no bundled model")
    words = word_categories(vocab)  # (V, C)
    probs = torch.rand(2, words.shape[1])
    tokens = torch.randint(4, len(vocab), (6, 3))
    images = torch.tensor([0, 0, 0, 1, 1, 1])
    ev = Evidence(probs, words, DecodeConfig(evidence_bonus=0.0))
    assert not ev.has_bonus
    full = ev.penalty[images] + (ev.bonus[images] * (1 - words[tokens].amax(1))) @ words.t()  # the general formula
    torch.testing.assert_close(ev.bias(images, tokens), full)
    assert word_categories(vocab) is not word_categories(vocab)  # built once, but each caller owns its copy


def test_beam_search_on_real_photos_equals_the_plain_step(bundled, flickr, one_torch_thread, monkeypatch):
    """At the stored settings (beam 5, trigram blocking, evidence), the same words and maps as beam
    search through the plain step (W_z z_t every step)."""
    feats = torch.cat([bundled.features(p) for p in val_photos(flickr)])
    fast = bundled.caption_features(feats)
    plain_step = Decoder.step

    def step_without_context_gates(self, state, emb, emb_gates, feats, feat_proj, context="expected", ctx_gates=None):
        return plain_step(self, state, emb, emb_gates, feats, feat_proj, context)

    monkeypatch.setattr(Decoder, "step", step_without_context_gates)
    plain = bundled.caption_features(feats)
    for a, b in zip(fast, plain):
        assert a.words == b.words and len(a.words) > 0
        assert abs(a.log_prob - b.log_prob) < 1e-4
        assert float(abs(a.alphas - b.alphas).max()) < 1e-5


def test_features_once_then_caption_and_explain(bundled, flickr, one_torch_thread):
    photo = val_photos(flickr, 1)[0]
    feats = bundled.features(photo)
    assert feats.shape == (1, bundled.grid_size ** 2, bundled.model.encoder.out_dim)
    cap, again = bundled.caption(photo), bundled.caption_features(feats)[0]
    assert cap.words == again.words and abs(cap.alphas - again.alphas).max() < 1e-5  # (the encoder's kernels may round
    # differently with another memory alignment)
    text = "a dog runs on the grass"
    a, b = bundled.explain(photo, text), bundled.explain_features(feats, text)
    assert a.words == b.words and abs(a.alphas - b.alphas).max() < 1e-5
    assert abs(a.word_log_probs - b.word_log_probs).max() < 1e-4
    assert bundled.caption_features(feats, beam_size=1)[0].words == bundled.caption(photo, beam_size=1).words


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
    """Without autograd embed() looks W_e E y up in a table filled as words occur; a training step
    (an in-place update of either weight) or another dtype drops it."""
    dec = tiny_decoder(12)
    words = torch.tensor([[4, 5, 4], [7, 4, 11]])
    want = lambda: dec.gates_embed(dec.embedding(words))  # noqa: E731 - the plain product
    with torch.no_grad():
        torch.testing.assert_close(dec.embed(words)[1], want())
        other = torch.tensor([5, 6])  # a remembered word and a new one
        torch.testing.assert_close(dec.embed(other)[1], dec.gates_embed(dec.embedding(other)))
        for weight in (dec.embedding.weight, dec.gates_embed.weight):
            weight.add_(0.5)  # as an optimiser step does
            torch.testing.assert_close(dec.embed(words)[1], want())
    opt = torch.optim.SGD(dec.parameters(), lr=1.0)
    dec.embed(words)[1].sum().backward()  # with autograd: the plain product, so gradients flow
    assert dec.gates_embed.weight.grad is not None and dec.embedding.weight.grad.abs().sum() > 0
    opt.step()
    with torch.no_grad():
        torch.testing.assert_close(dec.embed(words)[1], want())
        torch.testing.assert_close(dec.double().embed(words)[1], want())


@pytest.mark.parametrize("n", [1, 2, 5, 16, 17, 81])
def test_few_rows_linear_equals_nn_linear(n):
    from captioner.model import rows

    for layer in (torch.nn.Linear(64, 300), torch.nn.Linear(64, 300, bias=False)):
        x = torch.randn(n, 64, requires_grad=True)
        y = rows.linear(layer, x)
        torch.testing.assert_close(y, layer(x), atol=1e-5, rtol=1e-5)
        y.sum().backward()  # the swapped product has the same gradients
        torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(n, -1), atol=1e-5, rtol=1e-5)
