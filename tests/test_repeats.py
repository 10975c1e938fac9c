"""Repeated words: "an airplane airplane", "a black and black dog", "a kitchen that is in the
kitchen". The three kinds are counted by vocab.repeats (metrics, evaluate) and ruled out in decoding by
decode.block_repeats / decode.block_content_repeats (decoding/rules.py: Repeats, ContentRepeats, Salad, each read
here through the Rules a search steps through). Random decoders, no data."""
from __future__ import annotations

import pytest
import torch

from captioner.config import DecodeConfig
from captioner.decoding.rules import Lexicon, Rules, unruled
from captioner.vocab import SpecialIds
from captioner.decoding.search import decode
from captioner.evaluation.metrics import caption_defects, reference_repeats
from captioner.vocab import repeats

from .conftest import tiny_decoder
from .greedy_oracle import greedy_decode

START, END, PAD = 1, 2, 0
AND, A = 4, 5  # token 4 plays "and", 5 plays "a" (function words); 6.. are content words
IDS = SpecialIds(START, END, PAD)
LEX = Lexicon(function_words=(AND, A), joiners=(AND,))
P, D = 9, 16


def ruled(logits: torch.Tensor, ids: SpecialIds, settings: DecodeConfig, tokens: torch.Tensor,
          lex: Lexicon = LEX) -> torch.Tensor:
    """The scores (N, V) the decoding rules give the next word after tokens (N, t), the rules' state advanced word by
    word as a search advances it."""
    rules = Rules(ids, settings, lexicon=lex)
    state = rules.start(len(tokens))
    for t in range(tokens.shape[1]):
        rules.scores(logits, tokens[:, :t], state)
        state = rules.advance(state, tokens[:, t])
    return rules.scores(logits, tokens, state)


def off(**settings) -> DecodeConfig:
    """Every repeat-related rule off unless asked: an untrained decoder over a tiny vocabulary repeats."""
    return unruled(**settings)


def kinds(tokens: list[int]) -> dict[str, bool]:
    words = ["and" if t == AND else "a" if t == A else f"w{t}" for t in tokens]
    return repeats(words)


def test_repeats_names_the_three_kinds():
    assert repeats("an airplane airplane is on the runway".split()) == {"adjacent": True, "x_and_x": False,
                                                                       "content": True}
    assert repeats("a black and black dog".split())["x_and_x"]
    assert repeats("a kitchen that is in the kitchen".split()) == {"adjacent": False, "x_and_x": False,
                                                                   "content": True}
    assert repeats("a man in a red shirt".split()) == {"adjacent": False, "x_and_x": False, "content": False}
    assert not repeats([])["content"]


def test_defects_report_each_kind_and_the_references_rate():
    out = caption_defects(["a dog dog runs", "a black and black dog", "a dog runs on the grass", "a cat on a mat"])
    assert out["repeat_adjacent"] == 0.25 and out["repeat_x_and_x"] == 0.25 and out["repeat_content"] == 0.5
    refs = reference_repeats([["A dog, a DOG!", "A cat."], ["Two birds"]])
    assert refs == {"references_repeat_adjacent": 0.0, "references_repeat_x_and_x": 0.0,
                    "references_repeat_content": pytest.approx(1 / 3)}


def test_the_rules_on_hand_made_rows():
    tokens = torch.tensor([[6, 7], [6, AND], [A, A]])  # "w6 w7", "w6 and", "a a"
    logp = ruled(torch.zeros(3, 10), IDS, off(block_repeats=True), tokens)
    assert logp[0, 7] == float("-inf") and logp[0, 6] > float("-inf")  # back to back only
    assert logp[1, 6] == float("-inf") and logp[1, AND] == float("-inf")  # "w6 and w6", "and and"
    assert logp[2, A] == float("-inf")  # even a function word is not said twice back to back
    logp = ruled(torch.zeros(3, 10), IDS, off(block_content_repeats=True), tokens)
    assert logp[0, 6] == float("-inf") and logp[0, 7] == float("-inf")  # each content word once
    assert logp[2, A] > float("-inf") and logp[1, AND] > float("-inf")  # function words may come again


