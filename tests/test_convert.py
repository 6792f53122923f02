"""Converting trained BatchNorm / LayerNorm models (ResNet, ConvNeXt, ViT, EfficientNet) to PatchNorm, on Fashion-MNIST
at a small scale."""
import copy
import json
import math

import numpy as np
import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

import timm_affinediv  # noqa: F401
from timm_affinediv import AffineDivLinear, PatchNormConv2d, describe_slots
from timm_affinediv.commands import main as command
from timm_affinediv.commands.convert import main as convert_command
from timm_affinediv.convert import (
    ConversionError,
    ConvertOptions,
    DistillOptions,
    FitOptions,
    ReconstructOptions,
    convert_model,
    positions_per_batch_for,
)
from timm_affinediv.data import FASHION_MNIST_MEAN, FASHION_MNIST_STD, FashionMNIST

NARROW = dict(resnet18=dict(channels=(16, 32, 64, 128), stem_width=16),
              convnext_atto=dict(dims=(16, 32, 64, 128)),
              vit_tiny_patch16_224=dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2),
              eva02_tiny_patch14_224=dict(img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2),
              tinynet_e=dict())


def fit_only(**fit) -> ConvertOptions:
    """The fit alone (with `fit`'s options), no distillation."""
    return ConvertOptions(fit=FitOptions(**fit), distill=DistillOptions(epochs=0))


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
    calibrated, report = convert_model(model, calibration=calib, options=fit_only())
    swap_top1, calibrated_top1 = _top1(swapped, xt, yt), _top1(calibrated, xt, yt)
    assert calibrated_top1 > swap_top1 + 0.1, (original, swap_top1, calibrated_top1)
    assert calibrated_top1 > original - 0.1, (original, calibrated_top1)
    assert report.top1_agreement_calibrated > report.top1_agreement_analytic + 0.1
    # the float32 sums of the fits give the model the float64 fit gives
    exact, _ = convert_model(copy.deepcopy(model).double(), calibration=[b.double() for b in calib],
                             options=fit_only())
    with torch.no_grad():
        ours, truth = calibrated(xt), exact(xt.double())
    assert (ours.double() - truth).abs().max() <= 1e-3 * truth.abs().max()
    assert (ours.argmax(1) == truth.argmax(1)).float().mean() >= 0.99
    # per-layer fidelity: the fit never does worse than where it started, and the report says so
    assert report.layers and all(f.rel_err_after <= f.rel_err_before + 1e-6 for f in report.layers)
    assert json.loads(json.dumps(report.to_dict()))['layers'][0]['layer'] == report.layers[0].layer
    assert 'rel. err before' in report.format_table()
    # the converted model is exactly what timm builds: its state dict loads there 1:1
    rebuilt = timm.create_model(name, norm_layer='patchnorm', num_classes=10, in_chans=1, **NARROW[name])
    rebuilt.load_state_dict(calibrated.state_dict())
    torch.testing.assert_close(rebuilt.eval()(xt[:8]), calibrated(xt[:8]))


@pytest.mark.parametrize('name', ['vit_tiny_patch16_224', 'eva02_tiny_patch14_224', 'tinynet_e'])
def test_token_and_norm_act_families_convert_with_calibration(name, data):
    """LayerNorm ViT and EVA (slots over tokens, bound to qkv, fc1 and the head; EVA's qkv adds its q/v biases
    after the map, and is fitted as the module it is in the converted model) and a BatchNorm-act EfficientNet
    (norm-act slots, depthwise and SE blocks) convert with calibration into the model timm builds, every fit at
    least as close as the analytic map. The ViT keeps its top-1; the EfficientNet's 3x3 depthwise and 1-channel
    stem patches are too small for a linear refit to stand in for BatchNorm (README), so only the fits are checked.
    A norm-act slot's producer is fitted to the norm's output before the activation, which the slot applies."""
    (x, _), (xt, yt) = data
    model = _train(name, data, steps=60 if name == 'tinynet_e' else 100)  # tinynet_e's steps cost the most
    original = _top1(model, xt, yt)
    assert original > 0.3, 'the briefly trained model should have learned something (chance: 0.1)'
    calibrated, report = convert_model(model, calibration=[x[i:i + 64] for i in range(0, 256, 64)],
                                       options=fit_only())
    assert all(b.bound for b in describe_slots(calibrated))
    assert report.layers and all(f.rel_err_after <= f.rel_err_before + 1e-6 for f in report.layers)
    if name == 'tinynet_e':
        assert all(f.target.endswith('.norm') for f in report.layers if 'bn' in f.target), report.layers[:3]
        _check_reconstruction(model, x)
        _check_distillation(model, x)
    else:
        assert _top1(calibrated, xt, yt) > original - 0.05 and report.top1_agreement_calibrated > 0.8
    rebuilt = timm.create_model(name, norm_layer='patchnorm', num_classes=10, in_chans=1, **NARROW[name])
    rebuilt.load_state_dict(calibrated.state_dict())
    torch.testing.assert_close(rebuilt.eval()(xt[:8]), calibrated(xt[:8]))


