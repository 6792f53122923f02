"""`norm_layer="patchnorm"` in timm models: binding, the per-slot update factor, and timm's ways of use."""
import pytest
import timm
import torch
import torch.nn as nn
from timm.layers import create_norm_act_layer, create_norm_layer, get_norm_layer

import timm_affinediv
from timm_affinediv import (
    AffineDivLinear,
    AffineDivLSTM,
    PatchNorm,
    PatchNorm2d,
    PatchNormAct2d,
    PatchNormConv2d,
    bind_patchnorm,
    describe_slots,
    update_factor,
)

RESNETS = ['resnet18', 'resnet34', 'resnet50', 'resnet101', 'resnet50d', 'resnext50_32x4d', 'seresnet50',
           'wide_resnet50_2']
# convnext_small is convnext_tiny with a deeper third stage (27 blocks, not 9): the same blocks, three times the time
CONVNEXTS = [(name, conv_mlp) for name in ('convnext_atto', 'convnext_tiny') for conv_mlp in (False, True)]
ALL_MODELS = [(name, {}) for name in RESNETS] + [(name, dict(conv_mlp=m)) for name, m in CONVNEXTS]


def _model_id(case):
    name, kwargs = case
    return name + ('_conv_mlp' if kwargs.get('conv_mlp') else '')


def _capture(model: nn.Module, names, x: torch.Tensor):
    """Inputs and outputs of the named modules in one forward of `model(x)`."""
    inputs, outputs, handles = {}, {}, []
    modules = dict(model.named_modules())
    for name in names:
        def hook(_, args, out, name=name):
            # clones: in-place activations (ReLU(inplace=True)) overwrite outputs later; an LSTM's is a tuple
            out = out[0] if isinstance(out, tuple) else out
            inputs[name], outputs[name] = args[0].detach().clone(), out.detach().clone()
        handles.append(modules[name].register_forward_hook(hook))
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    return inputs, outputs


_LAYOUTS = [lambda y: y, lambda y: y.permute(0, 2, 3, 1), lambda y: y.flatten(1)]


def _layout_between(produced: torch.Tensor, received: torch.Tensor):
    """The layout-only op (identity, NCHW->NHWC, flatten) that took `produced` to `received`."""
    for layout in _LAYOUTS:
        moved = layout(produced)
        if moved.shape == received.shape and torch.equal(moved, received):
            return layout
    raise AssertionError(f'no layout op maps {tuple(produced.shape)} to {tuple(received.shape)}')


def _indices(out: torch.Tensor, channel_dim: int):
    """One output vector (over channels) of the first sample and one of the last, at different positions."""
    first, last = [0] * (out.dim() - 1), [out.shape[0] - 1] + [s - 1 for s in out.shape[1:]]
    if channel_dim == 1:
        last.pop(1)
    else:
        last.pop()
    for index in (first, last):
        index.insert(channel_dim % out.dim(), slice(None))
        yield tuple(index)


def _check_bindings(name, model):
    slots = describe_slots(model)
    assert slots and all(b.bound for b in slots), [b for b in slots if not b.bound]
    modules = dict(model.named_modules())
    for b in slots:
        if name.startswith('convnext'):
            if b.slot.startswith('stem') or b.slot.endswith('.norm') and 'blocks' in b.slot:
                assert b.producer is not None
            if 'blocks' in b.slot or 'downsample' in b.slot or b.slot == 'head.norm':
                assert len(b.consumers) == 1
        else:
            assert b.producer is not None and not b.consumers
        for path in filter(None, (b.producer, *b.consumers)):
            assert isinstance(modules[path], (PatchNormConv2d, AffineDivLinear))
        if b.producer is not None:
            assert modules[b.producer].bias is not None, 'the producer needs a pre-division bias'
    return slots


