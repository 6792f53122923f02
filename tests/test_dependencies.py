"""Every third-party module the package imports is a declared dependency (pyproject.toml), so a fresh install works."""
import ast
import importlib
import importlib.metadata
import pkgutil
import re
import sys
import tomllib
from pathlib import Path

import timm_affinediv

ROOT = Path(__file__).resolve().parent.parent


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
    return {re.split(r'[<>=!~\[; ]', req, maxsplit=1)[0].lower().replace('_', '-') for req in project['dependencies']}


def _imported_top_levels(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split('.')[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split('.')[0])
    return names


def test_every_module_imports_and_its_third_party_imports_are_declared():
    declared = _declared()
    distributions = importlib.metadata.packages_distributions()
    undeclared = {}
    for module in pkgutil.walk_packages(timm_affinediv.__path__, 'timm_affinediv.'):
        importlib.import_module(module.name)  # every module imports
        path = ROOT / (module.name.replace('.', '/') + '.py')
        for name in _imported_top_levels(path):
            if name in sys.stdlib_module_names or name == 'timm_affinediv':
                continue
            dists = {d.lower().replace('_', '-') for d in distributions.get(name, [name])}
            if not dists & declared:
                undeclared.setdefault(name, []).append(module.name)
    assert not undeclared, f'imported but not declared in pyproject.toml: {undeclared}'
