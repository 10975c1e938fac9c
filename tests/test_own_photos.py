"""README "Train on your own photos", run as written: a folder of real photos with a captions.txt and no
split files -> prepare -> train (from the bundled model) -> export -> a model file the app's menu offers and
captioner.load captions with. Only the folder, the run folder, the cache and the epochs are changed.

The folder (scripts/make_new_word_folder.py): Flickr8k photos of horses whose captions say "stallion", a word
the bundled model lacks, and as many photos without one. The exported model must say the new word on most
held-out photos of horses and on (almost) none of the others, and the log must say how often it did on val."""
from __future__ import annotations

import dataclasses
import importlib
import re
import shlex
from pathlib import Path

import pytest

import captioner
from captioner.data.flickr8k import by_name_split
from captioner.training.new_words import new_word_scores
from captioner.vocab import tokenize
from scripts.make_new_word_folder import build, new_word_use

ROOT = Path(__file__).resolve().parents[1]
FLICKR = ROOT.parent / "shared" / "data" / "flickr8k"


def readme_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Train on your own photos", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [shlex.split(line.split("  #")[0]) for line in block.splitlines() if line.strip()]


def test_split_by_name_without_split_files():
    names = [f"{i:03d}.jpg" for i in range(25)]
    parts = {s: by_name_split(names, s) for s in ("train", "val", "test")}
    assert sorted(sum(parts.values(), [])) == names  # every photo in exactly one split
    assert len(parts["val"]) == len(parts["test"]) == 2 and len(parts["train"]) == 21


def test_new_word_scores_count_uses_where_the_references_use_it():
    from captioner.data import ImageRecord

    recs = [ImageRecord("a", "a.jpg", ["a stallion runs"]), ImageRecord("b", "b.jpg", ["a stallion jumps"]),
            ImageRecord("c", "c.jpg", ["a dog runs"])]
    scores, line = new_word_scores(["stallion", "foal"], {"a": "a stallion", "b": "a horse", "c": "a stallion"}, recs)
    assert line.startswith("new words on val: stallion used in 1 of 2 captions whose references use it, and in 1 "
                           "of the 1 others") and "1 other new word(s)" in line  # foal: no val photo tells
    assert scores == {"new_words_recall": 0.5, "new_words_precision": 0.5, "new_words_F1": 0.5}


@pytest.mark.slow
def test_readme_teaches_the_bundled_model_a_new_word(tmp_path, monkeypatch, capsys):
    if not (FLICKR / "captions.txt").is_file():
        pytest.skip(f"Flickr8k is not at {FLICKR} (../shared/data): no real photos to train on")
    own, held_out = tmp_path / "myphotos", tmp_path / "heldout"
    build(own, photos=25, held_out=held_out, held_out_photos=10, flickr=FLICKR)  # 50 photos: 40 train, 5 val (4 horses)
    runs = tmp_path / "runs"
    extra = [f"data.cache_dir={tmp_path / 'cache'}", f"train.out_dir={runs}", "train.epochs=2"]
    monkeypatch.chdir(ROOT)
    commands = readme_commands()
    assert [c[0] for c in commands] == [".venv/bin/captioner-prepare", ".venv/bin/captioner-train",
                                        ".venv/bin/captioner-export", ".venv/bin/streamlit"]
    for cmd in commands[:3]:
        args = [a.replace("myphotos", str(own)).replace("runs/own_photos", str(runs)) for a in cmd[1:]]
        if "--set" in args:
            at = args.index("--set") + 2  # after the README's one KEY=VALUE
            args[at:at] = extra
        module = cmd[0].removeprefix(".venv/bin/captioner-").replace("-", "_")
        assert importlib.import_module(f"captioner.cli.{module}").main(args) == 0, cmd
    log = capsys.readouterr().out
    assert "new: stallion" in log and "stallion <- horse" in log  # named, and started as the word said in its place
    val_lines = re.findall(r"new words on val: stallion used in (\d+) of (\d+) .*?and in (\d+) of", log)
    print("\n".join(line for line in log.splitlines() if "new words on val" in line))
    assert len(val_lines) == 3  # epoch 0 (the warm start), 1 and 2
    model_file = runs / "model.safetensors"
    assert model_file.is_file() and model_file.stat().st_size < 60 * 2**20  # fp16, the size the README says
    from captioner.ui.checkpoints import find_model_files

    found = find_model_files([runs])
    assert model_file in found.files  # the app's menu offers it (runs/ is searched by default)
    use = new_word_use(model_file, held_out)  # photos it never saw
    assert use["thing"][1] == use["other"][1] == 10
    print("held-out photos saying the new word:", use)
    assert use["thing"][0] >= 6 and use["other"][0] <= 1, use  # most horses, (almost) nothing else