def _block_errors(original: nn.Module, converted: nn.Module, paths, batches) -> list:
    """Each block's relative squared output error in the converted model against the original's, averaged over the
    batches: the converted block on the converted model's own input to it (forward hooks)."""
    def outputs(model):
        seen = {p: [] for p in paths}
        handles = [model.get_submodule(p).register_forward_hook(lambda m, a, o, p=p: seen[p].append(o))
                   for p in paths]
        with torch.no_grad():
            for x in batches:
                model(x)
        for h in handles:
            h.remove()
        return seen
    ours, theirs = outputs(converted), outputs(original)
    return [sum(((a - b).square().sum() / b.square().sum()).item() for a, b in zip(ours[p], theirs[p])) / len(batches)
            for p in paths]


def _check_reconstruction(model: nn.Module, x: torch.Tensor) -> None:
    """Block-wise reconstruction after the fit: with threshold 0, the stem, every block and the head, each brought
    closer to the original's output on the calibration images, each block's error the one the final model has (its
    inputs came from the reconstructed prefix), the original untouched, the same result from the same seed; with a
    threshold above every layer's error, no block checked and the fit's model unchanged."""
    calib = [x[i:i + 32] for i in range(0, 128, 32)]
    before = copy.deepcopy(model.state_dict())
    options = ConvertOptions(reconstruct=ReconstructOptions(steps=12, threshold=0), distill=DistillOptions(epochs=0),
                             seed=3)
    runs = [convert_model(model, calibration=calib, options=options) for _ in range(2)]
    (converted, report), (again, _) = runs
    names = [b.block for b in report.blocks]
    assert names[0] == '(stem)' and names[-1] == '(head)' and 'blocks.1.0' in names, names
    assert all(0 < b.steps <= 12 for b in report.blocks), report.blocks
    assert all(b.rel_err_after <= b.rel_err_before for b in report.blocks), report.blocks
    assert sum(b.rel_err_after for b in report.blocks) < sum(b.rel_err_before for b in report.blocks), report.blocks
    blocks = [b for b in report.blocks if not b.block.startswith('(')]
    np.testing.assert_allclose(_block_errors(model, converted, [b.block for b in blocks], calib),
                               [b.rel_err_after for b in blocks], rtol=1e-3)
    assert report.top1_agreement_reconstructed is not None and 'after reconstruction' in report.format_table()
    assert 'blocks.1.0: ' in report.describe() and f'{len(names)} of {len(names)} blocks' in report.describe()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in converted.state_dict().items())
    fitted, _ = convert_model(model, calibration=calib, options=fit_only())
    untouched, report = convert_model(model, calibration=calib, options=options.updated(
        {'reconstruct.threshold': 1e9, 'seed': 0}))
    assert not report.blocks and 'no block was reconstructed' in report.describe()
    assert all(torch.equal(v, fitted.state_dict()[k]) for k, v in untouched.state_dict().items())


def _check_distillation(model: nn.Module, x: torch.Tensor) -> None:
    """Logit distillation after the fit, on images beyond the calibration set (a Dataset, read in shuffled batches),
    decided and checked on held-out images: the agreement the report gives before and after is the eager models' on
    the held-out images, each pass's is recorded, the mean KL there falls; the report and its sentence say what ran;
    the same result from the same seed, the original untouched; at or above the threshold the fit's model is returned
    as it is, and the sentence says it was not distilled."""
    from torch.utils.data import TensorDataset

    from timm_affinediv.convert.distill import measure_agreement
    calib = [x[i:i + 64] for i in range(0, 512, 64)]
    heldout = [x[1024:1152], x[1152:1280]]
    distill_data = TensorDataset(x[1536:1792])                               # 256 images, 4 batches of 64
    before = copy.deepcopy(model.state_dict())
    fitted, fit_report = convert_model(model, calibration=calib, heldout=heldout, distill_data=distill_data,
                                       options=ConvertOptions(distill=DistillOptions(threshold=0)))
    assert fit_report.distillation is None and 'at least 0%, so it was not distilled' in fit_report.describe()
    with torch.no_grad():
        targets = [model.eval()(b) for b in heldout]
    eager_fit = measure_agreement(fitted, heldout, targets)
    assert fit_report.heldout_images == 256 and fit_report.agreement_fitted == fit_report.agreement
    assert fit_report.agreement.top1 == eager_fit.top1 and fit_report.agreement.kl == pytest.approx(eager_fit.kl)
    options = ConvertOptions(distill=DistillOptions(epochs=3, threshold=1, patience=None, lr=3e-4))
    (converted, report), (again, _) = [
        convert_model(model, calibration=calib, heldout=heldout, distill_data=distill_data, options=options)
        for _ in range(2)]
    d = report.distillation
    assert d is not None and (d.images, d.epochs, d.steps, len(d.passes)) == (256, 3, 12, 3), d
    assert not d.stopped_early and d.kept_epoch == min(range(1, 4), key=lambda e: d.passes[e - 1].kl)
    eager = measure_agreement(converted, heldout, targets)
    assert report.agreement.top1 == eager.top1 and report.agreement.kl == pytest.approx(eager.kl, rel=1e-4)
    assert report.agreement == d.passes[d.kept_epoch - 1]
    assert report.agreement_fitted.kl == pytest.approx(eager_fit.kl, rel=1e-4)
    assert report.agreement.kl < 0.8 * report.agreement_fitted.kl, (report.agreement, report.agreement_fitted)
    assert ("the 256 held-out images (neither fitted nor distilled on)" in report.describe()
            and 'under 100%, so the whole model was distilled' in report.describe()
            and 'over 256 images a pass, 3 passes (12 Adam steps)' in report.describe())
    assert f'pass {d.kept_epoch} kept: agreement {100 * report.agreement.top1:.1f}%' in report.describe()
    assert 'pass 3 ' in report.format_table()
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in converted.state_dict().items())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_conversion_under_inference_mode_still_distils():
    """`convert_model` called inside `torch.inference_mode()` (batches made there too) builds a model it can train:
    the distillation runs and the converted model's parameters are ordinary tensors."""
    torch.manual_seed(0)
    model = timm.create_model('resnet18', num_classes=10, in_chans=1, **NARROW['resnet18']).eval()
    with torch.inference_mode():
        batches = [torch.randn(8, 1, 32, 32) for _ in range(2)]
        converted, report = convert_model(model, calibration=batches, options=ConvertOptions(
            distill=DistillOptions(epochs=1, threshold=1)))
    assert report.distillation is not None and report.distillation.steps == 2
    assert not any(p.is_inference() for p in converted.parameters())


