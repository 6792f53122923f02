"""The layer properties of the design doc (section 3), in float64, over a grid of geometries."""
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from timm_affinediv import (
    AffineDivLinear,
    L2Norm,
    L2Norm2d,
    L2NormLinear,
    PatchNorm2d,
    PatchNormConv2d,
    divergence_constant,
    update_factor,
)


@pytest.fixture(autouse=True)
def float64():
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(default)


# (in, out, kernel, stride, padding, dilation, groups, padding_mode)
CONV_GEOMETRIES = [
    (3, 4, 3, 1, 1, 1, 1, 'zeros'),
    (4, 6, 3, 2, 1, 1, 2, 'zeros'),
    (6, 6, 5, 1, 2, 1, 6, 'zeros'),            # depthwise (its own autograd Function; "same": a self-adjoint box)
    (3, 3, 3, 2, 1, 1, 3, 'zeros'),            # depthwise, strided, few channels (box filter by avg_pool2d)
    (6, 6, 3, (2, 1), (1, 2), 1, 6, 'zeros'),  # depthwise, uneven stride and padding
    (6, 6, 3, 1, 'same', 2, 6, 'zeros'),       # depthwise, dilated
    (6, 6, 4, 1, 'same', 1, 6, 'zeros'),       # depthwise, even kernel: asymmetric "same" (plain autograd)
    (5, 5, 3, 1, 1, 1, 5, 'reflect'),          # depthwise, padded beforehand
    (4, 8, 7, 2, 3, 1, 4, 'zeros'),            # depthwise, channel multiplier 2
    (5, 3, (3, 2), (2, 1), (0, 1), 1, 1, 'zeros'),
    (4, 4, 3, 1, 'same', 2, 1, 'zeros'),       # dilated, "same"
    (4, 4, 4, 1, 'same', 1, 2, 'zeros'),       # even kernel: asymmetric "same"
    (4, 6, 3, 1, 'valid', (2, 1), 2, 'zeros'),
    (3, 5, 3, 2, 4, 1, 1, 'zeros'),            # padding wider than half the kernel
    (3, 4, 1, 1, 0, 1, 1, 'zeros'),            # 1x1: a Linear over channels
    (3, 8, 1, 1, 0, 1, 1, 'zeros'),            # 1x1 wider than its input: scales the input instead
    (4, 6, 1, 2, 0, 1, 1, 'zeros'),            # strided 1x1 (ResNet downsample): norms at the read positions
    (4, 6, 1, (2, 3), 1, 1, 2, 'zeros'),       # strided, padded, grouped 1x1
    (4, 4, 2, 2, 0, 1, 1, 'zeros'),            # ConvNeXt downsample
    (3, 4, 3, 1, 1, 1, 1, 'reflect'),
    (4, 4, 3, 2, 1, 1, 2, 'replicate'),
    (2, 3, 3, 1, 2, 2, 1, 'circular'),
]
GRID = list(itertools.product(CONV_GEOMETRIES, (True, False), ('rms', 'l2')))


def _geometry_id(case):
    (cin, cout, k, s, p, d, g, mode), bias, scale = case
    return f'c{cin}-{cout}_k{k}_s{s}_p{p}_d{d}_g{g}_{mode}_{"bias" if bias else "nobias"}_{scale}'


def _conv(geometry, bias, scale, cls=PatchNormConv2d):
    cin, cout, k, s, p, d, g, mode = geometry
    kwargs = dict(stride=s, padding=p, dilation=d, groups=g, bias=bias, padding_mode=mode)
    if cls is PatchNormConv2d:
        kwargs['scale'] = scale
    torch.manual_seed(0)
    conv = cls(cin, cout, k, **kwargs)
    if bias:
        nn.init.normal_(conv.bias)
    return conv


def _padded(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    mode = 'constant' if conv.padding_mode == 'zeros' else conv.padding_mode
    return F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)


