""" Kernels that check themselves before they are trusted

A Triton kernel that builds and launches but returns wrong numbers on a user's GPU (a race, a wrong mask, a compiler
or driver the kernels were not tested on) would otherwise go unnoticed. So the first time a process would compute a
layer with the kernels on a (device, dtype, memory layout), `verify` runs every kernel family there on small inputs
and compares each result with that of its torch twin (`_torch`), on the same device:

- the output pass (`_channel_sq_norm_kernel`, `_box_filter_kernel` for a window's rows where it is larger than
  3 x 3, `_scale_kernel` with the box filter inside): `out` and `b`;
- the backward pass (`_scale_backward_kernel`): `dL/dy` and `t`;
- the `dx` update with the parameters' gradients summed in its launch (`_scale_kernel` with `SUM`, after
  `_box_filter_kernel` for a larger window's columns): `dL/dx` and the sums;

for a 3x3 map (stride 1), a grouped 3x3 map, a depthwise 3x3 map (stride 2), a strided 1x1 map, a 7x7 map with
stride 2 (ResNet's stem), a depthwise 7x7 map (ConvNeXt's) and rows (a linear layer), each with its activation and
affine. On a GPU the sizes span several tiles in every dimension, the last one ragged (136 channels, 17 x 17
positions); Triton's CPU interpreter, which runs each program in numpy, checks one ragged tile a dimension (12
channels, 5 x 5). The carried sums of a backward program that walks several blocks of
positions (more than `_PARTIAL_ROWS` of them) are not reached at these sizes: tests/test_kernels.py checks them.

A result whose largest difference from the twin's, relative to the twin's largest value, exceeds the tolerance of
its dtype (`TOLERANCE`) raises `KernelError`, which the ops take as a kernel that failed to build
(`dispatch.kernel_failed`): warned once under `auto`, which then computes on torch's operations, and raised under
`triton`. The inputs come from a generator of their own, so the check leaves the process's random state as it was.
"""
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple

import torch
from torch import Tensor

from ...errors import KernelError
from ..patches import is_channels_last
from . import _torch, _triton, dispatch
from .passes import add_norm_grad, conv_output

__all__ = ['TOLERANCE', 'GPU_SIZES', 'verify', 'run_cases']

#: largest difference from the torch twin, relative to its largest value, per dtype of the compared tensor: a few
#: units in the last place (the kernels and their twins sum in float32 in different orders, then round)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}



@dataclass(frozen=True)
class _Sizes:
    n: int
    channels: int  # divisible by every case's groups
    size: int
    rows: int


GPU_SIZES = _Sizes(n=3, channels=136, size=17, rows=37)
_INTERPRETER_SIZES = _Sizes(n=1, channels=12, size=5, rows=3)


@dataclass(frozen=True)
class _Case:
    name: str
    kernel_size: int
    stride: int
    groups: int  # 0: depthwise
    act: str
    affine: Tuple[bool, bool, bool]  # bias, gain, post_bias
    rows: bool = False


_CASES = (
    _Case('a 3x3 map', 3, 1, 1, 'relu', (True, True, True)),
    _Case('a grouped 3x3 map', 3, 1, 4, 'silu', (False, True, True)),
    _Case('a depthwise 3x3 map, stride 2', 3, 2, 0, 'none', (False, False, True)),
    _Case('a 1x1 map, stride 2', 1, 2, 1, 'gelu', (True, False, False)),
    _Case('a 7x7 map, stride 2 (a two-pass window)', 7, 2, 1, 'relu', (False, True, True)),
    _Case('a depthwise 7x7 map (a two-pass window)', 7, 1, 0, 'none', (True, True, False)),
    _Case('rows (a linear layer)', 1, 1, 1, 'none', (True, True, True), rows=True),
)

# what each compared result is, and the kernels that compute it
_STEPS = {
    'out': 'the output pass (_scale_kernel)',
    'b': 'the patch norms (_channel_sq_norm_kernel, _box_filter_kernel, _scale_kernel)',
    'grad_y': 'the backward pass (_scale_backward_kernel)', 't': 'the backward pass (_scale_backward_kernel)',
    'grad_x': 'the dx update (_box_filter_kernel, _scale_kernel)',
    'sums': "the parameters' gradients (_scale_backward_kernel, summed in _scale_kernel)",
}

def _layout(x: Tensor) -> str:
    return 'channels-last' if is_channels_last(x) else 'contiguous'


