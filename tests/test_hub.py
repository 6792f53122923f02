"""Hub folders, model cards, and push/load over real HTTP against a Hub on loopback (tests/hub_server.py)."""
import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import timm
import torch
from hub_server import HubServer
from huggingface_hub import ModelCard, constants
from torch import nn

from timm_affinediv.data import FASHION_MNIST_CLASSES
from timm_affinediv.hub import HubError, push_to_hub, render_model_card, save_hub_folder
from timm_affinediv.labels import label_config, with_labels

REPO_ID = 'test-org/test-resnet-fmnist'
TOKEN = 'hf_loopback_test_token'
MODEL_ARGS = {'num_classes': 10, 'in_chans': 1}
CARD = {
    'repo_id': REPO_ID,
    'base_model': 'timm/test_resnet.r160_in1k',
    'datasets': ['zalando-datasets/fashion_mnist'],
    'dataset_name': 'Fashion-MNIST',
    'license': 'mit',
    'recipe': 'Converted from BatchNorm, calibrated on 8 batches, fine-tuned 3 epochs.',
    'norm_layer': 'batchnorm',
}
METRICS = {'top1': 91.2, 'top5': 99.8}
FOLDER_FILES = {'README.md', 'config.json', 'model.safetensors', 'conversion_report.json'}


def _isolate_hub_env(mp: pytest.MonkeyPatch, home: Path) -> None:
    """No real token, cache or endpoint leaks into a test, in this process or its children."""
    for var in ('HF_TOKEN', 'HUGGING_FACE_HUB_TOKEN', 'HF_OIDC_RESOURCE', 'HF_HUB_OFFLINE', 'HF_ENDPOINT'):
        mp.delenv(var, raising=False)
    mp.setenv('HF_HOME', str(home))
    mp.setenv('HF_HUB_CACHE', str(home / 'hub'))
    mp.setenv('HF_HUB_DISABLE_TELEMETRY', '1')
    mp.setattr(constants, 'HF_TOKEN_PATH', str(home / 'token'))


def _python(*args: str) -> subprocess.CompletedProcess:
    """Run this Python (and the package it has installed) in a fresh process, in the current (test) environment."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope='module')
def model() -> nn.Module:
    torch.manual_seed(0)
    model = timm.create_model('test_resnet', **MODEL_ARGS)
    with torch.no_grad():  # non-trivial BatchNorm running statistics
        for _ in range(3):
            model(torch.randn(8, 1, 32, 32))
    # the class names, as the Trainer and convert_to_folder record those of their dataset
    model.pretrained_cfg = with_labels(model.pretrained_cfg, label_config(FASHION_MNIST_CLASSES, 10))
    return model.eval()


@pytest.fixture(scope='module')
def images() -> torch.Tensor:
    return torch.randn(4, 1, 32, 32, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope='module')
def folder(model, tmp_path_factory) -> Path:
    return save_hub_folder(
        model, tmp_path_factory.mktemp('saved') / 'test-resnet-fmnist', model_args=MODEL_ARGS, card=CARD,
        metrics=METRICS, extra_files={'conversion_report.json': '{"top1_agreement": 0.97}'},
    )


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A Hub requiring TOKEN, HF_ENDPOINT pointing at it, HF_TOKEN set."""
    _isolate_hub_env(monkeypatch, tmp_path / 'hf_home')
    with HubServer(require_token=TOKEN) as server:
        monkeypatch.setenv('HF_ENDPOINT', server.url)
        monkeypatch.setenv('HF_TOKEN', TOKEN)
        yield server


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


# ---------------------------------------------------------------- save_hub_folder