def test_a_small_set_is_passed_over_until_an_epoch_has_min_batches():
    from captioner.data.dataset import BucketBatchSampler

    plain = BucketBatchSampler([5.0] * 40, 16, seed=3)
    small = BucketBatchSampler([5.0] * 40, 16, seed=3, min_batches=20)
    assert len(plain) == len(plain.batches()) == 3
    batches = small.batches()
    assert len(small) == len(batches) == 21  # 7 passes of 3 batches
    assert all(len(set(b)) == len(b) for b in batches)  # no batch holds a photo twice
    assert sorted(i for b in batches for i in b) == sorted(list(range(40)) * 7)
    assert BucketBatchSampler([5.0] * 40, 16, seed=3, min_batches=20).batches() == batches  # (seed, epoch) decide


def test_validation_decodes_as_the_exported_file_will():
    """The own-photos recipe's validation lends the model the starting file's detectors and person floor (what
    captioner-export --detectors-from carries), at the stored beam, and takes them off again afterwards."""
    from torch import nn

    from captioner.checkpoint import load_checkpoint
    from captioner.concepts.detectors import detectors_of
    from captioner.config import load_config
    from captioner.training.as_exported import decoding_as_exported

    cfg = load_config(ROOT / "configs" / "own_photos.yaml")
    cfg.train.init_from = str(captioner.DEFAULT_CHECKPOINT)
    bundled = load_checkpoint(cfg.train.init_from)
    model = nn.Linear(2, 2)
    with decoding_as_exported(model, cfg) as settings:
        det = detectors_of(model)
        assert det is not None and det.groups == bundled.detector_info["groups"]
        assert settings.person_floor == bundled.config.decode.person_floor > 0
        assert settings.beam_size == cfg.decode.beam_size == cfg.train.val_beam_size  # the exported file's beam
        # a taught model is exported with the starting file's decode settings: validation decodes with them
        assert dataclasses.replace(settings, beam_size=bundled.config.decode.beam_size) == bundled.config.decode
    assert detectors_of(model) is None and "detectors." not in str(model.state_dict().keys())  # lent, not kept
    cfg.train.init_encoder = False  # another encoder: the detectors would read other vectors
    with decoding_as_exported(model, cfg) as settings:
        assert detectors_of(model) is None
    cfg.train.extend_vocab = False  # no new word taught: the run's own decode section
    with decoding_as_exported(model, cfg) as settings:
        assert dataclasses.replace(settings, beam_size=cfg.decode.beam_size) == cfg.decode


