"""The research report (docs/results/*.md) regenerates from its committed records, so no table in it can be edited
by hand.

- A table inside a page sits in a block `<!-- generated: COMMAND -->` ... `<!-- /generated -->`: COMMAND (a
  `python ...` or `timm-affinediv ...` line, run from the repository root) prints the block's lines, byte for byte
  but for trailing newlines. It reads records only: seconds, no training, so it runs in this process, as
  test_examples.py runs the documented commands (a fresh interpreter, importing torch and timm, would cost more
  than the command).
- A table file that a script writes whole (`TABLE_FILES`) is written again into a temporary folder from the same
  record and compared.
- Every other markdown table line (a line starting with `|`, outside code blocks) is an error.
"""
import json
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import pytest
from examples import _in_process as in_process
from examples import run_python

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / 'docs' / 'results'
PAGES = sorted(RESULTS.glob('*.md'))

OPEN = re.compile(r'^<!-- generated: (.+?) -->$')
CLOSE = '<!-- /generated -->'
FENCE = re.compile(r'^\s*(```|~~~)')


@dataclass
class Block:
    """One generated block of a page: the line of its opening marker (1-based), its command and the lines between
    its markers."""
    path: Path
    line: int
    command: str
    text: str


def parse_page(path: Path) -> Tuple[List[Block], List[str]]:
    """(the generated blocks of a markdown page, its problems): a marker left open or closed twice, and every table
    line outside a block, as `page:line: why`."""
    blocks: List[Block] = []
    problems: List[str] = []
    open_block, body, in_fence = None, [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        where = f'{path.name}:{number}'
        if open_block is None and FENCE.match(line):
            in_fence = not in_fence
        elif in_fence:
            continue
        elif OPEN.match(line):
            if open_block is not None:
                problems.append(f'{where}: a generated block opens inside the block of line {open_block[0]}')
            open_block, body = (number, OPEN.match(line).group(1)), []
        elif line == CLOSE:
            if open_block is None:
                problems.append(f'{where}: {CLOSE} closes no block')
            else:
                blocks.append(Block(path, open_block[0], open_block[1], ''.join(f'{b}\n' for b in body)))
                open_block = None
        elif open_block is not None:
            body.append(line)
        elif line.startswith('|'):
            problems.append(f'{where}: a table line outside a generated block: {line[:60]}')
    if open_block is not None:
        problems.append(f'{path.name}:{open_block[0]}: a generated block with no {CLOSE}')
    return blocks, problems


def command_words(command: str) -> List[str]:
    """The argv of a block's command: `python` is this interpreter, `timm-affinediv` the package's module."""
    words = shlex.split(command)
    if any(w.startswith('/dev/') for w in words):
        # the scripts write their files atomically, by a rename: as root, onto /dev/stdout it replaces the device
        raise ValueError(f'{command}: a block\'s command prints its table (--table-only), not into a /dev/ file')
    if words[0] in ('python', 'python3'):
        return [sys.executable, *words[1:]]
    if words[0] == 'timm-affinediv':
        return [sys.executable, '-m', 'timm_affinediv', *words[1:]]
    raise ValueError(f'{command}: a block\'s command is `python ...` or `timm-affinediv ...`')


def run_command(command: str) -> str:
    """The standard output of `command`, run in this process from the repository root (a script as `__main__`, its
    folder first on sys.path; the process state it sets restored afterwards)."""
    words = command_words(command)
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        if words[1] == '-c':
            outcome = run_python(words[2], {'__name__': '__main__'})
        else:
            outcome = in_process(['timm-affinediv', *words[3:]] if words[1:3] == ['-m', 'timm_affinediv'] else
                                 ['python', *words[1:]])
    finally:
        os.chdir(cwd)
    assert outcome.status == 0, f'{command}: exit status {outcome.status}\n{outcome.err[-2000:]}'
    return outcome.out


def differences(expected: str, got: str) -> str:
    """'' where two texts agree but for trailing newlines, else their line counts and first differing lines."""
    expected, got = expected.rstrip('\n'), got.rstrip('\n')
    if expected == got:
        return ''
    a, b = expected.splitlines(), got.splitlines()
    shown = [f'- {x}\n+ {y}' for x, y in zip(a + [''] * len(b), b + [''] * len(a)) if x != y][:3]
    return f'{len(a)} lines against {len(b)}; first differing lines (- committed, + regenerated):\n' + '\n'.join(shown)


def stale(block: Block) -> str:
    """'' where the block is its command's output (trailing newlines aside), else what differs."""
    problem = differences(block.text, run_command(block.command))
    return problem and f'{block.path.name}:{block.line}: the block is not the output of `{block.command}`: {problem}'


# --- the table files: each written whole by a script from its record ------------------------------------------

def _experiment(name: str) -> Callable[[Path], str]:
    """scripts/experiments.py's table of one experiment, written again with nothing trained (`--workers 0`) from
    its runs: the committed run records of `runs/NAME/` where there are (families), else the runs inside
    `NAME.json` laid out as the script records them."""
    def regenerate(tmp: Path) -> str:
        runs = tmp / 'runs' / name
        if (RESULTS / 'runs' / name).is_dir():
            shutil.copytree(RESULTS / 'runs' / name, runs)
        else:
            record = json.loads((RESULTS / f'{name}.json').read_text())
            runs.mkdir(parents=True)
            for run in record['runs']:
                path = runs / f"{run['setting']}-lr{run['lr']:g}-seed{run['seed']}.json"
                path.write_text(json.dumps({'config': record['config'], 'run': run}))
        run_command(f'python scripts/experiments.py --only {name} --workers 0 --output {tmp} --overwrite')
        return (tmp / f'{name}.md').read_text()
    return regenerate


def _record(script: str, record: str) -> Callable[[Path], str]:
    """A measurement script's table from its record, measuring nothing (`--table-only`)."""
    def regenerate(tmp: Path) -> str:
        run_command(f'python scripts/{script}.py --json docs/results/{record} --table-only --table {tmp}/table.md')
        return (tmp / 'table.md').read_text()
    return regenerate


def _coverage(tmp: Path) -> str:
    """scripts/coverage.py's page, written again from its record alone (`--merge`)."""
    run_command(f'python scripts/coverage.py --merge docs/results/coverage.json --output {tmp}/coverage.md')
    return (tmp / 'coverage.md').read_text()


#: docs/results/NAME.md -> how its script writes it again into a temporary folder
TABLE_FILES: Dict[str, Callable[[Path], str]] = {
    'mlp.md': _experiment('mlp'),
    'batch.md': _experiment('batch'),
    'conv.md': _experiment('conv'),
    'families.md': _experiment('families'),
    'signal-propagation.md': _record('signal_propagation', 'signal-propagation.jsonl'),
    'init-levers.md': _record('measure_init_levers', 'init-levers.jsonl'),
    'coverage.md': _coverage,
}

BLOCKS = [block for page in PAGES if page.name not in TABLE_FILES for block in parse_page(page)[0]]


@pytest.mark.parametrize('block', BLOCKS, ids=[f'{b.path.name}:{b.line}' for b in BLOCKS])
def test_every_generated_block_is_its_commands_output(block):
    problem = stale(block)
    assert not problem, problem


@pytest.mark.parametrize('name', sorted(TABLE_FILES))
def test_every_table_file_regenerates_from_its_record(name, tmp_path):
    problem = differences((RESULTS / name).read_text(), TABLE_FILES[name](tmp_path))
    assert not problem, f'docs/results/{name} is not what its script writes from its record: {problem}'



def test_every_table_of_the_report_is_generated():
    assert {p.name for p in PAGES} >= set(TABLE_FILES), 'a listed table file is missing'
    problems = [p for page in PAGES if page.name not in TABLE_FILES for p in parse_page(page)[1]]
    assert not problems, ('tables written by hand (put each in a <!-- generated: COMMAND --> block, or list its '
                          'file in TABLE_FILES):\n' + '\n'.join(problems))


def test_the_checks_catch_a_table_edited_by_hand(tmp_path):
    command = '''python -c "print('| a | b |'); print('|---|---|'); print('| 1 | 2 |')"'''
    table = '| a | b |\n|---|---|\n| 1 | 2 |\n'
    page = tmp_path / 'page.md'
    page.write_text(f'# Page\n\n<!-- generated: {command} -->\n{table}<!-- /generated -->\n\n'
                    f'<!-- generated: {command} -->\n{table.replace("2", "3")}<!-- /generated -->\n\n'
                    f'```\n| in a code block: not a table |\n```\n| a | hand-written |\n\n<!-- generated: x -->\n')
    blocks, problems = parse_page(page)
    assert [(b.line, b.command) for b in blocks] == [(3, command), (9, command)]
    assert problems == ['page.md:18: a table line outside a generated block: | a | hand-written |',
                        'page.md:20: a generated block with no <!-- /generated -->']
    assert stale(blocks[0]) == ''
    assert stale(blocks[1]).startswith(f'page.md:9: the block is not the output of `{command}`')
    assert '3 lines against 3;' in stale(blocks[1]) and '- | 1 | 3 |\n+ | 1 | 2 |' in stale(blocks[1])
    with pytest.raises(ValueError, match='not into a /dev/ file'):
        command_words('python scripts/signal_propagation.py --table-only --table /dev/stdout')
