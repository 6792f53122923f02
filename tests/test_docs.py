"""The documentation (README.md and docs/**/*.md) against the code: every relative link resolves (the file, and for
`#anchor` links the heading), and every `timm-affinediv COMMAND --flag` and `python scripts/NAME.py --flag` it shows
exists (the command's or script's `--help` lists the flag). Commands run in-process, so the check costs one import."""
import contextlib
import functools
import io
import re
import runpy
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

from timm_affinediv.commands import main as cli_main

ROOT = Path(__file__).parents[1]
DOC_FILES = [ROOT / 'README.md', *sorted((ROOT / 'docs').rglob('*.md'))]

FENCE = re.compile(r'^\s*(```|~~~)')
LINK = re.compile(r'!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)')
INLINE_CODE = re.compile(r'`([^`]+)`')
COMMAND = re.compile(r'(?:\btimm-affinediv|-m\s+timm_affinediv)\s+(\S+)(.*)')
SCRIPT_RUN = re.compile(r'\bpython3?\s+scripts/([a-z_]+)\.py\b(.*)')
SCRIPT_PATH = re.compile(r'(?<![\w/.-])scripts/([a-z_]+)\.py\b')
FLAG = re.compile(r'(?<![\w-])--[a-z][a-z0-9-]*')
COMMENT = re.compile(r'\s#\s.*$')


def split_markdown(text: str) -> Tuple[List[str], List[str]]:
    """(prose lines, code-block lines) of a markdown text; a code block's backslash-continued lines are joined."""
    prose, code, in_fence = [], [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            prose.append(line)
        elif code and code[-1].endswith('\\'):
            code[-1] = code[-1][:-1] + ' ' + line.strip()
        else:
            code.append(line)
    return prose, code


def github_anchors(text: str) -> set:
    """The anchors GitHub gives a markdown text's headings (lower case, punctuation dropped, spaces to hyphens,
    `-1`, `-2` on repeats)."""
    anchors, seen = set(), {}
    for line in split_markdown(text)[0]:
        m = re.match(r'#{1,6}\s+(.*?)\s*#*\s*$', line)
        if not m:
            continue
        slug = re.sub(r'[^\w\- ]', '', m.group(1).lower()).replace(' ', '-')
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f'{slug}-{n}')
    return anchors