def test_a_new_word_shares_its_old_words_probability_as_the_captions_do():
    """A new word copied from an old one was an exact tie (beam search chose by word order: the warm start kept
    saying "train" for the captions' "zoober") and doubled the pair's probability. Now the pair splits the old
    word's probability in the captions' proportion: ahead where only the new word is used, the sum unchanged."""
    from collections import Counter

    import torch

    from captioner.training.new_words import init_from_substitutes
    from captioner.vocab import Vocab

    vocab = Vocab.build(["a train on tracks"], min_count=1)
    old, n_old = vocab.stoi["train"], len(vocab)
    vocab = vocab.extended(["zoober foal"], min_count=1)
    new, foal = vocab.stoi["zoober"], vocab.stoi["foal"]
    decoder = torch.nn.Module()
    decoder.embedding, decoder.out_vocab = torch.nn.Embedding(len(vocab), 4), torch.nn.Linear(4, len(vocab))
    before = {k: v.detach().clone() for k, v in decoder.named_parameters()}
    for used_old in (0, 30):  # the captions never say "train" / say it as often as "zoober"
        with torch.no_grad():
            for k, v in decoder.named_parameters():
                v.copy_(before[k])
        lines = init_from_substitutes(decoder, {new: Counter({old: 30, vocab.stoi["a"]: 2}), foal: Counter({old: 3})},
                                      vocab, Counter({old: used_old}))
        b = decoder.out_vocab.bias.detach()
        assert torch.allclose(b[[new, old]].exp().sum(), before["out_vocab.bias"][old].exp())  # no likelier together
        assert (b[new] > b[old]) == (used_old == 0) and torch.isclose(b[new], b[old]) == (used_old == 30)
        assert torch.equal(decoder.out_vocab.weight[new], decoder.out_vocab.weight[old])  # the rest is a copy
        assert torch.equal(decoder.embedding.weight[new], decoder.embedding.weight[old])
        assert torch.equal(b[foal], before["out_vocab.bias"][foal])  # too few positions: not copied
        assert torch.equal(b[:n_old][torch.arange(n_old) != old], before["out_vocab.bias"][:n_old][torch.arange(n_old) != old])
        assert lines[0].startswith("zoober <- train (30 of 32 positions")


@pytest.mark.parametrize("word", ["train", "giraffe", "cat"])
def test_coco_paired_folders_hold_train_split_photos_and_keep_the_held_out_apart(tmp_path, word):
    """make_new_word_folder.py --word train|giraffe|cat: only coco-paired's train split (its val split is where
    the export's CIDEr is checked), the held-out photos never in the folder, the thing's captions saying the new
    word and never the old one, the others naming nothing near the thing."""
    from scripts.make_new_word_folder import WORDS, read_captions as folder_captions

    paired = ROOT.parent / "shared" / "data" / "coco-paired"
    if not (paired / "split_train.txt").is_file():
        pytest.skip(f"coco-paired is not at {paired} (../shared/data)")
    w = WORDS[word]
    got = build(tmp_path / "own", photos=6, held_out=tmp_path / "held", held_out_photos=4, flickr=FLICKR, word=word,
                others=5)
    assert [len(got[k]) for k in ("thing", "other", "held_out_thing", "held_out_other")] == [6, 5, 4, 4]
    train_split = set((paired / "split_train.txt").read_text().split())
    folder, held = set(got["thing"] + got["other"]), set(got["held_out_thing"] + got["held_out_other"])
    assert folder | held <= train_split and not folder & held
    for path, names in ((tmp_path / "own", folder), (tmp_path / "held", held)):
        caps = folder_captions(path)
        assert set(caps) == names == {p.name for p in (path / "Images").iterdir()}
        for n in names:
            words = {t for c in caps[n] for t in tokenize(c)}
            assert not words & set(w.new)  # the old word is gone everywhere
            assert bool(words & set(w.new.values())) == (n in got["thing"] + got["held_out_thing"])
            assert (n in got["thing"] + got["held_out_thing"]) or not words & w.near


