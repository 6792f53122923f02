""" torch's private names, which only timm_affinediv/_torch_compat.py reaches: every one resolves on the installed
torch, and one that a torch release moved fails with a line that names it and the file to update."""
import importlib
import pathlib

import pytest
import torch

from timm_affinediv import _torch_compat as compat
from timm_affinediv.layers.kernels import ops

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _instance(owner: str):
    """An object of the class `owner` names, whose instances carry the private attributes."""
    return {'torch.Tensor': torch.zeros(1),
            'torch.library.Library': torch.library.Library,
            'torch._ops.OpOverload': torch.ops.aten.add.Tensor,
            'torch._library.custom_ops.CustomOpDef': ops.patchnorm_conv2d}[owner]


@pytest.mark.parametrize('module,name', [(m, n) for m, names in compat.PRIVATE_IMPORTS.items() for n in names])
def test_every_private_import_resolves(module, name):
    found = getattr(importlib.import_module(module), name, None)
    assert found is not None, (f'torch {torch.__version__} moved {module}.{name}: update '
                               'timm_affinediv/_torch_compat.py')


@pytest.mark.parametrize('owner,name', [(o, n) for o, names in compat.PRIVATE_ATTRIBUTES.items() for n in names])
def test_every_private_attribute_resolves(owner, name):
    assert hasattr(_instance(owner), name), (f'torch {torch.__version__} moved {owner}.{name}: update '
                                             'timm_affinediv/_torch_compat.py')


def test_a_moved_name_fails_with_one_line_naming_it_and_this_module():
    with pytest.raises(ImportError) as raised:
        compat.private_name('torch._subclasses.fake_tensor', 'NoSuchMode')
    assert str(raised.value) == (f'torch {torch.__version__} has no torch._subclasses.fake_tensor.NoSuchMode: update '
                                 'timm_affinediv/_torch_compat.py to where this torch keeps it')
    with pytest.raises(ImportError, match=r'has no torch\._C\.DispatchKey\.NoSuchKey: update timm_affinediv/'):
        compat.dispatch_key_excluded('NoSuchKey')


def test_the_wrappers_do_what_they_say():
    base = torch.zeros(4)
    assert compat.is_view(base[1:]) and not compat.is_view(base)
    version = compat.tensor_version(base)
    base.add_(1)
    assert compat.tensor_version(base) > version
    assert compat.op_schema(torch.ops.aten.add_.Tensor).arguments[0].alias_info.is_write
    assert compat.custom_op_overload(ops.patchnorm_conv2d) is torch.ops.timm_affinediv.patchnorm_conv2d.default
    assert 'aten::conv2d' in compat.ops_with_kernel('AutocastCPU') and compat.has_kernel('aten::conv2d', 'AutocastCPU')
    with torch.autocast('cpu', dtype=torch.bfloat16):
        conv = lambda: torch.nn.functional.conv2d(torch.randn(1, 2, 3, 3), torch.randn(2, 2, 1, 1))  # noqa: E731
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
    """The package and its scripts import torch's private modules only through the compat module."""
    offenders = []
    for folder in ('timm_affinediv', 'scripts', 'tests'):
        for path in (ROOT / folder).rglob('*.py'):
            if path.name in ('_torch_compat.py', 'test_torch_compat.py'):
                continue
            text = path.read_text()
            for private in ('from torch._', 'import torch._', 'torch._C.', '._is_view(', '._destroy(', '._schema',
                            '._abstract_fn', '._init_fn', '._opoverload'):
                if private in text:
                    offenders.append(f'{path.relative_to(ROOT)}: {private}')
    assert not offenders, offenders
