"""The package's source as a whole: its modules import each other without a circle, the library never imports the
command line, and no module reaches a private name of another; every error it raises on bad input is one of
`errors.py`'s (`AffineDivError`, keeping its builtin), never a bare builtin; each module's docstring is at most 25
lines. The developer scripts (scripts/) use the public API and the compat modules only. Read from the source with
`ast`, so a module that is never imported is checked too."""
import ast
import builtins
import graphlib
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest
from conftest import SCRIPTS

import timm_affinediv
from timm_affinediv import errors

PACKAGE = Path(timm_affinediv.__file__).resolve().parent
BUILTIN_ERRORS = {name for name, value in vars(builtins).items()
                  if isinstance(value, type) and issubclass(value, BaseException)}

#: builtins the package may raise as they are, each for a reason; every other `raise Builtin(...)` fails
ALLOWED_BUILTIN_RAISES = {
    'NotImplementedError': 'a subclass that does not implement an abstract method is a bug, not bad input',
}

#: exception classes defined outside errors.py, each for a reason: neither is an error about the user's input
ALLOWED_EXCEPTION_CLASSES = {
    ('train.config', 'TrainingInterrupted'): 'a stop the user asked for (Ctrl-C, SIGTERM), a KeyboardInterrupt '
                                             'that `except Exception` must not catch',
    ('train.trainer', '_StopRequested'): "the training loop's own signal to leave its loop, caught inside it",
}


def _modules() -> Dict[str, Path]:
    """Every module of the package by its dotted name ('layers.kernels.ops'; '' for the package itself)."""
    modules = {}
    for path in sorted(PACKAGE.rglob('*.py')):
        parts = path.relative_to(PACKAGE).with_suffix('').parts
        modules['.'.join(parts[:-1] if parts[-1] == '__init__' else parts)] = path
    return modules


MODULES = _modules()


def _where(path: Path, node: ast.AST) -> str:
    return f'{path.relative_to(PACKAGE.parent)}:{node.lineno}'


def _parts(name: str) -> List[str]:
    return name.split('.') if name else []


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> Optional[str]:
    """The module (relative to the package) that `from ... import` in `module` reads; None outside the package."""
    if not node.level:
        top, _, rest = (node.module or '').partition('.')
        return rest if top == PACKAGE.name else None
    package = _parts(module) if path.name == '__init__.py' else _parts(module)[:-1]
    return '.'.join(package[:len(package) - node.level + 1] + _parts(node.module or ''))


def _imports(module: str, path: Path) -> Iterator[Tuple[ast.AST, str, List[ast.alias]]]:
    """`(node, module imported from, names)` for every import of a package module in `module` (`import
    timm_affinediv.x`: names empty), deferred ones (inside a function) included: an import in a function that closes
    a circle still ties the two modules to each other."""
    for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(module, path, node)
            if target is not None:
                yield node, target, node.names
        elif isinstance(node, ast.Import):
            for alias in node.names:
                top, _, rest = alias.name.partition('.')
                if top == PACKAGE.name:
                    yield node, rest, []


def _graph() -> Dict[str, Set[str]]:
    """Each module and the package modules it imports: `from . import ops` the submodule `ops`, `from .ops import
    f` the module `ops`."""
    graph = {}
    for module, path in MODULES.items():
        targets = set()
        for _, target, names in _imports(module, path):
            submodules = {'.'.join(_parts(target) + [alias.name]) for alias in names} & MODULES.keys()
            targets |= submodules if len(submodules) == len(names) > 0 else {target}
        graph[module] = targets - {module}
    return graph


def test_module_graph_is_read_in_full():
    graph = _graph()
    assert 'errors' in graph['layers.kernels.dispatch'] and 'layers.kernels.dispatch' in graph['layers.kernels.ops']
    assert 'layers.kernels.selfcheck' in graph['layers.kernels.ops'], 'a deferred import is an edge too'
    assert graph['errors'] == set()


def test_modules_import_each_other_without_a_circle():
    try:
        tuple(graphlib.TopologicalSorter(_graph()).static_order())
    except graphlib.CycleError as error:
        pytest.fail('the package modules import each other in a circle: ' + ' -> '.join(error.args[1]))


#: The command line, the top layer: the shared flags and error handling, one module a command, `python -m`
COMMAND_LINE = ('cli', 'commands', '__main__')


def _is_command_line(module: str) -> bool:
    return module.split('.')[0] in COMMAND_LINE


def _reached(graph: Dict[str, Set[str]], module: str) -> Set[str]:
    """Every module `module` imports, directly or through others."""
    reached, todo = set(), [module]
    while todo:
        for target in graph[todo.pop()] - reached:
            reached.add(target)
            todo.append(target)
    return reached


def test_the_library_never_imports_the_command_line():
    """The commands are built on the library, never the other way: what a library module needs of the command line
    (a check, a default) lives in the library, and the command line imports it from there."""
    graph = _graph()
    assert 'cli' in graph['commands.convert'], 'the walk sees the commands import the command line'
    upward = [f'{module} imports {target}' for module, targets in sorted(graph.items())
              if not _is_command_line(module) for target in sorted(targets) if _is_command_line(target)]
    assert not upward, 'library modules that import the command line:\n' + '\n'.join(upward)