def test_save_hub_folder_writes_a_timm_folder(folder, model, images):
    assert {p.name for p in folder.iterdir()} == FOLDER_FILES
    assert not [p for p in folder.parent.iterdir() if p.name.startswith('.')], 'temporary dirs left behind'

    config = json.loads((folder / 'config.json').read_text())
    assert config['architecture'].startswith('timm_affinediv.test_resnet ')
    assert config['pretrained_cfg']['architecture'] == 'test_resnet'
    # num_classes at the top only: transformers passes its own beside model_args
    assert config['model_args'] == {'in_chans': 1, 'global_pool': 'avg'}
    assert (config['num_classes'], config['num_features']) == (10, model.num_features)
    assert config['label_names'] == list(FASHION_MNIST_CLASSES) and 'label_descriptions' not in config
    assert not {'label_names', 'label_descriptions'} & config['pretrained_cfg'].keys()
    assert config['pretrained_cfg']['input_size'][0] == 1
    assert config['pretrained_cfg']['license'] == 'mit'
    assert json.loads((folder / 'conversion_report.json').read_text()) == {'top1_agreement': 0.97}

    weights = safetensors.torch.load_file(folder / 'model.safetensors')
    state = model.state_dict()
    assert weights.keys() == state.keys()
    assert all(torch.equal(weights[k], state[k]) for k in state)

    loaded = timm.create_model(f'local-dir:{folder}', pretrained=True).eval()
    assert type(loaded) is type(model) and loaded.num_classes == 10
    assert torch.equal(loaded(images), model(images))
    assert loaded.pretrained_cfg['label_names'] == list(FASHION_MNIST_CLASSES)


def test_folder_builds_by_its_architecture_name_as_transformers_does(folder, model, images):
    """transformers' TimmWrapper calls `timm.create_model(architecture, num_classes=..., **model_args)` and loads the
    weights itself: the model is the saved one, and, being 1-channel, reads an RGB image of gray pixels (what its
    pipeline makes of every image) as the gray image."""
    config = json.loads((folder / 'config.json').read_text())
    built = timm.create_model(config['architecture'], num_classes=config['num_classes'], **config['model_args'])
    built.load_state_dict(safetensors.torch.load_file(folder / 'model.safetensors'))
    built.eval()
    assert type(built) is type(model)
    assert torch.equal(built(images), model(images))
    assert torch.equal(built(images.expand(-1, 3, -1, -1)), model(images))
    rgb = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    luma = 0.299 * rgb[:, :1] + 0.587 * rgb[:, 1:2] + 0.114 * rgb[:, 2:]
    assert torch.allclose(built(rgb), model(luma), atol=1e-5)


@pytest.mark.parametrize('name, kwargs', [
    ('timm_affinediv.test_resnet', {}),  # a tag without the folder's hint
    ('timm_affinediv.no_such_model (pip install timm-affinediv, then import timm_affinediv before timm.create_model)',
     {}),
    ('timm_affinediv.test_resnet (pip install timm-affinediv, then import timm_affinediv before timm.create_model)',
     {'pretrained': True}),  # would be timm's weights for the architecture, not the folder's
])
def test_hub_entrypoint_refuses_what_no_folder_names(name, kwargs):
    with pytest.raises(ValueError, match="only loads folders written by timm_affinediv.hub.save_hub_folder"):
        timm.create_model(name, **kwargs)


def test_save_hub_folder_refuses_existing_dir_and_overwrites_atomically(folder, model, tmp_path):
    target = tmp_path / 'out'
    save_hub_folder(model, target, model_args=MODEL_ARGS, card=CARD, metrics={'top1': 50.0})
    with pytest.raises(FileExistsError, match='overwrite=True'):
        save_hub_folder(model, target, model_args=MODEL_ARGS, card=CARD, metrics=METRICS)
    assert '50.0' in (target / 'README.md').read_text()

    save_hub_folder(model, target, model_args=MODEL_ARGS, card=CARD, metrics=METRICS, overwrite=True)
    assert (target / 'README.md').read_text() != ''
    assert ModelCard.load(target / 'README.md').data.eval_results[0].metric_value == 91.2
    assert [p.name for p in tmp_path.iterdir()] == ['out'], 'temporary or old dirs left behind'


def test_save_hub_folder_failure_leaves_nothing(model, tmp_path):
    with pytest.raises(ValueError, match='not serializable'):
        save_hub_folder(model, tmp_path / 'out', model_args={**MODEL_ARGS, 'norm_layer': nn.BatchNorm2d})
    with pytest.raises(ValueError, match='pickle'):
        save_hub_folder(model, tmp_path / 'out', model_args=MODEL_ARGS, extra_files={'pytorch_model.bin': b''})
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- model card


