"""Converting a trained BatchNorm ResNet / LayerNorm ConvNeXt to PatchNorm, on Fashion-MNIST at a small scale."""
import json

import numpy as np
import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

import timm_affinediv  # noqa: F401
from timm_affinediv import AffineDivLinear, PatchNormConv2d, describe_slots
from timm_affinediv.convert import ConversionError, convert_model
from timm_affinediv.data import FASHION_MNIST_MEAN, FASHION_MNIST_STD, FashionMNIST

NARROW = dict(resnet18=dict(channels=(16, 32, 64, 128), stem_width=16),
              convnext_atto=dict(dims=(16, 32, 64, 128)))


def _tensors(split, n, offset=0):
    ds = FashionMNIST(split=split)
    x = torch.from_numpy(np.array(ds.images[offset:offset + n])).float().div(255)
    x = F.pad((x - FASHION_MNIST_MEAN[0]) / FASHION_MNIST_STD[0], (2, 2, 2, 2)).unsqueeze(1)
    return x, torch.from_numpy(np.array(ds.targets[offset:offset + n]))


@pytest.fixture(scope='module')
def data():
    return _tensors('train', 3072), _tensors('test', 1024)


def _train(name, data, steps=150):
    """A briefly trained model: a few epochs of a 3k-image subset, BatchNorm statistics re-estimated."""
    (x, y), _ = data
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10, in_chans=1, **NARROW[name])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    for _ in range(steps):
        idx = torch.randint(0, len(x), (64,))
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    with torch.no_grad():  # exact BatchNorm statistics, so the eval-mode model is what was trained
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.reset_running_stats()
                m.momentum = None
        for i in range(0, 1024, 256):
            model(x[i:i + 256])
    return model.eval()


def _top1(model, x, y):
    with torch.no_grad():
        return (model.eval()(x).argmax(1) == y).float().mean().item()


@pytest.mark.parametrize('name', ['resnet18', 'convnext_atto'])
def test_calibration_recovers_what_the_swap_loses(name, data):
    (x, _), (xt, yt) = data
    model = _train(name, data)
    original = _top1(model, xt, yt)
    assert original > 0.6, 'the briefly trained model should have learned something'
    swapped, report = convert_model(model)
    assert report.top1_agreement_analytic is None and not report.layers
    calib = [x[i:i + 64] for i in range(0, 256, 64)]
    calibrated, report = convert_model(model, calibration=calib)
    swap_top1, calibrated_top1 = _top1(swapped, xt, yt), _top1(calibrated, xt, yt)
    assert calibrated_top1 > swap_top1 + 0.1, (original, swap_top1, calibrated_top1)
    assert calibrated_top1 > original - 0.1, (original, calibrated_top1)
    assert report.top1_agreement_calibrated > report.top1_agreement_analytic + 0.1
    # per-layer fidelity: the fit never does worse than where it started, and the report says so
    assert report.layers and all(f.rel_err_after <= f.rel_err_before + 1e-6 for f in report.layers)
    assert json.loads(json.dumps(report.to_dict()))['layers'][0]['layer'] == report.layers[0].layer
    assert 'rel. err before' in report.format_table()
    # the converted model is exactly what timm builds: its state dict loads there 1:1
    rebuilt = timm.create_model(name, norm_layer='patchnorm', num_classes=10, in_chans=1, **NARROW[name])
    rebuilt.load_state_dict(calibrated.state_dict())
    torch.testing.assert_close(rebuilt.eval()(xt[:8]), calibrated(xt[:8]))


def test_affinediv_mode_corrects_every_affine_map(data):
    model = timm.create_model('resnet18', num_classes=10, in_chans=1, **NARROW['resnet18']).eval()
    converted, _ = convert_model(model, norm='affinediv')
    assert not any(type(m) in (nn.Conv2d, nn.Linear) for m in converted.modules())
    assert isinstance(converted.fc, AffineDivLinear) and isinstance(converted.conv1, PatchNormConv2d)
    assert all(b.bound for b in describe_slots(converted))


def test_bad_input(data):
    model = timm.create_model('resnet18', num_classes=10, in_chans=1, **NARROW['resnet18']).eval()
    with pytest.raises(ConversionError, match='norm must be one of'):
        convert_model(model, norm='batchnorm')
    with pytest.raises(ConversionError, match=r'\(N, 1, H, W\)'):
        convert_model(model, calibration=[torch.randn(4, 3, 32, 32)])
    vit = timm.create_model('vit_tiny_patch16_224', num_classes=10, img_size=32, patch_size=8)
    with pytest.raises(ConversionError):
        convert_model(vit)
