"""The library calls timm's train.py / validate.py make to build, load and resume a model, on patchnorm models.

train.py is not in timm's wheel, so its calls are made here as it makes them (`--device-modules timm_affinediv`
imports the package first); and a BatchNorm checkpoint never loads into patchnorm slots silently.
"""
import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.models import load_checkpoint, resume_checkpoint
from timm.optim import create_optimizer_v2

import timm_affinediv  # noqa: F401  (registers patchnorm, as --device-modules timm_affinediv does)
from timm_affinediv import NormMismatchError

NARROW = dict(channels=(16, 32, 64, 128), stem_width=16, in_chans=1)


def _create(norm_layer='patchnorm', num_classes=10, **kwargs):
    torch.manual_seed(0)
    return timm.create_model('resnet18', num_classes=num_classes, norm_layer=norm_layer, **NARROW, **kwargs)


def _perturbed(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model


@pytest.fixture(scope='module')
def batchnorm_file(tmp_path_factory):
    path = tmp_path_factory.mktemp('bn') / 'model.safetensors'
    torch.manual_seed(0)
    save_file(timm.create_model('resnet18', num_classes=10, **NARROW).state_dict(), str(path))
    return str(path)


@pytest.mark.parametrize('norm_layer', ['patchnorm', 'affinediv'])
@pytest.mark.parametrize('strict', [True, False])
def test_batchnorm_state_dict_into_slots_raises(batchnorm_file, norm_layer, strict):
    state_dict = timm.models.load_state_dict(batchnorm_file)
    model = _create(norm_layer)
    with pytest.raises(NormMismatchError, match=r"BatchNorm model's.*bn1\.running_mean.*timm-affinediv convert.*"
                                                r"convert_model"):
        model.load_state_dict(state_dict, strict=strict)
    assert model.conv1.fused_slot is model.bn1  # the slot is also conv1's submodule: the error names its own key


def test_batchnorm_checkpoint_through_timm_loaders_raises(batchnorm_file):
    """train.py's `--pretrained-path` (new head: strict=False inside timm), `--initial-checkpoint` and
    `load_checkpoint(strict=False)` all refuse a BatchNorm checkpoint for a patchnorm model."""
    with pytest.raises(NormMismatchError, match='timm-affinediv convert'):
        _create(num_classes=5, pretrained=True, pretrained_cfg_overlay=dict(file=batchnorm_file, num_classes=-1))
    with pytest.raises(NormMismatchError):
        _create(checkpoint_path=batchnorm_file)
    with pytest.raises(NormMismatchError):
        load_checkpoint(_create(), batchnorm_file, strict=False)


def test_patchnorm_checkpoint_loads_with_new_head_as_train_py_does(tmp_path):
    """`--pretrained-path FILE --num-classes 5`: every weight but the head's comes from the file."""
    source = _perturbed(_create())
    file = tmp_path / 'model.safetensors'
    save_file(source.state_dict(), str(file))
    model = _create(num_classes=5, pretrained=True, pretrained_cfg_overlay=dict(file=str(file), num_classes=-1))
    assert model.get_classifier().out_features == 5
    reference = source.state_dict()
    for key, value in model.state_dict().items():
        if not key.startswith('fc.'):
            assert torch.equal(value, reference[key]), key
    assert isinstance(model.conv1, timm_affinediv.PatchNormConv2d) and model.conv1.fused_slot is model.bn1
    # load_checkpoint(strict=False), as validate.py's --checkpoint and train.py's --initial-checkpoint call it
    again = _create()
    load_checkpoint(again, str(file), strict=False)
    x = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(x), source.eval()(x), rtol=0, atol=0)


def test_resume_checkpoint_as_train_py_writes_it(tmp_path):
    """timm's CheckpointSaver format (state_dict, optimizer, epoch): `resume_checkpoint` restores all of it."""
    model = _perturbed(_create())
    optimizer = create_optimizer_v2(model, opt='adamw', lr=1e-3)
    model(torch.randn(4, 1, 32, 32)).logsumexp(1).sum().backward()
    optimizer.step()
    file = tmp_path / 'last.pth.tar'
    torch.save(dict(epoch=3, arch='resnet18', state_dict=model.state_dict(), optimizer=optimizer.state_dict(),
                    version=2), file)
    fresh = _create()
    fresh_optimizer = create_optimizer_v2(fresh, opt='adamw', lr=1e-3)
    start_epoch = resume_checkpoint(fresh, str(file), optimizer=fresh_optimizer, log_info=False)
    assert start_epoch == 4
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k
    state, fresh_state = optimizer.state_dict()['state'], fresh_optimizer.state_dict()['state']
    assert state.keys() == fresh_state.keys() and all(
        torch.equal(state[i]['exp_avg'], fresh_state[i]['exp_avg']) for i in state)


_FAKE_TRAIN_PY = '''import argparse, os, timm
p = argparse.ArgumentParser()
p.add_argument('--output')
p.add_argument('--experiment')
args, _ = p.parse_known_args()
os.makedirs(os.path.join(args.output, args.experiment))
with open(os.path.join(args.output, args.experiment, 'summary.csv'), 'w') as f:
    f.write('epoch,eval_top1\\n0,12.5\\n')
print('Train: 0 [  10/10 (100%)]  Loss: 1.0 (1.0)  Time: 0.1s,  640.00/s  (0.100s,  640.00/s)')
'''


def test_compare_train_py_runs_a_checkouts_train_py_with_the_installed_timm(tmp_path):
    """A checkout's own timm package (here one that fails on import) is not the one its train.py gets; the commit
    and the checkout's timm version are reported."""
    import importlib.util
    import subprocess

    from conftest import SCRIPTS
    spec = importlib.util.spec_from_file_location('compare_train_py', SCRIPTS / 'compare_train_py.py')
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    checkout = tmp_path / 'pytorch-image-models'
    (checkout / 'timm').mkdir(parents=True)
    (checkout / 'timm' / '__init__.py').write_text("raise ImportError('the checkout timm was imported')\n")
    (checkout / 'timm' / 'version.py').write_text("__version__ = '1.0.29.dev0'\n")
    (checkout / 'train.py').write_text(_FAKE_TRAIN_PY)
    git = ['git', '-C', str(checkout), '-c', 'user.name=t', '-c', 'user.email=t@t']
    for args in (['init', '-q'], ['add', '.'], ['commit', '-qm', 'train.py']):
        subprocess.run(git + args, check=True)
    commit = subprocess.run(git + ['rev-parse', 'HEAD'], capture_output=True, text=True).stdout.strip()
    assert compare.describe_checkout(checkout) == f'train.py of {checkout} at {commit}, whose timm is 1.0.29.dev0'
    result = compare.run_train_py(checkout, tmp_path / 'data', tmp_path / 'train_py-0', [])
    assert result == dict(img_s=640.0, top1=12.5, timm=timm.__version__)