def test_check_on_a_folder_of_another_thing_says_so_before_any_model(tmp_path, capsys):
    """`--check MODEL giraffes/` with --word's default (horse) printed "says stallion ... on 0 of 0 photos of the
    horse": the folder's own word is found from its captions; a --word it does not teach, or a folder of none,
    is one line naming the folder (the model is never loaded: MODEL need not exist)."""
    from scripts.make_new_word_folder import check_word, main

    folder = tmp_path / "giraffes"
    (folder / "Images").mkdir(parents=True)
    (folder / "captions.txt").write_text("image,caption\na.jpg,a gombla eats leaves\nb.jpg,a dog on the grass\n")
    assert check_word(folder, None) == check_word(folder, "giraffe") == "giraffe"
    assert main([str(folder), "--check", str(tmp_path / "no-model.safetensors"), "--word", "horse"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "gombla" in err and "--word giraffe" in err and "no-model" not in err
    (folder / "captions.txt").write_text("image,caption\na.jpg,a dog on the grass\n")
    assert main([str(folder), "--check", str(tmp_path / "no-model.safetensors")]) == 2
    assert "its captions say none of the new words" in capsys.readouterr().err


def _epochs(photos: int, values: list[float], lr_decay: float = 0.5) -> tuple[object, list[str]]:
    """after_validation over a warm start (epoch 0) and trained epochs scoring `values` on `photos` val photos, with no
    model file written (not the main rank): the run's state and its log lines, the last one chosen's."""
    from types import SimpleNamespace

    from captioner.config import Config
    from captioner.training.after_validation import best_line, after_validation
    from captioner.training.run import TrainState
    from captioner.training.sources import ValSet

    cfg, logs = Config(), []
    cfg.train.val_metric, cfg.train.init_from, cfg.train.lr_decay, cfg.train.epochs = "CIDEr", "start.safetensors", lr_decay, 9
    run = SimpleNamespace(cfg=cfg, state=TrainState(), val_sets=[ValSet("own", [None] * photos)],
                          place=SimpleNamespace(main=False, log=logs.append),
                          best_path=Path("best.safetensors"), last_path=Path("last.safetensors"),
                          optimizer=SimpleNamespace(param_groups=[{"lr": 1e-3}]))
    for epoch, value in enumerate(values):
        run.state.epoch = epoch
        after_validation(run, value, False)
    return run, logs + [best_line(run)]


def test_a_val_split_too_small_to_choose_keeps_the_last_epoch_and_says_so():
    """Five val photos (one a bus) chose epoch 0, the starting file before any step, and four minutes of training
    were thrown away without a sign. Below MIN_VAL_PHOTOS the last trained epoch is kept (no decay, no early stop)."""
    run, logs = _epochs(5, [1.666, 0.5, 0.4, 0.3])
    assert run.state.best_position == 3 and run.optimizer.param_groups[0]["lr"] == 1e-3 and run.state.bad_validations == 0
    assert logs[0].startswith("  the starting model's CIDEr 1.6660, for comparison only: 5 val photos are too few")
    assert logs[-2].startswith("  kept the last epoch (CIDEr 0.3000; 5 val photos are too few to compare epochs)")
    assert logs[-1] == ("best CIDEr 0.3000 at epoch 3, the last trained epoch (5 val photos are too few to choose by "
                        "their scores)")


def test_the_starting_model_is_kept_only_with_a_log_that_says_why():
    run, logs = _epochs(50, [1.0, 0.5, 0.6])
    assert run.state.best_position == 0 and "(the starting model before any step" in logs[0]
    assert logs[-1].startswith("best CIDEr 1.0000 at epoch 0: the starting model (start.safetensors) before any "
                               "step, because none of the 2 trained epoch(s) beat it on the 50 val photos")
    run, logs = _epochs(50, [1.0, 1.2, 0.6])
    assert run.state.best_position == 1 and logs[-1] == "best CIDEr 1.2000 at epoch 1"


def test_a_taught_model_is_exported_with_its_starting_models_decode_settings_and_consensus_memory(tmp_path, capsys):
    """A taught model (README chain -> captioner-export) had no consensus memory beside it and turned
    decode.evidence_detectors on: 83 of 265 unrelated captions changed. The export now carries the starting
    file's decode settings and its memory (caption ids in the grown vocabulary)."""
    import torch

    from captioner.cli.caption import main as caption
    from captioner.cli.export import main as export
    from captioner.checkpoint import load_checkpoint
    from captioner.config import Config
    from captioner.data.features import encoder_fingerprint
    from captioner.decoding.choice import Weights
    from captioner.decoding.consensus import ConsensusMemory, memory_path
    from captioner.decoding.resources import Fitted
    from captioner.model.show_attend_tell import build_model
    from captioner.vocab import Vocab

    from .conftest import tiny_captioner

    start = tiny_captioner()
    start.config.decode.evidence_detectors, start.config.decode.beam_size = False, 4
    dim = start.encode(torch.zeros(1, 3, 224, 224)).shape[-1]
    said = [[[4, 5]], [[6, 7, 8], [4]], [[9]]]  # three photos' captions, in the starting model's ids
    start.resources = dataclasses.replace(  # its consensus memory and fitted choice
        start.resources, memory=ConsensusMemory.build(torch.randn(3, dim), said, len(start.vocab),
                                                      encoder_fingerprint(start.model.encoder)),
        fitted=Fitted(Weights.from_json({"score": 0.6, "consensus": 0.4})))
    start.save(tmp_path / "start.safetensors")
    cfg = Config.from_dict(start.config.to_dict())  # the run: the recipe's decode section, not the starting file's
    cfg.train.init_from, cfg.train.extend_vocab = str(tmp_path / "start.safetensors"), True
    cfg.decode.evidence_detectors, cfg.decode.beam_size = True, 5
    vocab = Vocab([*start.vocab.itos, "zorblax"])  # the vocabulary only grew: every old word keeps its id
    model = build_model(cfg.model, len(vocab))
    model.encoder.load_state_dict(start.model.encoder.state_dict())  # train.init_encoder: the same encoder
    captioner.Captioner(model, vocab, cfg).save(tmp_path / "best.safetensors")
    out = tmp_path / "model.safetensors"
    assert export([str(tmp_path / "best.safetensors"), str(out), "--half"]) == 0
    said_out = capsys.readouterr().out
    assert "decode settings: the starting model's" in said_out and "consensus memory: the starting model's (3 " \
        "photos, 4 captions)" in said_out, said_out
    assert load_checkpoint(out).config.decode == start.config.decode  # evidence_detectors off, beam 4, as it had
    assert load_checkpoint(out).fitted == load_checkpoint(tmp_path / "start.safetensors").fitted != {}  # its choice
    memory = ConsensusMemory.load(memory_path(out))
    assert memory.vocab_size == len(vocab) and len(memory) == 3 and memory.encoder == encoder_fingerprint(model.encoder)
    assert [list(map(list, memory.captions_of(j))) for j in range(3)] == said  # ids kept
    assert torch.equal(memory.features, ConsensusMemory.load(memory_path(tmp_path / "start.safetensors")).features)
    assert caption([str(ROOT / "captioner" / "assets" / "examples" / "cat.jpg"), "--checkpoint", str(out),
                    "--max-len", "3", "--verbose"]) == 0  # loads with its memory: the settings line claims no missing rerank
    err = capsys.readouterr().err
    assert "consensus_k 5" in err and "no consensus rerank" not in err
    out.with_name("bare.safetensors").write_bytes(out.read_bytes())  # the same file with no memory beside it
    assert caption([str(ROOT / "captioner" / "assets" / "examples" / "cat.jpg"), "--checkpoint",
                    str(out.with_name("bare.safetensors")), "--max-len", "3", "--verbose"]) == 0
    err = capsys.readouterr().err
    assert "consensus_k" not in err and "no consensus rerank (no consensus memory beside the file)" in err


def test_with_new_words_only_nothing_but_the_new_words_rows_moves():
    """train.new_words_only (the own-photos recipe): after Adam's steps every weight but the new words' rows is
    the starting model's, bit for bit, so a photo without the new words keeps the starting model's caption."""
    import torch

    from captioner.training.new_words import GROWN_ROWS, NewWordRows

    from .conftest import tiny_captioner

    decoder = tiny_captioner().model.decoder
    old_size = decoder.out_vocab.weight.shape[0] - 2  # the last two words are new
    before = {k: v.clone() for k, v in decoder.state_dict().items()}
    optimizer = torch.optim.Adam([p for p in decoder.parameters() if p.requires_grad], lr=1e-3)
    NewWordRows(optimizer, decoder, old_size, factor=10.0, only=True)
    for _ in range(3):
        optimizer.zero_grad()
        loss = sum((p.float() ** 2).sum() for p in decoder.parameters())  # a gradient on every weight
        loss.backward()
        optimizer.step()
    after = decoder.state_dict()
    for name, t in after.items():
        grown = name in GROWN_ROWS
        assert torch.equal(t[:old_size] if grown else t, before[name][:old_size] if grown else before[name]), name
        if grown:
            assert not torch.equal(t[old_size:], before[name][old_size:]), name  # the new words' rows learn