def test_model_card_metadata_and_content(folder):
    card = ModelCard.load(folder / 'README.md', ignore_metadata_errors=False)
    data = card.data
    assert data.library_name == 'timm' and data.pipeline_tag == 'image-classification'
    assert {'timm_affinediv', 'image-classification', 'timm'} <= set(data.tags)
    assert (data.license, data.base_model, data.datasets) == ('mit', CARD['base_model'], CARD['datasets'])
    results = {(r.metric_type, r.metric_value, r.dataset_type, r.dataset_name, r.task_type)
               for r in data.eval_results}
    assert results == {(k, v, 'zalando-datasets/fashion_mnist', 'Fashion-MNIST', 'image-classification')
                       for k, v in METRICS.items()}
    assert data.model_name == folder.name

    text = card.text
    assert f'timm.create_model("hf-hub:{REPO_ID}", pretrained=True)' in text
    assert text.index('import timm_affinediv') < text.index('timm.create_model("hf-hub:')
    assert 'pip install timm-affinediv' in text
    assert CARD['recipe'] in text
    assert 'Norm layer: `batchnorm`' in text
    assert 'The Affine Divergence: Aligning Activation Updates Beyond Normalisation' in text
    assert 'eprint = {2512.22247}' in text and 'ICLR' in text
    assert '| Top-1 Accuracy | the test split of Fashion-MNIST | 91.2 |' in text
    assert '$' not in text, 'unfilled template placeholder'


def test_card_names_the_classes_and_loads_with_transformers(folder):
    text = ' '.join(ModelCard.load(folder / 'README.md').text.split())
    assert ("10 classes, by output index (`label_names` in `config.json`; the labels of transformers' pipeline): "
            "`T-shirt/top`, `Trouser`, `Pullover`, `Dress`, `Coat`, `Sandal`, `Shirt`, `Sneaker`, `Bag`, "
            "`Ankle boot`.") in text
    assert f'pipeline("image-classification", model="{REPO_ID}")' in text
    assert text.index('import timm_affinediv') < text.index('from transformers import pipeline')
    assert "ImportError: The model architecture 'timm_affinediv.test_resnet (pip install timm-affinediv" in text


def test_imagenet_head_gets_imagenet_names_and_descriptions(tmp_path):
    """A model with ImageNet-1k's head and no names of its own (a timm ImageNet model, converted) is published with
    ImageNet's synsets and their lemmas, as timm knows them."""
    model = timm.create_model('test_resnet', num_classes=1000).eval()
    folder = save_hub_folder(model, tmp_path / 'in1k', model_args={})
    config = json.loads((folder / 'config.json').read_text())
    assert len(config['label_names']) == 1000 and config['label_names'][:2] == ['n01440764', 'n01443537']
    assert config['label_descriptions']['n01440764'] == 'tench, Tinca tinca'
    text = ' '.join((folder / 'README.md').read_text().split())
    assert '`n01440764` (tench, Tinca tinca), `n01443537` (goldfish, Carassius auratus)' in text
    assert '... (1000 in all).' in text
    loaded = timm.create_model(f'local-dir:{folder}', pretrained=True)
    assert loaded.pretrained_cfg['label_descriptions']['n01443537'] == 'goldfish, Carassius auratus'


def test_model_card_metrics_need_a_dataset(folder):
    config = json.loads((folder / 'config.json').read_text())
    with pytest.raises(ValueError, match='datasets'):
        render_model_card(config, card={'recipe': 'x'}, metrics=METRICS, model_name='m')


# ---------------------------------------------------------------- push and load over HTTP


@pytest.fixture(scope='module')
def pushed(folder, model, images, tmp_path_factory):
    """Push the folder twice to a loopback Hub, then load it in a fresh process with and without the plugin."""
    tmp = tmp_path_factory.mktemp('pushed')
    out = tmp / 'loaded.safetensors'
    safetensors.torch.save_file({'images': images}, tmp / 'images.safetensors')
    with pytest.MonkeyPatch.context() as mp, HubServer(require_token=TOKEN) as server:
        _isolate_hub_env(mp, tmp / 'hf_home')
        mp.setenv('HF_ENDPOINT', server.url)
        mp.setenv('HF_TOKEN', TOKEN)
        first = push_to_hub(folder, REPO_ID, commit_message='Add test model')
        requests_after_first = len(server.requests)
        second = push_to_hub(folder, REPO_ID)
        second_requests = server.requests[requests_after_first:]
        load = _python('-c', textwrap.dedent(f'''
            import json, sys
            import safetensors.torch, timm, torch
            errors = {{}}
            for name in ('hf-hub:{REPO_ID}', 'local-dir:{folder}'):
                try:
                    timm.create_model(name, pretrained=True)
                except Exception as e:
                    errors[name] = f'{{type(e).__name__}}: {{e}}'
            assert 'timm_affinediv' not in sys.modules
            print(json.dumps(errors))
            import timm_affinediv
            model = timm.create_model('hf-hub:{REPO_ID}', pretrained=True).eval()
            images = safetensors.torch.load_file({str(tmp / 'images.safetensors')!r})['images']
            with torch.no_grad():
                out = {{'logits': model(images), **{{'sd.' + k: v for k, v in model.state_dict().items()}}}}
            safetensors.torch.save_file(out, {str(out)!r})
        '''))
    return {'server': server, 'first': first, 'second': second, 'second_requests': second_requests,
            'load': load, 'out': out}


