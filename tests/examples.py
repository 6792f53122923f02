""" The commands README, docs/ and every `--help` epilog show, and the stand-ins under which the tests run them

Every line a user could copy that starts with `timm-affinediv`, `python scripts/NAME.py` or `torchrun` is collected:
code blocks and inline code of the markdown files (an inline mention of a bare command name, with no argument, is a
name, not a command), and the examples of each command's and script's `--help`. A collected line runs as written,
with one mechanism changing what it meets, never its flags' names:

- **Stand-in models**: the architectures the docs name (`resnet50`, `convnext_tiny`, `vit_small_patch16_224`, ...)
  are built narrow (`NARROW`: timm's entrypoint with fewer channels and blocks; arguments a command passes win), the
  convolutional ones with a 64 px default input (`SMALL_INPUT`, over their pretrained configuration's 224).
- **Stand-in data**: Fashion-MNIST is a 1,024-image copy in the Debian IDX format; `PATH` (and `/data/imagenet`), the
  images an ImageNet model is converted or fine-tuned on, is a folder of one small image for each of 1000 classes
  (`PATH/train/<class>/`, `PATH/validation/<class>/`).
- **Stand-in Hub**: `HF_ENDPOINT` is a loopback Hub (`hub_server.py`) holding `timm/resnet50.a1_in1k` (the narrow
  stand-in's weights), so `--model resnet50.a1_in1k --pretrained` downloads through timm's real code.
- **Stand-in files**: the inputs a command names are made before it runs (`PREPARED`: the demo run of `make demo`
  and what its folders hold, checkpoints of the stand-in models, a timm `args.yaml`); what the same document makes
  itself is not.
- **Budgets** (`BUDGET`): flag values that set how long a run takes are capped (`--epochs 5` runs 1 epoch,
  `--calib-images 1024` 16 images, `--reps 9` 4 rounds, ...); a full sweep gets its script's own flags for one
  family or experiment, and a measurement script short rounds on small images (`SHORTER`).

The ```python blocks of the pages in `RUN_PYTHON` (whole programs, where other pages show fragments) run too, as
written, after the page's commands, in order and in one namespace, in this process.

Each document's (or `--help`'s) commands run in order in one fresh folder, as a reader would type them, in this
process (the stand-ins are set here), or, for `torchrun` and an environment assignment, in a child process that
applies the same stand-ins at start-up (`standins/sitecustomize.py`). Each must exit 0 and write what its
`--output` names; a command the document shows with its error output (`$ COMMAND` followed by `... error: ...`)
must fail with exactly that line.
"""
import contextlib
import gzip
import io
import json
import os
import re
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

ROOT = Path(__file__).parents[1]
SCRIPTS = ROOT / 'scripts'
STANDINS_ENV = 'TIMM_AFFINEDIV_EXAMPLE_STANDINS'

# --- what the docs show -------------------------------------------------------------------------------------------

FENCE = re.compile(r'^\s*(```|~~~)')
INLINE_CODE = re.compile(r'`([^`]+)`')
COMMENT = re.compile(r'\s#\s.*$')
START = re.compile(r'^(?:\$\s+)?((?:[A-Z_]+=\S+\s+)*)'
                   r'(timm-affinediv|python3? scripts/[a-z_]+\.py|python -m timm_affinediv|torchrun)(\s.*)?$')
ERROR_LINE = re.compile(r'^(timm-affinediv [a-z]+|scripts/[a-z_]+\.py): error: ')


@dataclass
class Command:
    """One command line as shown: `env` assignments before it, the words after them, and, for a line the document
    shows with its error output, that line."""
    text: str
    env: Dict[str, str] = field(default_factory=dict)
    words: List[str] = field(default_factory=list)
    expected_error: Optional[str] = None


@dataclass
class Example:
    """The commands one document (or one `--help`) shows, in order, and the Python programs it shows to run after
    them (`RUN_PYTHON`)."""
    source: str
    commands: List[Command]
    python: List[str] = field(default_factory=list)


