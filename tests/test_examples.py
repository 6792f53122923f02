"""Every command README, docs/ and the `--help` of every command and script show runs as written, under the stand-ins
of `examples.py` (narrow models, a small Fashion-MNIST, a loopback Hub, capped budgets): exit status 0 and the output
it names written, or exactly the error line the document shows."""
import collections
import contextlib
import hashlib
import io
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import timm
import torch
from examples import (
    ARGS_YAML,
    PREPARED,
    ROOT,
    Command,
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
from timm_affinediv.pipeline import PipelineConfig

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


#: The command that makes the prepared demo run (`runs/demo`), as `make demo` does.
DEMO = ['timm-affinediv', 'pipeline', '--output', 'runs/demo']


@pytest.fixture(scope='module')
def ran(tmp_path_factory) -> Path:
    """Where the outputs of commands that ran are kept (`_record_run`): shared by the pytest-xdist workers of this
    session (their base folders' parent), so a command one worker ran is not run again by another."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get('PYTEST_XDIST_WORKER') else base) / 'examples-ran'
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture(scope='module')
def store(standins, tmp_path_factory) -> Path:
    """The prepared inputs (`examples.PREPARED`), made once; the demo run made by `DEMO`, which counts as run."""
    store = tmp_path_factory.mktemp('prepared')
    cwd = os.getcwd()
    os.chdir(store)
    try:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            status = cli_main(DEMO[1:])
        assert status == 0, out.getvalue()[-2000:]
    finally:
        os.chdir(cwd)
    _RAN[_key(Command(' '.join(DEMO), {}, DEMO))] = store
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


#: Commands that already ran, as run, and the folder holding the outputs each wrote (as it wrote them): a page
#: repeating a command another page (or `store`, or another xdist worker, through `ran`) ran successfully does not run
#: it again, where the command names nothing the page wrote before it (each page starts from the same prepared
#: inputs, so it meets what it met there); where a later command of the page names what it writes, those outputs are
#: copied in. A command is recorded only where it too named nothing its page wrote before it.
_RAN: Dict[tuple, Path] = {}


def _names(words, paths) -> bool:
    """Whether `words` name one of `paths` (or a path inside one)."""
    text = ' '.join(words)
    return any(re.search(rf'(?<![\w/.-]){re.escape(path)}(?![\w.-])', text) for path in paths)


def _with_default_output(words: List[str]) -> List[str]:
    """`words`, with the `--output` that `timm-affinediv pipeline` writes where it names none (its default)."""
    if words[:2] == ['timm-affinediv', 'pipeline'] and not {'--output', '--help'} & set(words):
        return [*words, '--output', PipelineConfig().output]
    return words


def _key(command: Command) -> tuple:
    return tuple(_with_default_output(apply_budget(command.words))), tuple(sorted(command.env.items()))


def _written(command: Command) -> set:
    return outputs_of(Example('', [Command(command.text, command.env, _with_default_output(command.words))]))


#: The commands more than one page shows: only their outputs are kept.
_REPEATED = {key for key, pages in collections.Counter(
    key for e in EXAMPLES for key in {_key(c) for c in e.commands}).items() if pages > 1}


def _ran_before(key: tuple, ran: Path) -> Optional[Path]:
    """The folder holding the outputs of an earlier successful run of `key`, or None."""
    if key in _RAN:
        return _RAN[key]
    shared = ran / hashlib.sha1(repr(key).encode()).hexdigest()
    return shared if shared.is_dir() else None


def _record_run(key: tuple, written: set, ran: Path) -> None:
    """Keep a copy of what a successful run wrote, for the pages (in any worker) that repeat it."""
    shared = ran / hashlib.sha1(repr(key).encode()).hexdigest()
    scratch = Path(tempfile.mkdtemp(dir=ran, prefix='.partial-'))
    for name in written:
        if Path(name).is_dir():
            shutil.copytree(name, scratch / name, symlinks=True)
        elif Path(name).exists():
            (scratch / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(name, scratch / name)
    try:
        scratch.rename(shared)  # whole or not at all; another worker may have recorded the same run first
    except OSError:
        shutil.rmtree(scratch)
    _RAN[key] = shared if shared.is_dir() else scratch


def _run_or_repeat(example: Example, position: int, ran: Path, store: Path, as_prepared: set) -> Optional[str]:
    """Run the page's command at `position` in the current folder, or take its outputs from an earlier run of it;
    what is wrong with its outcome, or None. `as_prepared`: what the page's earlier commands wrote that is a prepared
    input as `store` holds it (the outputs of the command that made it, copied from there), which this updates."""
    command = example.commands[position]
    key = _key(command)
    before = outputs_of(Example('', example.commands[:position])) - as_prepared
    written = _written(command)
    after = [word for later in example.commands[position + 1:] for word in later.words]
    earlier = None if _names(command.words, before) else _ran_before(key, ran)
    if earlier is not None and all((earlier / name).exists() for name in written):
        if written and _names(after, written):
            for name in written:
                source, target = earlier / name, Path(name)
                target.parent.mkdir(parents=True, exist_ok=True)
                if source.is_dir():
                    shutil.copytree(source, target, symlinks=True)
                else:
                    shutil.copy2(source, target)
                if earlier == store and name in PREPARED:
                    as_prepared.add(name)
        return None
    words, outcome = run_command(command)
    problem = check(command, words, outcome)
    if problem:
        return f'`{command.text}` (run as `{" ".join(words)}`): {problem}'
    if key in _REPEATED and outcome.status == 0 and not _names(command.words, before) and \
            _ran_before(key, ran) is None:
        _record_run(key, written, ran)
    return None


@pytest.mark.parametrize('example', EXAMPLES, ids=[e.source for e in EXAMPLES])
def test_every_shown_command_runs_as_written(example: Example, store, ran, tmp_path, monkeypatch):
    prepare_inputs(tmp_path, store, example)
    monkeypatch.chdir(tmp_path)
    problems, as_prepared = [], set()
    for position, command in enumerate(example.commands):
        assert ' ... ' not in f' {command.text} ', f'{example.source}: `{command.text}` elides part of the command'
        problem = _run_or_repeat(example, position, ran, store, as_prepared)
        if problem:
            problems.append(problem)
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