def _where(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def broken_links(path: Path) -> List[str]:
    """The relative links of the markdown file `path` that do not resolve, as `file: link (why)`."""
    prose = '\n'.join(split_markdown(path.read_text())[0])
    prose = INLINE_CODE.sub('', prose)
    problems = []
    for target in LINK.findall(prose):
        if re.match(r'[a-z][a-z0-9+.-]*:', target) or target.startswith('/'):
            continue  # absolute URL (https:, mailto:) or site-absolute path: not this repository's files
        file_part, _, anchor = target.partition('#')
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            problems.append(f'{_where(path)}: {target} (no such file)')
        elif anchor and linked.suffix == '.md' and anchor not in github_anchors(linked.read_text()):
            problems.append(f'{_where(path)}: {target} (no heading #{anchor} in {file_part or "itself"})')
    return problems


def shown_commands(text: str) -> Iterator[Tuple[str, Optional[str], List[str]]]:
    """(kind, name, flags) of every command line a markdown text shows, in code blocks and inline code: kind `cli`
    with the subcommand (None for `timm-affinediv --flag`), or `script` with the script's name."""
    prose, code = split_markdown(text)
    spans = [' '.join(s.split()) for s in INLINE_CODE.findall('\n'.join(prose))]
    for line in code + spans:
        line = COMMENT.sub('', line)
        for m in COMMAND.finditer(line):
            word, rest = m.groups()
            if word.startswith('--'):
                yield 'cli', None, [word, *FLAG.findall(rest)]
            elif re.fullmatch(r'[a-z][a-z-]*', word):  # not a placeholder (COMMAND, <command>, ...)
                yield 'cli', word, FLAG.findall(rest)
        for m in SCRIPT_RUN.finditer(line):
            yield 'script', m.group(1), FLAG.findall(m.group(2))


def _help_of(run) -> Tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            status = run()
        except SystemExit as e:
            status = e.code
    return int(status or 0), out.getvalue()


@functools.cache
def cli_help(command: Optional[str]) -> Tuple[int, str]:
    """(exit status, help text) of `timm-affinediv [COMMAND] --help`."""
    return _help_of(lambda: cli_main([command, '--help'] if command else ['--help']))


@functools.cache
def script_help(name: str) -> Tuple[int, str]:
    """(exit status, help text) of `python scripts/NAME.py --help`, run in this process (the script's directory
    first on sys.path, as `python scripts/NAME.py` has it)."""
    path = ROOT / 'scripts' / f'{name}.py'
    if not path.exists():
        return 1, ''
    sys.path.insert(0, str(path.parent))
    try:
        module = runpy.run_path(str(path), run_name=f'scripts_{name}')
        return _help_of(lambda: module['main'](['--help']))
    finally:
        sys.path.remove(str(path.parent))


def unknown_commands_and_flags(paths: List[Path]) -> Tuple[List[str], Dict[str, int]]:
    """(problems, how many command lines of each kind were checked) for the markdown files `paths`."""
    problems, counts = [], {'cli': 0, 'script': 0}
    for path in paths:
        text = path.read_text()
        where = _where(path)
        for name in sorted(set(SCRIPT_PATH.findall(text))):
            if not (ROOT / 'scripts' / f'{name}.py').exists():
                problems.append(f'{where}: scripts/{name}.py does not exist')
        for kind, name, flags in shown_commands(text):
            counts[kind] += 1
            status, help_text = cli_help(name) if kind == 'cli' else script_help(name)
            shown = f'timm-affinediv {name or ""}'.strip() if kind == 'cli' else f'python scripts/{name}.py'
            if status != 0:
                problems.append(f'{where}: `{shown}` is not a command (--help exits {status})')
                continue
            listed = set(FLAG.findall(help_text))
            problems += [f'{where}: `{shown}` has no flag {flag}' for flag in flags if flag not in listed]
    return problems, counts


def test_doc_files_exist():
    names = {p.relative_to(ROOT).as_posix() for p in DOC_FILES}
    assert {'README.md', 'docs/binding.md', 'docs/conversion.md', 'docs/training.md', 'docs/hub.md',
            'docs/export.md', 'docs/performance.md', 'docs/design.md', 'docs/results/results.md'} <= names


def test_every_relative_link_resolves():
    problems = [p for path in DOC_FILES for p in broken_links(path)]
    assert not problems, 'broken links:\n' + '\n'.join(problems)


def test_every_command_and_flag_shown_exists():
    problems, counts = unknown_commands_and_flags(DOC_FILES)
    assert not problems, 'commands or flags the docs show that do not exist:\n' + '\n'.join(problems)
    assert counts['cli'] >= 20 and counts['script'] >= 5, counts  # the parser found the docs' command lines


def test_the_checks_catch_what_they_are_for(tmp_path):
    page = tmp_path / 'page.md'
    page.write_text('# Title\n\n[ok](#title) [gone](missing.md) [no heading](#nowhere) [web](https://x.org/a)\n\n'
                    '```bash\ntimm-affinediv convert --model resnet18 \\\n    --no-such-flag  # --comment-flag\n'
                    'timm-affinediv bench --reps 3\npython scripts/bench.py --rounds-typo 2\n```\n'
                    'Run `timm-affinediv push --repo-id a/b --privat`, see `scripts/nothing_here.py`.\n')
    links = broken_links(page)
    assert len(links) == 2 and 'missing.md (no such file)' in links[0] and '#nowhere' in links[1], links
    problems, counts = unknown_commands_and_flags([page])
    assert counts == {'cli': 3, 'script': 1}, counts
    assert sorted(p.split(': ', 1)[1] for p in problems) == sorted([
        'scripts/nothing_here.py does not exist',
        '`timm-affinediv convert` has no flag --no-such-flag',
        '`timm-affinediv bench` is not a command (--help exits 2)',
        '`python scripts/bench.py` has no flag --rounds-typo',
        '`timm-affinediv push` has no flag --privat']), problems


@pytest.mark.parametrize('heading, anchor', [
    ("## timm's train.py", 'timms-trainpy'),
    ('### 1. The divergence is real and measured: **held**', '1-the-divergence-is-real-and-measured-held'),
    ('## The ResNet-50 gap: what was tried', 'the-resnet-50-gap-what-was-tried')])
def test_anchors_follow_github(heading, anchor):
    assert anchor in github_anchors(heading)