def test_push_uploads_exactly_the_folder(pushed, folder):
    server = pushed['server']
    repo = server.repos[REPO_ID]
    head = repo.refs['main']
    assert pushed['first'].oid == head.oid and head.message == 'Add test model'
    assert {k: v for k, v in head.files.items() if k != '.gitattributes'} == _files(folder)
    methods = [(m, p.split('/')[-2] if p.startswith('/api/models') else p) for m, p in server.requests[:4]]
    assert methods == [('POST', '/api/repos/create'), ('POST', '/api/validate-yaml'),
                       ('POST', 'preupload'), ('POST', 'commit')]


def test_second_push_is_a_noop(pushed):
    repo = pushed['server'].repos[REPO_ID]
    assert len(repo.commits) == 2  # the repo's initial commit and the upload
    assert pushed['second'].oid == pushed['first'].oid
    assert not [p for _, p in pushed['second_requests'] if p.endswith('/commit/main')]


def test_load_from_hub_is_bit_identical(pushed, model, images):
    load = pushed['load']
    assert load.returncode == 0, load.stderr[-3000:]
    out = safetensors.torch.load_file(pushed['out'])
    assert torch.equal(out['logits'], model(images))
    state = model.state_dict()
    assert {k[3:] for k in out if k.startswith('sd.')} == state.keys()
    assert all(torch.equal(out['sd.' + k], v) and out['sd.' + k].dtype == v.dtype for k, v in state.items())
    assert any(p.endswith('/resolve/main/model.safetensors') for _, p in pushed['server'].requests)


def test_load_without_plugin_says_to_install_and_import(pushed):
    assert pushed['load'].returncode == 0, pushed['load'].stderr[-3000:]
    errors = json.loads(pushed['load'].stdout.splitlines()[0])
    assert len(errors) == 2
    for message in errors.values():
        assert 'pip install timm-affinediv' in message and 'import timm_affinediv' in message, message


def test_push_to_branch_and_pull_request(hub, folder):
    push_to_hub(folder, REPO_ID, revision='dev', private=True)
    repo = hub.repos[REPO_ID]
    assert repo.private
    assert 'model.safetensors' in repo.refs['dev'].files and 'model.safetensors' not in repo.refs['main'].files

    result = push_to_hub(folder, REPO_ID, create_pr=True)
    assert result.pr_url.endswith(f'/{REPO_ID}/discussions/1')
    assert repo.refs['refs/pr/1'].files['model.safetensors'] == (folder / 'model.safetensors').read_bytes()
    assert 'model.safetensors' not in repo.refs['main'].files


# ---------------------------------------------------------------- CLI and bad input


def _cli():
    from timm_affinediv.commands import main
    return lambda argv: main(['push', *argv])


def test_cli_dry_run_lists_files_and_target_and_uploads_nothing(hub, folder, capsys):
    assert _cli()([str(folder), '--repo-id', REPO_ID, '--revision', 'dev', '--dry-run']) == 0
    out = capsys.readouterr().out
    assert hub.url in out and REPO_ID in out and 'branch dev' in out
    for path in folder.iterdir():
        assert f'{path.stat().st_size:,d}  {path.name}' in out
    assert f'{len(FOLDER_FILES)} files' in out
    assert TOKEN not in out
    assert hub.requests == []


def _with_pickle(folder: Path, tmp: Path) -> Path:
    for path in folder.iterdir():
        (tmp / path.name).write_bytes(path.read_bytes())
    torch.save({'w': torch.zeros(1)}, tmp / 'pytorch_model.bin')
    return tmp


