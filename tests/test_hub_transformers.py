"""Hub folders in transformers (the `transformers` extra): a converted and a fine-tuned folder load through
`AutoModelForImageClassification`, `AutoImageProcessor` and `pipeline("image-classification")` with the saved model's
logits and Fashion-MNIST's class names, from the folder and, pushed to a Hub on loopback, by repo id."""
import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import safetensors.torch
import timm
import torch
from hub_server import HubServer
from test_hub import _isolate_hub_env

from timm_affinediv.convert import ConvertOptions, DistillOptions
from timm_affinediv.data import FASHION_MNIST_CLASSES, FASHION_MNIST_DIR, FashionMNIST
from timm_affinediv.hub import PLUGIN_HINT, push_to_hub
from timm_affinediv.model_io import convert_to_folder
from timm_affinediv.publish import publish_run
from timm_affinediv.train import TrainConfig, Trainer

transformers = pytest.importorskip('transformers', reason='needs the transformers extra: pip install -e ".[dev]"')
pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(FASHION_MNIST_DIR, 'train-images-idx3-ubyte.gz')),
    reason='Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)')

NARROW = dict(channels=(16, 32, 64, 128), stem_width=16)
REPO_ID = 'test-org/resnet18-patchnorm-fmnist'
LABELS = dict(enumerate(FASHION_MNIST_CLASSES))


@pytest.fixture(scope='module')
def images() -> list:
    """Four Fashion-MNIST test images, as PIL images (28x28, mode L), as a user has them."""
    test = FashionMNIST(split='test')
    return [test[i][0] for i in range(4)]


@pytest.fixture(scope='module')
def folders(tmp_path_factory) -> dict:
    """name -> (the saved model, its Hub folder): a BatchNorm resnet18 converted to PatchNorm on Fashion-MNIST, and
    that model fine-tuned for one epoch of 32 images."""
    tmp = tmp_path_factory.mktemp('folders')
    torch.manual_seed(0)
    baseline = timm.create_model('resnet18', num_classes=10, in_chans=1, **NARROW).eval()
    converted, _, _ = convert_to_folder(baseline, str(tmp / 'converted'), dataset='fashion-mnist', calib_images=32,
                                        batch_size=16, eval_images=32,
                                        heldout_images=0, distill_images=0,
                                        options=ConvertOptions(distill=DistillOptions(epochs=0)))
    result = Trainer(TrainConfig(
        model='resnet18', norm_layer='patchnorm', dataset='fashion-mnist', num_classes=10, epochs=1, train_subset=32,
        val_subset=16, batch_size=16, workers=0, output=str(tmp / 'run'), progress=False),
        model=copy.deepcopy(converted)).fit()
    return {'converted': (converted.eval(), tmp / 'converted'),
            'finetuned': (result.model.eval(), publish_run(result, str(tmp / 'finetuned'), dataset='fashion-mnist'))}


@pytest.mark.parametrize('name', ['converted', 'finetuned'])
def test_folder_loads_in_transformers_with_the_saved_logits(name, folders, images):
    from transformers import AutoImageProcessor, AutoModelForImageClassification, pipeline

    saved, folder = folders[name]
    assert json.loads((folder / 'config.json').read_text())['label_names'] == list(FASHION_MNIST_CLASSES)
    processor = AutoImageProcessor.from_pretrained(folder)
    model = AutoModelForImageClassification.from_pretrained(folder).eval()
    assert model.config.id2label == LABELS

    # the processor is timm's own preprocessing of the folder; the model computes the saved model's logits
    timm_model = timm.create_model(f'local-dir:{folder}', pretrained=True).eval()
    transform = timm.data.create_transform(**timm.data.resolve_model_data_config(timm_model), is_training=False)
    pixels = processor(images)['pixel_values']
    assert pixels.shape == (4, 1, 32, 32) and torch.equal(pixels, torch.stack([transform(i) for i in images]))
    with torch.no_grad():
        logits = saved(pixels)
        assert torch.equal(model(pixel_values=pixels).logits, logits)
        assert torch.equal(timm_model(pixels), logits)

        # the pipeline makes RGB of every image (transformers' load_image): it gets the same numbers, and the names
        classify = pipeline('image-classification', model=str(folder))
        for image, pixel in zip(images, pixels):
            expected = saved(pixel[None])[0]
            got = classify(image, top_k=10, function_to_apply='none')
            assert {p['label']: p['score'] for p in got} == {LABELS[i]: v.item() for i, v in enumerate(expected)}
            assert got[0]['label'] == LABELS[expected.argmax().item()]
        assert classify(images[0])[0]['score'] == pytest.approx(logits[0].softmax(0).max().item(), rel=1e-6)


