"""Deployment: patchnorm/affinediv models export to ONNX (both exporters), TorchScript and torch.export with
eager's numbers, and an export that would change them is refused."""
import warnings

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

import timm_affinediv  # noqa: F401
from timm_affinediv.export import ExportError, export_onnx, relative_error, validate_onnx

pytest.importorskip('onnxruntime', reason='ONNX tests need the dev extra: pip install -e ".[dev]"')

# narrow and shallow, at 32x32, so that the exporters (dynamo's takes seconds per model) stay fast
NARROW_RESNET = dict(channels=(8, 16, 24, 32), layers=(1, 1, 1, 1))
NARROW_CONVNEXT = dict(dims=(8, 16, 24, 32), depths=(1, 1, 1, 1))
MODELS = {
    'resnet18-patchnorm': ('resnet18', dict(norm_layer='patchnorm', **NARROW_RESNET)),
    'resnet26d-patchnorm': ('resnet26d', dict(norm_layer='patchnorm', stem_width=8, **NARROW_RESNET)),
    'convnext-patchnorm': ('convnext_atto', dict(norm_layer='patchnorm', conv_mlp=False, **NARROW_CONVNEXT)),
    'convnext-conv_mlp-patchnorm': ('convnext_atto', dict(norm_layer='patchnorm', conv_mlp=True, **NARROW_CONVNEXT)),
    'resnet18-patchnorm_ws': ('resnet18', dict(norm_layer='patchnorm_ws', **NARROW_RESNET)),
    'resnet18-affinediv': ('resnet18', dict(norm_layer='affinediv', **NARROW_RESNET)),
    'convnext-conv_mlp-affinediv': ('convnext_atto', dict(norm_layer='affinediv', conv_mlp=True, **NARROW_CONVNEXT)),
    # token models: slots over the last dim bound to qkv, fc1 and the head; Swin's through pads, rolls and windows
    'vit-patchnorm': ('vit_tiny_patch16_224', dict(norm_layer='patchnorm', img_size=32, patch_size=8, embed_dim=32,
                                                   depth=2, num_heads=2)),
    'swin-patchnorm': ('swin_tiny_patch4_window7_224', dict(norm_layer='patchnorm', img_size=32, window_size=4,
                                                            embed_dim=16, depths=(2, 1), num_heads=(1, 2))),
}
INPUT_SIZE = (3, 32, 32)
TOLERANCE = 1e-5


def _model(key: str) -> nn.Module:
    name, kwargs = MODELS[key]
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10, **kwargs).eval()
    # random, not identity, slot affines: a path that drops or doubles one shows
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, timm_affinediv.layers.slot.PatchNormSlot):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0, 0.1)
    return model


def _batches(*sizes):
    generator = torch.Generator().manual_seed(1)
    return [torch.randn((b,) + INPUT_SIZE, generator=generator) for b in sizes]


@pytest.fixture(autouse=True)
def _quiet_exporters():
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        yield


@pytest.mark.parametrize('key', list(MODELS))
def test_torch_export_and_its_onnx_match_eager(key, tmp_path):
    """torch.export, and the dynamo ONNX exporter on its program, at batch sizes other than the example's."""
    model = _model(key)
    exported = torch.export.export(model, tuple(_batches(2)), dynamic_shapes=({0: torch.export.Dim.DYNAMIC},))
    with torch.no_grad():
        for x in _batches(1, 3):
            assert relative_error(exported.module()(x), model(x)) <= TOLERANCE
    path = tmp_path / 'model.onnx'
    torch.onnx.export(exported, (), str(path), dynamo=True, opset_version=18, external_data=False)
    assert validate_onnx(model, path, _batches(1, 5)) <= TOLERANCE


@pytest.mark.parametrize('key', list(MODELS))
def test_torchscript_exporter_onnx_matches_eager(key, tmp_path):
    model = _model(key)
    path = tmp_path / 'model.onnx'
    export_onnx(model, path, INPUT_SIZE, dynamo=False, opset=17, validate=False)
    # batch sizes other than the export's example (2): the batch axis is dynamic
    assert validate_onnx(model, path, _batches(1, 5)) <= TOLERANCE


@pytest.mark.parametrize('key', list(MODELS))
def test_torchscript_matches_eager(key):
    model = _model(key)
    scripted = torch.jit.script(model)
    with torch.no_grad():
        for x in _batches(1, 3):
            assert relative_error(scripted(x), model(x)) <= TOLERANCE