@pytest.mark.parametrize('case', ALL_MODELS, ids=_model_id)
def test_every_slot_is_bound_and_its_update_factor_is_constant(case):
    name, kwargs = case
    torch.manual_seed(0)
    model = timm.create_model(name, norm_layer='patchnorm', num_classes=5, **kwargs).double()
    slots = _check_bindings(name, model)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for b in slots:  # non-trivial gains; zero_init_last would make some factors 0
            modules[b.slot].weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    bound_layers = [p for b in slots for p in filter(None, (b.producer, *b.consumers))]
    inputs, outputs = _capture(model, [b.slot for b in slots] + bound_layers, x)
    for b in slots:
        slot = modules[b.slot]
        for path in filter(None, (b.producer, *b.consumers)):
            layer, layer_in = modules[path], inputs[path]
            expected = torch.full((layer.weight.shape[0],), float(layer.divergence_constant), dtype=torch.float64)
            if path == b.producer:  # measured at the slot's output, with its gain fixed
                layout = _layout_between(outputs[path], inputs[b.slot])
                out_fn, channel_dim = (lambda: slot(layout(layer(layer_in)))), slot.channel_dim
                expected = expected * slot.weight.detach() ** 2
                torch.testing.assert_close(out_fn(), outputs[b.slot])
            else:  # a consumer is measured at its own output
                out_fn, channel_dim = (lambda: layer(layer_in)), 1 if isinstance(layer, nn.Conv2d) else -1
            for index in _indices(out_fn(), channel_dim):
                factor = update_factor(out_fn, [layer.weight, layer.bias], index)
                torch.testing.assert_close(factor, expected, rtol=1e-6, atol=1e-9, msg=f'{b.slot} via {path}')


def test_batchnorm_model_shows_a_varying_factor():
    """The same measurement on the BatchNorm resnet18: each position and sample gets its own factor."""
    torch.manual_seed(0)
    pn = timm.create_model('resnet18', norm_layer='patchnorm', num_classes=5)
    bn = timm.create_model('resnet18', num_classes=5).double().eval()
    modules = dict(bn.named_modules())
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64) * torch.tensor([0.5, 2.0], dtype=torch.float64).view(2, 1, 1, 1)
    bindings = describe_slots(pn)
    inputs, _ = _capture(bn, [b.producer for b in bindings], x)
    spreads = []
    for b in bindings:
        conv, norm = modules[b.producer], modules[b.slot]

        def out_fn():
            return norm(conv(inputs[b.producer]))
        factors = torch.stack([update_factor(out_fn, [conv.weight], index) for index in _indices(out_fn(), 1)])
        spreads.append(((factors[0] - factors[1]).abs() / factors.abs().amax(0)).median())
    assert min(spreads) > 0.1, 'BatchNorm leaves a per-sample, per-position factor'


def test_registration_is_idempotent_and_leaves_timm_entries_alone():
    batchnorm = get_norm_layer('batchnorm')
    timm_affinediv.register()
    timm_affinediv.register()
    assert get_norm_layer('batchnorm') is batchnorm is nn.BatchNorm2d
    assert get_norm_layer('patchnorm') is PatchNorm2d
    assert isinstance(create_norm_layer('patchnorm', 8), PatchNorm2d)
    assert isinstance(create_norm_layer('l2norm2d', 8), timm_affinediv.L2Norm2d)
    norm_act = create_norm_act_layer('patchnorm', 8, act_layer='silu')
    assert isinstance(norm_act, PatchNormAct2d) and isinstance(norm_act.act, nn.SiLU)
    import timm.models._builder as builder
    assert not hasattr(builder._init_model_traits.__wrapped__, 'binds_patchnorm')


def test_norm_act_slot_binds_in_a_norm_act_model():
    model = timm.create_model('resnetv2_50', norm_layer='patchnorm', num_classes=3)
    assert any(isinstance(m, PatchNormAct2d) for m in model.modules())
    for b in describe_slots(model):
        if b.slot.endswith(('norm2', 'norm3')):  # conv -> norm-act -> conv
            assert b.producer and b.consumers, b
        elif not b.bound:  # pre-activation norms whose output feeds both the shortcut and conv1
            assert b.note, b
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 3)