def test_distillation_rate_runs_a_warm_up_and_a_cosine_to_zero_in_every_pass():
    """Each pass is one cycle: the rate rises to its peak over the pass's first fifth and ends the pass at 0, so the
    held-out check compares finished models."""
    from timm_affinediv.convert.distill import schedule
    factor = schedule(DistillOptions(warmup=0.2), 10)
    rates = [factor(step) for step in range(30)]
    assert rates[:10] == rates[10:20] == rates[20:]
    assert rates[1] == 1 and rates[0] == 0.5 and max(rates) == 1
    assert rates[9] == pytest.approx(0.5 * (1 + math.cos(math.pi * 7 / 8))) and all(
        a > b for a, b in zip(rates[2:9], rates[3:10]))


def test_distillation_keeps_the_best_pass_and_stops_early():
    """Where no pass comes closer to the original on the check images (a lower KL) than the fit (here the original
    itself, a learning rate far too large), the distillation stops after `patience` passes and the fitted parameters
    are restored; where passes help, the one of lowest KL is kept, and the returned agreement is the model's."""
    from timm_affinediv.convert.distill import distill_logits, measure_agreement
    torch.manual_seed(0)
    student, teacher = nn.Linear(4, 3), nn.Linear(4, 3)
    batches = [torch.randn(8, 4) for _ in range(3)]
    check = [torch.randn(64, 4)]
    with torch.no_grad():
        targets = [teacher(b) for b in check]
    run = dict(early_stop=True, device=torch.device('cpu'))
    exact = copy.deepcopy(teacher)
    fit, returned = distill_logits(exact, teacher, batches, check, targets, measure_agreement(exact, check, targets),
                                   DistillOptions(epochs=6, lr=1e3, patience=2), **run)
    assert (fit.epochs, fit.kept_epoch, fit.stopped_early, fit.steps) == (2, 0, True, 6)
    assert returned.top1 == 1 and all(torch.equal(v, teacher.state_dict()[k]) for k, v in exact.state_dict().items())
    assert any(p.top1 < 1 for p in fit.passes)
    fitted = measure_agreement(student, check, targets)
    fit, returned = distill_logits(student, teacher, batches, check, targets, fitted,
                                   DistillOptions(epochs=20, lr=1e-2, patience=None), **run)
    assert fit.epochs == 20 and fit.steps == 60 and fit.kept_epoch > 0 and returned.kl < fitted.kl
    assert returned == measure_agreement(student, check, targets) == fit.passes[fit.kept_epoch - 1]
    assert returned.kl == min(p.kl for p in fit.passes)


def test_distillation_matches_the_fitted_layers_outputs():
    """The feature term of the distillation's loss: for each (layer, target) pair, the converted layer's output
    against the original's value at the target module, `|a - t|^2 / |t|^2` averaged over the pairs; the hooks go
    when it closes."""
    from timm_affinediv.convert.distill import _MatchedOutputs
    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    teacher = nn.Sequential(nn.Linear(4, 5), nn.Sequential(nn.ReLU()), nn.Linear(5, 3))
    x = torch.randn(6, 4)
    matched = _MatchedOutputs(student, teacher, [('0', '0'), ('2', '2'), ('1', '1.0')])
    with torch.no_grad():
        teacher(x)
    student(x)
    with torch.no_grad():
        a = [student[0](x), student(x), student[1](student[0](x))]
        t = [teacher[0](x), teacher(x), teacher[1](teacher[0](x))]
    expected = sum(((p - q).square().sum() / q.square().sum()).item() for p, q in zip(a, t)) / 3
    assert matched.loss().item() == pytest.approx(expected, rel=1e-5) and not matched.values
    matched.close()
    assert not any(m._forward_hooks for m in [*student.modules(), *teacher.modules()])


def test_options_by_dotted_names_and_flat_keywords_refused():
    """`ConvertOptions.updated` sets a group's option by its dotted name and refuses an unknown one, naming the known;
    a flat keyword of the earlier `convert_model` is refused with the grouped form, never passed to timm."""
    options = ConvertOptions().updated({'fit.ridge': 0.5, 'distill.epochs': 2, 'seed': 3})
    assert (options.fit.ridge, options.distill.epochs, options.seed) == (0.5, 2, 3)
    assert options.distill.lr == DistillOptions.lr and ConvertOptions().fit.ridge == FitOptions.ridge
    with pytest.raises(ConversionError, match=r"unknown conversion option 'distill\.foo': use one of fit\.ridge"):
        ConvertOptions().updated({'distill.foo': 1})
    model = timm.create_model('resnet18', num_classes=10, in_chans=1, **NARROW['resnet18']).eval()
    with pytest.raises(ConversionError, match=r"'distill_epochs' is not a keyword of convert_model: .*ConvertOptions"):
        convert_model(model, distill_epochs=0)


