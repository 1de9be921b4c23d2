"""The streamed convolutions (engine/audio/mimi_conv.py) equal torch's conv1d and
conv_transpose1d of each stream's whole input: over many calls of every length, streams
of different ages in one batch, a slot reused by the next stream, both GEMM forms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdunit.engine.audio.mimi_conv import StreamConv

BOUND = 1e-5  # fp32


def reference(module: nn.Module, x: torch.Tensor, elu: float | None) -> torch.Tensor:
    """The whole input [T, in] at once, causal: [T x frames, out]."""
    h = x.T[None]
    if elu is not None:
        h = F.elu(h, elu)
    if isinstance(module, nn.ConvTranspose1d):
        y = module(h)
        y = y[..., : x.shape[0] * module.stride[0]]  # trim right: kernel - stride
    else:
        pad = (module.kernel_size[0] - 1) * module.dilation[0]
        y = module(F.pad(h, (pad, 0)))
    return y[0].T


class Pool:
    """The decoder's use: state rows by slot, gathered for a call and written back."""

    def __init__(self, conv: StreamConv, slots: int) -> None:
        self.conv = conv
        self.rows = torch.zeros(slots, conv.state_values)

    def push(self, slots: list[int], xs: list[torch.Tensor], elu: float | None) -> torch.Tensor:
        index = torch.tensor(slots)
        state = self.rows.index_select(0, index)
        held = state if self.conv.state_values else None
        y = self.conv(torch.stack(xs), held, held, elu)
        self.rows.index_copy_(0, index, state)
        return y


MODULES = {
    "k7": lambda: nn.Conv1d(6, 10, 7),
    "k3-narrow": lambda: nn.Conv1d(12, 3, 3),  # shift-add form
    "k3-dilated": lambda: nn.Conv1d(8, 4, 3, dilation=2),
    "k1": lambda: nn.Conv1d(5, 7, 1),
    "k3-one-out": lambda: nn.Conv1d(8, 1, 3),
    "grouped": lambda: nn.Conv1d(8, 8, 3, groups=4),
    "t16s8": lambda: nn.ConvTranspose1d(12, 6, 16, stride=8),
    "t12s6": lambda: nn.ConvTranspose1d(6, 4, 12, stride=6),
    "t5s2": lambda: nn.ConvTranspose1d(4, 3, 5, stride=2),  # kernel not a multiple of the stride
    "t4s4": lambda: nn.ConvTranspose1d(4, 3, 4, stride=4),  # no overlap: no context
    "t-depthwise": lambda: nn.ConvTranspose1d(8, 8, 4, stride=2, groups=8),
    "t-nobias": lambda: nn.ConvTranspose1d(4, 6, 8, stride=4, bias=False),
}


def stream_conv(module: nn.Module) -> StreamConv:
    return StreamConv.transposed(module) if isinstance(module, nn.ConvTranspose1d) else StreamConv.conv1d(module)


@pytest.mark.parametrize("name", sorted(MODULES))
@pytest.mark.parametrize("elu", [None, 1.0])
def test_streams_of_every_age_and_call_length_equal_the_whole_input_convolved(name: str, elu: float | None) -> None:
    torch.manual_seed(0)
    module = MODULES[name]().eval()
    conv = stream_conv(module)
    pool = Pool(conv, slots=4)
    cin = module.in_channels
    inputs = {s: torch.randn(40, cin) for s in "abcd"}
    done = dict.fromkeys(inputs, 0)
    out: dict[str, list[torch.Tensor]] = {s: [] for s in inputs}
    slot = {"a": 0, "b": 1}
    plan = [{"a": 3}, {"a": 1, "b": 1}, {"a": 2, "b": 2}, {"b": 5}, {"a": 1, "b": 1}]
    with torch.no_grad():
        for i, call in enumerate(plan * 3):
            if i == 4:
                slot["c"] = 2
            if i == 8:  # a ends; d takes its slot, which holds a's context until reset
                del slot["a"]
                pool.rows[0].zero_()
                slot["d"] = 0
            call = {("c" if s == "a" and "a" not in slot else s): n for s, n in call.items()}
            if "c" in slot:
                call.setdefault("c", 2)
            if "d" in slot:
                call.setdefault("d", 1)
            for n in sorted(set(call.values())):  # one batch per call length, as the decoder
                names = [s for s, m in call.items() if m == n]
                y = pool.push([slot[s] for s in names], [inputs[s][done[s] : done[s] + n] for s in names], elu)
                for s, part in zip(names, y, strict=True):
                    out[s].append(part)
                    done[s] += n
        for s, parts in out.items():
            if not parts:
                continue
            want = reference(module, inputs[s][: done[s]], elu)
            got = torch.cat(parts)
            assert got.shape == want.shape, s
            assert (got - want).abs().max() <= BOUND * max(1.0, float(want.abs().max())), (name, s)


def test_narrow_outputs_take_the_shift_add_form_and_wide_ones_the_unfolded_gemm() -> None:
    assert stream_conv(nn.Conv1d(64, 32, 3)).shift_add
    assert stream_conv(nn.Conv1d(64, 1, 3)).shift_add
    assert not stream_conv(nn.Conv1d(512, 1024, 7)).shift_add
    assert not stream_conv(nn.ConvTranspose1d(1024, 512, 16, stride=8)).shift_add
    t = stream_conv(nn.ConvTranspose1d(1024, 512, 16, stride=8))
    assert (t.context, t.state_values, t.frames, t.out_channels) == (1, 1024, 8, 512)


def test_convolutions_the_stream_cannot_run_are_refused() -> None:
    with pytest.raises(ValueError, match="stride != 1"):
        stream_conv(nn.Conv1d(4, 4, 3, stride=2))
    with pytest.raises(ValueError, match="not a causal Mimi one"):
        stream_conv(nn.ConvTranspose1d(4, 4, 4, stride=2, padding=1))
    with pytest.raises(ValueError, match="not a causal Mimi one"):
        stream_conv(nn.ConvTranspose1d(4, 4, 3, stride=4))  # a kernel under its stride leaves gaps


def test_the_decoder_streams_its_convolutions_and_refuses_a_layer_it_cannot_run() -> None:
    from pdunit.engine.audio.mimi_stream import MimiStreamDecoder
    from tests.audio.tiny import tiny_mimi

    codec = tiny_mimi()
    d = MimiStreamDecoder(codec)
    convs = [m for m in codec.model.decoder.modules() if isinstance(m, (nn.Conv1d, nn.ConvTranspose1d))]
    widths = [(m.kernel_size[0] - 1) * m.in_channels if isinstance(m, nn.Conv1d)
              else (-(-m.kernel_size[0] // m.stride[0]) - 1) * m.in_channels for m in convs]
    assert d._conv.shape[1] == sum(widths)  # every context is input rows, none an output tail
    codec.model.decoder.decoder_seanet.layers[1] = nn.Tanh()
    with pytest.raises(ValueError, match=r"Tanh \(layer 1\) is not one the stream decoder runs"):
        MimiStreamDecoder(codec)


def test_the_codebooks_gather_equals_the_quantizers_decode() -> None:
    from pdunit.engine.audio.mimi_stream import _Codebooks
    from tests.audio.test_mimi_graphs import lively
    from tests.audio.tiny import tiny_mimi

    quantizer = lively(tiny_mimi()).model.quantizer
    codes = torch.randint(0, 32, (3, 4, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = quantizer.decode(codes).transpose(1, 2)
        got = _Codebooks(quantizer, 4)(codes)
    assert want.abs().max() > 0.1 and (got - want).abs().max() <= 1e-5
