"""`patchnorm`'s default start for residual branches (`residual_init`): where timm zero-initialises the last norm of
a branch, its slot starts at 1/sqrt(N) and the classifier at zero; everything else is timm's; the layers' divergence
factors stay their constants; weights that load (a conversion, a checkpoint) replace it."""
import math

import pytest
import timm
import torch

from timm_affinediv import (
    AffineDivError,
    PatchNorm2d,
    convert_model,
    divergence_report,
    get_residual_init,
    init_residual_branches,
    residual_init,
)
from timm_affinediv.errors import OptionError

# every timm family with a zero_init_last that takes norm_layer='patchnorm' as a string or class, a small member each
ZERO_INIT_FAMILIES = [('resnet18', 8), ('resnet50', 16), ('regnetx_002', 13), ('cspresnet50', 13),
                      ('resnest14d', 4), ('res2net50_14w_8s', 16)]
UNCHANGED_FAMILIES = ['densenet121', 'mobilenetv3_small_050', 'tinynet_e', 'convnext_atto', 'vit_tiny_patch16_224']


def _build(name: str, policy: str, **kwargs):
    torch.manual_seed(0)
    with residual_init(policy):
        return timm.create_model(name, norm_layer='patchnorm', num_classes=5, **kwargs)


def _slot_gains(model):
    return {n: m.weight.detach() for n, m in model.named_modules() if isinstance(m, PatchNorm2d)}


@pytest.mark.parametrize('name,branches', ZERO_INIT_FAMILIES)
def test_the_branches_timm_closes_start_open_and_the_classifier_at_zero(name, branches):
    timm_init, default = _build(name, 'timm'), _build(name, 'skipinit')
    closed = [n for n, gain in _slot_gains(timm_init).items() if not gain.any()]
    assert len(closed) == branches  # timm's zero_init_last reaches the slots
    gains = _slot_gains(default)
    for n in closed:
        assert torch.equal(gains[n], torch.full_like(gains[n], 1 / math.sqrt(branches)))
    classifier = default.get_classifier()
    assert not classifier.weight.any() and not classifier.bias.any()
    # everything else is timm's own initialisation, drawn from the same seed
    timm_state, state = timm_init.state_dict(), default.state_dict()
    head = {f'{p}.{k}' for p in ('fc', 'head.fc') for k in ('weight', 'bias')}
    differ = {k for k in state if not torch.equal(state[k], timm_state[k])}
    assert differ <= {f'{n}.weight' for n in closed} | head and differ >= {f'{n}.weight' for n in closed}


@pytest.mark.parametrize('name', UNCHANGED_FAMILIES)
def test_families_without_closed_branches_keep_timms_initialisation(name):
    kwargs = dict(img_size=32) if name.startswith('vit') else {}
    timm_init, default = _build(name, 'timm', **kwargs), _build(name, 'skipinit', **kwargs)
    assert init_residual_branches(default) == 0
    for (k, a), b in zip(timm_init.state_dict().items(), default.state_dict().values()):
        assert torch.equal(a, b), k


def test_every_divergence_factor_stays_its_constant_in_the_default_start():
    torch.manual_seed(0)
    model = timm.create_model('resnet18', norm_layer='patchnorm', num_classes=5).double()
    report = divergence_report(model, torch.randn(4, 3, 32, 32, dtype=torch.float64), samples=2,
                               positions_per_sample=2, batch_stats=True)
    corrected = [r for r in report if r.corrected]
    assert len(corrected) == 20
    for r in corrected:
        assert r.closed_form_error < 1e-9 and r.max / r.min - 1 < 1e-9, r.name


def test_a_conversion_is_the_same_under_either_start():
    torch.manual_seed(0)
    original = timm.create_model('resnet18', num_classes=5, channels=(8, 16, 32, 64), stem_width=8).eval()
    calibration = [torch.randn(16, 3, 32, 32) for _ in range(2)]
    converted = {}
    for policy in ('skipinit', 'timm'):
        with residual_init(policy):
            converted[policy] = convert_model(original, calibration=calibration)[0].state_dict()
    assert converted['skipinit'].keys() == converted['timm'].keys()
    for k, v in converted['timm'].items():
        assert torch.equal(converted['skipinit'][k], v), k


def test_the_policy_is_scoped_and_checked():
    assert get_residual_init() == 'skipinit'
    with residual_init('timm'):
        assert get_residual_init() == 'timm'
    assert get_residual_init() == 'skipinit'
    with pytest.raises(OptionError, match=r"residual_init takes one of \('skipinit', 'timm'\), got 'zero'"):
        with residual_init('zero'):
            pass
    with pytest.raises(AffineDivError):
        init_residual_branches(timm.create_model('resnet18', num_classes=5), policy='fixup')
