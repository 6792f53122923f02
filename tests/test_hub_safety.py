"""Hub folders from and to strangers: each bad folder is built here and refused in one line, before anything outside
the folder is read or uploaded, any pickle is unpickled, or any model half-loads."""
import json
import os
import pickle
import shutil
import textwrap
from pathlib import Path
from typing import Callable

import pytest
import safetensors.torch
import test_hub
import timm
import torch
from huggingface_hub import HfApi
from test_hub import MODEL_ARGS, TOKEN, _python

from timm_affinediv.data import FASHION_MNIST_CLASSES
from timm_affinediv.errors import CheckpointError, ConfigError, HubError
from timm_affinediv.hub import push_to_hub, save_hub_folder
from timm_affinediv.labels import label_config, with_labels
from timm_affinediv.model_io import load_trained_model
from timm_affinediv.train import TrainConfig
from timm_affinediv.train.trainer import create_train_model

hub = test_hub.hub  # the loopback Hub, HF_ENDPOINT and HF_TOKEN set
REPO_ID = 'test-org/stranger'
SECRET = 'hf_a_token_that_must_stay_home'


@pytest.fixture(scope='module')
def folder(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    model = timm.create_model('test_resnet', **MODEL_ARGS).eval()
    model.pretrained_cfg = with_labels(model.pretrained_cfg, label_config(FASHION_MNIST_CLASSES, 10))
    return save_hub_folder(model, tmp_path_factory.mktemp('good') / 'model', model_args=MODEL_ARGS)


class _Marker:
    """Unpickled, it creates the file ``path``: proof that a pickle ran."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def _copy(folder: Path, tmp: Path) -> Path:
    copy = tmp / 'stranger'
    shutil.copytree(folder, copy)
    return copy


def _edit_config(copy: Path, edit: Callable[[dict], None]) -> Path:
    config = json.loads((copy / 'config.json').read_text())
    edit(config)
    (copy / 'config.json').write_text(json.dumps(config))
    return copy


def _edit_weights(copy: Path, edit: Callable[[dict], None]) -> Path:
    weights = safetensors.torch.load_file(copy / 'model.safetensors')
    edit(weights)
    safetensors.torch.save_file(weights, copy / 'model.safetensors')
    return copy


def _truncated(folder: Path, tmp: Path) -> Path:
    """What an interrupted download leaves."""
    copy = _copy(folder, tmp)
    data = (copy / 'model.safetensors').read_bytes()
    (copy / 'model.safetensors').write_bytes(data[:len(data) // 2])
    return copy


def _nine_names(folder: Path, tmp: Path) -> Path:
    return _edit_config(_copy(folder, tmp), lambda c: c.update(label_names=c['label_names'][:9]))


def _not_json(folder: Path, tmp: Path) -> Path:
    copy = _copy(folder, tmp)
    (copy / 'config.json').write_text('{"architecture": ')
    return copy


def _json_list(folder: Path, tmp: Path) -> Path:
    copy = _copy(folder, tmp)
    (copy / 'config.json').write_text('["test_resnet"]')
    return copy


def _other_shape(folder: Path, tmp: Path) -> Path:
    return _edit_weights(_copy(folder, tmp), lambda w: w.update({'fc.weight': torch.zeros(5, w['fc.weight'].shape[1])}))


def _nan_weight(folder: Path, tmp: Path) -> Path:
    def poison(weights):
        weights['fc.weight'][0, 0] = float('nan')
    return _edit_weights(_copy(folder, tmp), poison)


def _pickle_only(folder: Path, tmp: Path) -> Path:
    """Weights as a pickle that runs code when unpickled (it creates `ran`), and no model.safetensors."""
    copy = _copy(folder, tmp)
    (copy / 'model.safetensors').unlink()
    (copy / 'pytorch_model.bin').write_bytes(pickle.dumps(_Marker(tmp / 'ran')))
    return copy


LOAD_REFUSALS = [
    (_truncated, 'model.safetensors is not a complete safetensors file', 'download the folder again'),
    (_nine_names, 'names 9 classes (label_names) for 10 outputs (num_classes)', 'one name per output'),
    (_not_json, 'config.json is not readable JSON', 'download the folder again'),
    (_json_list, 'config.json holds a JSON list, not the object of a timm config.json', 'save_hub_folder'),
    (_other_shape, 'does not fit test_resnet: 1 of another shape (fc.weight: (5, ', 'write it again'),
    (_nan_weight, 'holds NaN or infinite values in 1 tensor (fc.weight)', 'download them again'),
    (_pickle_only, 'has no model.safetensors', 'never loaded'),
]


# ---------------------------------------------------------------- loading a stranger's folder


@pytest.mark.parametrize('make_folder, wrong, to_do', LOAD_REFUSALS)
def test_cli_refuses_a_bad_folder_in_one_line(folder, tmp_path, capsys, make_folder, wrong, to_do):
    from timm_affinediv.commands import main
    bad = make_folder(folder, tmp_path)
    assert main(['report', '--model', f'local-dir:{bad}', '--dataset', 'random', '--output',
                 str(tmp_path / 'out')]) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and err.startswith('timm-affinediv report: error: '), err
    assert wrong in err and to_do in err, err
    assert not (tmp_path / 'out').exists() and not (tmp_path / 'ran').exists()


@pytest.mark.parametrize('make_folder, wrong, to_do', LOAD_REFUSALS)
def test_timm_loader_refuses_a_bad_folder(folder, tmp_path, make_folder, wrong, to_do):
    """Every caller of timm (finetune --model local-dir:, a user's script) gets the plugin's refusal."""
    bad = make_folder(folder, tmp_path)
    if make_folder in (_not_json, _json_list):  # timm parses config.json before the plugin is called
        with pytest.raises(HubError, match='config.json'):
            load_trained_model(f'local-dir:{bad}')
        return
    with pytest.raises(HubError) as e:
        timm.create_model(f'local-dir:{bad}', pretrained=True)
    assert wrong in str(e.value) and to_do in str(e.value)
    assert not (tmp_path / 'ran').exists()


def test_weights_are_read_from_safetensors_only(folder, tmp_path):
    """A pickle beside model.safetensors is never unpickled; the folder loads from its safetensors."""
    copy = _copy(folder, tmp_path)
    (copy / 'pytorch_model.bin').write_bytes(pickle.dumps(_Marker(tmp_path / 'ran')))
    model = load_trained_model(f'local-dir:{copy}')
    expected = safetensors.torch.load_file(folder / 'model.safetensors')
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert not (tmp_path / 'ran').exists()


def test_hub_repo_without_safetensors_is_refused_unread(hub, folder, tmp_path):
    upload = _pickle_only(folder, tmp_path)
    api = HfApi(endpoint=hub.url, token=TOKEN)
    api.create_repo(REPO_ID)
    api.upload_folder(repo_id=REPO_ID, folder_path=upload)
    # a fresh process: huggingface_hub reads HF_ENDPOINT when it is imported
    load = _python('-c', textwrap.dedent(f'''
        import timm, timm_affinediv
        try:
            timm.create_model('hf-hub:{REPO_ID}', pretrained=True)
        except timm_affinediv.errors.HubError as e:
            print(e)
    '''))
    assert load.returncode == 0, load.stderr[-3000:]
    assert f'hf-hub:{REPO_ID} has no model.safetensors' in load.stdout and 'never loaded' in load.stdout, load.stdout
    assert not (tmp_path / 'ran').exists()
    assert not [p for _, p in hub.requests if p.endswith('/pytorch_model.bin')]


# ---------------------------------------------------------------- checkpoints: convert --checkpoint, finetune


@pytest.mark.parametrize('make_folder, wrong', [
    (_truncated, 'is unreadable (SafetensorError'),
    (_nan_weight, 'holds NaN or infinite values in 1 tensor (fc.weight)'),
    (_pickle_only, 'is a folder without model.safetensors'),
])
def test_initial_checkpoint_is_refused_in_one_line(folder, tmp_path, make_folder, wrong):
    bad = make_folder(folder, tmp_path)
    cfg = TrainConfig(model='test_resnet', num_classes=10, initial_checkpoint=str(bad), output=str(tmp_path / 'run'))
    with pytest.raises(ConfigError) as e:
        create_train_model(cfg, in_chans=1)
    assert wrong in str(e.value) and '\n' not in str(e.value), e.value
    assert not (tmp_path / 'ran').exists()


@pytest.mark.parametrize('make_folder, wrong', [
    (_truncated, 'is unreadable (SafetensorError'),
    (_nan_weight, 'holds NaN or infinite values in 1 tensor (fc.weight)'),
])
def test_checkpoint_file_is_refused_in_one_line(folder, tmp_path, make_folder, wrong):
    weights = make_folder(folder, tmp_path) / 'model.safetensors'
    with pytest.raises(CheckpointError) as e:
        load_trained_model('test_resnet', str(weights), **MODEL_ARGS)
    assert f'checkpoint {weights} {wrong}' in str(e.value) and '\n' not in str(e.value), e.value


# ---------------------------------------------------------------- pushing a folder not checked


def _link_to_token(folder: Path, tmp: Path) -> Path:
    """A link to a token file in the parent folder: its target must never be read."""
    copy = _copy(folder, tmp)
    (tmp / 'token').write_text(SECRET)
    (copy / 'token').symlink_to('../token')
    return copy


def _link_to_folder(folder: Path, tmp: Path) -> Path:
    copy = _copy(folder, tmp)
    (tmp / 'home').mkdir()
    (tmp / 'home' / 'token').write_text(SECRET)
    (copy / 'extras').symlink_to(tmp / 'home', target_is_directory=True)
    return copy


def _weights_linked_out(folder: Path, tmp: Path) -> Path:
    copy = _copy(folder, tmp)
    (copy / 'model.safetensors').rename(tmp / 'elsewhere.safetensors')
    (copy / 'model.safetensors').symlink_to(tmp / 'elsewhere.safetensors')
    return copy


def _cache_folder(folder: Path, tmp: Path) -> Path:
    copy = _copy(folder, tmp)
    (copy / '.cache').mkdir()
    (copy / '.cache' / 'notes.txt').write_text('notes')
    return copy


def _plain_timm_folder(folder: Path, tmp: Path) -> Path:
    """timm's own architecture name: the folder would not load through the plugin, nor say what to install."""
    return _edit_config(_copy(folder, tmp), lambda c: c.update(architecture=c['pretrained_cfg']['architecture']))


@pytest.mark.parametrize('make_folder, wrong, to_do', [
    (_link_to_token, 'token is a symbolic link to', 'copy the file into the folder (cp -L)'),
    (_link_to_folder, 'extras is a symbolic link to', 'or remove the link'),
    (_weights_linked_out, 'model.safetensors is a symbolic link to', 'cp -L'),
    (_cache_folder, 'holds .cache/notes.txt, under a name the Hub takes no files in', 'remove or move them'),
    (_plain_timm_folder, "names the architecture 'test_resnet', not a timm-affinediv Hub folder's", 'save_hub_folder'),
    (_pickle_only, 'missing model.safetensors', 'save_hub_folder'),
    *[refusal for refusal in LOAD_REFUSALS if refusal[0] is not _pickle_only],
])
def test_push_refuses_a_bad_folder_before_any_request(hub, folder, tmp_path, capsys, make_folder, wrong, to_do):
    from timm_affinediv.commands import main
    bad = make_folder(folder, tmp_path)
    assert main(['push', str(bad), '--repo-id', REPO_ID]) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and wrong in err and to_do in err, err
    assert hub.requests == [] and hub.repos == {}
    assert not (tmp_path / 'ran').exists()


def test_push_takes_links_inside_the_folder_and_skips_git(hub, folder, tmp_path):
    """A link to a file of the folder publishes that file; `.git/` is never uploaded, links out of it included."""
    copy = _copy(folder, tmp_path)
    (copy / 'MODEL_CARD.md').symlink_to('README.md')
    (tmp_path / 'token').write_text(SECRET)
    (copy / '.git').mkdir()
    (copy / '.git' / 'credentials').symlink_to(tmp_path / 'token')
    plan = push_to_hub(copy, REPO_ID, dry_run=True)
    assert [name for name, _ in plan.files] == ['MODEL_CARD.md', 'README.md', 'config.json', 'model.safetensors']
    push_to_hub(copy, REPO_ID)
    files = hub.repos[REPO_ID].refs['main'].files
    assert files['MODEL_CARD.md'] == (folder / 'README.md').read_bytes()
    assert not any(SECRET.encode() in content for content in files.values())
    assert not [name for name in files if name.startswith('.git/')]


def test_hard_link_is_an_ordinary_file(hub, folder, tmp_path):
    copy = _copy(folder, tmp_path)
    os.link(copy / 'README.md', copy / 'CARD.md')
    push_to_hub(copy, REPO_ID)
    assert hub.repos[REPO_ID].refs['main'].files['CARD.md'] == (folder / 'README.md').read_bytes()


@pytest.mark.parametrize('make_folder, wrong, to_do', LOAD_REFUSALS)
def test_finetune_model_refuses_a_bad_folder(folder, tmp_path, make_folder, wrong, to_do):
    """`finetune --model local-dir:` checks the folder before timm parses its config.json."""
    from timm_affinediv.train import TrainConfig
    from timm_affinediv.train.trainer import create_train_model
    bad = make_folder(folder, tmp_path)
    with pytest.raises(HubError) as e:
        create_train_model(TrainConfig(model=f'local-dir:{bad}', pretrained=True, output=str(tmp_path / 'run')), 1)
    assert wrong in str(e.value) and to_do in str(e.value)
    assert not (tmp_path / 'ran').exists()


def test_push_uploads_the_files_it_checked_only(hub, folder, tmp_path, monkeypatch):
    """A file that appears in the folder after the check (a link out, here) is not uploaded."""
    import timm_affinediv.hub as hub_module
    copy = _copy(folder, tmp_path)
    (tmp_path / 'token').write_text(SECRET)
    plan_upload = hub_module._plan_upload

    def plan_then_add_a_link(*args, **kwargs):
        plan = plan_upload(*args, **kwargs)
        (copy / 'late[1].txt').symlink_to(tmp_path / 'token')
        return plan
    monkeypatch.setattr(hub_module, '_plan_upload', plan_then_add_a_link)
    push_to_hub(copy, REPO_ID)
    files = hub.repos[REPO_ID].refs['main'].files
    assert set(files) - {'.gitattributes'} == {'README.md', 'config.json', 'model.safetensors'}
    assert not any(SECRET.encode() in content for content in files.values())