@pytest.mark.parametrize("k", [1, 3])
def test_decoding_never_writes_a_repeat(k):
    """A random decoder over 10 words repeats itself; with the rules on, no caption has any of the three
    kinds, beam 1 equals greedy, and captions that had no repeat are unchanged."""
    torch.manual_seed(0)
    dec = tiny_decoder(10)  # D = 16
    feats = torch.randn(16, P, D) * 3
    plain = [h[0].tokens for h in decode(dec, feats, IDS, off(beam_size=1, max_len=12))]
    assert any(any(kinds(t).values()) for t in plain)  # the test exercises something
    on = off(beam_size=k, max_len=12, block_repeats=True, block_content_repeats=True)
    for hyps in decode(dec, feats, IDS, on, Rules(IDS, on, lexicon=LEX)):
        for h in hyps:
            assert not any(kinds(h.tokens).values()), h.tokens
    if k == 1:
        greedy = [h.tokens for h in greedy_decode(dec, feats, IDS, on, Rules(IDS, on, lexicon=LEX))]
        beam1 = [h[0].tokens for h in decode(dec, feats, IDS, on, Rules(IDS, on, lexicon=LEX))]
        assert greedy == beam1
        for before, after in zip(plain, beam1):
            if not any(kinds(before).values()):
                assert before == after


def test_a_taught_word_and_its_old_twin_are_one_content_word():
    """Own photos: "stallion" taught from "horse" (Vocab.aliases, saved with the model). Saying one, a caption
    does not say the other ("a man is riding a horse on a stallion" was an exported own-photos model's)."""
    from captioner.vocab import Vocab

    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>", "a", "horse", "man", "stallion", "dog"])
    ids, plain = SpecialIds.of(vocab), Lexicon.of(vocab)
    vocab.alias("stallion", "horse")
    lex = Lexicon.of(vocab)
    assert lex.twins == ((7, 5),) and plain.twins == ()
    tokens = torch.tensor([[4, 7], [4, 5], [4, 8]])  # "a stallion", "a horse", "a dog"
    logp = ruled(torch.zeros(3, 9), ids, off(block_content_repeats=True), tokens, lex)
    assert logp[0, 5] == float("-inf") and logp[1, 7] == float("-inf")  # the twin is banned either way round
    assert logp[2, 5] > float("-inf") and logp[2, 7] > float("-inf")  # a row that said neither may say either
    assert ruled(torch.zeros(3, 9), ids, off(block_content_repeats=True), tokens, plain)[0, 5] > float("-inf")
    back = Vocab.from_json(vocab.to_json())
    assert back.aliases == {"stallion": "horse"} and Vocab.from_json(Vocab(vocab.itos).to_json()).aliases == {}
    with pytest.raises(ValueError, match="both must be vocabulary words"):
        vocab.alias("unicorn", "horse")


def test_a_word_and_its_plural_are_one_content_word():
    """"a train traveling down a track tracks": a plural is its singular for the repeat rules and the count."""
    from captioner.vocab import Vocab, singular

    assert repeats("a train traveling down a track tracks".split())["content"]
    assert not repeats("a man in shorts with short hair".split())["content"]  # "shorts" are not several "short"
    assert [singular(w, {"track", "bus", "puppy", "man", "cape"}) for w in ("tracks", "buses", "puppies", "men", "capes")] \
        == ["track", "bus", "puppy", "man", "cape"]
    assert singular("tracks", {"dog"}) == "tracks" and singular("is", {"i"}) == "is"  # no singular known: itself
    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>", "a", "track", "train", "tracks", "trains", "zoober",
                   "zoobers", "dog"], {"zoober": "train", "zoobers": "trains"})
    ids, lex = SpecialIds.of(vocab), Lexicon.of(vocab)
    family = dict(lex.twins)
    assert {w for w in vocab.itos if family.get(vocab.stoi[w]) == vocab.stoi["train"]} == {"trains", "zoober", "zoobers"}
    assert family[vocab.stoi["tracks"]] == vocab.stoi["track"] and vocab.stoi["dog"] not in family
    s = vocab.stoi
    tokens = torch.tensor([[s["a"], s["track"]], [s["a"], s["zoobers"]], [s["a"], s["dog"]]])
    logp = ruled(torch.zeros(3, len(vocab)), ids, off(block_content_repeats=True), tokens, lex)
    assert logp[0, s["tracks"]] == float("-inf") and logp[0, s["train"]] > float("-inf")
    assert all(logp[1, s[w]] == float("-inf") for w in ("train", "trains", "zoober")) and logp[1, s["track"]] > float("-inf")
    assert (logp[2, 5:11] > float("-inf")).all()  # a row that said none of them may say any