def _run_folder(folder: Path, tmp: Path) -> Path:
    """A training run's folder: weights, a pickled checkpoint, and the Hub folder in model/."""
    (tmp / 'model').mkdir()
    for path in folder.iterdir():
        (tmp / 'model' / path.name).write_bytes(path.read_bytes())
    (tmp / 'model.safetensors').write_bytes((folder / 'model.safetensors').read_bytes())
    (tmp / 'checkpoints' / 'epoch-0000').mkdir(parents=True)
    torch.save({'epoch': 0}, tmp / 'checkpoints' / 'epoch-0000' / 'train_state.pt')
    return tmp


def _without_weights(folder: Path, tmp: Path) -> Path:
    for name in ('config.json', 'README.md'):
        (tmp / name).write_bytes((folder / name).read_bytes())
    return tmp


def _corrupt_weights(folder: Path, tmp: Path) -> Path:
    _without_weights(folder, tmp)
    (tmp / 'model.safetensors').write_bytes(b'not safetensors')
    return tmp


def _num_classes_in_model_args(folder: Path, tmp: Path) -> Path:
    """A folder as earlier versions wrote it: transformers passes num_classes beside model_args, and fails."""
    for path in folder.iterdir():
        (tmp / path.name).write_bytes(path.read_bytes())
    config = json.loads((folder / 'config.json').read_text())
    config['model_args']['num_classes'] = config['num_classes']
    (tmp / 'config.json').write_text(json.dumps(config))
    return tmp


@pytest.mark.parametrize('make_folder, repo_id, wrong, to_do', [
    (_without_weights, REPO_ID, 'missing model.safetensors', 'Write one with timm_affinediv.hub.save_hub_folder'),
    (_corrupt_weights, REPO_ID, 'model.safetensors is not a complete safetensors file', 'save_hub_folder'),
    (_with_pickle, REPO_ID, 'pickle weight files (pytorch_model.bin)', 'Remove them'),
    (_num_classes_in_model_args, REPO_ID, 'config.json has num_classes in model_args', 'write the folder again'),
    (_run_folder, REPO_ID, 'is not a Hub model folder: missing config.json, README.md', 'Push its Hub folder'),
    (lambda folder, tmp: folder, 'test-org/bad--name', "invalid repo id 'test-org/bad--name'", "Use 'org/name'"),
    (lambda folder, tmp: folder, 'a/b/c', "invalid repo id 'a/b/c'", "Use 'org/name'"),
])
def test_bad_input_is_refused_before_any_request(hub, folder, tmp_path, make_folder, repo_id, wrong, to_do):
    with pytest.raises(HubError) as e:
        push_to_hub(make_folder(folder, tmp_path), repo_id)
    assert wrong in str(e.value) and to_do in str(e.value)
    assert hub.requests == []


def test_missing_token_is_a_clear_error_and_uploads_nothing(hub, folder, monkeypatch, capsys):
    monkeypatch.delenv('HF_TOKEN')
    assert _cli()([str(folder), '--repo-id', REPO_ID]) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'requires a Hub token and none was found' in err and 'HF_TOKEN' in err
    assert hub.repos == {}
    assert not [p for _, p in hub.requests if 'preupload' in p or 'commit' in p]

    with pytest.raises(HubError, match='refused the token'):
        push_to_hub(folder, REPO_ID, token='hf_wrong')
    assert hub.repos == {}


def test_cli_unreachable_endpoint_is_one_clear_line(folder, tmp_path, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    endpoint = f'http://127.0.0.1:{port}'
    _isolate_hub_env(monkeypatch, tmp_path)
    monkeypatch.setenv('HF_ENDPOINT', endpoint)
    monkeypatch.setenv('HF_TOKEN', TOKEN)
    result = _python('-m', 'timm_affinediv', 'push', str(folder), '--repo-id', REPO_ID)
    assert result.returncode == 2
    assert 'Traceback' not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f'timm-affinediv push: error: cannot reach the Hub at {endpoint}'), lines
    assert TOKEN not in result.stderr + result.stdout


# ---------------------------------------------------------------- what a Hub folder says about its model


FMNIST_DATA_CONFIG = dict(input_size=(1, 32, 32), interpolation='bilinear', mean=(0.286,), std=(0.353,),
                          crop_pct=1.0, crop_mode='center')