def test_standalone_fallback_where_nothing_can_be_bound():
    """A slot between two activations has no affine neighbour: it is the RMS normaliser + affine."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), PatchNorm2d(4), nn.GELU())
    (binding,) = bind_patchnorm(model)
    assert not binding.bound and 'fed by' in binding.note and 'feeds' in binding.note
    assert type(model[0]) is nn.Conv2d
    x = torch.randn(2, 3, 8, 8)
    normalised = model[2](model[1](model[0](x)))
    torch.testing.assert_close(normalised.square().mean(1), torch.ones(2, 6, 6), rtol=1e-3, atol=1e-3)
    # a conv whose output also goes elsewhere is not taken over
    shared = nn.Conv2d(3, 4, 3)

    class TwoUsers(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.norm = shared, PatchNorm2d(4)

        def forward(self, x):
            y = self.conv(x)
            return self.norm(y) + y
    two = TwoUsers()
    (binding,) = bind_patchnorm(two)
    assert not binding.bound and 'also feeds' in binding.note and type(two.conv) is nn.Conv2d


def test_untraceable_model_gives_a_clear_error():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.norm = nn.Conv2d(3, 4, 3), PatchNorm2d(4)

        def forward(self, x):
            if x.sum() > 0:
                return self.norm(self.conv(x))
            return x
    with pytest.raises(RuntimeError, match='could not trace'):
        bind_patchnorm(DataDependent())


def test_reset_classifier_then_rebind():
    model = timm.create_model('convnext_atto', norm_layer='patchnorm', num_classes=5)
    model.reset_classifier(7)
    assert type(model.head.fc) is nn.Linear
    bind_patchnorm(model)
    assert isinstance(model.head.fc, AffineDivLinear)
    assert describe_slots(model)[-1].consumers == ('head.fc',)


def test_slots_refuse_wrong_shapes():
    with pytest.raises(ValueError, match='8 channels in dim 1'):
        PatchNorm2d(8)(torch.randn(2, 4, 3, 3))
    with pytest.raises(ValueError, match='8 channels in dim -1'):
        PatchNorm(8)(torch.randn(2, 3, 3, 4))


# narrow token and channels-last models at small inputs: what their slots bind to is the family's block structure
TOKEN_MODELS = {
    'vit': ('vit_tiny_patch16_224', dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)),
    'vit_avg': ('vit_tiny_patch16_224', dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2,
                                             global_pool='avg', class_token=False, fc_norm=True)),
    # 16 tokens of 16 channels: the layout comes from the data flow (the patch embedding's Linear-like output)
    'vit_l_eq_c': ('vit_tiny_patch16_224', dict(img_size=32, patch_size=8, embed_dim=16, depth=1, num_heads=2,
                                                global_pool='avg', class_token=False)),
    'eva02': ('eva02_tiny_patch14_224', dict(img_size=28, embed_dim=32, depth=2, num_heads=2)),
    'swin': ('swin_tiny_patch4_window7_224', dict(img_size=32, window_size=4, embed_dim=16, depths=(2, 1),
                                                  num_heads=(1, 2))),
    'swinv2': ('swinv2_tiny_window8_256', dict(img_size=32, window_size=4, embed_dim=16, depths=(2, 1),
                                               num_heads=(1, 2))),
    'mambaout': ('mambaout_femto', dict(depths=(1, 1, 1, 1), dims=(8, 16, 24, 32))),
    'pvt_v2': ('pvt_v2_b0', dict(embed_dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1))),
    # its forward takes an optional mask: traced at the default (None), the plain forward
    'hiera': ('hiera_tiny_224', dict(img_size=64, embed_dim=16, num_heads=1, stages=(1, 1, 1, 1))),
    # timm's no-trace attention modules, traced through at the input's shapes: padded windows (ws 3 of 16), and
    # q plus the strided sub-sampling conv; ConViT's gated attention builds its positions from the token count
    'twins': ('twins_svt_small', dict(img_size=64, embed_dims=(8, 16, 24, 32), num_heads=(1, 1, 1, 1),
                                      depths=(2, 1, 1, 1), wss=(3, 2, 2, 2), sr_ratios=(2, 2, 1, 1),
                                      mlp_ratios=(2, 2, 2, 2))),
    'convit': ('convit_tiny', dict(img_size=32, patch_size=8, embed_dim=16, num_heads=4, depth=2,
                                   local_up_to_layer=1)),
    # the legacy inner norm: its pixels' channel vectors merged into one vector for the outer Linear
    'tnt': ('tnt_s_legacy_patch16_224', dict(img_size=32, embed_dim=16, inner_dim=8, depth=1, num_heads_outer=2,
                                             num_heads_inner=2)),
    # projections norm -> GELU -> Linear: the slot keeps normalising, the Linear is corrected
    'crossvit': ('crossvit_tiny_240', dict(img_size=48, img_scale=(1.0, 1.0), patch_size=[12, 16], embed_dim=[16, 32],
                                           depth=[[1, 1, 0]], num_heads=[2, 2], mlp_ratio=[2, 2, 1])),
    # norm -> the vertical and horizontal bidirectional LSTMs
    'sequencer': ('sequencer2d_s', dict(img_size=28, layers=(1, 1, 1, 1), embed_dims=(8, 16, 16, 16),
                                        hidden_sizes=(4, 8, 8, 8))),
}


def _update_factors_are_constant(model: nn.Module, x: torch.Tensor) -> None:
    """Every bound layer's update factor, measured at its own output (a producer's includes the slot's fused affine,
    so its factor is `c` times the slot's gain squared, also where it is another slot's consumer), is its constant
    for two samples and positions."""
    slots = describe_slots(model)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for b in slots:
            modules[b.slot].weight.uniform_(0.5, 1.5)
    layers = [p for b in slots for p in filter(None, (b.producer, *b.consumers))]
    produced_for = {b.producer: b.slot for b in slots if b.producer}
    inputs, _ = _capture(model, layers, x)
    for b in slots:
        for path in filter(None, (b.producer, *b.consumers)):
            layer, layer_in = modules[path], inputs[path]
            if isinstance(layer, AffineDivLSTM):  # its first layer's input map, both directions
                params = [p for pair in layer.first_layer_maps() for p in pair]
                def out_fn(layer=layer, layer_in=layer_in):
                    return layer.input_map(layer_in)
            else:
                params = [layer.weight, layer.bias]
                def out_fn(layer=layer, layer_in=layer_in):
                    return layer(layer_in)
            expected = torch.full(out_fn().shape[-1:] if not isinstance(layer, nn.Conv2d) else (layer.out_channels,),
                                  float(layer.divergence_constant), dtype=torch.float64)
            if path in produced_for:  # a layer that feeds a slot applies that slot's gain after its division
                expected = expected * modules[produced_for[path]].weight.detach() ** 2
            for index in _indices(out_fn(), 1 if isinstance(layer, nn.Conv2d) else -1):
                factor = update_factor(out_fn, params, index)
                torch.testing.assert_close(factor, expected, rtol=1e-6, atol=1e-9, msg=f'{b.slot} via {path}')


@pytest.mark.parametrize('key', list(TOKEN_MODELS))
def test_token_and_channels_last_slots_bind_with_exact_factors(key):
    """The string builds slots over the last dim where the model's tensors hold channels there, every slot binds
    (attention's qkv through windows, rolls and pads; fc1; the head through pooling), and the factors are exact."""
    name, kwargs = TOKEN_MODELS[key]
    torch.manual_seed(0)
    model = timm.create_model(name, norm_layer='patchnorm', num_classes=5, **kwargs).double()
    slots = describe_slots(model)
    assert slots and all(b.bound for b in slots), [b for b in slots if not b.bound]
    modules = dict(model.named_modules())
    side = kwargs.get('img_size', 32)
    x = torch.randn(2, 3, side, side, dtype=torch.float64)
    if key != 'mambaout':  # a token model: its block norms see (N, L, C) or (N, H, W, C) and bind to Linears
        assert any(isinstance(modules[b.slot], PatchNorm2d) and modules[b.slot].channel_dim == -1 for b in slots)
    inputs, outputs = _capture(model, [b.slot for b in slots], x)
    if key.startswith('vit'):  # every norm over tokens works over their last dim (the pooled fc_norm: (N, C))
        assert all(modules[b.slot].channel_dim == -1 for b in slots if inputs[b.slot].dim() > 2)
    for b in slots:  # a slot bound to consumers only applies its affine over the channel axis it found
        slot = modules[b.slot]
        if b.producer is None:
            shape = [-1] + [1] * (inputs[b.slot].dim() - 2) if slot.channel_dim == 1 else [-1]
            received = inputs[b.slot]
            if b.normalises:  # its consumers follow an activation: RMS-normalised first
                received = received / received.square().mean(slot.channel_dim, keepdim=True).add(slot.eps).sqrt()
            torch.testing.assert_close(outputs[b.slot], received * slot.weight.view(shape) + slot.bias.view(shape))
    assert (key == 'crossvit') == any(b.normalises for b in slots)
    _update_factors_are_constant(model, x)
    model.float().train()
    out = model(x.float())
    out.square().mean().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(p.grad).all() for p in model.parameters()
                                             if p.grad is not None)