def test_a_word_said_again_as_the_start_of_the_next_is_a_repeat():
    """"a bath bathroom with a sink in the background" slipped past the rules: a word right after itself as the
    start of a longer word (vocab.stutters) is an adjacent repeat, counted and never written with block_repeats;
    apart, or the other way round, or a short ending ("dog dogs": the plural rule's), it is not."""
    from captioner.vocab import Vocab, stutter_pairs, stutters

    assert repeats("a bath bathroom with a sink in the background".split())["adjacent"]
    assert repeats("a snow snowboarder".split())["adjacent"]
    for fine in ("a bath in a bathroom", "a bathroom bath mat", "a dog dogs", "a man in an office",
                 "a basketball game"):
        assert not repeats(fine.split())["adjacent"], fine
    assert not stutters("in", "inside") and not stutters("ba", "bath")  # a function word, a short stem
    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>", "a", "bath", "bathroom", "bathtub", "sink", "dog", "dogs",
                   "in", "inside"])
    s = vocab.stoi
    ids, lex = SpecialIds.of(vocab), Lexicon.of(vocab)
    assert set(stutter_pairs(vocab)) == set(lex.stutters) == {(s["bath"], s["bathroom"]), (s["bath"], s["bathtub"])}
    tokens = torch.tensor([[s["a"], s["bath"]], [s["a"], s["bathroom"]], [s["a"], s["dog"]]])
    logp = ruled(torch.zeros(3, len(vocab)), ids, off(block_repeats=True), tokens, lex)
    assert logp[0, s["bathroom"]] == float("-inf") and logp[0, s["bathtub"]] == float("-inf")
    assert logp[0, s["sink"]] > float("-inf") and logp[1, s["bath"]] > float("-inf")  # only the stutter
    assert (logp[2, [s["bath"], s["bathroom"], s["bathtub"]]] > float("-inf")).all()
    unruled_logp = ruled(torch.zeros(3, len(vocab)), ids, off(), tokens, lex)
    assert unruled_logp[0, s["bathroom"]] > float("-inf")  # the rule is block_repeats'


def test_a_colour_after_an_article_is_followed_by_a_noun():
    """"a white sitting on a toilet": after "a white" no verb or preposition (decode.block_salad); "a white dog",
    "a white and black dog" and "a man in white sitting" stay allowed, and vocab.is_salad counts the same."""
    from captioner.vocab import Vocab, is_salad

    assert is_salad("a white sitting on a toilet".split()) and is_salad("the black on the grass".split())
    assert not any(is_salad(c.split()) for c in ("a white dog sitting on a toilet", "a white and black dog runs",
                                                 "a man in white sitting on a bench"))
    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>", "a", "white", "sitting", "on", "dog", "and", "in", "man"])
    ids, lex, s = SpecialIds.of(vocab), Lexicon.of(vocab), vocab.stoi
    tokens = torch.tensor([[s["a"], s["white"]], [s["in"], s["white"]], [s["a"], s["dog"]]])
    settings = off(block_salad=True)
    logp = ruled(torch.zeros(3, len(vocab)), ids, settings, tokens, lex)
    assert logp[0, s["sitting"]] == logp[0, s["on"]] == float("-inf")
    assert logp[0, s["dog"]] > float("-inf") and logp[0, s["and"]] > float("-inf")
    assert (logp[1:, 5:] > float("-inf")).all()  # no article before the colour, or no colour: nothing banned
    free = ruled(torch.zeros(3, len(vocab)), ids, off(), tokens, lex)
    assert free[0, s["sitting"]] > float("-inf")  # the rule is block_salad's


