""" The fused Triton kernels (`timm_affinediv.layers.kernels`) against the float64 eager layers

Without a GPU the kernels run on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`, which conftest.py sets
before anything imports Triton); tiny shapes keep that fast. On a machine with CUDA the interpreter tests are
skipped and the `cuda`-marked tests run the compiled kernels instead (`pytest -m cuda`).
"""
import importlib
import importlib.util
import json
import os

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

import timm_affinediv
from timm_affinediv.layers import AffineDivLinear, L2Norm2d, L2NormLinear, PatchNormAct2d, PatchNormConv2d, SlotBinding
from timm_affinediv.layers.kernels import KernelError, kernel_path, kernels_mode, set_kernels, triton_available

HAS_CUDA = torch.cuda.is_available()


def _interpreter_reason() -> str:
    """Why the kernels cannot run under Triton's interpreter here ('' where they can)."""
    if not triton_available():
        return 'Triton is not installed'
    if HAS_CUDA:
        return 'a GPU is present: the kernels are tested compiled (pytest -m cuda), not under the interpreter'
    import triton.language as tl
    if os.environ.get('TRITON_INTERPRET') != '1' or type(tl.zeros).__name__ != 'InterpretedFunction':
        return 'TRITON_INTERPRET=1 must be set before Triton is imported (tests/conftest.py sets it)'
    return ''


INTERPRETED = not _interpreter_reason()
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason=_interpreter_reason())
needs_cuda = pytest.mark.skipif(not HAS_CUDA or not triton_available(), reason='needs a CUDA GPU and Triton')


@pytest.fixture
def kernels():
    """Selects a kernel path for the test: `kernels('triton')`; restores the mode after."""
    before = kernels_mode()
    yield set_kernels
    set_kernels(before)


