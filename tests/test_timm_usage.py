"""PatchNorm models work the way timm models work."""
import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.models import create_feature_extractor

import timm_affinediv  # noqa: F401  (registers patchnorm)
from timm_affinediv import AffineDivLinear, PatchNormConv2d, describe_slots, residual_init

MODELS = ['resnet18', 'convnext_atto']
# for torch.compile, whose time grows with the blocks it compiles: one block a stage still has every layer kind of
# the model (stem, downsampling block, head)
ONE_BLOCK_A_STAGE = dict(resnet18=dict(layers=(1, 1, 1, 1)), convnext_atto=dict(depths=(1, 1, 1, 1)))


def _create(name, **kwargs):
    """With timm's start: `patchnorm`'s own starts the classifier at zero, which leaves nothing for these checks of the
    layers' outputs and gradients to see (tests/test_residual_init.py covers that start)."""
    torch.manual_seed(0)
    with residual_init('timm'):
        return timm.create_model(name, norm_layer='patchnorm', num_classes=4, in_chans=1, **kwargs)


@pytest.fixture(params=MODELS)
def name(request):
    return request.param


def test_forward_backward_train_eval(name):
    model = _create(name)
    x = torch.randn(3, 1, 32, 32)
    model.train()
    out = model(x)
    out.logsumexp(1).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    conv_bias = 'conv1.bias' if name == 'resnet18' else 'stages.0.blocks.0.conv_dw.bias'
    assert grads[conv_bias].abs().sum() > 0, 'the pre-division bias is trained'
    # no batch statistics: train and eval give the same function, and samples do not interact
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), out.detach())
        torch.testing.assert_close(model(x[:1]), out[:1].detach(), rtol=1e-5, atol=1e-5)


def test_parameter_names_are_those_of_the_norm_model(name):
    plain = timm.create_model(name, num_classes=4, in_chans=1)
    patch = _create(name)
    plain_keys, patch_keys = set(plain.state_dict()), set(patch.state_dict())
    conv_keys = {k for k, v in plain.state_dict().items() if v.dim() == 4}
    assert conv_keys <= patch_keys, 'convolution weights load 1:1'
    if name == 'resnet18':  # BatchNorm's running statistics are gone, the pre-division conv biases appear
        new = patch_keys - plain_keys
        assert 'layer1.0.conv1.bias' in new and all(k.endswith('conv1.bias') or k.endswith('conv2.bias')
                                                     or k.endswith('downsample.0.bias') for k in new), new
        assert not any('running' in k for k in patch_keys)
    else:  # ConvNeXt's convolutions have biases already: a LayerNorm checkpoint's keys are exactly ours
        assert patch_keys == plain_keys


def test_fx_feature_extraction_and_features_only(name):
    model = _create(name).eval()
    x = torch.randn(2, 1, 32, 32)
    node = 'layer4' if name == 'resnet18' else 'stages.3'
    extractor = create_feature_extractor(model, return_nodes={node: 'out'})
    with torch.no_grad():
        torch.testing.assert_close(extractor(x)['out'], model.forward_features(x))
    features = _create(name, features_only=True).eval()
    assert describe_slots(features) and all(b.bound for b in describe_slots(features))
    with torch.no_grad():
        maps = features(x)
    assert [m.shape[1] for m in maps] == features.feature_info.channels()


def test_channels_last(name):
    model = _create(name).eval()
    x = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        expected = model(x)
        model_cl = model.to(memory_format=torch.channels_last)
        torch.testing.assert_close(model_cl(x.to(memory_format=torch.channels_last)), expected,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_half_precision(name, dtype):
    model = _create(name).eval()
    x = torch.randn(2, 1, 32, 32) * 100  # large activations: |P|^2 overflows float16 if not taken in float32
    with torch.no_grad():
        expected = model(x)
        if dtype == torch.bfloat16:
            with torch.autocast('cpu', dtype=torch.bfloat16):
                out = model(x)
        else:
            out = model.to(dtype)(x.to(dtype))
    assert torch.isfinite(out).all()
    cos = torch.nn.functional.cosine_similarity(out.float(), expected, dim=1)
    assert cos.min() > 0.98, cos


@pytest.mark.parametrize('conv_mlp', [False, True])
def test_convnext_runs_channels_last_from_the_stem_like_layernorm(conv_mlp):
    """timm's LayerNorm2d returns channels-last memory, so a LayerNorm ConvNeXt runs channels-last from its
    stem on; the patchnorm slots that stand in for it do the same (the blocks' permutes then copy nothing)."""
    layouts = {}
    for norm in ('layernorm', 'patchnorm'):
        model = _create('convnext_atto', conv_mlp=conv_mlp) if norm == 'patchnorm' else timm.create_model(
            'convnext_atto', num_classes=4, in_chans=1, conv_mlp=conv_mlp)
        seen = layouts[norm] = []
        for module in [model.stem] + [block.conv_dw for stage in model.stages for block in stage.blocks]:
            module.register_forward_hook(
                lambda m, args, out: seen.append(out.is_contiguous(memory_format=torch.channels_last)))
        model(torch.randn(2, 1, 32, 32)).sum().backward()
    assert layouts['patchnorm'] == layouts['layernorm'] and all(layouts['layernorm'])


def test_torch_compile_training_step():
    """torch.compile captures the layers' own autograd Functions: outputs and gradients equal eager mode."""
    model = _create('convnext_atto', **ONE_BLOCK_A_STAGE['convnext_atto'])
    x = torch.randn(2, 1, 32, 32)
    grads = []
    for forward in (model, torch.compile(model, backend='aot_eager')):
        model.zero_grad()
        out = forward(x)
        out.logsumexp(1).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if forward is model:
            expected = out.detach()
    torch.testing.assert_close(out.detach(), expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(*grads[::-1]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_checkpoint_reload_through_timm(name, tmp_path):
    model = _create(name)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    file = tmp_path / 'model.safetensors'
    save_file(model.state_dict(), str(file))
    reloaded = timm.create_model(name, norm_layer='patchnorm', num_classes=4, in_chans=1, pretrained=True,
                                 pretrained_cfg_overlay=dict(file=str(file), num_classes=4, input_size=(1, 32, 32)))
    for (k, a), (k2, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    x = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(x), model.eval()(x), rtol=0, atol=0)
    fresh = _create(name)
    fresh.load_state_dict(model.state_dict())
    assert isinstance(fresh.get_submodule('head.fc' if name != 'resnet18' else 'conv1'),
                      (AffineDivLinear, PatchNormConv2d))


def test_torch_compile_on_cpu():
    model = _create('resnet18', **ONE_BLOCK_A_STAGE['resnet18']).eval()
    x = torch.randn(2, 1, 32, 32)
    compiled = torch.compile(model)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