def _patches(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """im2col columns per group: (N, groups, C_in/groups * kh * kw, L), padding applied as the conv does."""
    cols = F.unfold(_padded(conv, x), conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
    return cols.unflatten(1, (conv.groups, -1))


def _reference(conv: PatchNormConv2d, x: torch.Tensor) -> torch.Tensor:
    cols = _patches(conv, x)
    w = conv.weight.flatten(1).unflatten(0, (conv.groups, -1))            # (G, O/G, K)
    out = torch.einsum('gok,ngkl->ngol', w, cols)
    sq = cols.square().sum(2)                                                # (N, G, L)
    if conv.bias is not None:
        out = out + conv.bias.view(conv.groups, -1, 1)
        sq = sq + 1
    else:
        sq = sq + conv.eps
    out = out / (sq / conv.divergence_constant).sqrt().unsqueeze(2)
    h, w = _padded(conv, x).shape[-2:]
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel_size, conv.stride, conv.dilation
    return out.flatten(1, 2).unflatten(2, ((h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1))


def _positions(y: torch.Tensor):
    n, _, h, w = y.shape
    return [(0, slice(None), 0, 0), (n - 1, slice(None), h - 1, w - 1), (n - 1, slice(None), h // 2, w // 3)]


@pytest.mark.parametrize('case', GRID, ids=_geometry_id)
def test_patchnorm_matches_im2col_reference(case):
    """Both forward paths: with autograd, and the inference one that scales its output in place."""
    conv = _conv(*case)
    x = torch.randn(2, conv.in_channels, 9, 8)
    reference = _reference(conv, x)
    torch.testing.assert_close(conv(x), reference, rtol=1e-10, atol=1e-12)
    with torch.inference_mode():
        torch.testing.assert_close(conv(x), reference.detach(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('case', GRID, ids=_geometry_id)
def test_patchnorm_update_factor_is_c(case):
    """One SGD step on the layer's weight and bias moves the touched position by exactly c."""
    conv = _conv(*case)
    x = torch.randn(2, conv.in_channels, 9, 8)
    sq = _patches(conv, x).square().sum(2)                                   # (N, G, L)
    y = conv(x)
    for index in _positions(y):
        factor = update_factor(lambda: conv(x), [conv.weight, conv.bias], index)
        if conv.bias is not None:
            expected = torch.full_like(factor, conv.divergence_constant)
        else:  # c |P|^2 / (|P|^2 + eps): c up to the 0/0 guard
            n, _, i, j = index
            p_sq = sq[n, :, i * y.shape[-1] + j].repeat_interleave(conv.out_channels // conv.groups)
            expected = conv.divergence_constant * p_sq / (p_sq + conv.eps)
        torch.testing.assert_close(factor, expected, rtol=1e-7, atol=0)


def _with_slot(layer: nn.Module, channels: int) -> PatchNorm2d:
    """Fuse a slot with a non-trivial gain and shift into `layer`, as binding does; returns the slot."""
    slot = PatchNorm2d(channels)
    nn.init.uniform_(slot.weight, 0.5, 1.5)
    nn.init.normal_(slot.bias)
    layer.fuse_post_affine(slot)
    return slot


@pytest.mark.parametrize('fused', [False, True], ids=['plain', 'fused_slot'])
@pytest.mark.parametrize('channels_last', [False, True], ids=['nchw', 'channels_last'])
@pytest.mark.parametrize('case', GRID[::2], ids=_geometry_id)
def test_patchnorm_gradients_match_im2col_reference(case, channels_last, fused):
    """Gradients for the input, the weight, the pre-division bias and a fused slot's affine, on every path
    (the depthwise layer's own backward included), equal autograd through the im2col reference."""
    conv = _conv(*case)
    params = [conv.weight] + ([conv.bias] if conv.bias is not None else [])
    slot = None
    if fused:
        slot = _with_slot(conv, conv.out_channels)
        params += [slot.weight, slot.bias]
    x = torch.randn(2, conv.in_channels, 9, 8)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    out = conv(x)
    reference = _reference(conv, x)
    if fused:
        reference = reference * slot.weight.view(-1, 1, 1) + slot.bias.view(-1, 1, 1)
    torch.testing.assert_close(out, reference, rtol=1e-10, atol=1e-12)
    weights = torch.randn_like(out)
    for got, expected in zip(torch.autograd.grad((out * weights).sum(), [x] + params),
                             torch.autograd.grad((reference * weights).sum(), [x] + params)):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize('case', GRID[::2], ids=_geometry_id)
def test_plain_conv_update_factor_is_patch_norm(case):
    """The divergence is real: a plain conv with the same weights moves by |P_p|^2 + 1 (|P_p|^2)."""
    geometry, bias, _ = case
    conv = _conv(geometry, bias, None, cls=nn.Conv2d)
    x = torch.randn(2, conv.in_channels, 9, 8)
    sq = _patches(conv, x).square().sum(2)
    y = conv(x)
    factors = []
    for n, _, i, j in _positions(y):
        factor = update_factor(lambda: conv(x), [conv.weight, conv.bias], (n, slice(None), i, j))
        expected = (sq[n, :, i * y.shape[-1] + j] + float(bias)).repeat_interleave(conv.out_channels // conv.groups)
        torch.testing.assert_close(factor, expected, rtol=1e-7, atol=1e-9)
        factors.append(factor)
    factors = torch.stack(factors)
    spread = (factors.amax(0) - factors.amin(0)) / factors.amax(0)
    assert spread.max() > 0.05, 'the plain conv should give positions different factors'


@pytest.mark.parametrize('bias', [True, False])
@pytest.mark.parametrize('scale', ['rms', 'l2'])
@pytest.mark.parametrize('out_features', [5, 12])  # 12 > 7 + 1: the path that scales the input
def test_affine_div_linear(bias, scale, out_features):
    torch.manual_seed(0)
    lin = AffineDivLinear(7, out_features, bias=bias, scale=scale)
    x = torch.randn(3, 4, 7) * torch.rand(3, 4, 1) * 5                     # varied sample norms
    sq = x.square().sum(-1)
    expected_out = F.linear(x, lin.weight, lin.bias) / ((sq + (1 if bias else lin.eps)) /
                                                        lin.divergence_constant).sqrt().unsqueeze(-1)
    torch.testing.assert_close(lin(x), expected_out, rtol=1e-12, atol=1e-12)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x), expected_out.detach(), rtol=1e-12, atol=1e-12)
    assert lin.divergence_constant == divergence_constant(7, bias, scale) == (7 + bias if scale == 'rms' else 1)
    plain = nn.Linear(7, out_features, bias=bias)
    plain.load_state_dict(lin.state_dict())
    for index in [(0, 0, slice(None)), (2, 3, slice(None))]:
        factor = update_factor(lambda: lin(x), [lin.weight, lin.bias], index)
        torch.testing.assert_close(factor, torch.full_like(factor, float(lin.divergence_constant)), rtol=1e-7, atol=0)
        plain_factor = update_factor(lambda: plain(x), [plain.weight, plain.bias], index)
        torch.testing.assert_close(plain_factor, (sq[index[:2]] + float(bias)).expand(out_features), rtol=1e-7, atol=0)


@pytest.mark.parametrize('fused', [False, True], ids=['plain', 'fused_slot'])
@pytest.mark.parametrize('bias', [True, False])
@pytest.mark.parametrize('out_features', [5, 12])
def test_affine_div_linear_gradients(out_features, bias, fused):
    """Gradients for the input, weight, bias and a fused slot's affine equal autograd through the formula."""
    torch.manual_seed(0)
    lin = AffineDivLinear(7, out_features, bias=bias)
    params = [lin.weight] + ([lin.bias] if bias else [])
    gain = shift = None
    if fused:
        slot = _with_slot(lin, out_features)
        gain, shift = slot.weight, slot.bias
        params += [gain, shift]
    x = (torch.randn(3, 4, 7) * torch.rand(3, 4, 1) * 5).requires_grad_()
    s = ((x.square().sum(-1, keepdim=True) + (1 if bias else lin.eps)) / lin.divergence_constant).sqrt()
    reference = F.linear(x, lin.weight, lin.bias) / s
    if fused:
        reference = reference * gain + shift
    out = lin(x)
    torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
    weights = torch.randn_like(out)
    for got, expected in zip(torch.autograd.grad((out * weights).sum(), [x] + params),
                             torch.autograd.grad((reference * weights).sum(), [x] + params)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_pointwise_patchnorm_is_affine_div_linear():
    """A 1x1 PatchNorm is AffineDivLinear over the channel vector at each position."""
    conv = PatchNormConv2d(6, 4, 1)
    lin = AffineDivLinear(6, 4)
    lin.weight.data.copy_(conv.weight.flatten(1))
    lin.bias.data.copy_(conv.bias)
    x = torch.randn(2, 6, 5, 5)
    torch.testing.assert_close(conv(x), lin(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))


@pytest.mark.parametrize('cls,dim', [(L2Norm, -1), (L2Norm2d, 1)])
@pytest.mark.parametrize('scale', ['l2', 'rms'])
def test_l2_normaliser(cls, dim, scale):
    norm = cls(6, scale=scale)
    x = torch.randn(3, 6, 4, 6) * 10
    y = norm(x)
    c = 6 if scale == 'rms' else 1
    torch.testing.assert_close(y.square().sum(dim), torch.full_like(y.sum(dim), c), rtol=1e-6, atol=0)
    # after the normaliser, a linear layer's factor |x|^2 + 1 is the constant c + 1
    head = nn.Linear(6, 3)
    features = norm(torch.randn(4, 6) * torch.tensor([[0.1], [1.0], [10.0], [100.0]]) if dim == -1 else
                    torch.randn(4, 6, 1, 1) * torch.tensor([0.1, 1.0, 10.0, 100.0]).view(4, 1, 1, 1)).flatten(1)
    for n in range(4):
        factor = update_factor(lambda: head(features), [head.weight, head.bias], (n, slice(None)))
        torch.testing.assert_close(factor, (features[n].square().sum() + 1).expand(3), rtol=1e-7, atol=0)
        torch.testing.assert_close(factor, torch.full_like(factor, c + 1.0), rtol=1e-3, atol=0)


@pytest.mark.parametrize('bias', [True, False])
@pytest.mark.parametrize('scale', ['l2', 'rms'])
def test_l2_norm_linear(bias, scale):
    """The norm-like layer: W x/|x| + b, scale-invariant, one update factor (c + 1, or c) for every sample."""
    torch.manual_seed(0)
    lin = L2NormLinear(7, 5, bias=bias, scale=scale)
    x = torch.randn(3, 4, 7) * torch.tensor([0.1, 1.0, 100.0]).view(3, 1, 1)     # norms over three decades
    c = 7 if scale == 'rms' else 1
    expected = F.linear(x / (x.square().sum(-1, keepdim=True) / c + lin.eps).sqrt(), lin.weight, lin.bias)
    torch.testing.assert_close(lin(x), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lin(x * 1e7), lin(x * 1e4), rtol=1e-9, atol=1e-12)  # |x|^2 >> eps: scale-invariant
    assert torch.equal(lin(torch.zeros(2, 7)), lin.bias.expand(2, 5) if bias else torch.zeros(2, 5))
    plain = nn.Linear(7, 5, bias=bias)
    plain.load_state_dict(lin.state_dict())
    for index in [(0, 0, slice(None)), (1, 2, slice(None)), (2, 3, slice(None))]:
        factor = update_factor(lambda: lin(x), [lin.weight, lin.bias], index)
        # |x / sqrt(|x|^2 / c + eps)|^2 (+ 1): eps moves it by ~c eps / |x|^2 < 5e-4 (smallest |x|^2 ~ 0.05)
        torch.testing.assert_close(factor, torch.full_like(factor, c + float(bias)), rtol=5e-4, atol=0)
        plain_factor = update_factor(lambda: plain(x), [plain.weight, plain.bias], index)
        sq = x[index[:2]].square().sum() + float(bias)                    # the plain layer's: |x|^2 (+1), 0.05 to 7e4
        torch.testing.assert_close(plain_factor, sq.expand(5), rtol=1e-7, atol=0)
    with pytest.raises(ValueError, match='in_features=7'):
        lin(torch.randn(2, 6))
    with pytest.raises(ValueError, match='scale'):
        L2NormLinear(7, 5, scale='max')


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_half_precision_does_not_overflow(dtype):
    """|P|^2 of large float16 activations exceeds 65504; the norms are taken in float32."""
    conv = PatchNormConv2d(16, 8, 3, padding=1).float()
    lin = AffineDivLinear(64, 8).float()
    norm_lin = L2NormLinear(64, 8).float()
    x = torch.randn(2, 16, 6, 6, dtype=torch.float32) * 200
    v = torch.randn(2, 64, dtype=torch.float32) * 200
    for layer, inp in [(conv, x), (lin, v), (norm_lin, v)]:
        expected = layer(inp)
        out = layer.to(dtype)(inp.to(dtype))
        assert out.dtype == dtype and torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), expected, rtol=0.05, atol=0.05)
        layer.float()


@pytest.mark.parametrize('precision', ['float16', 'bfloat16_autocast'])
@pytest.mark.parametrize('layer', ['depthwise_same', 'depthwise_strided', 'wide_linear'])
def test_half_precision_training(layer, precision):
    """Backward in float16 and under bfloat16 autocast: finite, and the gradients of float32 within rounding."""
    torch.manual_seed(0)
    if layer == 'wide_linear':
        module, shape = AffineDivLinear(16, 48), (6, 16)
    else:
        module, shape = PatchNormConv2d(8, 8, 5, stride=2 if layer == 'depthwise_strided' else 1, padding=2,
                                        groups=8), (2, 8, 9, 9)
    module.float()
    x = (torch.randn(shape, dtype=torch.float32) * 200).requires_grad_()
    params = list(module.parameters())
    expected = torch.autograd.grad(module(x).square().mean(), [x] + params)
    if precision == 'float16':
        module.half()
        inputs = [x.detach().half().requires_grad_()]
        out = module(inputs[0])
    else:
        inputs = [x]
        with torch.autocast('cpu', dtype=torch.bfloat16):
            out = module(x)
    assert out.dtype == (torch.float16 if precision == 'float16' else torch.bfloat16)
    for got, want in zip(torch.autograd.grad(out.float().square().mean(), inputs + list(module.parameters())),
                         expected):
        assert torch.isfinite(got).all()
        assert F.cosine_similarity(got.float().flatten(), want.flatten(), dim=0) > 0.99


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match='padding_mode'):
        PatchNormConv2d(3, 4, 3, padding=1, padding_mode='mirror')
    with pytest.raises(ValueError, match='scale'):
        PatchNormConv2d(3, 4, 3, scale='frobenius')
    with pytest.raises(ValueError, match='scale'):
        AffineDivLinear(3, 4, scale='max')
    conv = PatchNormConv2d(3, 4, 3)
    with pytest.raises(ValueError, match=r'4-D input \(N, C, H, W\)'):
        conv(torch.randn(3, 8, 8))
    with pytest.raises(ValueError, match='3 input channels'):
        conv(torch.randn(1, 5, 8, 8))
    with pytest.raises(ValueError, match='in_features=3'):
        AffineDivLinear(3, 4)(torch.randn(2, 5))
    with pytest.raises(ValueError, match='in_features=3'):
        AffineDivLinear(3, 4)(torch.tensor(1.0))


def test_from_conv_and_from_linear_share_parameters():
    conv = nn.Conv2d(4, 6, 3, stride=2, padding=1, bias=False)
    pn = PatchNormConv2d.from_conv(conv, bias=True)
    assert pn.weight is conv.weight and torch.equal(pn.bias, torch.zeros(6))
    assert (pn.stride, pn.padding, pn.groups) == (conv.stride, conv.padding, conv.groups)
    lin = nn.Linear(4, 2)
    ad = AffineDivLinear.from_linear(lin, scale='l2')
    assert ad.weight is lin.weight and ad.bias is lin.bias and ad.scale == 'l2'


def _reference_lstm(lstm: nn.LSTM, x: torch.Tensor, first_input_map) -> torch.Tensor:
    """ The LSTM recurrence written out, batch first: layer 0's input gates from `first_input_map(x)` (per
    direction, concatenated), the later layers' from their plain input maps."""
    directions = 2 if lstm.bidirectional else 1
    hidden = lstm.hidden_size
    for layer in range(lstm.num_layers):
        outputs = []
        for d, suffix in enumerate(['', '_reverse'][:directions]):
            names = [f'{kind}_l{layer}{suffix}' for kind in ('weight_ih', 'weight_hh', 'bias_ih', 'bias_hh')]
            w_ih, w_hh = getattr(lstm, names[0]), getattr(lstm, names[1])
            b_ih, b_hh = (getattr(lstm, names[2]), getattr(lstm, names[3])) if lstm.bias else (None, None)
            if layer == 0:
                gates_in = first_input_map(x)[..., d * 4 * hidden:(d + 1) * 4 * hidden]
            else:
                gates_in = F.linear(x, w_ih, b_ih)
            h = c = torch.zeros(x.shape[0], hidden)
            steps = range(x.shape[1] - 1, -1, -1) if d else range(x.shape[1])
            out = [None] * x.shape[1]
            for t in steps:
                gates = gates_in[:, t] + F.linear(h, w_hh, b_hh)
                i, f, g, o = gates.chunk(4, -1)
                c = f.sigmoid() * c + i.sigmoid() * g.tanh()
                h = o.sigmoid() * c.tanh()
                out[t] = h
            outputs.append(torch.stack(out, 1))
        x = torch.cat(outputs, -1)
    return x


@pytest.mark.parametrize('bias', [True, False])
@pytest.mark.parametrize('bidirectional', [False, True])
@pytest.mark.parametrize('num_layers', [1, 2])
def test_affine_div_lstm(bias, bidirectional, num_layers):
    """Layer 0's input map is `(W_ih x + b_ih) / s(x)` with factor `c` at every step; the rest is nn.LSTM's."""
    from timm_affinediv import AffineDivLSTM
    torch.manual_seed(0)
    plain = nn.LSTM(5, 3, num_layers=num_layers, bias=bias, batch_first=True, bidirectional=bidirectional)
    lstm = AffineDivLSTM.from_lstm(plain)
    assert lstm.weight_ih_l0 is plain.weight_ih_l0 and lstm.state_dict().keys() == plain.state_dict().keys()
    assert lstm.divergence_constant == 5 + bias
    x = torch.randn(2, 4, 5) * torch.rand(2, 4, 1) * 5                     # varied norms per step
    s = ((x.square().sum(-1, keepdim=True) + (1 if bias else lstm.eps)) / lstm.divergence_constant).sqrt()
    directions = [''] + (['_reverse'] if bidirectional else [])
    expected_map = torch.cat([F.linear(x, getattr(lstm, f'weight_ih_l0{d}'), getattr(lstm, f'bias_ih_l0{d}', None)
                                       if bias else None) / s for d in directions], -1)
    torch.testing.assert_close(lstm.input_map(x), expected_map, rtol=1e-12, atol=1e-12)
    out, (h, c) = lstm(x)
    torch.testing.assert_close(out, _reference_lstm(lstm, x, lstm.input_map), rtol=1e-10, atol=1e-12)
    one_sequence, _ = lstm(x[0])                                             # unbatched input
    torch.testing.assert_close(one_sequence, out[0], rtol=1e-12, atol=1e-12)
    again, _ = lstm(x, (h, c))                                               # a given state
    plain_again, _ = plain(x, (h, c))
    assert again.shape == out.shape and not torch.allclose(again, plain_again)
    params = [lstm.weight_ih_l0] + ([lstm.bias_ih_l0] if bias else [])
    for index in [(0, 0, slice(0, 12)), (1, 3, slice(0, 12))]:
        factor = update_factor(lambda: lstm.input_map(x), params, index)
        torch.testing.assert_close(factor, torch.full_like(factor, float(lstm.divergence_constant)), rtol=1e-7, atol=0)
    with pytest.raises(ValueError, match=r'\(N, L, 5\)'):
        lstm(torch.randn(2, 4, 6))