def _join_continued(lines: Sequence[str]) -> List[str]:
    joined: List[str] = []
    for line in lines:
        if joined and joined[-1].endswith('\\'):
            joined[-1] = joined[-1][:-1].rstrip() + ' ' + line.strip()
        else:
            joined.append(line.rstrip())
    return joined


def _markdown_lines(text: str) -> List[Tuple[str, bool]]:
    """(line, in a code block) of a markdown text, in order: a code block's lines (continuations joined), and each
    inline code span of the prose (spans may wrap across lines) as a line of its own."""
    lines: List[Tuple[str, bool]] = []
    block: List[str] = []
    prose: List[str] = []
    in_fence = False
    for line in [*text.splitlines(), '```']:  # the sentinel fence flushes the last paragraph
        if FENCE.match(line):
            lines += [(' '.join(s.split()), False) for s in INLINE_CODE.findall('\n'.join(prose))]
            lines += [(c, True) for c in _join_continued(block)]
            block, prose = [], []
            in_fence = not in_fence
        elif in_fence:
            block.append(line)
        else:
            prose.append(line)
    return lines


def parse_commands(lines: Sequence[Tuple[str, bool]]) -> List[Command]:
    """The commands among `lines`; a bare command name in inline code (no argument) is a mention, not a command."""
    commands: List[Command] = []
    parts = [(part, in_block) for line, in_block in lines for part in COMMENT.sub('', line).split(' && ')]
    for line, in_block in parts:
        stripped = line.strip()
        if commands and ERROR_LINE.match(stripped) and commands[-1].text.startswith('$'):
            commands[-1].expected_error = stripped
            continue
        m = START.match(stripped)
        if not m:
            continue
        assignments, program, rest = m.group(1), m.group(2), (m.group(3) or '').strip()
        # an optional part is run too, unless it elides what it holds (`[--model-kwargs ...]`)
        rest = re.sub(r'\[([^\]]*)\]', lambda o: '' if '...' in o.group(1) else o.group(1), rest)
        if not in_block and program in ('timm-affinediv', 'torchrun') and re.fullmatch(r'[a-z]*', rest):
            continue  # a command's name in the prose (`timm-affinediv convert`), not a command
        if re.fullmatch(r'[A-Z<][A-Za-z<>-]*', rest.split(' ', 1)[0] if rest else ''):
            continue  # a placeholder command (`timm-affinediv COMMAND --help`)
        words = shlex.split(rest)
        env = dict(a.split('=', 1) for a in assignments.split())
        command = Command(stripped, env, [*program.split(), *words])
        if not any(c.words == command.words and c.env == command.env for c in commands):
            commands.append(command)
    return commands


#: Pages whose ```python blocks are whole programs (others show fragments): each runs, in order and in one
#: namespace, after the page's commands.
RUN_PYTHON = ('README.md', 'docs/hub.md', 'docs/layers.md')
PYTHON_FENCE = re.compile(r'^\s*```python\s*$')


def python_blocks(text: str) -> List[str]:
    """The ```python code blocks of a markdown text, in order."""
    blocks: List[str] = []
    block: Optional[List[str]] = None
    for line in text.splitlines():
        if block is None:
            block = [] if PYTHON_FENCE.match(line) else None
        elif FENCE.match(line):
            blocks.append('\n'.join(block) + '\n')
            block = None
        else:
            block.append(line)
    return blocks


def doc_examples() -> List[Example]:
    """The commands of README.md and of every page under docs/, and the programs of the pages of `RUN_PYTHON`."""
    paths = [ROOT / 'README.md', *sorted((ROOT / 'docs').rglob('*.md'))]
    examples = []
    for path in paths:
        source, text = path.relative_to(ROOT).as_posix(), path.read_text()
        commands = parse_commands(_markdown_lines(text))
        python = python_blocks(text) if source in RUN_PYTHON else []
        if commands or python:
            examples.append(Example(source, commands, python))
    return examples