def test_mixer_token_mixing_norms_stay_standalone_with_their_reason():
    """Mixer's norms before token mixing feed a Linear across tokens, not across their channels: standalone."""
    from timm.models.mlp_mixer import MlpMixer
    model = MlpMixer(num_blocks=2, embed_dim=16, img_size=64, patch_size=16, norm_layer=PatchNorm2d)
    (binding, *_) = bind_patchnorm(model)  # built outside create_model, so the model's input size is timm's default
    assert 'fake-tensor forward stopped at input size (3, 224, 224): AssertionError: Input height' in binding.note
    model.pretrained_cfg = dict(input_size=(3, 64, 64))
    bind_patchnorm(model)
    slots = {b.slot: b for b in describe_slots(model)}
    for name, b in slots.items():
        if name.endswith('norm1'):
            assert not b.bound and 'mlp_tokens.fc1 (Linear over an axis other than its channels)' in b.note, b
        else:
            assert b.bound, b
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 1000)


def test_tensors_a_module_caches_in_the_shape_pass_are_not_left_fake():
    """The binding's forward on fake tensors must not leave a fake tensor where a module caches one (ConViT)."""
    class Caching(nn.Module):
        pretrained_cfg = dict(input_size=(3, 8, 8))

        def __init__(self):
            super().__init__()
            self.conv, self.norm, self.positions = nn.Conv2d(3, 4, 3, padding=1), PatchNorm2d(4), None

        def forward(self, x):
            if self.positions is None or self.positions.shape[-1] != x.shape[-1]:
                self.positions = torch.arange(x.shape[-1], dtype=x.dtype)
            return self.norm(self.conv(x)) + self.positions

    model = Caching()
    bind_patchnorm(model)
    assert model.positions is None
    assert model(torch.randn(1, 3, 8, 8)).shape == (1, 4, 8, 8)


