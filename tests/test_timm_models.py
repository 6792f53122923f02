"""timm's own model checks (`tests/test_models.py` of the installed timm's sdist) on patchnorm/affinediv builds.

timm's tests are not ours to commit: `make setup` fetches the sdist of the installed timm version with
`pip download` into `.timm-tests/` (ignored by git). A missing copy fails this module's collection, loudly.
Selected test functions run with their module's `create_model` wrapped to add `norm_layer=...`; the plain
models pass all of them (timm's CI), so each must pass for the patchnorm build too.
"""
import functools
import importlib.util
from pathlib import Path

import pytest
import timm

import timm_affinediv
from timm_affinediv.layers.slot import PatchNormSlot

TIMM_TESTS = Path(__file__).parents[1] / '.timm-tests' / f'timm-{timm.__version__}' / 'tests' / 'test_models.py'
CHECKS = ['test_model_forward', 'test_model_backward', 'test_model_forward_torchscript', 'test_model_forward_fx',
          'test_model_forward_fx_torchscript', 'test_model_forward_features', 'test_model_forward_intermediates']
# what fits the CI time: every check on the small builds; on resnet50d (timm's bottleneck and deep-stem code, slow
# at its 224 px) and on affinediv the scripting and tracing checks, the ones a layer's Python can break
SCRIPTING_CHECKS = ['test_model_forward_torchscript', 'test_model_forward_fx_torchscript',
                    'test_model_forward_features']
CASES = [(model, norm, check) for model, norm, checks in [
    ('resnet18', 'patchnorm', CHECKS), ('convnext_atto', 'patchnorm', CHECKS),
    ('resnet50d', 'patchnorm', SCRIPTING_CHECKS), ('resnet18', 'affinediv', SCRIPTING_CHECKS),
    ('resnet18', 'patchnorm_ws', CHECKS),
    # token and channels-last families: slots over the last dim, bound to Linears
    ('test_vit', 'patchnorm', CHECKS), ('test_vit3', 'patchnorm', CHECKS), ('test_vit_relpos', 'patchnorm', CHECKS),
    ('test_mambaout', 'patchnorm', CHECKS),
    # norm-act slots: EfficientNet's depthwise and squeeze-excite blocks, ByobNet's blocks
    ('test_efficientnet', 'patchnorm', CHECKS), ('test_byobnet', 'patchnorm', CHECKS),
] for check in checks]


def _load_timm_tests():
    if not TIMM_TESTS.is_file():
        raise FileNotFoundError(
            f"timm's model tests are missing ({TIMM_TESTS}): run `make setup`, which fetches timm "
            f"{timm.__version__}'s sdist with `pip download timm=={timm.__version__} --no-binary :all: --no-deps`.")
    spec = importlib.util.spec_from_file_location('timm_sdist_test_models', TIMM_TESTS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


timm_tests = _load_timm_tests()


def _batch_size(check) -> int:
    """The batch size timm's test is parametrized with."""
    for mark in getattr(check, 'pytestmark', []):
        if mark.name == 'parametrize' and mark.args[0] == 'batch_size':
            return mark.args[1][0]
    raise LookupError(f'{check.__name__} has no batch_size parametrization')


def _with_norm_layer(create_model, norm_layer: str, built: list):
    """timm's create_model, building `norm_layer` models (and recording them)."""
    @functools.wraps(create_model)
    def create(model_name, *args, **kwargs):
        model = create_model(model_name, *args, norm_layer=norm_layer, **kwargs)
        built.append(model)
        return model
    return create


@pytest.mark.parametrize('model_name,norm_layer,check', CASES, ids=['-'.join(case) for case in CASES])
def test_timm_model_check(model_name, norm_layer, check, monkeypatch):
    built = []
    monkeypatch.setattr(timm_tests, 'create_model', _with_norm_layer(timm_tests.create_model, norm_layer, built))
    test = getattr(timm_tests, check)
    test(model_name=model_name, batch_size=_batch_size(test))
    # the check ran on a bound patchnorm/affinediv build, not on the plain model
    assert built and all(
        any(isinstance(m, PatchNormSlot) and m.bound for m in model.modules()) for model in built)
    corrected = (timm_affinediv.PatchNormConv2d, timm_affinediv.AffineDivLinear)
    assert any(isinstance(m, corrected) for m in built[0].modules())