def verify(x: Tensor) -> None:
    """ Check the kernels on `x`'s device, dtype and memory layout once per process (`dispatch.SELF_CHECKS` records
    it); raise `KernelError` (on this and every later call, until `set_kernels`) where a kernel fails to build or
    launch there, or a result differs from its torch twin's beyond `TOLERANCE`."""
    checks, key = dispatch.SELF_CHECKS, (str(x.device), x.dtype, _layout(x))
    if key not in checks:
        try:
            checks[key] = _check(x.device, x.dtype, key[2] == 'channels-last')
        except KernelError as failure:
            checks[key] = failure
    failure = checks[key]
    if failure is not None:
        raise failure


def _check(device: torch.device, dtype: torch.dtype, channels_last: bool) -> Optional[KernelError]:
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        for (case, got), (_, want) in zip(run_cases(_triton, device, dtype, channels_last),
                                          run_cases(_torch, device, dtype, channels_last)):
            for name, expected in want.items():
                error = _relative_error(got[name], expected)
                tolerance = TOLERANCE[expected.dtype]
                if not error <= tolerance:  # NaN included
                    layout = 'channels-last' if channels_last else 'contiguous'
                    return KernelError(
                        f'the Triton kernels failed their self-check on {device} ({dtype}, {layout}): '
                        f'{_STEPS[name]} of {case.name} is {error:.3g} from its torch twin, relative to its largest '
                        f'value (tolerance {tolerance:g})')
    return None


def run_cases(kernels, device: torch.device, dtype: torch.dtype, channels_last: bool,
              sizes: Optional[_Sizes] = None) -> Iterator[Tuple[_Case, Dict[str, Tensor]]]:
    """ Each case and its results on the launchers `kernels` (`_triton`, `_torch`), at `sizes` (default: those of
    `device`'s kind); the inputs are drawn from a generator seeded anew each call, so every call computes on the
    same ones."""
    generator = torch.Generator().manual_seed(0)
    sizes = sizes or (GPU_SIZES if device.type == 'cuda' else _INTERPRETER_SIZES)
    for case in _CASES:
        yield case, _layer(kernels, case, *_inputs(case, sizes, generator, device, dtype, channels_last))


def _relative_error(got: Tensor, want: Tensor) -> float:
    got, want = got.float(), want.float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def _random(shape, generator: torch.Generator, device: torch.device, dtype: torch.dtype,
            channels_last: bool = False) -> Tensor:
    x = torch.randn(shape, generator=generator).to(device, dtype)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def _inputs(case: _Case, sizes: _Sizes, generator: torch.Generator, device: torch.device, dtype: torch.dtype,
            channels_last: bool):
    """`(x, weight, affine, grad, grad_x)`: the layer's input and weight, its (bias, gain, post_bias), the gradient of
    its output and the convolution's input gradient that the `dx` update adds to."""
    n, size = (sizes.rows, 1) if case.rows else (sizes.n, sizes.size)
    channels = sizes.channels
    groups = case.groups or channels
    x = _random((n, channels, size, size), generator, device, dtype, channels_last)
    weight = _random((channels, channels // groups, case.kernel_size, case.kernel_size), generator, device, dtype)
    affine = tuple(_random((channels,), generator, device, torch.float32) if wanted else None
                   for wanted in case.affine)
    out_size = (size + 2 * (case.kernel_size // 2) - case.kernel_size) // case.stride + 1
    grad = _random((n, channels, out_size, out_size), generator, device, dtype, channels_last)
    grad_x = _random(x.shape, generator, device, dtype, channels_last)
    return x, weight, affine, grad, grad_x


def _layer(kernels, case: _Case, x: Tensor, weight: Tensor, affine: Tuple[Optional[Tensor], ...], grad: Tensor,
           grad_x: Tensor) -> Dict[str, Tensor]:
    """A patchnorm map's forward and backward as the ops compose them (`passes`), on the launchers `kernels`."""
    bias, gain, post_bias = affine
    geometry = ([case.stride] * 2, [case.kernel_size // 2] * 2, [1, 1])
    groups = case.groups or x.shape[1]
    c = weight[0].numel() + 1
    y = torch.ops.aten.convolution(x, weight, None, *geometry, False, [0, 0], groups)
    out, b = conv_output(kernels, x, y, weight, bias, gain, post_bias, *geometry, groups, c, 1., case.act)
    grad_y, t, partials = kernels.scale_backward(
        grad, y, b, post_bias, case.act, post_bias is not None, gain=gain, gain_grad=gain is not None, bias=bias,
        bias_grad=bias is not None)
    grad_x = grad_x.clone()
    sums = add_norm_grad(kernels, grad_x, x, t, weight.shape[2:], *geometry, c, partials)
    return dict(b=b, out=out, t=t, grad_y=grad_y, grad_x=grad_x, sums=sums)