def test_reconstruction_stops_when_a_pass_over_the_batches_stops_lowering_the_loss():
    """A block's Adam steps stop after the first pass over the calibration batches whose mean loss is not at least
    `tolerance` below the best pass's, and at `steps` at the latest."""
    from timm_affinediv.convert.reconstruct import _train
    torch.manual_seed(0)
    layer, teacher = nn.Linear(4, 4), nn.Linear(4, 4)
    inputs = [torch.randn(16, 4) for _ in range(4)]
    targets = [(teacher(x) + 0.3 * torch.randn(16, 4)).detach() for x in inputs]
    losses = []

    def output(i):
        out = layer(inputs[i])
        losses.append(((out - targets[i]).square().sum() / targets[i].square().sum()).item())
        return out
    options = ReconstructOptions(steps=4000, lr=3e-2, tolerance=0.05)
    steps = _train(list(layer.parameters()), output, targets, options, torch.Generator().manual_seed(0))
    passes = [sum(losses[i:i + 4]) / 4 for i in range(0, steps, 4)]
    assert steps % 4 == 0 and 8 <= steps < 4000
    assert passes[-1] > (1 - 0.05) * min(passes[:-1]) and all(
        b <= (1 - 0.05) * min(passes[:i + 1]) for i, b in enumerate(passes[1:-1])), passes
    assert _train(list(layer.parameters()), output, targets, ReconstructOptions(steps=6), torch.Generator()) == 6


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
    vit = timm.create_model('vit_tiny_patch16_224', num_classes=10, img_size=32, patch_size=8, norm_layer='rmsnorm')
    with pytest.raises(ConversionError, match='the original has RmsNorm, not a BatchNorm/LayerNorm'):
        convert_model(vit)


# --- one-pass calibration against the layer-by-layer fit it replaces ---------------------------------------------

class _Stop(Exception):
    pass


def _capture(model, module, x, want):
    """The reference's prefix rerun: `module`'s input or output in `model(x)`, stopping the forward there."""
    captured = []

    def hook(_, args, out=None):
        captured.append((args[0] if want == 'input' else out).detach())
        raise _Stop
    handle = module.register_forward_pre_hook(hook) if want == 'input' else module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            model(x)
    except _Stop:
        pass
    finally:
        handle.remove()
    return captured[0]


def _unfold_features(layer, x):
    """The reference's features: the full im2col by F.unfold, every position, each patch in (kh, kw, C) order."""
    bias = layer.bias is not None
    if isinstance(layer, AffineDivLinear):
        cols = x.reshape(-1, x.shape[-1]).unsqueeze(0)
    else:
        mode = 'constant' if layer.padding_mode == 'zeros' else layer.padding_mode
        x = F.pad(x, layer._reversed_padding_repeated_twice, mode=mode)
        cols = F.unfold(x, layer.kernel_size, dilation=layer.dilation, stride=layer.stride)
        cols = cols.unflatten(1, (layer.groups, -1)).permute(1, 0, 3, 2).flatten(1, 2)     # (G, P, C/G kh kw)
        cols = cols.unflatten(-1, (-1, *layer.kernel_size)).permute(0, 1, 3, 4, 2).flatten(2)
    if bias:
        cols = torch.cat([cols, torch.ones_like(cols[..., :1])], -1)
    sq = cols.square().sum(-1, keepdim=True)
    return cols * (layer.divergence_constant / (sq if bias else sq + layer.eps)).sqrt()