def test_pushed_folder_loads_by_repo_id_in_transformers(folders, images, tmp_path, monkeypatch):
    """Pushed to a Hub on loopback, the fine-tuned folder loads by its repo id in a fresh process: without
    `import timm_affinediv` each loader's error names the package to install; with it, the saved logits."""
    saved, folder = folders['finetuned']
    pixels = torch.stack([timm.data.create_transform(**timm.data.resolve_model_data_config(saved))(i) for i in images])
    safetensors.torch.save_file({'pixels': pixels}, tmp_path / 'pixels.safetensors')
    images[0].save(tmp_path / 'image.png')
    out = tmp_path / 'out.safetensors'
    _isolate_hub_env(monkeypatch, tmp_path / 'hf_home')
    with HubServer() as server:
        monkeypatch.setenv('HF_ENDPOINT', server.url)
        push_to_hub(folder, REPO_ID)
        load = subprocess.run([sys.executable, '-c', textwrap.dedent(f'''
            import json, sys
            import safetensors.torch, torch
            from PIL import Image
            from transformers import AutoImageProcessor, AutoModelForImageClassification, pipeline
            errors = {{}}
            for name, loader in (('AutoModelForImageClassification', AutoModelForImageClassification.from_pretrained),
                                 ('pipeline', lambda repo: pipeline('image-classification', model=repo))):
                try:
                    loader({REPO_ID!r})
                except Exception as e:
                    errors[name] = f'{{type(e).__name__}}: {{e}}'
            assert 'timm_affinediv' not in sys.modules
            print(json.dumps(errors))
            import timm_affinediv
            model = AutoModelForImageClassification.from_pretrained({REPO_ID!r}).eval()
            processor = AutoImageProcessor.from_pretrained({REPO_ID!r})
            classify = pipeline('image-classification', model={REPO_ID!r})
            print(json.dumps([model.config.id2label[i] for i in range(10)]))
            print(json.dumps(classify({str(tmp_path / 'image.png')!r}, top_k=10, function_to_apply='none')))
            pixels = safetensors.torch.load_file({str(tmp_path / 'pixels.safetensors')!r})['pixels']
            with torch.no_grad():
                logits = model(**processor(Image.open({str(tmp_path / 'image.png')!r}))).logits, model(pixels).logits
            safetensors.torch.save_file(dict(zip(('processed', 'logits'), logits)), {str(out)!r})
        ''')], capture_output=True, text=True, timeout=300)
    assert load.returncode == 0, load.stderr[-3000:]
    errors, labels, predictions = (json.loads(line) for line in load.stdout.splitlines()[-3:])
    assert errors.keys() == {'AutoModelForImageClassification', 'pipeline'}
    for message in errors.values():
        assert message.startswith('ImportError: ') and f'({PLUGIN_HINT})' in message, message
    assert labels == list(FASHION_MNIST_CLASSES)
    with torch.no_grad():
        expected, first = saved(pixels), saved(pixels[:1])
    logits = safetensors.torch.load_file(out)
    assert torch.equal(logits['logits'], expected) and torch.equal(logits['processed'], first)
    assert {p['label']: p['score'] for p in predictions} == {LABELS[i]: v.item() for i, v in enumerate(first[0])}
    requests = [path for _, path in server.requests]
    assert any(p.endswith('/model.safetensors') and f'/{REPO_ID}/resolve/' in p for p in requests)
