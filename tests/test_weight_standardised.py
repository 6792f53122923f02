"""`norm_layer="patchnorm_ws"`: PatchNorm whose producers apply their weight standardised per output channel."""
import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers import ScaledStdConv2d

import timm_affinediv
from timm_affinediv import AffineDivLinear, PatchNormConv2d, PatchNormWS2d, standardised_weight
from timm_affinediv.errors import ConversionError
from timm_affinediv.hub import save_hub_folder

GEOMETRIES = [dict(kernel_size=3, stride=1, padding=1), dict(kernel_size=3, stride=2, padding=1, groups=2),
              dict(kernel_size=1, stride=1, padding=0), dict(kernel_size=3, stride=1, padding=2, dilation=2)]


def _reference(conv: PatchNormConv2d, x: torch.Tensor) -> torch.Tensor:
    """`(W_std * x + b)_p / s(P_p)` through im2col, every patch's norm taken from its column."""
    groups, (kh, kw) = conv.groups, conv.kernel_size
    cols = F.unfold(x, (kh, kw), dilation=conv.dilation, padding=conv.padding, stride=conv.stride)
    n, _, positions = cols.shape
    cols = cols.view(n, groups, -1, positions)
    weight = standardised_weight(conv.weight).view(groups, conv.out_channels // groups, -1)
    y = torch.einsum('gof,ngfp->ngop', weight, cols) + conv.bias.view(1, groups, -1, 1)
    s = ((cols.pow(2).sum(2, keepdim=True) + 1) / conv.divergence_constant).sqrt()
    h = (x.shape[2] + 2 * conv.padding[0] - conv.dilation[0] * (kh - 1) - 1) // conv.stride[0] + 1
    return (y / s).reshape(n, conv.out_channels, h, -1)


def test_standardised_weight_is_timms_scaled_std_conv_weight():
    torch.manual_seed(0)
    timm_conv = ScaledStdConv2d(6, 8, 3, gamma=1.0, eps=1e-6).double()
    ours = standardised_weight(timm_conv.weight)
    theirs = F.batch_norm(timm_conv.weight.reshape(1, 8, -1), None, None,
                          weight=(timm_conv.gain * timm_conv.scale).view(-1), training=True, momentum=0.,
                          eps=timm_conv.eps).reshape_as(timm_conv.weight)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    rows = ours.flatten(1)
    torch.testing.assert_close(rows.mean(1), torch.zeros(8, dtype=torch.float64), rtol=0, atol=1e-15)
    # unit norm up to the variance guard (1e-6 against a variance of about 1 / 54 here)
    torch.testing.assert_close(rows.norm(dim=1), torch.ones(8, dtype=torch.float64), rtol=2e-4, atol=0)


@pytest.mark.parametrize('geometry', GEOMETRIES, ids=lambda g: '-'.join(f'{k}{v}' for k, v in g.items()))
def test_a_standardising_producer_is_exact_and_blind_to_its_weights_scale_and_shift(geometry):
    torch.manual_seed(0)
    conv = PatchNormConv2d(4, 6, **geometry).double()
    conv.standardise_weight = True
    with torch.no_grad():  # a variance of about 1: the guard (1e-6) moves the output by less than the tolerance
        conv.weight.normal_()
    x = torch.randn(2, 4, 9, 9, dtype=torch.float64) * torch.rand(2, 1, 9, 9, dtype=torch.float64) * 5
    y = conv(x)
    torch.testing.assert_close(y, _reference(conv, x), rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        conv.weight.mul_(7.0).add_(torch.randn(6, 1, 1, 1, dtype=torch.float64))
    torch.testing.assert_close(conv(x), y, rtol=1e-4, atol=1e-5)
    conv.standardise_weight = False
    assert not torch.allclose(conv(x), y)


def test_half_weights_are_standardised_in_float32():
    weight = torch.full((4, 8, 3, 3), 300.0, dtype=torch.float16)
    weight[:, 0] = 400.0  # its squares overflow float16
    std = standardised_weight(weight)
    assert std.dtype == torch.float16 and torch.isfinite(std).all()
    torch.testing.assert_close(std.float(), standardised_weight(weight.float()).half().float())


def test_gradients_reach_the_weight_through_the_standardisation():
    torch.manual_seed(0)
    linear = AffineDivLinear(5, 3).double()
    linear.standardise_weight = True
    with torch.no_grad():
        linear.weight.normal_()
    x = torch.randn(4, 5, dtype=torch.float64)
    torch.autograd.gradcheck(lambda w: F.linear(x, standardised_weight(w)), (linear.weight.detach().requires_grad_(),))
    linear(x).sum().backward()
    rows = linear.weight.grad
    # the loss cannot change along the weight's own row or a constant shift of it: the gradient is orthogonal to both
    torch.testing.assert_close((rows * linear.weight.detach()).sum(1), torch.zeros(3, dtype=torch.float64),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(rows.sum(1), torch.zeros(3, dtype=torch.float64), rtol=0, atol=1e-10)


def test_the_string_standardises_every_producer_and_keeps_patchnorms_names_and_start():
    torch.manual_seed(0)
    ws = timm.create_model('resnet50', norm_layer='patchnorm_ws', num_classes=10)
    plain = timm.create_model('resnet50', norm_layer='patchnorm', num_classes=10)
    ws_convs = [m for m in ws.modules() if isinstance(m, PatchNormConv2d)]
    assert len(ws_convs) == 53 and all(m.standardise_weight for m in ws_convs)
    assert not any(m.standardise_weight for m in plain.modules() if isinstance(m, PatchNormConv2d))
    assert all(isinstance(m, PatchNormWS2d) for n, m in ws.named_modules() if n.endswith('bn3'))
    assert ws.state_dict().keys() == plain.state_dict().keys()
    # patchnorm's default start: the 16 branches' last slots at 1/sqrt(16), the classifier at zero
    assert all(float(m.weight.detach().max()) == float(m.weight.detach().min()) == 0.25 for n, m in ws.named_modules()
               if n.endswith('bn3'))
    assert not ws.get_classifier().weight.any()
    ws.load_state_dict(plain.state_dict())
    assert timm.create_model('resnet18', norm_layer='patchnormws').layer1[0].conv1.standardise_weight


def test_conversion_refuses_it_in_one_line():
    model = timm.create_model('resnet18', num_classes=10, channels=(8, 16, 24, 32))
    with pytest.raises(ConversionError, match="standardises each producer's weight.*convert to 'patchnorm'") as e:
        timm_affinediv.convert_model(model, norm='patchnorm_ws')
    assert '\n' not in str(e.value)


def test_a_hub_folder_loads_back_through_timm_with_its_card(tmp_path):
    args = dict(norm_layer='patchnorm_ws', num_classes=10, channels=(8, 16, 24, 32))
    torch.manual_seed(0)
    model = timm.create_model('resnet18', **args).eval()
    with torch.no_grad():
        model.get_classifier().weight.normal_()
    folder = save_hub_folder(model, tmp_path / 'ws', model_args=args)
    loaded = timm.create_model(f'local-dir:{folder}', pretrained=True).eval()
    assert all(m.standardise_weight for m in loaded.modules() if isinstance(m, PatchNormConv2d))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    card = ' '.join((folder / 'README.md').read_text().split())
    assert 'Norm layer: `patchnorm_ws`' in card and 'standardised per output channel' in card