@pytest.fixture(scope='module')
def trained_folder(tmp_path_factory) -> Path:
    """A 32x32 Fashion-MNIST model whose pretrained_cfg still carries the ImageNet source's provenance, as a model
    fine-tuned from timm weights does (the Trainer adds its preprocessing on top), with training curves."""
    model = timm.create_model('test_resnet', **MODEL_ARGS, norm_layer='patchnorm')
    model.pretrained_cfg = {**model.pretrained_cfg, 'test_input_size': (3, 288, 288), 'paper_ids': 'arXiv:2110.00476',
                            'test_crop_pct': 1.0, **FMNIST_DATA_CONFIG}
    card = dict(CARD, norm_layer='patchnorm', repo_id=None, base_model=None,
                base_model_description='converted from the BatchNorm `test_resnet` in runs/x/baseline, not on the Hub',
                eval_set='a fixed random 2,000 of the 10,000 images of the Fashion-MNIST test split')
    return save_hub_folder(model.eval(), tmp_path_factory.mktemp('trained') / 'model', model_args=MODEL_ARGS, card=card,
                           metrics=METRICS, extra_files={'metrics.png': b'\x89PNG fake'})


def test_config_describes_the_trained_model(trained_folder):
    cfg = json.loads((trained_folder / 'config.json').read_text())['pretrained_cfg']
    assert cfg['input_size'] == [1, 32, 32] and cfg['mean'] == [0.286] and cfg['std'] == [0.353]
    assert cfg['num_classes'] == 10 and cfg['pool_size'] == [1, 1]  # 32 px through stride 32 (ImageNet's: 5x5)
    for foreign in ('tag', 'paper_ids', 'hf_hub_id', 'test_input_size', 'test_crop_pct'):
        assert foreign not in cfg, foreign
    loaded = timm.create_model(f'local-dir:{trained_folder}', pretrained=True)
    data = timm.data.resolve_data_config({}, model=loaded, use_test_size=True)
    assert data['input_size'] == (1, 32, 32) and tuple(data['mean']) == (0.286,) and data['crop_pct'] == 1.0


def test_card_says_what_the_model_is(trained_folder):
    card = ModelCard.load(trained_folder / 'README.md', ignore_metadata_errors=False)
    assert 'patchnorm' in card.data.tags and card.data.base_model is None
    text = card.text
    assert 'Model card for test-resnet-fmnist' not in text and '# Model card for model' in text  # the folder name
    assert 'hf-hub:YOUR-ORG/YOUR-MODEL' in text and 'replace it with that repo id' in text
    assert 'converted from the BatchNorm `test_resnet` in runs/x/baseline' in text
    assert 'trained from scratch' not in text
    assert 'Evaluated on a fixed random 2,000 of the 10,000 images of the Fashion-MNIST test split' in text
    assert 'author = {Bird, George}' in text and 'George Bird' in text
    assert '![Training curves' in text and '(metrics.png)' in text
    assert '10 classes, not named' in ' '.join(text.split())  # its pretrained_cfg has no names
    assert (trained_folder / 'metrics.png').read_bytes() == b'\x89PNG fake'
    assert '$' not in text


def test_card_names_repo_and_hub_base_model(folder):
    card = ModelCard.load(folder / 'README.md', ignore_metadata_errors=False)
    assert card.data.base_model == CARD['base_model']
    assert f'[{CARD["base_model"]}](https://huggingface.co/{CARD["base_model"]})' in card.text
    assert '# Model card for test-resnet-fmnist' in card.text and 'YOUR-ORG' not in card.text


def test_batchnorm_baseline_card_is_not_patchnorm(folder):
    """CARD describes a BatchNorm model: neither the tag nor the text may call it PatchNorm."""
    card = ModelCard.load(folder / 'README.md', ignore_metadata_errors=False)
    assert 'patchnorm' not in card.data.tags
    assert 'Norm layer: `batchnorm`. This model has no PatchNorm' in card.text
    assert 'PatchNorm divides' not in card.text


def test_card_links_only_to_pages_that_exist(folder):
    """The card links timm's repository, the paper and the Hub page of the model it was made from, not a package
    page that does not exist (no PyPI release)."""
    import re
    links = set(re.findall(r'\]\((https?://[^)\s]+)\)', (folder / 'README.md').read_text()))
    pages = {link for link in links if link.startswith('https://huggingface.co/timm/')}
    assert links - pages == {'https://github.com/huggingface/pytorch-image-models', 'https://arxiv.org/abs/2512.22247'}
    assert not any('pypi.org' in link for link in links), links