def test_the_recovery_does_not_reach_the_demo_pipeline():
    """`recover` and the demo (`pipeline`) share what lies below both (`publish`, `train`), not each other."""
    reached = _reached(_graph(), 'recover')
    assert {'publish', 'train'} <= reached, 'the walk follows the recovery\'s imports'
    assert 'pipeline' not in reached, 'recover imports the demo pipeline, directly or through another module'


def test_no_module_reaches_another_modules_private_names():
    """`from .x import _name` and `x._name` between the package's modules: a name one module uses from another is
    public within the package. Modules with a private name (`_state_dict`, `_timm_compat`, `_triton`, ...) may be
    imported whole: their functions are the package's."""
    reaches = []
    for module, path in MODULES.items():
        bound = {}  # local names of imported package modules
        for node, target, names in _imports(module, path):
            for alias in names:
                name = '.'.join(_parts(target) + [alias.name])
                if name in MODULES:
                    bound[alias.asname or alias.name] = name
                elif alias.name.startswith('_') and not alias.name.startswith('__'):
                    reaches.append(f'{_where(path, node)}: from {target or PACKAGE.name} import {alias.name}')
            if isinstance(node, ast.Import):
                bound.update({alias.asname: alias.name.partition('.')[2] for alias in node.names if alias.asname})
        for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith('_') and not node.attr.startswith('__')):
                reaches.append(f'{_where(path, node)}: {node.value.id}.{node.attr}')
    assert not reaches, 'private names reached across modules (make them public within the package):\n' + \
        '\n'.join(reaches)


def _raised_builtins(path: Path) -> Iterator[Tuple[int, str]]:
    """`(line, builtin)` for every `raise Builtin(...)` / `raise Builtin` in the module at `path`."""
    for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
        if isinstance(node, ast.Raise) and node.exc is not None:
            raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(raised, ast.Name) and raised.id in BUILTIN_ERRORS:
                yield node.lineno, raised.id


def test_the_raise_walk_finds_bare_builtins_and_only_them(tmp_path):
    module = tmp_path / 'module.py'
    module.write_text('from .errors import ConversionError\n\n\ndef f(x):\n    if x:\n        raise ValueError(x)\n'
                      '    try:\n        g()\n    except KeyError as e:\n        raise ConversionError(x) from e\n'
                      '    raise RuntimeError\n')
    assert sorted(_raised_builtins(module)) == [(6, 'ValueError'), (11, 'RuntimeError')]


def test_every_raise_on_bad_input_is_an_affinediv_error():
    bare = [f'{path.relative_to(PACKAGE.parent)}:{line}: raise {name}' for path in MODULES.values()
            for line, name in _raised_builtins(path) if name not in ALLOWED_BUILTIN_RAISES]
    assert not bare, ('bare builtin errors raised (raise one of timm_affinediv/errors.py, which keeps the builtin as '
                      'its second base):\n' + '\n'.join(bare))


def test_every_exception_class_is_defined_in_errors_py():
    exception_bases = BUILTIN_ERRORS | set(errors.__all__)
    outside = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
            if isinstance(node, ast.ClassDef) and module != 'errors' and (module, node.name) not in \
                    ALLOWED_EXCEPTION_CLASSES:
                bases = {base.id if isinstance(base, ast.Name) else getattr(base, 'attr', '') for base in node.bases}
                if bases & exception_bases:
                    outside.append(f'{_where(path, node)}: class {node.name}')
    assert not outside, 'exception classes outside timm_affinediv/errors.py:\n' + '\n'.join(outside)


@pytest.mark.parametrize('name', errors.__all__)
def test_every_error_in_errors_py_is_an_affinediv_error_with_a_builtin_base(name):
    error = getattr(errors, name)
    assert issubclass(error, errors.AffineDivError)
    builtin_bases = [base for base in error.__mro__
                     if base.__module__ == 'builtins' and base not in (Exception, BaseException, object)]
    assert builtin_bases or error is errors.AffineDivError, \
        f'{name} keeps no builtin base, so `except <builtin>` around the call that raises it misses it'


#: The most lines a module's docstring takes, its quotes included: what the module does, its formula and its design;
#: results and history belong in the report (docs/results/)
MAX_MODULE_DOCSTRING_LINES = 25


def _docstring_lines(path: Path) -> int:
    """The lines the module docstring of `path` spans (0 without one)."""
    body = ast.parse(path.read_text(encoding='utf-8')).body
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0


def test_every_module_docstring_is_at_most_25_lines():
    assert _docstring_lines(MODULES['errors']) > 1, 'the walk reads a module docstring'
    long = [f'{path.relative_to(PACKAGE.parent)}: {lines} lines' for path in MODULES.values()
            if (lines := _docstring_lines(path)) > MAX_MODULE_DOCSTRING_LINES]
    assert not long, (f'module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines (keep what the module does, its '
                      'formula and its design; move results and history to docs/results/):\n' + '\n'.join(long))

