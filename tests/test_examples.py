"""Every command README, docs/ and the `--help` of every command and script show runs as written, under the stand-ins
of `examples.py` (narrow models, a small Fashion-MNIST, a loopback Hub, capped budgets): exit status 0 and the output
it names written, or exactly the error line the document shows."""
import contextlib
import io
import os
import re
import shutil
from pathlib import Path

import pytest
import timm
import torch
from examples import (
    ARGS_YAML,
    PREPARED,
    ROOT,
    Example,
    StandIns,
    applied,
    apply_budget,
    budget_recipe,
    check,
    doc_examples,
    help_examples,
    make_fashion_mnist,
    make_imagenet_folder,
    outputs_of,
    prepare_inputs,
    run_command,
    run_python,
)
from hub_server import HubServer, Repo
from safetensors.torch import save_file

from timm_affinediv.commands import main as cli_main
from timm_affinediv.data import FASHION_MNIST_DIR

pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(FASHION_MNIST_DIR, 'train-images-idx3-ubyte.gz')),
    reason='needs Debian dataset-fashion-mnist (make setup installs it)')


def _help_text(words):
    from examples import _in_process
    return _in_process([*words, '--help']).out


EXAMPLES = doc_examples() + help_examples(_help_text)


@pytest.fixture(scope='module')
def standins(tmp_path_factory):
    """The stand-in data and Hub, applied in this process for the module's tests."""
    tmp = tmp_path_factory.mktemp('standins')
    fashion = make_fashion_mnist(tmp / 'fashion-mnist', FASHION_MNIST_DIR)
    with HubServer() as hub:
        record = StandIns(str(fashion), hub.url, str(tmp / 'hf_home'))
        with applied(record):
            torch.manual_seed(0)
            model = timm.create_model('resnet50.a1_in1k')
            saved = tmp / 'resnet50.safetensors'
            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(saved))
            hub.repos['timm/resnet50.a1_in1k'] = repo = Repo(private=False)
            repo.commit('main', {'model.safetensors': saved.read_bytes()}, 'stand-in weights')
            yield record


@pytest.fixture(scope='module')
def store(standins, tmp_path_factory) -> Path:
    """The prepared inputs (`examples.PREPARED`), made once."""
    store = tmp_path_factory.mktemp('prepared')
    cwd = os.getcwd()
    os.chdir(store)
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            status = cli_main(['pipeline', '--output', 'runs/demo'])
        assert status == 0, out.getvalue()[-2000:]
    finally:
        os.chdir(cwd)
    demo = store / 'runs' / 'demo'
    for name, source in (('runs/converted', 'converted'), ('runs/resnet18-patchnorm', 'converted'),
                         ('runs/baseline', 'baseline')):
        shutil.copytree(demo / source, store / name)
    for name in ('baseline.safetensors', 'model.safetensors'):
        shutil.copy2(demo / 'baseline' / 'model.safetensors', store / name)
    make_imagenet_folder(store / 'imagenet')
    (store / 'args.yaml').write_text(ARGS_YAML)
    recipes = store / 'tests' / 'data' / 'recipes'
    recipes.mkdir(parents=True)
    for recipe in (ROOT / 'tests' / 'data' / 'recipes').glob('*.yaml'):
        (recipes / recipe.name).write_text(budget_recipe(recipe.read_text()))
    vit = timm.create_model('vit_tiny_patch16_224', num_classes=10, in_chans=1, img_size=32, patch_size=4,
                            embed_dim=64, depth=4, num_heads=2)
    (store / 'runs' / 'vit-tiny').mkdir()
    save_file(vit.state_dict(), str(store / 'runs' / 'vit-tiny' / 'model.safetensors'))
    (store / 'run').mkdir()
    model = timm.create_model('tinynet_e', num_classes=10, in_chans=1)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(store / 'run' / 'model.safetensors'))
    assert all((store / name).exists() for name in PREPARED), sorted(PREPARED)
    return store


#: Commands that already ran, as run: a page repeating another's command on the same prepared inputs does not run it
#: again, where the command names nothing the page wrote before it and nothing after it in the page names what it
#: writes (each page starts from the same prepared inputs, so such a command meets what it met on the earlier page).
_RAN = set()


def _names(words, paths) -> bool:
    """Whether `words` name one of `paths` (or a path inside one)."""
    text = ' '.join(words)
    return any(re.search(rf'(?<![\w/.-]){re.escape(path)}(?![\w.-])', text) for path in paths)


def _repeats_an_earlier_page(example: Example, position: int) -> bool:
    command = example.commands[position]
    key = (tuple(apply_budget(command.words)), tuple(sorted(command.env.items())))
    if key in _RAN:
        before = outputs_of(Example('', example.commands[:position]))
        written = outputs_of(Example('', [command]))
        after = [word for later in example.commands[position + 1:] for word in later.words]
        return not _names(command.words, before) and not (written and _names(after, written))
    _RAN.add(key)
    return False


@pytest.mark.parametrize('example', EXAMPLES, ids=[e.source for e in EXAMPLES])
def test_every_shown_command_runs_as_written(example: Example, store, tmp_path, monkeypatch):
    prepare_inputs(tmp_path, store, example)
    monkeypatch.chdir(tmp_path)
    problems = []
    for position, command in enumerate(example.commands):
        assert ' ... ' not in f' {command.text} ', f'{example.source}: `{command.text}` elides part of the command'
        if _repeats_an_earlier_page(example, position):
            continue
        words, outcome = run_command(command)
        problem = check(command, words, outcome)
        if problem:
            problems.append(f'`{command.text}` (run as `{" ".join(words)}`): {problem}')
    namespace = {'__name__': '__main__'}
    for number, code in enumerate(example.python, 1):
        outcome = run_python(code, namespace)
        if outcome.status != 0:
            problems.append(f'python block {number}: {outcome.err[-1500:]}')
    assert not problems, f'{example.source}:\n' + '\n'.join(problems)


def test_the_examples_are_found():
    sources = {e.source for e in EXAMPLES}
    assert {'README.md', 'docs/conversion.md', 'docs/training.md', 'timm-affinediv convert --help',
            'timm-affinediv finetune --help', 'python scripts/bench.py --help'} <= sources, sorted(sources)
    assert sum(len(e.commands) for e in EXAMPLES) >= 60
    hub = next(e for e in EXAMPLES if e.source == 'docs/hub.md')
    assert any('hf-hub:' in code for code in hub.python) and any('from transformers' in code for code in hub.python)