def test_never_a_plural_right_after_a():
    """"a person is doing a skis in the snow" (2 of 320 sampled captions of 40 coco-mini photos): after "a" or "an"
    no plural whose singular the vocabulary holds (decode.block_salad); after "the", or a singular, or a word
    that only looks plural ("shorts", "bus"), nothing is banned, and vocab.is_salad counts the same."""
    from captioner.vocab import Vocab, is_salad

    words = ["<pad>", "<start>", "<end>", "<unk>", "a", "an", "the", "ski", "skis", "elephant", "elephants", "men",
             "man", "shorts", "bus", "riding"]
    vocab = Vocab(words)
    ids, lex, s = SpecialIds.of(vocab), Lexicon.of(vocab), vocab.stoi
    assert {vocab.itos[i] for i in lex.plurals} == {"skis", "elephants", "men"}
    assert is_salad("a man riding a skis".split(), words) and is_salad("an elephants".split(), words)
    assert not any(is_salad(c.split(), words) for c in ("a man riding the skis", "a man riding a ski",
                                                        "a man in shorts riding a bus"))
    tokens = torch.tensor([[s["riding"], s["a"]], [s["riding"], s["an"]], [s["riding"], s["the"]]])
    logp = ruled(torch.zeros(3, len(vocab)), ids, off(block_salad=True), tokens, lex)
    plural = [s["skis"], s["elephants"], s["men"]]
    assert (logp[:2, plural] == float("-inf")).all() and (logp[2, plural] > float("-inf")).all()
    assert (logp[:2, [s["ski"], s["elephant"], s["man"], s["shorts"], s["bus"]]] > float("-inf")).all()
    free = ruled(torch.zeros(3, len(vocab)), ids, off(), tokens, lex)
    assert (free[:2, plural] > float("-inf")).all()  # the rule is block_salad's


def test_the_bundled_models_samples_never_say_a_plural_after_a(bundled, coco_mini):
    """The bundled model's sampled captions (Photo.sample at its defaults, seed 1) of 8 coco-mini photos, the skier
    among them: none has "a" or "an" before a plural (without the rule, two of the skier's 8 did: "riding a skis")."""
    from captioner.vocab import a_plural

    known = set(bundled.vocab.itos)
    photos = sorted((coco_mini / "train2017").glob("*.jpg"))[24:32]
    texts = [c.text for p in photos for c in bundled.read(p).sample(8, seed=1)]
    bad = [t for t in texts if any(a_plural(two, known) for two in zip(t.split(), t.split()[1:]))]
    assert len(texts) == 64 and not bad, bad


def test_the_rules_never_wait_for_the_device():
    """Every rule is a mask computed on the device: no nonzero(), item() or bool(tensor) (each a host sync per
    step on a GPU). tests/device_check.NoHostSync raises at any of them."""
    from .device_check import HostSync, NoHostSync

    ids, lex = SpecialIds(START, END, PAD, 3), Lexicon(function_words=(AND, A), bad_last=(AND, A), joiners=(AND,),
                                                       twins=((9, 7),))
    every = DecodeConfig(block_trigrams=True, block_bigrams=True, block_salad=True, block_repeats=True,
                         block_content_repeats=True)
    tokens = torch.tensor([[6, 7, 6, 7, AND], [A, 6, AND, 6, 6], [7, 8, 9, 7, 8]])
    with NoHostSync():
        logp = ruled(torch.zeros(3, 10), ids, every, tokens, lex)
    assert logp[0, END] == logp[0, 6] == logp[1, 6] == logp[2, 9] == float("-inf") and logp[1, 8] > float("-inf")
    with pytest.raises(HostSync), NoHostSync():
        torch.tensor([1, 0]).nonzero()  # the check itself sees a sync
