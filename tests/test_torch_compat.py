""" torch's private names, which only timm_affinediv/_torch_compat.py reaches: every one it lists resolves on the
installed torch (a release that moves one fails here, naming it and the file to update), the list holds every
private name the module touches, and nothing else in the package, its scripts or tests reaches torch's internals."""
import ast
import importlib
import pathlib
from typing import Optional, Set

import pytest
import torch

from timm_affinediv import _torch_compat as compat
from timm_affinediv.errors import TorchVersionError
from timm_affinediv.layers.kernels import ops

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMPAT = ROOT / 'timm_affinediv' / '_torch_compat.py'


def _instance(owner: str):
    """An object of the class `owner` names, whose instances carry the private attributes."""
    return {'torch.Tensor': torch.zeros(1),
            'torch.library.Library': torch.library.Library,
            'torch._ops.OpOverload': torch.ops.aten.add.Tensor,
            'torch._library.custom_ops.CustomOpDef': ops.patchnorm_conv2d}[owner]


def _moved(owner: str, name: str, found: bool) -> Optional[str]:
    """The failure's line where `owner.name` is not found on this torch."""
    return None if found else f'torch {torch.__version__} moved {owner}.{name}: update timm_affinediv/_torch_compat.py'


def _importable(module: str, name: str) -> bool:
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


@pytest.mark.parametrize('module,name', [(m, n) for m, names in compat.PRIVATE_IMPORTS.items() for n in names])
def test_every_private_import_resolves(module, name):
    failure = _moved(module, name, _importable(module, name))
    assert failure is None, failure


@pytest.mark.parametrize('owner,name', [(o, n) for o, names in compat.PRIVATE_ATTRIBUTES.items() for n in names])
def test_every_private_attribute_resolves(owner, name):
    failure = _moved(owner, name, hasattr(_instance(owner), name))
    assert failure is None, failure


def test_a_moved_name_fails_with_one_line_naming_it_and_the_module():
    assert not _importable('torch._C', '_no_such_name') and not _importable('torch._no_such_module', 'x')
    assert _moved('torch._C', '_no_such_name', False) == (
        f'torch {torch.__version__} moved torch._C._no_such_name: update timm_affinediv/_torch_compat.py')
    for module, name in (('torch._C', '_no_such_name'), ('torch._no_such_module', 'x')):
        with pytest.raises(TorchVersionError) as raised:
            compat.private_name(module, name)
        assert str(raised.value) == (
            f'torch {torch.__version__} has no {module}.{name}, which timm_affinediv reaches: install the torch it is '
            'tested with, or update timm_affinediv/_torch_compat.py to where this torch keeps it')
        assert isinstance(raised.value, ImportError)


def _touched(tree: ast.AST) -> Set[str]:
    """The private names a module's source takes from torch: `from torch.x._y import z`, `torch._C.NAME` and
    `private_name('torch.x._y', 'z')`, as 'module.name', and private attributes it reads (`._is_view`), as '.name'."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == 'private_name' and \
                all(isinstance(a, ast.Constant) for a in node.args):
            names.add('.'.join(a.value for a in node.args))
        elif isinstance(node, ast.ImportFrom) and (node.module or '').startswith('torch.') and '._' in node.module:
            names |= {f'{node.module}.{alias.name}' for alias in node.names}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and \
                isinstance(node.value.value, ast.Name) and node.value.value.id == 'torch' and node.value.attr == '_C':
            names.add(f'torch._C.{node.attr}')
        elif isinstance(node, ast.Attribute) and node.attr.startswith('_') and not node.attr.startswith('__') and \
                not (isinstance(node.value, ast.Name) and node.value.id == 'torch'):
            names.add(f'.{node.attr}')
    return names


def test_the_lists_hold_every_private_name_the_module_touches():
    listed = {f'{m}.{n}' for m, names in compat.PRIVATE_IMPORTS.items() for n in names}
    listed |= {f'.{n}' for names in compat.PRIVATE_ATTRIBUTES.values() for n in names} | {'torch._C'}
    touched = _touched(ast.parse(COMPAT.read_text()))
    assert touched <= listed, sorted(touched - listed)
    assert {'torch._subclasses.fake_tensor.FakeTensorMode', 'torch._C._ExcludeDispatchKeyGuard', '._is_view',
            '._abstract_fn'} <= touched


def test_the_wrappers_do_what_they_say():
    base = torch.zeros(4)
    assert compat.is_view(base[1:]) and not compat.is_view(base)
    version = compat.tensor_version(base)
    base.add_(1)
    assert compat.tensor_version(base) > version
    assert compat.op_schema(torch.ops.aten.add_.Tensor).arguments[0].alias_info.is_write
    assert compat.custom_op_overload(ops.patchnorm_conv2d) is torch.ops.timm_affinediv.patchnorm_conv2d.default
    assert 'aten::conv2d' in compat.ops_with_kernel('AutocastCPU') and compat.has_kernel('aten::conv2d', 'AutocastCPU')
    assert compat.lookup_device_info('NVIDIA H100').tops_sparsity_factor > 1

    def conv():
        return torch.nn.functional.conv2d(torch.randn(1, 2, 3, 3), torch.randn(2, 2, 1, 1))

    with torch.autocast('cpu', dtype=torch.bfloat16):
        assert conv().dtype == torch.bfloat16
        with compat.dispatch_key_excluded('AutocastCPU'):
            assert conv().dtype == torch.float32


def test_fake_ops_run_their_bodies_inside_the_context_only():
    op = ops.l2_normalise_channels
    fake = op._abstract_fn
    with compat.fakes_run_bodies([op]):
        assert op._abstract_fn is compat.custom_op_body(op) is not fake
    assert op._abstract_fn is fake


def test_nothing_else_reaches_torch_internals():
    """The package, its scripts and tests import torch's private modules only through the compat module."""
    offenders = []
    for folder in ('timm_affinediv', 'scripts', 'tests'):
        for path in (ROOT / folder).rglob('*.py'):
            if path in (COMPAT, pathlib.Path(__file__).resolve()):
                continue
            for name in _touched(ast.parse(path.read_text())):
                if not name.startswith('.') or name[1:] in {n for v in compat.PRIVATE_ATTRIBUTES.values() for n in v}:
                    offenders.append(f'{path.relative_to(ROOT)}: {name}')
    assert not offenders, offenders