@pytest.mark.parametrize('conv, channels_last', [
    (dict(kernel_size=3, stride=2, padding=1), False),
    (dict(kernel_size=3, stride=2, padding=1), True),
    (dict(kernel_size=3, padding=2, dilation=2, groups=2), False),         # grouped, 3 channels a group
    (dict(kernel_size=7, padding=3, groups=6), True),                      # depthwise, as ConvNeXt's
    (dict(kernel_size=1, stride=2), False),                                # ResNet's downsample
    (dict(kernel_size=3, padding=1, padding_mode='reflect', bias=False), False),
])
def test_features_are_the_patches_at_the_kept_positions(conv, channels_last):
    """The gathered features against the full im2col, at sampled positions, in the weight's fit order."""
    from timm_affinediv.convert.features import fit_order, from_fit_order, patch_features
    torch.manual_seed(0)
    layer = PatchNormConv2d(6, 6, **conv).double()
    x = torch.randn(3, 6, 9, 8, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    reference = _unfold_features(layer, x)
    keep = torch.randperm(reference.shape[1])[:17]
    u = patch_features(layer, x, keep, shift=True)
    torch.testing.assert_close(u[..., :-1], reference[:, keep], rtol=1e-12, atol=1e-12)
    assert (u[..., -1] == 1).all()
    torch.testing.assert_close(patch_features(layer, x, None), reference, rtol=1e-12, atol=1e-12)
    # the features' order is the weight's fit order: the layer's output is u . (W, b)
    w = fit_order(layer.weight).unflatten(0, (layer.groups, -1)).transpose(1, 2)   # (G, K, O/G)
    out = layer(x).unflatten(1, (layer.groups, -1)).permute(1, 0, 3, 4, 2).flatten(1, 3)  # (G, P, O/G)
    fit = reference[..., :w.shape[1]] @ w
    if layer.bias is not None:
        fit = fit + reference[..., -1:] * layer.bias.view(layer.groups, 1, -1)
    torch.testing.assert_close(fit, out, rtol=1e-10, atol=1e-10)
    assert from_fit_order(fit_order(layer.weight), layer.weight).equal(layer.weight)


def _reference_convert(model, batches, positions_per_batch, ridge=1e-2, seed=0):
    """The layer-by-layer fit as it was: every layer reruns both prefixes on every batch (layers x batches)."""
    from timm_affinediv.convert import build_converted
    from timm_affinediv.convert.features import layer_params, output_targets, set_layer_params
    from timm_affinediv.convert.rebuild import carry_weights, check_norms
    from timm_affinediv.convert.solver import NormalEquations
    from timm_affinediv.layers.slot import PatchNormSlot
    converted = build_converted(model).eval()
    carry_weights(model, converted, check_norms(model, converted))
    order = []
    handles = [m.register_forward_pre_hook(lambda mod, args, name=name: order.append((name, mod)))
               for name, m in converted.named_modules() if isinstance(m, (PatchNormConv2d, AffineDivLinear))]
    with torch.no_grad():
        converted(batches[0])
    for h in handles:
        h.remove()
    generator = torch.Generator().manual_seed(seed)
    original = dict(model.named_modules())
    slots = {s.binding.producer: s for s in converted.modules()
             if isinstance(s, PatchNormSlot) and s.binding is not None and s.binding.producer}
    slot_paths = {id(s): n for n, s in converted.named_modules()}
    errors = []
    for name, layer in order:
        slot = slots.get(name)
        target = slot_paths[id(slot)] if slot is not None else name
        equations = NormalEquations()
        for x in batches:
            u = _unfold_features(layer, _capture(converted, layer, x, 'input'))
            z = output_targets(_capture(model, original[target], x, 'output'), layer.weight.shape[0],
                         isinstance(layer, PatchNormConv2d), None)
            z = z.unflatten(1, (u.shape[0], -1)).transpose(0, 1)
            if slot is not None:
                u = torch.cat([u, torch.ones_like(u[..., :1])], -1)
            if u.shape[1] > positions_per_batch:
                keep = torch.randperm(u.shape[1], generator=generator)[:positions_per_batch]
                u, z = u[:, keep], z[:, keep]
            equations.add(u, z)
        v, _, after = equations.fit(layer_params(layer, slot), ridge, free_last=slot is not None)
        errors.append(after[0])
        set_layer_params(layer, slot, v)
    return converted, errors


def _randomised(name):
    """A model whose norms carry non-trivial statistics and affines, so that every fit has work to do."""
    torch.manual_seed(1)
    model = timm.create_model(name, num_classes=10, in_chans=1, **NARROW[name]).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.2)
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.3)
                m.running_var.uniform_(0.5, 2.0)
    return model


@pytest.mark.parametrize('name', ['resnet18', 'convnext_atto'])
def test_one_pass_calibration_matches_the_layer_by_layer_fit(name, data):
    (x, _), _ = data
    # in float64, where the two fits agree up to floating-point order: with 12 images the last stages have fewer
    # positions than unknowns, and float32 sums would leave directions the ridge alone pins (a slot's shift
    # against the pre-division bias) free to move by percents between two orders of summation
    model = _randomised(name).double()
    batches = [x[i:i + 6].double() for i in range(0, 12, 6)]
    reference, errors = _reference_convert(model, batches, positions_per_batch=200)
    converted, report = convert_model(model, calibration=batches, options=fit_only(positions_per_batch=200))
    assert [f.layer for f in report.layers] == [n for n, m in reference.named_modules()
                                                 if isinstance(m, (PatchNormConv2d, AffineDivLinear))]
    np.testing.assert_allclose([f.rel_err_after for f in report.layers], errors, rtol=1e-4, atol=1e-6)
    expected = reference.state_dict()
    for key, value in converted.state_dict().items():
        torch.testing.assert_close(value, expected[key], rtol=1e-4, atol=1e-5, msg=key)
    # the agreement the walk reports is that of the eager models
    with torch.no_grad():
        agree = sum((model(b).argmax(1) == converted(b).argmax(1)).sum().item() for b in batches) / 12
    assert report.top1_agreement_calibrated == pytest.approx(agree)
    # activations spilled to disk (no memory budget) give the very same model
    spilled, _ = convert_model(model, calibration=batches, options=fit_only(positions_per_batch=200, calib_memory=0))
    for key, value in spilled.state_dict().items():
        torch.testing.assert_close(value, converted.state_dict()[key], rtol=0, atol=0, msg=key)