def _private_timm_imports(path: Path) -> Iterator[str]:
    """The private timm modules and names `path` imports (`timm.models._hub`, `from timm.layers import _x`)."""
    for node in ast.walk(ast.parse(path.read_text(encoding='utf-8'))):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or '').split('.')[0] == 'timm':
            if any(p.startswith('_') for p in node.module.split('.')):
                yield f'{_where(path, node)}: from {node.module} import ...'
            yield from (f'{_where(path, node)}: from {node.module} import {a.name}' for a in node.names
                        if a.name.startswith('_') and not a.name.startswith('__'))
        elif isinstance(node, ast.Import):
            yield from (f'{_where(path, node)}: import {a.name}' for a in node.names
                        if a.name.split('.')[0] == 'timm' and any(p.startswith('_') for p in a.name.split('.')))


def test_timm_private_names_are_reached_through_timm_compat_only():
    outside = [line for module, path in MODULES.items() if module != '_timm_compat'
               for line in _private_timm_imports(path)]
    assert not outside, 'timm private names outside timm_affinediv/_timm_compat.py:\n' + '\n'.join(outside)
    assert any(_private_timm_imports(MODULES['_timm_compat'])), 'the walk finds the compat module\'s own imports'


#: The package's private modules the scripts may import, each for a reason; any other private module or name of the
#: package (or of timm, torch, Triton) is refused in scripts/
SCRIPT_ALLOWED_PRIVATE_MODULES = {
    'timm_affinediv._timm_compat': "the version shim over timm's private names: scripts reach them through it, as "
                                   'the package does',
    'timm_affinediv._torch_compat': "the version shim over torch's private names (fake tensors, dispatch modes, the "
                                    'operator registry)',
}


def _is_private(name: str) -> bool:
    return name.startswith('_') and not name.startswith('__')


def _script_private_reaches(path: Path, siblings: Set[str]) -> Iterator[str]:
    """The private modules and names the script at `path` imports from anything but its sibling scripts (`from
    timm_affinediv._io import ...`, `from timm_affinediv.layers.kernels import _triton`, `from triton._utils import
    ...`), and the private names it reads off a package module it imported whole (`ops._launch`)."""
    where = path.relative_to(SCRIPTS.parent) if path.is_relative_to(SCRIPTS) else path.name
    tree = ast.parse(path.read_text(encoding='utf-8'))
    bound = {}  # local names of imported package modules
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module.split('.')[0] not in siblings:
            if any(map(_is_private, node.module.split('.'))) and node.module not in SCRIPT_ALLOWED_PRIVATE_MODULES:
                yield f'{where}:{node.lineno}: from {node.module} import ...'
            for alias in node.names:
                if _is_private(alias.name):
                    yield f'{where}:{node.lineno}: from {node.module} import {alias.name}'
                elif node.module.split('.')[0] == PACKAGE.name:
                    bound[alias.asname or alias.name] = f'{node.module}.{alias.name}'
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split('.')[0] not in siblings and any(map(_is_private, alias.name.split('.'))) and \
                        alias.name not in SCRIPT_ALLOWED_PRIVATE_MODULES:
                    yield f'{where}:{node.lineno}: import {alias.name}'
                if alias.name.split('.')[0] == PACKAGE.name:
                    bound[alias.asname or alias.name.split('.')[0]] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound and \
                _is_private(node.attr):
            yield f'{where}:{node.lineno}: {node.value.id}.{node.attr}'


def _siblings() -> Set[str]:
    """What a script imports from scripts/ itself: the other scripts and the packages beside them (paper)."""
    return {p.stem for p in SCRIPTS.glob('*.py')} | {p.name for p in SCRIPTS.iterdir() if (p / '__init__.py').is_file()}


def test_the_script_walk_finds_private_imports(tmp_path):
    source = tmp_path / 'a_script.py'
    source.write_text('import timm_affinediv.layers.kernels.ops as ops\nfrom timm_affinediv import _io\n'
                      'from timm_affinediv._torch_compat import FakeTensorMode\nfrom triton._utils import x\n'
                      'from sibling import _helper\nops._launch()\n')
    assert list(_script_private_reaches(source, {'sibling'})) == [
        'a_script.py:2: from timm_affinediv import _io', 'a_script.py:4: from triton._utils import ...',
        'a_script.py:6: ops._launch']


def test_scripts_use_the_public_api_and_the_compat_modules_only():
    """scripts/ reach no private module or name of the package, timm, torch or Triton, but the compat modules: what a
    script needs of the package is public (`timm_affinediv.files.atomic_write`) or lives in scripts/."""
    siblings = _siblings()
    reaches = [line for path in sorted(SCRIPTS.rglob('*.py')) for line in _script_private_reaches(path, siblings)]
    assert not reaches, 'private names reached from scripts/ (make them public, or move the helper into ' \
                        'scripts/):\n' + '\n'.join(reaches)
