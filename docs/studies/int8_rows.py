"""Study (issue: a caption at the encoder's pace on any CPU), the second look: the decoder step's large products
(W_h, W_hh, L_h, L_z, L_o, W_z) as an int8 product per row (torch._int_mm: weights per output channel, each row of
activations quantized with its own scale, with --offset also its own offset; the sums in int32, so exact at any
thread count and in any batch) in place of the packed float32 product. 1 thread. Prints caption() ms of a read photo (interleaved), CIDEr
(pycocoevalcap, Python tokens) and captions changed on coco-paired val, Flickr8k val and coco-mini, and whether a
photo's caption depends on the photos batched with it. Run from the repository root:
.venv/bin/python docs/studies/int8_rows.py [--offset] (about ten minutes; the comparison is int8_step.compare)."""
import sys

import torch

import captioner
from int8_step import PLAIN, compare  # the same comparison as the first look (this folder is on the path)

ASYMMETRIC = "--offset" in sys.argv  # each row's 256 levels from its least to its largest value (else: scale only)


def int8_forward(packs: dict, asymmetric: bool):
    def forward(self, x, plain=False):
        p = packs.get(id(self))
        if p is None or torch.is_grad_enabled() or plain:
            return PLAIN(self, x, plain)
        w_t, w_scale, w_sum, bias = p  # (in, out) int8, (out,) float, (out,) the int8 weights' sums, (out,)
        rows = x.reshape(-1, x.shape[-1])  # (N, in)
        if not asymmetric:  # x = s q, q in [-127, 127]
            scale = rows.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127  # (N, 1): each row its own
            y = torch._int_mm(torch.round(rows / scale).to(torch.int8), w_t).float() * (scale * w_scale)  # (N, out)
        else:  # x = s (q + 128) + lo, q in [-128, 127]: all 256 levels between the row's least and largest
            lo = rows.amin(1, keepdim=True)  # (N, 1)
            scale = (rows.amax(1, keepdim=True) - lo).clamp_min(1e-12) / 255  # (N, 1)
            q = (torch.round((rows - lo) / scale) - 128).to(torch.int8)  # (N, in)
            acc = torch._int_mm(q, w_t) + 128 * w_sum  # (N, out) int32: sum_k (q + 128) w_q, exact
            y = (acc.float() * scale + lo * w_sum.float()) * w_scale  # (N, out)
        return (y if bias is None else y + bias).view(*x.shape[:-1], -1)
    return forward


def packed_int8(decoder) -> dict:
    out = {}
    for layer in (decoder.attention.hidden_proj, decoder.gates_hidden, decoder.out_hidden, decoder.out_context,
                  decoder.out_vocab, decoder.gates_context):
        w = layer.weight.detach().float()  # (out, in)
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12)  # (out,)
        q = torch.round(w / scale[:, None]).to(torch.int8)  # (out, in)
        out[id(layer)] = q.t(), scale, q.sum(1, dtype=torch.int32), None if layer.bias is None else layer.bias.detach().float()
    return out


def main() -> None:
    m = captioner.load(dtype="float32")
    compare(m, int8_forward(packed_int8(m.model.decoder), ASYMMETRIC))


if __name__ == "__main__":
    main()