def _run(module: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    """Output and the gradients of the input and of every parameter, for the output gradient `grad`."""
    module.zero_grad()
    x = x.detach().clone().requires_grad_()
    out = module(x)
    out.backward(grad.to(out.dtype))
    return [out.detach(), x.grad] + [p.grad.clone() for p in module.parameters()]


def _compare(module: nn.Module, x: torch.Tensor, kernels, device='cpu', dtype=torch.float32, rtol=1e-5, atol=1e-5):
    """The module on the Triton path in `dtype` against itself in float64 on torch's path."""
    torch.manual_seed(1)
    module = module.to(device)
    out = module(x.to(device, torch.float64))
    grad = torch.randn_like(out)
    kernels('torch')
    want = _run(module.double(), x.to(device, torch.float64), grad)
    kernels('triton')
    got = _run(module.to(dtype), x.to(device, dtype), grad)
    names = ['output', 'input grad'] + [f'{n} grad' for n, _ in module.named_parameters()]
    for name, g, w in zip(names, got, want):
        assert g is not None, name
        assert g.dtype == dtype, name
        scale = w.abs().max().item() or 1.
        torch.testing.assert_close(g.double(), w, rtol=rtol, atol=atol * scale, msg=lambda m: f'{name}: {m}')
    return got


def _conv(cin, cout, k, bias=True, **kwargs) -> PatchNormConv2d:
    torch.manual_seed(0)
    conv = PatchNormConv2d(cin, cout, k, bias=bias, **kwargs)
    if bias:
        nn.init.normal_(conv.bias)
    return conv.double()


# every geometry of the layer tests: (in, out, kernel, kwargs)
GEOMETRIES = {
    '1x1': (4, 6, 1, {}),
    '3x3': (4, 6, 3, dict(padding=1)),
    'strided': (4, 6, 3, dict(stride=2, padding=1)),
    '1x1-strided': (4, 6, 1, dict(stride=2)),
    'rect-kernel': (3, 5, (3, 2), dict(stride=(2, 1), padding=(1, 0))),
    'grouped': (4, 6, 3, dict(groups=2, padding=1)),
    'depthwise': (4, 4, 3, dict(groups=4, padding=1)),
    'depthwise-strided': (4, 8, 3, dict(groups=4, stride=2, padding=1)),
    'depthwise-7x7': (4, 4, 7, dict(groups=4, padding=3)),
    'depthwise-5x5-strided': (4, 8, 5, dict(groups=4, stride=2, padding=2)),
    'dilated': (4, 6, 3, dict(dilation=2, padding=2)),
    'dilated-5x5-strided': (4, 6, 5, dict(dilation=2, stride=2, padding=4)),
    'asymmetric-same': (4, 6, 4, dict(padding='same')),
    'reflect': (4, 6, 3, dict(padding=1, padding_mode='reflect')),
    'wide-1x1': (3, 8, 1, {}),
}


@needs_interpreter
@pytest.mark.parametrize('channels_last', [False, True], ids=['nchw', 'channels_last'])
@pytest.mark.parametrize('bias', [True, False], ids=['bias', 'no_bias'])
@pytest.mark.parametrize('geometry', list(GEOMETRIES))
def test_patchnorm_conv(geometry, bias, channels_last, kernels):
    cin, cout, k, kwargs = GEOMETRIES[geometry]
    x = torch.randn(2, cin, 7, 6)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    got = _compare(_conv(cin, cout, k, bias=bias, **kwargs), x, kernels)
    assert got[0].is_contiguous(memory_format=torch.channels_last) == channels_last
    assert got[1].is_contiguous(memory_format=torch.channels_last) == channels_last


@needs_interpreter
@pytest.mark.parametrize('geometry', ['3x3', 'depthwise', 'wide-1x1'])
def test_standardised_weight_on_the_kernels(geometry, kernels):
    """A `patchnorm_ws` producer hands the kernels its standardised weight: output and gradients as torch's path."""
    cin, cout, k, kwargs = GEOMETRIES[geometry]
    conv = _conv(cin, cout, k, **kwargs)
    conv.standardise_weight = True
    _compare(conv, torch.randn(2, cin, 7, 6), kernels)


def _fused(conv: PatchNormConv2d, act_layer) -> nn.Sequential:
    """`conv` with a bound PatchNormAct2d applying its affine (and, on the Triton path, its activation)."""
    slot = PatchNormAct2d(conv.out_channels, act_layer=act_layer).double()
    nn.init.normal_(slot.weight)
    nn.init.normal_(slot.bias)
    conv.fuse_post_affine(slot)
    slot.bind(SlotBinding('1', producer='0'), fused=True)
    return nn.Sequential(conv, slot)


@needs_interpreter
def test_64_bit_offsets(kernels, monkeypatch):
    """The kernels' 64-bit offsets (taken for tensors of 2^31 elements or more) give the 32-bit offsets' numbers."""
    from timm_affinediv.layers.kernels import _triton
    monkeypatch.setattr(_triton, '_i64', lambda *tensors: True)
    cin, cout, k, kwargs = GEOMETRIES['depthwise-strided']
    _compare(_fused(_conv(cin, cout, k, **kwargs), nn.GELU), torch.randn(2, cin, 7, 6), kernels)
    _compare(_conv(4, 6, 1), torch.randn(2, 4, 7, 6).to(memory_format=torch.channels_last), kernels)


@needs_interpreter
@pytest.mark.parametrize('geometry,act', [
    ('3x3', 'relu'), ('grouped', 'gelu'), ('depthwise', 'silu'), ('1x1-strided', 'gelu'), ('depthwise', 'elu')])
def test_fused_slot_affine_and_activation(geometry, act, kernels):
    """The slot's affine (gain folded into the weight, bias after the division) and its activation in the output
    pass; an activation the kernels do not have (ELU) stays the slot's, applied once."""
    cin, cout, k, kwargs = GEOMETRIES[geometry]
    act_layer = dict(relu=nn.ReLU, gelu=nn.GELU, silu=nn.SiLU, elu=nn.ELU)[act]
    for channels_last in (False, True):
        x = torch.randn(2, cin, 6, 6)
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        _compare(_fused(_conv(cin, cout, k, **kwargs), act_layer), x, kernels)


@needs_interpreter
@pytest.mark.parametrize('bias', [True, False], ids=['bias', 'no_bias'])
@pytest.mark.parametrize('features', [(5, 3), (5, 12)], ids=['narrow', 'wide'])
def test_affine_div_linear(features, bias, kernels):
    torch.manual_seed(0)
    layer = AffineDivLinear(*features, bias=bias).double()
    slot = timm_affinediv.PatchNorm(features[1]).double()
    nn.init.normal_(slot.weight)
    nn.init.normal_(slot.bias)
    _compare(layer, torch.randn(3, 4, features[0]), kernels)
    layer.fuse_post_affine(slot)
    slot.bind(SlotBinding('1', producer='0'), fused=True)
    _compare(nn.Sequential(layer.double(), slot), torch.randn(3, 4, features[0]), kernels)


@needs_interpreter
@pytest.mark.parametrize('scale', ['l2', 'rms'])
def test_l2_normalisers(scale, kernels):
    torch.manual_seed(0)
    _compare(L2NormLinear(6, 4, scale=scale).double(), torch.randn(3, 6), kernels)
    norm = L2Norm2d(5, scale=scale).double()
    nn.init.normal_(norm.weight)
    _compare(norm, torch.randn(2, 5, 4, 3), kernels)
    _compare(norm, torch.randn(2, 5, 4, 3).to(memory_format=torch.channels_last), kernels)


@needs_interpreter
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_half_precision_norms_in_float32(dtype, kernels):
    """Inputs whose squares overflow float16 (|x| = 300, |P|^2 ~ 3.2e6) give finite outputs and gradients: the
    norms accumulate in float32. Tolerances are those of the dtype's rounding of `y`."""
    cin, cout, k, kwargs = GEOMETRIES['3x3']
    conv = _fused(_conv(cin, cout, k, **kwargs), nn.GELU)
    got = _compare(conv, 300 * torch.randn(2, cin, 6, 6).to(memory_format=torch.channels_last), kernels, dtype=dtype,
                   rtol=5e-2, atol=5e-2)
    assert all(torch.isfinite(g).all() for g in got)


@needs_interpreter
def test_norm_map_shared_by_pointwise_maps_of_one_input(kernels, monkeypatch):
    """A bottleneck's first 1x1 convolution and its strided 1x1 downsample read one norm computation of their
    common input; an in-place write to the input, or another input, computes it afresh. Outputs equal torch's."""
    from timm_affinediv.layers.kernels import _triton
    launches = []
    channel_sq_norm = _triton.channel_sq_norm
    monkeypatch.setattr(_triton, 'channel_sq_norm', lambda *a, **k: launches.append(1) or channel_sq_norm(*a, **k))
    conv1, downsample = _conv(4, 6, 1).float(), _conv(4, 8, 1, stride=2).float()
    x = torch.randn(2, 4, 7, 6)
    for step in range(3):
        kernels('torch')
        want = conv1(x), downsample(x)
        kernels('triton')
        launches.clear()
        got = conv1(x), downsample(x)
        assert len(launches) == 1, step
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        if step == 0:
            x.mul_(3)
        else:
            x = torch.randn(2, 4, 7, 6)


@needs_interpreter
def test_custom_ops_pass_opcheck():
    """Schemas, fake (meta) implementations and autograd registrations of the custom ops."""
    from timm_affinediv.layers.kernels import ops
    torch.manual_seed(0)
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    w, b, gain, pb = (torch.randn(6, 2, 3, 3, requires_grad=True), torch.randn(6, requires_grad=True),
                      torch.randn(6, requires_grad=True), torch.randn(6, requires_grad=True))
    # aot_dispatch (tracing as torch.compile does) is test_compile_fullgraph's, at a fifth of opcheck's cost
    light = ('test_schema', 'test_autograd_registration', 'test_faketensor')
    torch.library.opcheck(ops.patchnorm_conv2d, (x, w, b, gain, pb, [2, 1], [1, 1], [1, 1], 2, 19, 1., 'silu'),
                          test_utils=light)
    norm_map = torch.rand(2, 2, 3, 5) + 0.5
    torch.library.opcheck(ops.patchnorm_conv2d, (x, w[:, :, :1, :1], None, None, pb, [2, 1], [0, 0], [1, 1], 2, 2,
                                                 1e-12, 'none', norm_map), test_utils=light)
    rows, lw = torch.randn(3, 5, requires_grad=True), torch.randn(7, 5, requires_grad=True)
    torch.library.opcheck(ops.affine_div_linear, (rows, lw, None, None, pb[:1].detach().expand(7).clone(), 5, 1e-12),
                          test_utils=light)
    torch.library.opcheck(ops.affine_div_linear, (rows, lw[:6], b, gain, pb, 5, 1.), test_utils=light)
    torch.library.opcheck(ops.l2_normalise_channels, (x.to(memory_format=torch.channels_last), 4, 1e-6),
                          test_utils=light)


@needs_interpreter
def test_model_train_step_matches_torch_path(kernels):
    """A patchnorm EfficientNet's train step on the Triton path (depthwise and pointwise maps, SiLU applied in the
    producers' output pass) equals torch's path: outputs, every gradient, and the SGD step after."""
    results = {}
    for path in ('torch', 'triton'):
        kernels(path)
        torch.manual_seed(0)
        model = timm.create_model('test_efficientnet', norm_layer='patchnorm', num_classes=3, in_chans=2)
        model = model.to(memory_format=torch.channels_last)
        assert model.bn1.activation_in_producer
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(2, 2, 32, 32).to(memory_format=torch.channels_last)
        out = model(x)
        F.cross_entropy(out, torch.tensor([0, 2])).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        results[path] = [out.detach()] + grads + [model(x).detach()]
    for got, want in zip(results['triton'], results['torch']):
        # float32 sums in another order through a dozen layers: errors relative to each tensor's scale
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def _unbuildable(name: str, calls: list):
    """A stand-in for kernel `name` whose build fails, as ptxas or the driver fails on a GPU the kernels were not
    tested on: the launcher sees the error at the launch."""
    class Unbuildable:
        __name__ = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append(grid)
                raise RuntimeError('PTXAS error: Internal Triton PTX codegen error: ptxas fatal: Value "sm_121" is '
                                   'not defined for option "gpu-name"')
            return launch
    return Unbuildable()


def _fallback_layer(layer: str) -> nn.Module:
    if layer == 'conv':
        return _fused(_conv(4, 6, 3, groups=2, padding=1), nn.GELU).float()
    torch.manual_seed(0)
    if layer == 'linear':
        return AffineDivLinear(5, 12).float()
    norm = L2Norm2d(5, scale='rms')
    nn.init.normal_(norm.weight)
    return norm


def _box_filter_inputs(geometry: str, h: int, w: int):
    """`(conv, x, y, m, t)`: a convolution of `GEOMETRIES`, a channels-last input of `h x w`, its output, the map its
    box filter sums (`x` itself for a depthwise map) and a map at its output positions for the adjoint."""
    cin, cout, k, kwargs = GEOMETRIES[geometry]
    conv = nn.Conv2d(cin, cout, k, **kwargs)
    torch.manual_seed(0)
    x = torch.randn(2, cin, h, w).to(memory_format=torch.channels_last)
    y = conv(x).detach()
    m = x if conv.groups == cin else torch.rand(2, conv.groups, h, w)
    return conv, x, y, m, torch.rand(2, conv.groups, *y.shape[2:])


@needs_interpreter
@pytest.mark.parametrize('geometry', ['3x3', 'strided', 'dilated', 'rect-kernel', 'depthwise-strided'])
def test_box_filter_in_the_output_pass_matches_its_torch_twin(geometry):
    """The output pass's box filter (forward, storing `b`; adjoint) gives what the torch twins the ops fall back to
    give (pooling, a depthwise or transposed convolution), strides, padding, dilation and a depthwise map's squares
    of `x` alike."""
    from timm_affinediv.layers.kernels import _torch, _triton
    from timm_affinediv.layers.patches import BoxFilter
    conv, x, y, m, t = _box_filter_inputs(geometry, 9, 7)
    geo = dict(kernel_size=conv.kernel_size, stride=conv.stride, padding=conv.padding, dilation=conv.dilation)
    depthwise = conv.groups == x.shape[1]
    results = []
    for kernels in (_triton, _torch):
        b = torch.empty(2, conv.groups, *y.shape[2:])
        box = BoxFilter(**geo, divisor=5, offset=0.1, squares=depthwise, out=b)
        out = kernels.scale(y, m, box=box)
        adjoint = kernels.scale(x, t, alpha=-0.2, rsqrt=False, base=x, out=torch.empty_like(x),
                                box=BoxFilter(**geo, adjoint=True))
        results.append((out, b, adjoint))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize('geometry', ['depthwise-7x7', 'depthwise-5x5-strided', 'dilated-5x5-strided'])
def test_a_large_window_sums_rows_then_columns(geometry):
    """A window larger than 3 x 3 sums in two passes (`_separable`): its rows into a float32 map, then its columns in
    the output pass, and the adjoint in the reverse order; both give the one-pass window's sums."""
    from timm_affinediv.layers.kernels import _torch, _triton, passes
    from timm_affinediv.layers.patches import BoxFilter
    conv, x, y, m, t = _box_filter_inputs(geometry, 11, 9)
    geo = [list(conv.kernel_size), list(conv.stride), list(conv.padding), list(conv.dilation)]
    assert passes._separable(geo[0])
    depthwise = conv.groups == x.shape[1]
    rows, columns = passes._rows_and_columns(*geo)
    whole = _torch.scale(y, m, box=BoxFilter(*map(tuple, geo), divisor=5, offset=0.1, squares=depthwise))
    whole_adjoint = _torch.scale(x, t, rsqrt=False, box=BoxFilter(*map(tuple, geo), adjoint=True))
    for kernels in (_triton, _torch):
        r = kernels.box_filter(m, passes._box(*rows, squares=depthwise), (x.shape[2], y.shape[3]))
        split = kernels.scale(y, r, box=passes._box(*columns, divisor=5, offset=0.1))
        r = kernels.box_filter(t, passes._box(*columns, adjoint=True), (x.shape[2], y.shape[3]))
        split_adjoint = kernels.scale(x, r, rsqrt=False, box=passes._box(*rows, adjoint=True))
        torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(split_adjoint, whole_adjoint, rtol=1e-5, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize('tile', [(2, 4), (4, 2)], ids=['channel-blocks-outer', 'units-outer'])
@pytest.mark.parametrize('groups', [1, 2, 12], ids=['one-group', 'grouped', 'per-channel'])
@pytest.mark.parametrize('channels_last', [False, True], ids=['nchw', 'channels_last'])
def test_backward_partial_sums_over_units_and_channel_blocks(groups, channels_last, tile, monkeypatch):
    """The backward's programs each walk several blocks of positions (and of a group's channels), keeping one row of
    partial sums a program and carrying `t` over the channel blocks (or the partial sums over the blocks of
    positions, for tiles of more positions than channels); the `dx` pass sums the partials in its launch: dL/dy,
    `t`, the `dx` update and the parameters' gradients equal the torch twins', with tiles, programs and summing
    tiles shrunk so that every loop runs several times with a ragged end."""
    from timm_affinediv.layers.kernels import _torch, _triton
    # 2 x 4 tiles: 54 units of positions, walked by 5 programs of 11 (the last of 10);
    # 4 x 2 tiles: 27 units, by 5 programs of 6 (the last of 3)
    monkeypatch.setattr(_triton, '_tiles', lambda *args, **kwargs: tile)
    monkeypatch.setattr(_triton, '_PARTIAL_ROWS', 5)
    monkeypatch.setattr(_triton, '_SUM_ROWS', 2)
    monkeypatch.setattr(_triton, '_SUM_COLUMNS', 4)
    torch.manual_seed(0)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    grad, y, x = (torch.randn(3, 12, 5, 7).to(memory_format=layout) for _ in range(3))
    b = torch.rand(3, groups, 5, 7) + 0.5
    gain, bias, post_bias = torch.randn(12), torch.randn(12), torch.randn(12)
    results = []
    for kernels in (_triton, _torch):
        grad_y, t, partials = kernels.scale_backward(grad, y, b, post_bias, 'gelu', True, gain=gain, gain_grad=True,
                                                     bias=bias, bias_grad=True)
        sums = torch.empty(3, 12)
        dx = kernels.scale(x, t, alpha=-0.25, rsqrt=False, base=x, out=torch.empty_like(x), partials=partials,
                           sums=sums)
        results.append((grad_y, t, dx, sums))
        if kernels is _triton:
            assert partials.shape == (3, 5, 12)
    for name, got, want in zip(['dL/dy', 't', 'dx', 'sums'], *results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f'{name}: {m}')


@needs_interpreter
@pytest.mark.parametrize('kernel', ['_scale_kernel', '_scale_backward_kernel'], ids=['forward', 'backward'])
@pytest.mark.parametrize('layer', ['conv', 'linear', 'l2norm'])
def test_kernel_that_fails_to_build_falls_back_under_auto_and_raises_under_triton(layer, kernel, kernels,
                                                                                 monkeypatch):
    """Under `auto` a kernel that fails to build warns once, naming the layer, the kernel, the error and
    TIMM_AFFINEDIV_KERNELS=torch; the failed operation (forward or backward) and every later one run on torch's
    operations (the kernel is not tried again), with torch's numbers; under `triton` the failure raises."""
    from timm_affinediv.layers.kernels import _triton, dispatch
    module = _fallback_layer(layer)
    x = torch.randn(2, 5, 6, 5) if layer == 'l2norm' else torch.randn(2, 4, 6, 5).to(
        memory_format=torch.channels_last) if layer == 'conv' else torch.randn(3, 4, 5)
    grad = torch.randn_like(module(x))
    kernels('torch')
    want = _run(module, x, grad)
    calls = []
    monkeypatch.setattr(_triton, kernel, _unbuildable(kernel, calls))
    monkeypatch.setattr(dispatch, '_runs_kernels', lambda device: True)  # the interpreted CPU stands in for a GPU
    kernels('auto')
    with pytest.warns(RuntimeWarning) as warned:
        got = [_run(module, x, grad) for _ in range(2)]
    assert len(warned) == 1 and len(calls) == 1
    message = str(warned[0].message)
    where = {'conv': 'PatchNormConv2d(4, 6, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), dilation=(1, 1), '
                     'groups=2)', 'linear': 'AffineDivLinear(5, 12)', 'l2norm': 'the L2 normaliser'}[layer]
    failure = f'the Triton kernel {kernel} failed: RuntimeError: PTXAS error'
    assert where in message and failure in message and 'TIMM_AFFINEDIV_KERNELS=torch' in message
    assert dispatch.fell_back()
    for step in got:
        for g, w in zip(step, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    kernels('triton')
    with pytest.raises(KernelError, match=f'{kernel} failed: RuntimeError: PTXAS error.*'
                                          'TIMM_AFFINEDIV_KERNELS=torch'):
        _run(module, x, grad)


def _wrong(launcher, how: str):
    """A launcher that builds and launches but returns wrong values, as a race, a wrong mask or a compiler bug would on
    a GPU the kernels were not tested on."""
    def run(*args, **kwargs):
        result = launcher(*args, **kwargs)
        if how == 'last channel lost':  # a mask one channel short: the output pass leaves a channel unwritten
            result[:, -1] = 0
        elif how == 't off':
            result[1].mul_(1.5)
        else:  # a norm off by a constant
            result.add_(1.)
        return result
    return run


@needs_interpreter
@pytest.mark.parametrize('launcher, how, step', [
    ('scale', 'last channel lost', 'the output pass (_scale_kernel) of a 3x3 map'),
    ('scale_backward', 't off', 'the backward pass (_scale_backward_kernel) of a 3x3 map'),
    ('channel_sq_norm', 'norm off',
     'the patch norms (_channel_sq_norm_kernel, _box_filter_kernel, _scale_kernel) of a 3x3 map'),
], ids=['output-pass', 'backward', 'patch-norms'])
def test_kernel_that_returns_wrong_values_is_caught_at_first_use(launcher, how, step, kernels, monkeypatch):
    """The kernels' self-check at their first use on a device, dtype and layout catches a kernel that runs but
    computes wrong values: under `auto` it warns once (the kernel, its error, TIMM_AFFINEDIV_KERNELS=torch) and the
    layer computes torch's numbers, forward and backward; under `triton` it raises."""
    from timm_affinediv.layers.kernels import _triton, dispatch
    module = _fallback_layer('conv')
    x = torch.randn(2, 4, 6, 5).to(memory_format=torch.channels_last)
    grad = torch.randn_like(module(x))
    kernels('torch')
    want = _run(module, x, grad)
    monkeypatch.setattr(_triton, launcher, _wrong(getattr(_triton, launcher), how))
    monkeypatch.setattr(dispatch, '_runs_kernels', lambda device: True)  # the interpreted CPU stands in for a GPU
    monkeypatch.setattr(dispatch, 'SELF_CHECKS', {})
    kernels('auto')
    with pytest.warns(RuntimeWarning) as warned:
        got = [_run(module, x, grad) for _ in range(2)]
    assert len(warned) == 1, [str(w.message) for w in warned]
    message = str(warned[0].message)
    assert ('the Triton kernels failed their self-check on cpu (torch.float32, channels-last): ' + step) in message
    assert 'from its torch twin' in message and 'TIMM_AFFINEDIV_KERNELS=torch' in message
    assert dispatch.fell_back()
    for step_results in got:
        for g, w in zip(step_results, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    kernels('triton')
    with pytest.raises(KernelError, match='failed their self-check.*TIMM_AFFINEDIV_KERNELS=torch'):
        _run(module, x, grad)


@needs_interpreter
def test_self_check_runs_once_per_device_dtype_and_layout_and_keeps_the_random_state(kernels, monkeypatch):
    """Correct kernels pass their self-check, which runs once for each (device, dtype, layout) a process computes
    on, and draws its inputs without touching the process's random numbers."""
    from timm_affinediv.layers.kernels import _triton, dispatch
    monkeypatch.setattr(dispatch, 'SELF_CHECKS', {})
    calls = []
    check = _triton.channel_sq_norm
    monkeypatch.setattr(_triton, 'channel_sq_norm', lambda *a, **k: calls.append(1) or check(*a, **k))
    kernels('triton')
    module = _fallback_layer('linear')
    x = torch.randn(3, 5)
    torch.manual_seed(1)
    for _ in range(2):
        module(x)
    after = torch.randn(1)
    torch.manual_seed(1)
    assert torch.equal(after, torch.randn(1))  # the two forward passes drew no random numbers
    assert list(dispatch.SELF_CHECKS) == [('cpu', torch.float32, 'contiguous')]
    assert dispatch.SELF_CHECKS[('cpu', torch.float32, 'contiguous')] is None
    assert len(calls) == 5 + 2  # the check's seven cases but the depthwise maps', then one launch each forward
    module(x.to(torch.bfloat16))
    assert set(dispatch.SELF_CHECKS) == {('cpu', torch.float32, 'contiguous'), ('cpu', torch.bfloat16, 'contiguous')}


@needs_interpreter
def test_export_paths_keep_portable_ops(kernels):
    """torch.jit.script and torch.export take torch's portable operations whatever the kernel mode."""
    kernels('triton')
    conv = _fused(_conv(4, 6, 3, padding=1), nn.ReLU).float().eval()
    x = torch.randn(1, 4, 5, 5)
    with torch.no_grad():
        want = conv(x)
        scripted = torch.jit.script(conv)
        torch.testing.assert_close(scripted(x), want, rtol=1e-5, atol=1e-5)
        program = torch.export.export(conv, (x,))
    assert 'timm_affinediv' not in str(program.graph)
    torch.testing.assert_close(program.module()(x), want, rtol=1e-5, atol=1e-5)


def test_dispatch_modes(kernels):
    """'torch' never takes the kernels; 'auto' takes them for CUDA tensors only; float64 always stays on torch's
    path; an unknown mode is refused."""
    kernels('torch')
    assert kernel_path('cuda') == 'torch'
    kernels('auto')
    assert kernel_path('cpu') == 'torch'
    assert kernel_path('cuda') == ('triton' if triton_available() else 'torch')
    assert kernel_path('cuda', torch.float64) == 'torch'
    with pytest.raises(ValueError, match="set_kernels.mode. must be one of auto, triton, torch, got 'cuda'"):
        set_kernels('cuda')
    assert kernels_mode() == 'auto'


def test_environment_variable_selects_the_path(monkeypatch):
    """TIMM_AFFINEDIV_KERNELS is read at import; a wrong value fails the import with one line naming it."""
    from timm_affinediv.layers.kernels import dispatch
    try:
        monkeypatch.setenv('TIMM_AFFINEDIV_KERNELS', 'Torch')
        importlib.reload(dispatch)
        assert kernels_mode() == 'torch' and kernel_path('cuda') == 'torch'
        monkeypatch.setenv('TIMM_AFFINEDIV_KERNELS', 'fast')
        with pytest.raises(ValueError, match="^TIMM_AFFINEDIV_KERNELS must be one of auto, triton, torch, got 'fast'$"):
            importlib.reload(dispatch)
    finally:
        monkeypatch.delenv('TIMM_AFFINEDIV_KERNELS')
        importlib.reload(dispatch)
    assert kernels_mode() == 'auto'


def test_report_of_kernel_paths(kernels):
    from timm_affinediv.layers import describe_kernel_paths, layer_kernel_paths
    model = timm.create_model('resnet10t', norm_layer='patchnorm', num_classes=3)
    kernels('torch')
    paths = layer_kernel_paths(model)
    assert set(paths.values()) == {'torch'} and {'conv1.0', 'layer1.0.conv1'} <= set(paths)
    assert describe_kernel_paths(model) == f'kernels: {len(paths)} layers on the torch path (cpu); on a CUDA GPU: torch'
    kernels('auto')
    assert describe_kernel_paths(model).endswith('on a CUDA GPU: ' + ('triton' if triton_available() else 'torch'))
    if INTERPRETED:
        kernels('triton')
        assert set(layer_kernel_paths(model).values()) == {'triton'}
        assert set(layer_kernel_paths(model.double()).values()) == {'torch'}


# GPU: the compiled kernels, in every dtype, against the float64 eager layers (run with `pytest -m cuda`)
@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize('geometry', list(GEOMETRIES))
def test_cuda_kernels(geometry, dtype, kernels):
    cin, cout, k, kwargs = GEOMETRIES[geometry]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for channels_last in (False, True):
        x = torch.randn(4, cin, 13, 11)
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        _compare(_fused(_conv(cin, cout, k, **kwargs), nn.GELU), x, kernels, 'cuda', dtype, tol, tol)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_row_kernels(dtype, kernels):
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.manual_seed(0)
    _compare(AffineDivLinear(48, 192).double(), torch.randn(4, 7, 48), kernels, 'cuda', dtype, tol, tol)
    _compare(L2NormLinear(48, 16).double(), torch.randn(9, 48), kernels, 'cuda', dtype, tol, tol)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize('name', ['resnet18', 'convnext_atto'])
def test_cuda_train_step_matches_torch_path(name, kernels):
    """A bf16-autocast channels-last train step on the GPU: the Triton path's loss and gradients equal torch's."""
    results = {}
    for path in ('torch', 'triton'):
        kernels(path)
        torch.manual_seed(0)
        model = timm.create_model(name, norm_layer='patchnorm', num_classes=10).cuda()
        model = model.to(memory_format=torch.channels_last)
        x = torch.randn(8, 3, 64, 64, device='cuda').to(memory_format=torch.channels_last)
        with torch.autocast('cuda', torch.bfloat16):
            loss = F.cross_entropy(model(x), torch.arange(8, device='cuda'))
        loss.backward()
        results[path] = [loss.detach().float()] + [p.grad.float() for p in model.parameters()]
    for got, want in zip(results['triton'], results['torch']):
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2 * want.abs().max().item())


@pytest.mark.cuda
@needs_cuda
def test_cuda_compiled_model_has_no_graph_breaks(kernels):
    kernels('triton')
    model = timm.create_model('resnet18', norm_layer='patchnorm', num_classes=10).cuda()
    x = torch.randn(4, 3, 64, 64, device='cuda')
    compiled = torch.compile(model, fullgraph=True)
    with torch.autocast('cuda', torch.bfloat16):
        compiled(x).float().sum().backward()
        torch.testing.assert_close(compiled(x).float(), model(x).float(), rtol=5e-2, atol=5e-2)


@pytest.mark.cuda
@needs_cuda
def test_cuda_convert_model_on_the_gpu():
    """`convert_model` of a model already on the GPU, with `device='cuda'` and calibration batches on the CPU: every
    tensor follows the model, and the converted model computes what a conversion on the CPU gives."""
    from timm_affinediv import ConvertOptions, convert_model
    from timm_affinediv.convert import DistillOptions
    torch.manual_seed(0)
    model = timm.create_model('resnet18', num_classes=10).eval()
    calibration = [torch.randn(8, 3, 64, 64) for _ in range(2)]
    # the fit alone: reconstruction's Adam steps would differ between the devices by their floating-point order
    fit_only = DistillOptions(epochs=0)
    on_cpu, _ = convert_model(model, calibration=calibration, options=ConvertOptions(distill=fit_only, device='cpu'))
    converted, _ = convert_model(model.cuda(), calibration=calibration,
                                 options=ConvertOptions(distill=fit_only, device='cuda'))
    assert all(p.is_cuda for p in converted.parameters())
    with torch.no_grad():
        x = calibration[0]
        torch.testing.assert_close(converted(x.cuda()).cpu(), on_cpu(x), rtol=1e-3, atol=1e-3)


def test_bench_gpu_script_runs_on_the_cpu(tmp_path, capsys):
    """scripts/bench_gpu.py end to end at tiny sizes (its figures are the GPU's to give): eager and compiled rows,
    the table printed and saved; wrong modes refused."""
    from conftest import SCRIPTS
    spec = importlib.util.spec_from_file_location('bench_gpu', SCRIPTS / 'bench_gpu.py')
    bench_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_gpu)
    out = tmp_path / 'bench.json'
    assert bench_gpu.main(['--device', 'cpu', '--quick', '--models', 'test_resnet', '--steps', 'inference',
                           '--backend', 'aot_eager', '--json', str(out)]) == 0
    record = json.loads(out.read_text())
    assert [(r['model'], r['step'], r['mode']) for r in record['rows']] == [
        ('test_resnet', 'inference', 'eager'), ('test_resnet', 'inference', 'compiled')]
    assert all(r['native_img_s'] > 0 and r['patchnorm_img_s'] > 0 for r in record['rows'])
    assert '| test_resnet | inference | compiled |' in capsys.readouterr().out
    assert record['environment']['gpu'] == 'none (cpu)'
    with pytest.raises(SystemExit):
        bench_gpu.main(['--device', 'cpu', '--modes', 'jit'])
    assert "--modes eager,compiled; got 'train,inference', 'jit'" in capsys.readouterr().err


def test_train_step_launches_no_box_filter_or_sum_of_its_own(run_script):
    """On the Triton path a k x k map's box filter (forward and adjoint) and a depthwise map's channel norms run inside
    the output and `dx` passes: a train step adds no pooling, fill or transposed convolution to the native model's
    launches (`scripts/launch_count.py`, the kernels' values from their torch twins). The `dx` pass sums the
    backward's partial sums too: a ResNet adds one `sum`, its stem's, whose input needs no gradient."""
    proc = run_script('launch_count', '--models', 'resnet18', 'convnext_atto', '--img-size', '32', '--top', '100',
                      timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith('| resnet18') or line.startswith('| convnext')]
    assert len(rows) == 2, proc.stdout
    box_filter_ops = {'avg_pool2d', 'avg_pool2d_backward', 'conv_transpose2d', 'fill_', 'ones', 'new_ones', 'full',
                      'new_full'}
    added = {row.split('|')[1].strip(): dict(item.strip().split(' +') for item in row.split('|')[-2].split(','))
             for row in rows}
    for name, ops in added.items():
        assert not set(ops) & box_filter_ops, (name, ops)
    assert added['resnet18'].get('sum') == '1', added['resnet18']