def help_examples(help_of: Callable[[List[str]], str]) -> List[Example]:
    """The commands in the examples of every command's and script's `--help` (`help_of(words)` gives the text)."""
    from timm_affinediv.commands import COMMANDS
    shown = [['timm-affinediv', name] for name in COMMANDS]
    shown += [['python', f'scripts/{p.name}'] for p in sorted(SCRIPTS.glob('*.py'))]
    examples = []
    for words in shown:
        text = help_of(words)
        _, _, epilog = text.partition('\nexamples:\n')
        lines = [(line.strip(), True) for line in _join_continued(epilog.splitlines())]
        commands = parse_commands(lines)
        if commands:
            examples.append(Example(' '.join(words) + ' --help', commands))
    return examples


# --- the stand-ins ------------------------------------------------------------------------------------------------

#: The architectures the docs name, built narrow (timm's entrypoint with these defaults; a command's own win).
NARROW: Dict[str, dict] = {
    'resnet18': dict(channels=(16, 32, 64, 128), stem_width=16),
    'resnet50': dict(channels=(16, 32, 64, 128), stem_width=16, layers=(1, 1, 1, 1)),
    'convnext_tiny': dict(dims=(16, 32, 64, 128), depths=(1, 1, 1, 1)),
    'convnext_atto': dict(dims=(16, 32, 64, 128), depths=(1, 1, 1, 1)),
    'vit_small_patch16_224': dict(embed_dim=64, depth=2, num_heads=2),
    'vit_tiny_patch16_224': dict(embed_dim=64, depth=2, num_heads=2),
}

#: Flags whose value sets how long a run takes, and the cap each gets.
BUDGET: Dict[str, int] = {
    '--epochs': 1, '--calib-images': 16, '--calib-batches': 2, '--reps': 4, '--rounds': 2, '--steps': 2,
    '--train-subset': 128, '--val-subset': 64, '--train-images': 64, '--reconstruct-steps': 2, '--distill-epochs': 1,
    '--batches': 2, '--heldout-images': 64, '--distill-images': 128,
    '--batch-size': 16, '-b': 16, '--eval-images': 64, '--img-size': 64,
    # worker processes each import torch and timm again: on the suite's two busy cores that doubles a short run
    # (experiments.py's pool of workers is tested by test_evidence)
    '--workers': 1,
}
#: Flags listing several values (runs of the same thing), cut to the first.
FIRST_ONLY = ('--seeds', '--families')

#: The measurement scripts' own flags for a short run (one family, one experiment, few rounds, small images), each
#: appended where the command does not set that flag itself.
SHORTER: Dict[str, Dict[str, List[str]]] = {
    'scripts/bench.py': {'--reps': ['4'], '--img-size': ['64'], '--batch-size': ['2']},
    'scripts/bench_onnx.py': {'--reps': ['4'], '--img-size': ['64'], '--batch-size': ['2'], '--models': ['resnet50']},
    'scripts/bench_convert.py': {'--reps': ['1'], '--batches': ['1', '1'], '--batch-size': ['2', '8']},
    'scripts/bench_gpu.py': {'--quick': [], '--models': ['resnet18'], '--steps': ['train']},
    'scripts/measure_conversion.py': {'--batch-size': ['8']},
    'scripts/measure_finetune.py': {'--epochs': ['1'], '--train-subset': ['128']},
    'scripts/measure_family_conversion.py': {'--models': ['resnet18'], '--recipes': ['adamw'], '--epochs': ['1'],
                                             '--train-images': ['128'], '--calib-batches': ['2'],
                                             '--heldout-images': ['64'], '--distill-images': ['128'],
                                             '--test-images': ['64']},
    'scripts/measure_family_recovery.py': {'--quick': []},
    'scripts/measure_recovery_swap.py': {'--quick': []},
    'scripts/signal_propagation.py': {'--quick': []},
    'scripts/measure_init_levers.py': {'--quick': []},
    'scripts/tune_longer_budget.py': {'--quick': []},
    'scripts/coverage.py': {'--modules': ['resnet'], '--max-params': ['1'], '--output': ['coverage.md']},
    'scripts/experiments.py': {'--only': ['mlp'], '--quick': []},
    'scripts/kernel_registers.py': {'--models': ['resnet18'], '--archs': ['sm_90a']},
    'scripts/gpu_model.py': {'--models': ['resnet50'], '--batch-train': ['2'], '--batch-infer': ['2'],
                             '--img-size': ['64'], '--layouts': ['channels_last']},
}
#: Scripts that run in a child process without these variables of the test process: kernel_registers.py compiles
#: the kernels, which the interpreter the kernel tests run (TRITON_INTERPRET=1) makes impossible.
WITHOUT_ENV: Dict[str, Tuple[str, ...]] = {'scripts/kernel_registers.py': ('TRITON_INTERPRET',)}