def test_convert_script_reads_a_folder_with_the_models_own_transforms(tmp_path, monkeypatch):
    from PIL import Image

    import timm_affinediv.model_io as workflow
    rng = np.random.default_rng(0)
    pixels = []
    for i in range(6):
        (tmp_path / 'images' / f'class{i % 2}').mkdir(parents=True, exist_ok=True)
        pixels.append(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8))
        Image.fromarray(pixels[-1]).save(tmp_path / 'images' / f'class{i % 2}' / f'{i}.png')
    # a checkpoint served as timm's "pretrained" weights, with a pretrained_cfg of its own preprocessing
    weights = tmp_path / 'weights.pth'
    torch.save(timm.create_model('resnet18', num_classes=10, **NARROW['resnet18']).state_dict(), weights)
    mean, std, size = (0.2, 0.3, 0.4), (0.5, 0.6, 0.7), 48
    overlay = dict(file=str(weights), mean=mean, std=std, input_size=(3, size, size), crop_pct=1.0,
                   interpolation='bilinear', num_classes=10)
    seen = []

    def spy(model, norm, calibration, **kwargs):
        seen.extend(calibration)
        return convert_model(model, norm, calibration, **kwargs)
    monkeypatch.setattr(workflow, 'convert_model', spy)
    status = convert_command([
        '--model', 'resnet18', '--pretrained', '--num-classes', '10', '--model-kwargs',
        f'pretrained_cfg_overlay={overlay!r}', 'channels=(16,32,64,128)', 'stem_width=16',
        '--dataset', '', '--data-dir', str(tmp_path / 'images'), '--calib-images', '5', '-b', '4', '--eval-images', '0',
        '--device', 'cpu', '--reconstruct-steps', '2', '--reconstruct-threshold', '0', '--heldout-images', '0',
        '--distill-epochs', '0',
        '--output', str(tmp_path / 'out')])
    assert status == 0 and (tmp_path / 'out' / 'model.safetensors').is_file()
    images = torch.cat(seen)
    assert images.shape == (5, 3, size, size)
    expected = []
    for p in pixels:  # the model's own preprocessing, by hand: bilinear resize to 48, its mean and std
        x = np.asarray(Image.fromarray(p).resize((size, size), Image.BILINEAR), dtype=np.float32) / 255
        expected.append(torch.from_numpy((x - np.array(mean)) / np.array(std)).permute(2, 0, 1).float())
    expected = torch.stack(expected)
    for x in images:  # each calibration image is one of the folder's, preprocessed the model's way
        assert (expected - x).abs().flatten(1).max(1).values.min() < 1e-4
    report = json.loads((tmp_path / 'out' / 'conversion_report.json').read_text())
    assert report['calibration_images'] == 5 and report['layers']
    assert report['blocks'] and all(b['steps'] == 2 for b in report['blocks'])
    assert report['options']['reconstruct'] == dict(steps=2, threshold=0, lr=3e-3, tolerance=0.02)
    card = ' '.join((tmp_path / 'out' / 'README.md').read_text().split())
    assert (f"{len(report['blocks'])} of {len(report['blocks'])} blocks had a relative squared output error above 0 "
            'after the fit and were reconstructed ((stem): 2 Adam steps') in card, card
    assert 'top-1 agreement with the original on the 5 calibration images' in card


def test_convert_to_folder_calibrates_on_a_python_iterable_of_batches(tmp_path):
    """`convert_to_folder(calibration=...)` takes any iterable of batches (here a generator, read once), instead of
    reading the dataset's training split, and says so in the card."""
    from timm_affinediv.model_io import convert_to_folder
    x, _ = _tensors('train', 40)
    model = timm.create_model('resnet18', num_classes=10, in_chans=1, **NARROW['resnet18']).eval()
    _, report, _ = convert_to_folder(model, str(tmp_path / 'out'), dataset='fashion-mnist', eval_images=0,
                                     calibration=(x[i:i + 16] for i in range(0, 40, 16)), options=fit_only())
    assert report.calibration_batches == 3 and report.calibration_images == 40 and report.layers
    assert 'on 40 given images (3 batches, no labels)' in ' '.join((tmp_path / 'out' / 'README.md').read_text().split())


