"""The "int8" precision (model/int8_rows.py): the decoder step's products in int8, each row with its own scale.

Invariants: a row's result is within the quantization's bound of float32 and does not depend on the other rows or
the thread count; a changed weight is quantized again; autograd sees the float32 layer; a Captioner in int8 says so
in every caption's settings, captions a photo the same alone and in a batch, and never changes a model it was
given; where int8 cannot run, float32, said.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F

import captioner
from captioner.model import int8_rows
from captioner.model.int8_rows import EXACT_TOP, Int8Linear, Int8Logits, STEP_LAYERS, precision_of, quantize, rows_product
from captioner.model.packed_linear import Linear
from .conftest import photo, tiny_captioner

needs_int8 = pytest.mark.skipif(not int8_rows.available(), reason="this torch has no int8 product on a CPU")


def layer_as(cls: type, layer: Linear) -> Linear:
    """`layer` as a `cls` by int8_rows.swap, the way quantize swaps a decoder's, with its own weight and bias."""
    holder = torch.nn.Module()
    holder.layer = layer
    new = int8_rows.swap(holder, "layer", cls)
    assert type(new) is cls and new.weight is layer.weight and new.bias is layer.bias
    return new


@needs_int8
@torch.no_grad()
def test_each_row_is_within_the_quantization_bound_of_float32():
    """|y - x W^T| <= sum_k |x_k - t p_k| |W_ok| + |x_k| |W_ok - s_o Q_ok| <= (t/2) |W_o|_1 + |x|_1 s_o / 2, per
    row and output: the rounding of each factor, nothing else."""
    x, w, b = torch.randn(7, 96) * 3, torch.randn(40, 96) / 10, torch.randn(40)
    y = rows_product(x, w, b)  # (7, 40)
    t = x.abs().amax(1, keepdim=True) / 127  # (7, 1)
    s = w.abs().amax(1) / 127  # (40,)
    bound = t / 2 * w.abs().sum(1) + x.abs().sum(1, keepdim=True) * s / 2  # (7, 40)
    err = (y - F.linear(x, w, b)).abs()
    assert (err <= bound * 1.001 + 1e-5).all() and err.max() > 0  # close, and really int8 (not float32)


@needs_int8
@torch.no_grad()
def test_a_rows_result_never_depends_on_the_other_rows_or_the_thread_count():
    x, w = torch.randn(16, 64), torch.randn(200, 64)
    old = torch.get_num_threads()
    try:
        got = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got[threads] = rows_product(x, w, None)
            for i in (0, 5, 15):  # alone, and beside rows 100x larger (a batch's other photos)
                assert torch.equal(rows_product(x[i:i + 1], w, None)[0], got[threads][i])
                loud = torch.cat([x[i:i + 1], 100 * torch.randn(3, 64)])
                assert torch.equal(rows_product(loud, w, None)[0], got[threads][i])
        assert torch.equal(got[1], got[2])
    finally:
        torch.set_num_threads(old)


@needs_int8
@torch.no_grad()
def test_the_logits_a_beam_chooses_among_are_float32s_the_rest_int8s():
    layer = layer_as(Int8Logits, Linear(64, 300))
    x = torch.randn(6, 64)
    got, want, rough = layer(x), F.linear(x, layer.weight, layer.bias), rows_product(x, layer.weight, layer.bias)
    top = rough.topk(EXACT_TOP, -1).indices  # (6, K): the rows' largest int8 logits ...
    assert torch.allclose(got.gather(1, top), want.gather(1, top), rtol=0, atol=1e-5)  # ... recomputed in float32
    rest = torch.ones_like(got, dtype=torch.bool).scatter_(1, top, False)
    assert torch.equal(got[rest], rough[rest]) and not torch.equal(got, rough)
    old = torch.get_num_threads()
    try:  # each row its own: alone, beside others, at 1 and 2 threads
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert all(torch.equal(layer(x[i:i + 1])[0], got[i]) for i in range(6))
            assert torch.equal(layer(torch.cat([x, 50 * torch.randn(9, 64)]))[:6], got)
    finally:
        torch.set_num_threads(old)


@needs_int8
def test_a_changed_weight_is_quantized_again_and_autograd_sees_the_float_layer():
    layer = layer_as(Int8Linear, Linear(8, 5))
    x = torch.randn(3, 8)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2)  # an in-place change bumps the version: never the stale int8 copy
        assert torch.allclose(layer(x), 2 * before - layer.bias, atol=1e-5)
    x.requires_grad_(True)
    y = layer(x)  # autograd: Linear's float32 product, exactly, with gradients
    assert torch.equal(y, F.linear(x, layer.weight, layer.bias))
    y.sum().backward()
    assert layer.weight.grad is not None and x.grad is not None


def test_quantize_swaps_the_step_layers_keeping_their_tensors_and_state_dict():
    decoder = tiny_captioner().model.decoder
    state = decoder.state_dict()
    weights = {n: decoder.get_submodule(n).weight for n in STEP_LAYERS}
    quantize(decoder)
    assert precision_of(decoder) == "int8" and decoder.state_dict().keys() == state.keys()
    assert all(decoder.get_submodule(n).weight is w and isinstance(decoder.get_submodule(n), Int8Linear)
               for n, w in weights.items()) and isinstance(decoder.out_vocab, Int8Logits)
    quantize(decoder, on=False)
    assert precision_of(decoder) == "float32" and not any(
        isinstance(m, Int8Linear) for m in decoder.modules())


@needs_int8
def test_an_int8_captioner_says_so_captions_alone_as_in_a_batch_and_leaves_its_model_alone(tmp_path):
    given = tiny_captioner()
    fast = captioner.Captioner(given.model, given.vocab, given.config, dtype="int8")
    assert fast.precision == "int8" and fast.model is not given.model  # a copy: the caller's model unchanged
    assert precision_of(given.model.decoder) == "float32"
    images = [photo(320, 200), photo(200, 300), photo(64, 64)]
    alone = [fast.caption(im) for im in images]
    together = fast.caption_batch(images)
    assert [c.settings["precision"] for c in alone] == ["int8"] * 3
    assert given.caption(images[0]).settings["precision"] == "float32"
    for a, b in zip(alone, together):
        assert a.words == b.words and a.log_prob == b.log_prob and a.confidence == b.confidence
    fast.save(tmp_path / "m.safetensors")  # the float32 weights, as a float32 model saves them
    back = captioner.load(tmp_path / "m.safetensors")
    assert back.precision == "float32" and all(torch.equal(p, q) for p, q in
                                               zip(back.model.parameters(), given.model.parameters()))


def test_without_an_int8_product_the_precision_is_float32_and_says_so(monkeypatch):
    monkeypatch.setattr(int8_rows, "_available", False)
    given = tiny_captioner()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fell = captioner.Captioner(given.model, given.vocab, given.config, dtype="int8")
    assert fell.precision == "float32" and precision_of(fell.model.decoder) == "float32"
    assert any("int8" in str(w.message) and "float32" in str(w.message) for w in seen)
    assert fell.caption(photo()).settings["precision"] == "float32"