def test_fused_slot_affine_is_visible_to_torchscript():
    """A bound convolution applies its slot's affine under TorchScript as in eager, the slot being its submodule:
    scripted on its own it gives the eager numbers and follows the slot. The slot stays the model's: one name per
    parameter in `named_parameters`, `modules` and the state dict, which loads strictly into a fresh model."""
    model = _model('resnet18-patchnorm')
    block = model.layer1[0]
    conv, slot = block.conv1, block.bn1
    assert conv.fused_slot is slot
    x = torch.randn(2, conv.in_channels, 8, 8)
    scripted = torch.jit.script(conv)
    with torch.no_grad():
        assert relative_error(scripted(x), conv(x)) <= TOLERANCE
        without = conv(x) - slot.bias.view(-1, 1, 1)
        slot.bias.add_(1.)
        assert relative_error(scripted(x), conv(x)) <= TOLERANCE
        torch.testing.assert_close(conv(x) - slot.bias.view(-1, 1, 1), without)
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_modules()]
    assert 'layer1.0.bn1.weight' in names and 'layer1.0.bn1' in names and not any('fused_slot' in n for n in names)
    assert sum(m is slot for m in model.modules()) == 1
    state = model.state_dict()
    assert not any('fused_slot' in k for k in state)
    fresh = _model('resnet18-patchnorm')
    fresh.load_state_dict(state)
    with torch.no_grad():
        x = _batches(2)[0]
        torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)
        scripted_model = torch.jit.script(model)
        assert relative_error(scripted_model(x), model(x)) <= TOLERANCE


def test_scripted_model_trains_like_eager():
    """Under autograd the eager layers take their own autograd Functions, TorchScript plain ops: same gradients."""
    model = _model('convnext-conv_mlp-patchnorm').train()
    scripted = torch.jit.script(model)
    x = _batches(2)[0]
    grads = []
    for net in (model, scripted):
        net.zero_grad()
        net(x).square().sum().backward()
        grads.append([p.grad.clone() for p in net.parameters()])
    for eager_grad, scripted_grad in zip(*grads):
        assert relative_error(scripted_grad, eager_grad) <= 1e-4


class _DroppedDivisor(nn.Module):
    """What PatchNorm once did: avg_pool2d's divisor_override, which the dynamo ONNX exporter drops silently."""

    def forward(self, x):
        return F.avg_pool2d(x, 3, 1, 1, divisor_override=2)


def test_export_that_changes_numbers_is_refused(tmp_path):
    path = tmp_path / 'wrong.onnx'
    with pytest.raises(ExportError, match='differs from eager'):
        export_onnx(_DroppedDivisor(), path, (1, 8, 8))
    assert list(tmp_path.iterdir()) == []
    # the same export, when its numbers are right, is written
    assert export_onnx(nn.AvgPool2d(3, 1, 1), path, (1, 8, 8)) <= TOLERANCE
    assert [p.name for p in tmp_path.iterdir()] == ['wrong.onnx']


def test_export_script(tmp_path, capsys):
    from timm_affinediv.commands import main as command

    def main(argv):
        return command(['export', *argv])
    model = _model('resnet18-patchnorm')
    checkpoint = tmp_path / 'model.safetensors'
    save_file(model.state_dict(), str(checkpoint))
    args = ['--model', 'resnet18', '--checkpoint', str(checkpoint), '--norm-layer', 'patchnorm', '--num-classes',
            '10', '--img-size', '32', '--model-kwargs', 'channels=(8,16,24,32)', 'layers=(1,1,1,1)']
    output = tmp_path / 'out' / 'model.onnx'
    assert main(args + ['--output', str(output), '--no-dynamo']) == 0
    assert 'worst relative error' in capsys.readouterr().out
    assert validate_onnx(model, output, _batches(2)) <= TOLERANCE
    exported = output.read_bytes()
    assert main(args + ['--output', str(output), '--no-dynamo']) == 2  # an earlier export is kept
    assert 'holds earlier results' in capsys.readouterr().err and output.read_bytes() == exported
    assert main(args[:2] + ['--checkpoint', str(tmp_path / 'missing.pth'), '--output', str(output),
                            '--overwrite']) == 2
    assert 'not found' in capsys.readouterr().err