def _shared_images(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many images of `a` are also in `b`, exactly."""
    return int(((a.flatten(1)[:, None] - b.flatten(1)[None]).abs().amax(-1) == 0).any(1).sum())


def test_conversion_images_are_disjoint_draws_of_the_training_split():
    """`conversion_images`: the calibration images are those the command always drew (the eval loader's fixed
    subset), the held-out ones and the distillation ones follow them in the same fixed order, none shared; the
    distillation images come augmented, each pass anew."""
    from timm.data import create_transform

    from timm_affinediv.data import create_eval_loader, resolve_dataset_data_config
    from timm_affinediv.model_io import conversion_images
    cfg = resolve_dataset_data_config('fashion-mnist', in_chans=1)
    images = conversion_images('fashion-mnist', None, cfg, 16, calib_images=48, heldout_images=32, distill_images=40)
    calib, heldout = torch.cat(images.calibration), torch.cat(images.heldout)
    expected = torch.cat([x for x, _ in create_eval_loader('fashion-mnist', None, cfg, 16, split='train', subset=48,
                                                           workers=0)])
    assert torch.equal(calib, expected) and heldout.shape == (32, 1, 32, 32)
    assert images.distill_images == 40 and len(images.distill) == 3
    plain = FashionMNIST(transform=create_transform(**cfg))
    distill = torch.stack([plain[i][0] for i in images.distill.dataset.indices])
    assert _shared_images(heldout, calib) == 0 and _shared_images(distill, torch.cat([calib, heldout])) == 0
    first, second = (torch.cat([x for x, _ in images.distill]) for _ in range(2))
    assert first.shape == (40, 1, 32, 32) and _shared_images(first, distill) < 20 and not torch.equal(first, second)


def test_distillation_on_augmented_images_is_the_same_from_the_same_seed():
    """A distillation on a dataset read with timm's train-time augmentation (crops, flips, a random interpolation:
    torch's, Python's and numpy's generators) gives the same model from the same seed, and leaves the caller's
    Python's and numpy's generators as they were."""
    import random

    from timm_affinediv.data import resolve_dataset_data_config
    from timm_affinediv.model_io import conversion_images
    cfg = resolve_dataset_data_config('fashion-mnist', in_chans=1)
    images = conversion_images('fashion-mnist', None, cfg, 16, calib_images=32, heldout_images=16, distill_images=32)
    assert len(images.distill.dataset.dataset.transform.transforms[0].interpolation) == 2  # drawn by random.choice
    torch.manual_seed(0)
    model = timm.create_model('resnet18', num_classes=10, in_chans=1, **NARROW['resnet18']).eval()
    options = ConvertOptions(distill=DistillOptions(epochs=1, threshold=1), seed=5)
    random.seed(7)
    np.random.seed(7)
    state = random.getstate(), np.random.get_state()[1].copy()
    runs = [convert_model(model, calibration=images.calibration, heldout=images.heldout,
                          distill_data=images.distill, options=options)[0] for _ in range(2)]
    assert random.getstate() == state[0] and (np.random.get_state()[1] == state[1]).all()
    assert all(torch.equal(v, runs[1].state_dict()[k]) for k, v in runs[0].state_dict().items())


def test_convert_command_distils_on_further_images_and_reports_the_heldout_agreement(tmp_path, capsys):
    """`convert --distill-images N --heldout-images M`: the flags reach `ConvertOptions`, the distillation reads N
    further training images a pass, the held-out agreement before and after is in the report, the output and the
    card, and the report's options are the flags'."""
    from safetensors.torch import save_file
    torch.manual_seed(0)
    model = timm.create_model('resnet18', num_classes=10, in_chans=1, **NARROW['resnet18']).eval()
    save_file(model.state_dict(), str(tmp_path / 'model.safetensors'))
    status = convert_command([
        '--model', 'resnet18', '--checkpoint', str(tmp_path / 'model.safetensors'), '--num-classes', '10',
        '--in-chans', '1', '--model-kwargs', 'channels=(16,32,64,128)', 'stem_width=16', '--calib-images', '64',
        '-b', '32', '--heldout-images', '48', '--distill-images', '96', '--distill-epochs', '2', '--distill-threshold',
        '1', '--distill-lr', '3e-4', '--ridge', '0.02', '--eval-images', '64', '--device', 'cpu',
        '--output', str(tmp_path / 'out')])
    out = capsys.readouterr().out
    report = json.loads((tmp_path / 'out' / 'conversion_report.json').read_text())
    assert status == 0 and report['heldout_images'] == 48 and report['metrics']['distill_images'] == 96
    d = report['distillation']
    assert d['images'] == 96 and d['steps'] == 3 * d['epochs'] and len(d['passes']) == d['epochs'] >= 1
    assert report['options']['distill'] == dict(epochs=2, lr=3e-4, features=1.0, warmup=0.2, threshold=1,
                                                patience=1, batch_size=32)
    assert report['options']['fit']['ridge'] == 0.02
    fitted = report['agreement_fitted']['top1']
    assert f'on the 48 held-out images (neither fitted nor distilled on): after the fit {100 * fitted:.2f}%' in out
    card = ' '.join((tmp_path / 'out' / 'README.md').read_text().split())
    assert f'top-1 agreement with the original on the 48 held-out images (neither fitted nor distilled on) ' \
           f'{100 * fitted:.1f}%' in card, card
    assert 'The distillation images are 96 further fashion-mnist training images' in card


def test_convert_script_refuses_missing_pretrained_weights(tmp_path, capsys):
    overlay = dict(file=str(tmp_path / 'absent.pth'))
    status = command(['convert', '--model', 'resnet18', '--pretrained', '--model-kwargs',
                      f'pretrained_cfg_overlay={overlay!r}', '--output', str(tmp_path / 'out')])
    assert status == 2 and 'cannot' in capsys.readouterr().err and not (tmp_path / 'out').exists()


def test_sample_budget_per_unknown_bounds_every_fit(data):
    (x, _), _ = data
    model = _randomised('resnet18')
    batches = [x[i:i + 16] for i in range(0, 64, 16)]
    _, full = convert_model(model, calibration=batches, options=fit_only(positions_per_unknown=None))
    converted, budgeted = convert_model(model, calibration=batches, options=fit_only(positions_per_unknown=2))
    modules = dict(converted.named_modules())
    for fit, unbounded in zip(budgeted.layers, full.layers):
        layer = modules[fit.layer]
        unknowns = layer.weight[0].numel() + (layer.bias is not None) + (fit.target != fit.layer)
        per_batch = positions_per_batch_for(unknowns, len(batches), 2048, 2)
        assert fit.positions == min(unbounded.positions, per_batch * len(batches)), fit.layer
    assert any(f.positions < u.positions for f, u in zip(budgeted.layers, full.layers)), 'the budget never bound'
    assert positions_per_batch_for(100, 4, 2048, None) == 2048
    assert positions_per_batch_for(100, 4, 2048, 32) == 800
    assert positions_per_batch_for(100, 4, 500, 32) == 500


def _closed_form_fit(u, z, v0, ridge, free_last):
    """The float64 ridge fit of `NormalEquations.fit`, from its definition."""
    gram = u.transpose(1, 2) @ u
    penalty = torch.ones(u.shape[-1], dtype=torch.float64)
    if free_last:
        penalty[-1] = 0
    reg = torch.diag_embed(ridge * gram.diagonal(dim1=1, dim2=2).mean(1, keepdim=True) * penalty)
    return torch.linalg.solve(gram + reg, u.transpose(1, 2) @ z + reg @ v0)


@pytest.mark.parametrize('rows, block, free_last', [
    ((5, 30, 3, 40), 7, True),         # pooled into the sums, block-triangular products
    ((5, 30, 3, 40), 1024, False),
    ((5, 3, 4), 7, True),              # fewer rows than features: the dual fit
    ((5, 3, 4), 1024, False),
])
def test_normal_equations_are_the_least_squares_fit(rows, block, free_last):
    """The float32 sums (or row products) and the float64 solve against the float64 closed form, with features
    no row reaches (a tap reading only padding) among them."""
    from timm_affinediv.convert.solver import NormalEquations
    generator = torch.Generator().manual_seed(0)
    us = [torch.randn(2, n, 20, generator=generator) for n in rows]
    for u in us:
        u[..., 3] = 0                                                             # never reached
    if free_last:
        us = [torch.cat([u, torch.ones_like(u[..., :1])], -1) for u in us]       # a free constant column last
    zs = [torch.randn(2, u.shape[1], 4, generator=generator) for u in us]
    equations = NormalEquations(pool_rows=32, block=block)
    k = us[0].shape[-1]
    v0 = torch.randn(2, k, 4, generator=generator, dtype=torch.float64)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision('medium')  # as a training script may leave it: the sums take 'highest'
    try:
        for u, z in zip(us, zs):
            equations.add(u, z)
        v, before, after = equations.fit(v0, ridge=1e-2, free_last=free_last)
        assert torch.get_float32_matmul_precision() == 'medium', 'the setting is restored'
    finally:
        torch.set_float32_matmul_precision(previous)
    u, z = torch.cat(us, 1).double(), torch.cat(zs, 1).double()
    assert equations.count == u.shape[1]
    torch.testing.assert_close(v, _closed_form_fit(u, z, v0, 1e-2, free_last), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(v[:, 3], v0[:, 3], rtol=0, atol=1e-12)              # no data: the starting point
    for w, (rel_err, cos) in ((v0, before), (v, after)):
        residual = (u @ w - z).square().sum()
        assert rel_err == pytest.approx((residual / z.square().sum()).sqrt().item(), rel=1e-4)
        assert cos == pytest.approx(((u @ w) * z).sum().item() / ((u @ w).norm() * z.norm()).item(), rel=1e-4)
    assert after[0] < before[0]


def test_half_precision_model_converts_in_its_dtype(data):
    (x, _), _ = data
    model = _randomised('resnet18')
    batches = [x[i:i + 16] for i in range(0, 32, 16)]
    _, full = convert_model(model, calibration=batches, options=fit_only())
    half, report = convert_model(copy.deepcopy(model).bfloat16(), calibration=[b.bfloat16() for b in batches],
                                 options=fit_only())
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    # the fits are summed in float32: bfloat16's own rounding of the activations is all that differs
    np.testing.assert_allclose([f.rel_err_after for f in report.layers], [f.rel_err_after for f in full.layers],
                               rtol=0.05, atol=0.01)


def test_slots_that_keep_normalising_are_not_converted():
    """CrossViT's projection norms feed a GELU, so their slots keep normalising: no calibrated map stands in for the
    LayerNorm there, and the conversion names them instead of fitting a different function."""
    model = timm.create_model('crossvit_tiny_240', num_classes=3, img_size=48, img_scale=(1.0, 1.0),
                              patch_size=[12, 16], embed_dim=[16, 32], depth=[[1, 1, 0]], num_heads=[2, 2],
                              mlp_ratio=[2, 2, 1])
    with pytest.raises(ConversionError, match=r'blocks\.0\.projs\.0\.0: the slot normalises its input'):
        convert_model(model)


def test_reconstruction_blocks_are_whole_blocks_whose_outputs_match_the_original():
    """Reconstruction fits blocks whose output means what the original's does: not a block inside another (ResNet's
    `downsample.0`), not a layer that applies the affine of a slot after it (ConvNeXt's stem conv)."""
    from timm_affinediv.convert.reconstruct import reconstruction_blocks
    resnet = timm.create_model('resnet18', norm_layer='patchnorm', **NARROW['resnet18'])
    assert reconstruction_blocks(resnet) == [f'layer{i}.{j}' for i in range(1, 5) for j in range(2)]
    convnext = timm.create_model('convnext_atto', norm_layer='patchnorm', **NARROW['convnext_atto'])
    assert reconstruction_blocks(convnext) == [f'stages.{i}' for i in range(4)]