def test_no_trace_modules_are_traced_through_where_their_control_flow_reads_shapes_only():
    """timm's no-trace modules holding affine maps are traced at the input's shapes (a slot then binds to the
    Linear inside); one whose control flow reads tensor values stays a leaf, its state as it was, the slot
    standalone with the reason."""
    from timm.layers import register_notrace_module

    @register_notrace_module
    class ShapeBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if x.shape[1] % 2:  # plain symbolic tracing cannot branch on a shape
                x = x[:, :-1]
            return self.fc(x)

    @register_notrace_module
    class ValueBranch(ShapeBranch):
        def forward(self, x):
            self.last = x  # a proxy in the trace, a fake tensor in the leaf's shape pass: neither may stay
            return self.fc(x) if x.sum() > 0 else x

    class Model(nn.Module):
        pretrained_cfg = dict(input_size=(5, 4))

        def __init__(self):
            super().__init__()
            self.norm_a, self.a, self.norm_b, self.b = PatchNorm(4), ShapeBranch(), PatchNorm(4), ValueBranch()

        def forward(self, x):
            return self.a(self.norm_a(x)) + self.b(self.norm_b(x))[:, :4]

    model = Model()
    a, b = bind_patchnorm(model)
    assert a.consumers == ('a.fc',) and isinstance(model.a.fc, AffineDivLinear)
    assert not b.bound and 'feeds b (ValueBranch)' in b.note and type(model.b.fc) is nn.Linear
    assert 'last' not in vars(model.b)
    assert model(torch.randn(2, 5, 4)).shape == (2, 4, 4)