#: Placeholders the docs use for the reader's own things.
PLACEHOLDERS: Dict[str, str] = {'PATH': 'imagenet', '/data/imagenet': 'imagenet', 'M': 'tinynet_e', 'FILE': 'args.yaml',
                                'RUN/model.safetensors': 'run/model.safetensors', 'converted/': 'runs/converted',
                                'original/': 'runs/baseline',
                                'PATH/TO/pytorch-image-models': os.environ.get('TIMM_CHECKOUT', 'pytorch-image-models')}

FASHION_MNIST_SIZES = {'train': 768, 't10k': 256}  # experiments.py --quick's 512+256 and 256


def apply_budget(words: List[str]) -> List[str]:
    """`words` with the budget flags' values capped, placeholders replaced and a sweep cut to one family."""
    out: List[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        out.append(PLACEHOLDERS.get(word, word))
        if word in BUDGET and i + 1 < len(words) and re.fullmatch(r'\d+', words[i + 1]):
            values = []
            i += 1
            while i < len(words) and re.fullmatch(r'\d+', words[i]):
                values.append(str(min(int(words[i]), BUDGET[word])))
                i += 1
            out += values[:1] if word in FIRST_ONLY else values
            continue
        if word in FIRST_ONLY and i + 1 < len(words):
            i += 1
            values = []
            while i < len(words) and not words[i].startswith('-'):
                values.append(words[i])
                i += 1
            out += values[:1]
            continue
        i += 1
    shorter = SHORTER.get(out[1] if len(out) > 1 else '', {})
    if not any(flag in out for flag in ('--help', '--merge')):
        for flag, values in shorter.items():
            short = {'--batch-size': '-b'}.get(flag)
            if flag not in out and (short is None or short not in out):
                out += [flag, *values]
    return out

#: The convolutional stand-ins' default input size: their pretrained configuration's 224 px (what the commands
#: resolve their data transforms from where they give no size) made 64, as their width is narrowed.
SMALL_INPUT: Dict[str, dict] = {name: dict(input_size=(3, 64, 64), test_input_size=(3, 64, 64), crop_pct=1.0)
                                for name in ('resnet18', 'resnet50', 'convnext_tiny', 'convnext_atto')}


def _narrow_entrypoints() -> Dict[str, Callable]:
    import functools

    from timm.models import _registry

    originals = {}
    for name, defaults in NARROW.items():
        original = _registry._model_entrypoints[name]
        originals[name] = original

        @functools.wraps(original)
        def narrow(pretrained=False, _original=original, _defaults=defaults, _name=name, **kwargs):
            kwargs = {**_defaults, **kwargs}
            if _name in SMALL_INPUT:
                overlay = kwargs.get('pretrained_cfg_overlay') or {}
                kwargs['pretrained_cfg_overlay'] = {**SMALL_INPUT[_name], **overlay}
            return _original(pretrained=pretrained, **kwargs)
        _registry._model_entrypoints[name] = narrow
    return originals


def make_fashion_mnist(folder: Path, source: str) -> Path:
    """The first images of each split of the Fashion-MNIST IDX files in `source`, as IDX files in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in FASHION_MNIST_SIZES.items():
        for kind, header, item in (('images-idx3', 16, 28 * 28), ('labels-idx1', 8, 1)):
            name = f'{split}-{kind}-ubyte.gz'
            with gzip.open(os.path.join(source, name)) as f:
                data = f.read(header + count * item)
            data = data[:4] + count.to_bytes(4, 'big') + data[8:]
            with gzip.open(folder / name, 'wb') as f:
                f.write(data)
    return folder


def make_imagenet_folder(folder: Path, classes: int = 1000) -> Path:
    """`folder/{train,validation}/nNNNNNNNN/0.png`: one 8x8 image of random pixels for each of `classes` classes."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(0)
    for split in ('train', 'validation'):
        for index in range(classes):
            target = folder / split / f'n{index:08d}'
            target.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(target / '0.png')
    return folder


@dataclass
class StandIns:
    """Everything `apply` sets, as a JSON-able record a child process applies too (`STANDINS_ENV`)."""
    fashion_mnist: str
    hub_endpoint: str
    hf_home: str

    def to_env(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_env(cls) -> Optional['StandIns']:
        text = os.environ.get(STANDINS_ENV)
        return cls(**json.loads(text)) if text else None


@contextlib.contextmanager
def applied(standins: StandIns) -> Iterator[None]:
    """The stand-ins set in this process (and in the environment its children inherit), restored afterwards."""
    import huggingface_hub.constants as hub_constants
    from timm.models import _registry

    import timm_affinediv.data as data

    env = {STANDINS_ENV: standins.to_env(), 'HF_ENDPOINT': standins.hub_endpoint, 'HF_HOME': standins.hf_home,
           'HF_HUB_CACHE': os.path.join(standins.hf_home, 'hub'), 'HF_HUB_DISABLE_TELEMETRY': '1',
           'PYTHONPATH': os.pathsep.join(p for p in (str(Path(__file__).parent / 'standins'),
                                                      os.environ.get('PYTHONPATH')) if p)}
    saved_env = {k: os.environ.get(k) for k in (*env, 'HF_TOKEN')}
    saved = (data.FASHION_MNIST_DIR, hub_constants.ENDPOINT, hub_constants.HUGGINGFACE_CO_URL_TEMPLATE,
             hub_constants.HF_HUB_CACHE)
    os.environ.update(env)
    os.environ.pop('HF_TOKEN', None)
    data.FASHION_MNIST_DIR = standins.fashion_mnist
    hub_constants.ENDPOINT = standins.hub_endpoint
    hub_constants.HUGGINGFACE_CO_URL_TEMPLATE = standins.hub_endpoint + '/{repo_id}/resolve/{revision}/{filename}'
    hub_constants.HF_HUB_CACHE = env['HF_HUB_CACHE']
    originals = _narrow_entrypoints()
    try:
        yield
    finally:
        _registry._model_entrypoints.update(originals)
        (data.FASHION_MNIST_DIR, hub_constants.ENDPOINT, hub_constants.HUGGINGFACE_CO_URL_TEMPLATE,
         hub_constants.HF_HUB_CACHE) = saved
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def apply_in_child() -> None:
    """Set the stand-ins in a child process started by an example (`standins/sitecustomize.py` calls this)."""
    standins = StandIns.from_env()
    if standins is None:
        return
    import timm_affinediv  # noqa: F401  the registry the narrow entrypoints replace entries of
    global _IN_FORCE
    _IN_FORCE = applied(standins)  # held for the process's life: a collected context would restore everything
    _IN_FORCE.__enter__()


_IN_FORCE: Optional[contextlib.AbstractContextManager] = None


# --- the files the commands name ----------------------------------------------------------------------------------

#: Inputs the commands name: path -> what it is (made by `prepare_inputs`), unless the document makes it itself.
PREPARED = {
    'runs/demo': 'the output of `timm-affinediv pipeline --output runs/demo` (make demo)',
    'runs/converted': "the demo's converted model folder",
    'runs/resnet18-patchnorm': "the demo's converted model folder",
    'runs/baseline': "the demo's BatchNorm baseline folder",
    'baseline.safetensors': "the demo's BatchNorm baseline weights (narrow resnet18, 10 classes, 1 channel)",
    'model.safetensors': "the demo's BatchNorm baseline weights (narrow resnet18, 10 classes, 1 channel)",
    'imagenet': "the stand-in ImageNet folder (PATH): one small image of each of 1000 classes a split",
    'args.yaml': "a timm train.py args.yaml (RandAugment, mixup, LAMB)",
    'run/model.safetensors': 'a checkpoint of the stand-in model of measure_family_conversion (tinynet_e)',
    'runs/vit-tiny/model.safetensors': 'a checkpoint of the narrow ViT of measure_family_conversion --help',
    'tests/data/recipes': "timm's published recipes (tests/data/recipes/*.yaml), their budget settings capped",
}

ARGS_YAML = """\
model: resnet18
num_classes: 10
opt: lamb
lr: 0.005
weight_decay: 0.02
sched: cosine
epochs: 1
warmup_epochs: 0
aa: rand-m7-mstd0.5
mixup: 0.2
cutmix: 1.0
smoothing: 0.1
batch_size: 16
"""


def budget_recipe(text: str) -> str:
    """A train.py args.yaml with the settings of `BUDGET`'s flags capped (`batch_size: 1024` -> 16; `img_size`, unset
    for the model's own 224 px, 64)."""
    import yaml
    settings = yaml.safe_load(text)
    for key, value in settings.items():
        cap = BUDGET.get('--' + key.replace('_', '-'))
        if cap is not None and (isinstance(value, int) or key == 'img_size' and value is None):
            settings[key] = cap if value is None else min(value, cap)
    return yaml.safe_dump(settings, sort_keys=False)


def outputs_of(example: Example) -> set:
    """The first path component (or file) of every `--output` the example's commands write."""
    found = set()
    for command in example.commands:
        words = command.words
        for flag in ('--output', '--json'):
            if flag in words and words.index(flag) + 1 < len(words):
                found.add(os.path.normpath(words[words.index(flag) + 1]))
    return found


def prepare_inputs(folder: Path, store: Path, example: Example) -> None:
    """Copy into `folder` the prepared inputs (made once in `store`) that `example` names and does not make."""
    written = outputs_of(example)
    text = ' '.join([' '.join(apply_budget(c.words)) for c in example.commands] + example.python)
    for name in PREPARED:
        named = re.search(rf'(?<![\w/.-]){re.escape(name)}(?![\w.-])', text)
        if named and not any(name == w or name.startswith(w + '/') for w in written):
            source, target = store / name, folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_dir():
                shutil.copytree(source, target, symlinks=True)
            else:
                shutil.copy2(source, target)


# --- running them -------------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    status: int
    out: str
    err: str


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """What a command may set for its whole process, restored after it: torch's threads, random generators and
    matmul precision, the kernel path, the environment, warning filters (a script sets threads to 1, a benchmark
    the kernels' path: later tests would run under them)."""
    import random

    import numpy as np
    import torch

    from timm_affinediv.layers.kernels import kernels_mode, set_kernels
    threads, precision, mode = torch.get_num_threads(), torch.get_float32_matmul_precision(), kernels_mode()
    rng, np_rng, py_rng, environ = torch.random.get_rng_state(), np.random.get_state(), random.getstate(), dict(
        os.environ)
    with warnings.catch_warnings():
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            torch.set_float32_matmul_precision(precision)
            set_kernels(mode)
            torch.random.set_rng_state(rng)
            np.random.set_state(np_rng)
            random.setstate(py_rng)
            os.environ.clear()
            os.environ.update(environ)


def _in_process(words: List[str]) -> Outcome:
    from timm_affinediv.commands import main as cli_main
    out, err = io.StringIO(), io.StringIO()
    with _process_state_kept(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if words[0] == 'timm-affinediv' or words[:3] == ['python', '-m', 'timm_affinediv']:
                status = cli_main(words[1 if words[0] == 'timm-affinediv' else 3:])
            else:  # as `python scripts/NAME.py ARGS`: its folder first on sys.path, run as __main__
                script = SCRIPTS / Path(words[1]).name
                sys.path.insert(0, str(SCRIPTS))
                argv, sys.argv = sys.argv, [f'scripts/{script.name}', *words[2:]]
                try:
                    runpy.run_path(str(script), run_name='__main__')
                    status = 0
                finally:
                    sys.argv = argv
                    sys.path.remove(str(SCRIPTS))
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) or e.code is None else 1
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=err)
        except Exception:  # a traceback: what a user would see, and a failure
            status = 1
            print(traceback.format_exc(), file=err)
    return Outcome(int(status or 0), out.getvalue(), err.getvalue())


def run_python(code: str, namespace: dict) -> Outcome:
    """Run a page's Python program as written, under the stand-ins in force, in the current folder, in `namespace`
    (that of the page's earlier programs)."""
    out, err = io.StringIO(), io.StringIO()
    with _process_state_kept(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            exec(compile(code, '<python block>', 'exec'), namespace)
            status = 0
        except Exception:  # a traceback: what a user would see, and a failure
            status = 1
            print(traceback.format_exc(), file=err)
    return Outcome(status, out.getvalue(), err.getvalue())


def _in_child(command: Command, words: List[str], timeout: float) -> Outcome:
    if words[0] == 'torchrun':
        argv = [sys.executable, '-m', 'torch.distributed.run', *words[1:]]
    elif words[0] == 'timm-affinediv':
        argv = [sys.executable, '-m', 'timm_affinediv', *words[1:]]
    else:
        argv = [sys.executable, str(SCRIPTS / Path(words[1]).name), *words[2:]]
    # a session of its own: on a time-out the whole group goes, torchrun's workers included
    env = {k: v for k, v in {**os.environ, **command.env}.items() if k not in WITHOUT_ENV.get(words[1], ())}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return Outcome(124, out, err + f'\ntimed out after {timeout} s')
    return Outcome(proc.returncode, out, err)


def run_command(command: Command, timeout: float = 300) -> Tuple[List[str], Outcome]:
    """Run one command as written, under the stand-ins in force, in the current folder."""
    words = apply_budget(command.words)
    if words[0] == 'python3':
        words[0] = 'python'
    if command.env or words[0] == 'torchrun' or words[1] in WITHOUT_ENV:
        return words, _in_child(command, words, timeout)
    return words, _in_process(words)


def missing_resource(words: List[str]) -> Optional[str]:
    """The part of the refusal a command must print where what it needs cannot be had here (a CUDA GPU, timm's
    train.py, which is in no package: `TIMM_CHECKOUT=PATH` names a checkout), or None where it can run."""
    import torch
    device = words[words.index('--device') + 1] if '--device' in words else None
    if not torch.cuda.is_available() and (device == 'cuda' or (words[1:2] == ['scripts/bench_gpu.py'] and
                                                                device != 'cpu' and '--help' not in words)):
        return 'no CUDA'  # bench_gpu.py's 'no CUDA GPU is visible', --device cuda's 'torch sees no CUDA device'
    if words[1:2] == ['scripts/compare_train_py.py'] and not (Path(words[2]) / 'train.py').is_file():
        return 'holds no train.py: give a checkout of pytorch-image-models'
    return None


def check(command: Command, words: List[str], outcome: Outcome) -> Optional[str]:
    """What is wrong with a command's outcome, or None."""
    refusal = missing_resource(words)
    if refusal:
        lines = outcome.err.strip().splitlines()
        if outcome.status == 0 or len(lines) != 1 or refusal not in lines[0]:
            return f'expected a one-line refusal naming {refusal!r}, got status {outcome.status}: {outcome.err[-800:]}'
        return None
    if command.expected_error:
        lines = outcome.err.strip().splitlines()
        if outcome.status != 2 or not lines or not lines[-1].startswith(command.expected_error.rstrip('.')):
            return f'expected the error {command.expected_error!r}, got status {outcome.status}: {outcome.err[-800:]}'
        return None
    if outcome.status != 0:
        return f'exit status {outcome.status}: {(outcome.err or outcome.out)[-1500:]}'
    for flag in ('--output', '--json'):
        if flag in words and words.index(flag) + 1 < len(words):
            target = Path(words[words.index(flag) + 1])
            if not target.exists() or (target.is_dir() and not any(target.iterdir())):
                return f'{flag} {target} was not written'
    return None
