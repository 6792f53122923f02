#!/usr/bin/env python3
""" Predicted GPU time of one train step and one inference step, native norm against patchnorm (its Triton path and
its torch path), from a roofline model of every kernel a step launches, traced on the CPU without arithmetic

The trace: a step (train: forward, cross-entropy, backward, SGD with momentum as `bench_gpu.py` runs it, after a
warm-up step; inference: a forward under `no_grad`) runs under `FakeTensorMode`, with a real step's shapes, strides
and dtypes and nothing computed. Autocast follows CUDA's rules (ATen's `autocast_mode.h` lists, installed over the
CPU's autocast kernels: `CudaAutocast`). A `TorchDispatchMode` prices every ATen operation below autograd; the Triton
path's custom ops run their bodies, whose launchers record each launch with its arguments.

A launch reads each tensor argument once and writes each output once, as many bytes as its view's elements (a
broadcast dimension counts once; a view whose innermost stride is not 1 costs whole 32-byte sectors); `RULES` gives
each ATen operation's launches, bytes and FLOPs. Operations CUDA runs as several kernels (BatchNorm's passes, a
convolution's backward GEMMs, LayerNorm's backward, a foreach update per 48 tensors) are priced as those kernels. A
k x k box filter inside a Triton pass reads its map once and issues `taps` loads per element (`Gpu.issue_rate`).

A launch takes max(bytes / (bandwidth x fraction), FLOPs / (peak x fraction), instructions / issue rate) plus a
floor, and a step the longer of the GPU's sum and the CPU's, which issues the launches ahead (`CPU_COSTS`). The
parameters and their sources are in `GPUS`, `FRACTIONS` and `CPU_COSTS`. Every figure printed is predicted, but for
`--calibration`'s H200 measurements (scripts/data/h200-2026-12-04); `--table-only` prints a `--json` record's tables.

    python scripts/gpu_model.py                                 # resnet50, convnext_tiny: H100 and H200, CL and NCHW
    python scripts/gpu_model.py --models resnet50 --gpus h200 --layouts channels_last --json model.json
    python scripts/gpu_model.py --json model.json --table-only  # the record's tables, nothing traced
    python scripts/gpu_model.py --calibration --top 12          # torch path beside the H200 measurements
"""
import collections
import contextlib
import dataclasses
import functools
import io
import json
import math
import pathlib
import statistics
import sys
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import flop_registry

import timm_affinediv  # noqa: F401  registers norm_layer='patchnorm'
from timm_affinediv._torch_compat import (
    FakeTensorMode,
    TorchDispatchMode,
    custom_op_body,
    custom_op_overload,
    destroy_library,
    dispatch_key_excluded,
    has_kernel,
    is_view,
    lookup_device_info,
    op_schema,
    ops_with_kernel,
    tree_flatten,
)
from timm_affinediv.cli import positive_int, run_main
from timm_affinediv.commands import command_parser
from timm_affinediv.files import atomic_write

aten = torch.ops.aten


# --- the GPUs and the model's parameters --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Gpu:
    """A GPU's datasheet figures: HBM bandwidth (B/s), dense tensor-core peaks and the CUDA cores' float32 peak
    (FLOP/s), and the rate at which its SMs issue instructions (SMs x 4 schedulers x 32 lanes x boost clock)."""
    name: str
    bandwidth: float
    bf16_peak: float
    tf32_peak: float
    fp32_peak: float
    issue_rate: float
    source: str


def _hopper(name: str, bandwidth: float, source: str) -> Gpu:
    """An SXM Hopper: torch's datasheet row of the H100 (inductor's `device_info`, whose tensor-core figures are
    with 2:4 sparsity: halved here) and 132 SMs at 1.98 GHz, with the card's HBM bandwidth."""
    row = lookup_device_info('NVIDIA H100')
    dense = 1. / row.tops_sparsity_factor
    return Gpu(name, bandwidth, row.tops[torch.bfloat16] * dense * 1e12, row.tops['torch.tf32'] * dense * 1e12,
               row.tops[torch.float32] * 1e12, 132 * 4 * 32 * 1.98e9, source)


GPUS: Dict[str, Gpu] = {
    'h100': _hopper('H100 SXM', 3.35e12, 'NVIDIA H100 datasheet (torch device_info row): 3.35 TB/s, 989 TFLOPS bf16 '
                    'dense, 67 TFLOPS fp32; 132 SMs, 1.98 GHz'),
    'h200': _hopper('H200 SXM', 4.8e12, 'NVIDIA H200 datasheet: 4.8 TB/s HBM3e, the H100 SXM\'s GH100 compute (989 '
                    'TFLOPS bf16 dense, 67 TFLOPS fp32, 132 SMs)'),
}

#: The fraction of a peak each kind of kernel reaches (`engine` of a launch): bytes at `bandwidth x fraction`,
#: FLOPs at `peak x fraction`. "The H200 profile(s)": `prof_*.txt` in `H200_DATA`.
FRACTIONS: Dict[str, Tuple[float, str]] = {
    'stream': (0.9, (
        "vectorised elementwise kernels (all operands in one layout): 89.7% of spec for quack's softmax on an "
        'H100 (Dao-AILab/quack membound-sol); 0.92 measured for the residual adds of the H200 profile')),
    'strided': (0.27, (
        'elementwise kernels TensorIterator cannot vectorise (a broadcast operand, operands in different '
        'layouts): 0.24-0.32 of bandwidth in the patchnorm ResNet-50 profile (div 153 us, masked_fill_ 90 us, '
        'threshold_backward 100.5 us a call, the last against 35.8 us natively on the same sizes)')),
    'reduce': (0.65, (
        'reductions along the innermost dimension (sums, norms, softmax over rows): 60-70% of bandwidth '
        '(quack blog)')),
    'reduce_outer': (0.27, (
        'reductions across rows, the innermost dimension kept (bias gradients, channel sums of channels-last '
        'maps): reduce_kernel<128, 4> on bfloat16, 57.4 us a call in the H200 ConvNeXt profile')),
    'layer_norm': (0.145, (
        "LayerNorm's forward on rows of 96-768 floats (vectorized_layer_norm_kernel<float>, one row a block): "
        '4.45 ms a step in the H200 ConvNeXt profile')),
    'layer_norm_backward': (0.38, (
        "LayerNorm's backward (layer_norm_grad_input_kernel_vectorized, 2.44 ms a step; GammaBetaBackward, "
        '1.78 ms)')),
    'bn_statistics': (0.135, (
        "BatchNorm's statistics kernel (batch_norm_collect_statistics_channels_last): 4.61 ms a step in the "
        'H200 profile on the 0.60 GB this model counts for it')),
    'bn_transform': (0.56, (
        "BatchNorm's normalising pass (batch_norm_transform_input_channels_last): 2.32 ms a step")),
    'bn_backward_reduce': (0.46, (
        "BatchNorm's backward reduction (batch_norm_backward_reduce_channels_last): 2.76 ms a step")),
    'bn_backward_elementwise': (0.64, (
        "BatchNorm's backward elementwise pass (batch_norm_backward_elemt_channels_last): 2.94 ms a step")),
    'transpose': (0.45, (
        "cuDNN's layout transposes of NCHW activations (nchwToNhwcKernel): fitted to the native NCHW "
        'ResNet-50 inference step on the H200 (25.1 ms against 16.5 ms channels-last); no profile of an NCHW '
        'step exists')),
    'pool': (0.25, (
        "max pooling's forward and backward (one each in ResNet): 0.42 and 0.91 ms in the H200 profile")),
    'gemm': (0.55, (
        "cuDNN's and cuBLAS's convolutions and GEMMs of the native ResNet-50 train step in the H200 profile: "
        'forward 3.08 ms, backward 5.51 ms a step')),
    'depthwise': (0.17, (
        "cuDNN's bfloat16 depthwise 7x7 forward (ConvNeXt) on CUDA cores: conv2d_c1_k1_nhwc_specialized, "
        '131.5 us a call in the H200 profile')),
    'depthwise_dgrad': (0.084, (
        'its data gradient: dgrad2d_c1_k1_nhwc_specialized, 267.6 us a call')),
    'depthwise_wgrad': (0.23, (
        'its weight gradient: wgrad2d_c1_k1_nhwc, 96.1 us a call')),
    'depthwise_fp32': (0.072, (
        "a float32 depthwise 7x7 convolution (the torch path's box filter): conv2d_c1_k1_nhwc, 311 us a call "
        'in the patchnorm ConvNeXt profile')),
    'gemv': (0.25, (
        'matrix-vector products (a matrix product with a dimension of 1): cuBLAS gemvx kernels, 2.73 ms a '
        'step in the patchnorm ResNet-50 profile')),
    'batched_dot': (0.08, (
        'batched products of 1 x K by K x 1 matrices (row dot products): aten::bmm, 167-177 us a call in the '
        'patchnorm profiles')),
    'triton': (0.85, (
        'the fused kernels (not yet run on a GPU): the bar set for them (docs/results/performance.md), 85% of '
        'bandwidth, an assumption until measured')),
    'issue': (0.5, (
        'instruction issue of the fused kernels: half of one instruction a scheduler per clock (loads, '
        'integer index arithmetic and masks share the issue slots), an assumption')),
}

FLOOR_S = 3e-6  # a launch's own cost on the GPU: ~1 us the shortest kernel, ~2 us between kernels (H200 profile)

#: CPU time per operation (s) where it differs from `default`, from the H200 profile's CPU time per call (with the
#: profiler's own cost in it) and the sources named.
CPU_COSTS: Dict[str, float] = {
    'default': 10e-6,  # an ATen op with autograd on: 5-10 us (pytorch/pytorch#41383); 12-20 us a call in the profile
    'convolution': 52e-6,  # aten::cudnn_convolution, 52 us a call (cuDNN's plan lookup)
    'convolution_backward': 125e-6,  # 125 us a call
    'native_batch_norm': 92e-6,  # 92 us a call
    'native_batch_norm_backward': 97e-6,  # 97 us a call
    'custom_op': 30e-6,  # a torch.library custom op called from Python (autograd Function, Python kernel): assumed
    'triton_launch': 5.6e-6,  # Triton's launcher, 4.7-5.6 us a kernel (meta-pytorch/tritonbench#1017)
}

#: The H200 measurements the model is calibrated on, in the repository with how they were taken (its README): the
#: torch path's eager steps (torch 2.11, bf16 autocast, 224 px, batch 128 train / 256 inference), one file a layout,
#: and the profiles the fractions and CPU costs are read from (`prof_*.txt`).
H200_DATA = pathlib.Path(__file__).resolve().parent / 'data' / 'h200-2026-12-04'
H200_RESULTS = {'channels_last': 'results-2026-12-04-h200.jsonl', 'nchw': 'results-2026-12-04-h200-nchw.jsonl'}


def measured_steps(folder: pathlib.Path = H200_DATA) -> Dict[Tuple[str, str, str], Tuple[float, float]]:
    """ Seconds a step of the measured eager configurations, native and patchnorm (the median of each one's timed
    rounds, as `bench_gpu.py` takes it), by (model, step, layout): channels-last first, then each model in the
    files' order, train before inference."""
    rows = []
    for layout, name in H200_RESULTS.items():
        for line in (folder / name).read_text().splitlines():
            record = json.loads(line)
            if record['part'] == 'eager':
                mode = 'inference' if record['mode'] == 'infer' else 'train'
                rows.append(((record['model'], mode, layout),
                             tuple(statistics.median(record['rounds'][norm]) for norm in ('native', 'patchnorm'))))
    models = list(dict.fromkeys(key[0] for key, _ in rows))
    layouts = list(H200_RESULTS)
    rows.sort(key=lambda row: (layouts.index(row[0][2]), models.index(row[0][0]), row[0][1] != 'train'))
    return dict(rows)


MEASURED_H200 = measured_steps()


# --- CUDA's autocast on CPU tensors -------------------------------------------------------------------------------

#: ATen's CUDA autocast policy (aten/src/ATen/autocast_mode.h: AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32,
#: AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_PROMOTE), by operator overload.
CUDA_AUTOCAST: Dict[str, Tuple[str, ...]] = {
    'lower': (
        '_convolution.deprecated', '_convolution', 'conv1d', 'conv2d', 'conv3d', 'conv_tbc', 'conv_transpose1d',
        'conv_transpose2d.input', 'conv_transpose3d.input', 'convolution', 'prelu', 'addmm', 'addmv', 'addr',
        'matmul', 'einsum', 'mm', 'mv', 'linalg_vecdot', 'linear', 'addbmm', 'baddbmm', 'bmm', 'chain_matmul',
        'linalg_multi_dot', '_thnn_fused_lstm_cell', '_thnn_fused_gru_cell', 'lstm_cell', 'gru_cell',
        'rnn_tanh_cell', 'rnn_relu_cell', '_scaled_dot_product_flash_attention', 'scaled_dot_product_attention'),
    'fp32': (
        'acos', 'asin', 'cosh', 'erfinv', 'exp', 'expm1', 'log', 'log10', 'log2', 'log1p', 'reciprocal', 'rsqrt',
        'sinh', 'tan', 'pow.Tensor_Scalar', 'pow.Tensor_Tensor', 'pow.Scalar', 'softplus', 'layer_norm',
        'native_layer_norm', 'group_norm', 'frobenius_norm.dim', 'nuclear_norm', 'nuclear_norm.dim',
        'cosine_similarity', 'poisson_nll_loss', 'cosine_embedding_loss', 'nll_loss', 'nll_loss2d',
        'hinge_embedding_loss', 'kl_div', 'l1_loss', 'smooth_l1_loss', 'huber_loss', 'mse_loss', 'margin_ranking_loss',
        'multilabel_margin_loss', 'soft_margin_loss', 'triplet_margin_loss', 'multi_margin_loss',
        'binary_cross_entropy_with_logits', 'dist', 'pdist', 'cdist', 'renorm', 'logsumexp', 'upsample_nearest1d',
        '_upsample_nearest_exact1d', 'upsample_nearest2d', '_upsample_nearest_exact2d', 'upsample_nearest3d',
        '_upsample_nearest_exact3d', 'upsample_linear1d', 'upsample_bilinear2d', '_upsample_bilinear2d_aa',
        'upsample_trilinear3d', 'upsample_bicubic2d', '_upsample_bicubic2d_aa'),
    'fp32_set_opt_dtype': (
        'prod', 'prod.dim_int', 'softmax.int', 'log_softmax.int', 'cumprod', 'cumsum', 'linalg_vector_norm',
        'linalg_matrix_norm', 'linalg_matrix_norm.str_ord', 'sum', 'sum.dim_IntList'),
    'promote': ('addcdiv', 'addcmul', 'atan2', 'bilinear', 'cross', 'dot', 'vdot', 'grid_sampler', 'index_put',
                'tensordot', 'scatter_add'),
}


def _overload(name: str):
    base, _, overload = name.partition('.')
    return getattr(getattr(aten, base), overload or 'default')


def autocast_ops(key: str) -> List[str]:
    """The ATen operators with a kernel for the dispatch key `key` (`AutocastCPU`, `AutocastCUDA`) in this build."""
    return sorted(name[len('aten::'):] for name in ops_with_kernel(key) if name.startswith('aten::'))


class CudaAutocast:
    """ CUDA's autocast policy in force for CPU tensors, as Python kernels of the `AutocastCPU` key: the CPU's own
    lists differ (it runs LayerNorm, sums and norms in bfloat16 where CUDA runs them in float32, and casts
    cross-entropy to float32 where CUDA casts only its log-softmax), and a CPU trace has to cast as a GPU does.

    Operators in `CUDA_AUTOCAST` cast as CUDA casts them (`lower`: float tensors to the autocast dtype, a float32
    leaf that requires grad once per autocast region, as CUDA caches it; `fp32`: to float32; `fp32_set_opt_dtype`:
    a dtype of float32 where none is given; `promote`: to the widest float dtype among them); the operators the CPU
    casts and CUDA does not run as they are.
    """

    def __init__(self):
        self._cache: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._library: Optional[torch.library.Library] = None

    def __enter__(self) -> 'CudaAutocast':
        import warnings
        self._library = torch.library.Library('aten', 'IMPL')
        policy = {name: kind for kind, names in CUDA_AUTOCAST.items() for name in names}
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')  # "overriding a previously registered kernel": the point here
            for name in sorted(set(policy) | set(autocast_ops('AutocastCPU'))):
                if name in policy or has_kernel(f'aten::{name}', 'AutocastCPU'):
                    op = _overload(name)
                    self._library.impl(name, self._kernel(op, policy.get(name)), 'AutocastCPU')
        return self

    def __exit__(self, *exc) -> None:
        destroy_library(self._library)
        self._library = None
        self._cache.clear()

    def new_region(self) -> None:
        """Forget the cached weight casts, as leaving an autocast region does."""
        self._cache.clear()

    def _cast(self, value, dtype: torch.dtype):
        if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64
                and value.dtype != dtype):
            return value
        cacheable = dtype != torch.float32 and value.dtype == torch.float32 and value.requires_grad and \
            value.is_leaf and not is_view(value)
        if cacheable and id(value) in self._cache:
            return self._cache[id(value)][1]
        cast = value.to(dtype)
        if cacheable:
            self._cache[id(value)] = (value, cast)
        return cast

    def _kernel(self, op, kind: Optional[str]) -> Callable:
        dtype_index = next((i for i, a in enumerate(op_schema(op).arguments) if a.name == 'dtype'), None)

        def cast_all(args, kwargs, dtype):
            def cast(value):
                if isinstance(value, (list, tuple)):
                    return [self._cast(t, dtype) for t in value]
                return self._cast(value, dtype)
            return [cast(a) for a in args], {k: cast(v) for k, v in kwargs.items()}

        def kernel(*args, **kwargs):
            if kind == 'lower':
                args, kwargs = cast_all(args, kwargs, torch.get_autocast_dtype('cpu'))
            elif kind == 'fp32':
                args, kwargs = cast_all(args, kwargs, torch.float32)
            elif kind == 'fp32_set_opt_dtype':
                first = args[0]
                if first.is_floating_point() and first.dtype != torch.float64:
                    if dtype_index is not None and len(args) > dtype_index:
                        args = [*args[:dtype_index], args[dtype_index] or torch.float32, *args[dtype_index + 1:]]
                    elif kwargs.get('dtype') is None:
                        kwargs = {**kwargs, 'dtype': torch.float32}
            elif kind == 'promote':
                floats = [t for t in tree_flatten((args, kwargs))[0]
                          if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64]
                widest = torch.float32 if any(t.dtype == torch.float32 for t in floats) else \
                    torch.get_autocast_dtype('cpu')
                args, kwargs = cast_all(args, kwargs, widest)
            with dispatch_key_excluded('AutocastCPU'):
                return op(*args, **kwargs)
        return kernel


# --- launches and what they move ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Launch:
    """ One kernel (or `count` alike) as the model prices it: `engine` names the fraction of peak it reaches
    (`FRACTIONS`), `kind` the layer it belongs to, `phase` forward, backward or optimizer."""
    op: str
    engine: str
    read: int
    written: int
    flops: float = 0.
    instructions: float = 0.
    math: str = 'bf16'
    count: int = 1
    cpu: float = 0.
    bound: int = 0
    kind: str = ''
    phase: str = ''

    @property
    def bytes(self) -> int:
        return self.read + self.written


SECTOR = 32  # bytes a DRAM access moves at least


def dram_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel moves to read or write `t` once: its view's elements (a broadcast dimension once), in whole
    32-byte sectors where its innermost stride is not 1."""
    elements, innermost = 1, None
    for size, stride in zip(t.shape, t.stride()):
        if size > 1 and stride != 0:
            elements *= size
            innermost = abs(stride) if innermost is None else min(innermost, abs(stride))
    waste = 1 if innermost in (None, 1) else min(innermost, max(1, SECTOR // t.element_size()))
    return elements * t.element_size() * waste


def _tensors(value) -> List[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _dim_order(t: torch.Tensor) -> Tuple[int, ...]:
    """The dimensions of size > 1 from the outermost stride in: a layout."""
    dims = [d for d in range(t.dim()) if t.shape[d] > 1]
    return tuple(sorted(dims, key=lambda d: -t.stride(d)))


def _layout_engine(operands: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> str:
    """ 'stream' where TensorIterator runs a vectorised kernel: every operand of more than one element has the
    output's shape and layout and is dense. Otherwise ('strided': a broadcast operand, operands in different layouts)
    it runs `elementwise_kernel`, which computes each operand's offset from the index dimension by dimension."""
    if not out:
        return 'stream'
    shape, order = out[0].shape, _dim_order(out[0])
    for t in [*out, *operands]:
        if t.numel() > 1 and (t.shape != shape or _dim_order(t) != order or not _dense(t)):
            return 'strided'
    return 'stream'


def _reduce_engine(x: torch.Tensor, out: torch.Tensor) -> str:
    """'reduce' for a reduction along `x`'s innermost dimension, 'reduce_outer' for one that keeps it (each output
    sums a strided column)."""
    order = _dim_order(x)
    if not order or out.numel() <= 1:
        return 'reduce'
    innermost = order[-1]
    kept = out.dim() == x.dim() and out.shape[innermost] == x.shape[innermost] or \
        out.numel() % x.shape[innermost] == 0 and out.numel() >= x.shape[innermost] and out.dim() < x.dim() and \
        x.shape[innermost] in out.shape
    return 'reduce_outer' if kept else 'reduce'


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill its memory without gaps (in some order of its dimensions)."""
    expected = 1
    for d in reversed(_dim_order(t)):
        if t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


# operations that launch nothing on a GPU: views, allocations, metadata
FREE = {
    'detach', 'view', '_unsafe_view', 't', 'transpose', 'permute', 'expand', 'as_strided', 'unsqueeze', 'squeeze',
    'slice', 'select', 'alias', '_reshape_alias', 'reshape', 'empty', 'new_empty', 'lift_fresh', 'empty_like',
    'empty_strided', 'new_empty_strided', 'detach_', 'split', 'split_with_sizes', 'unbind', 'chunk', 'narrow',
    'view_as', 'expand_as', 'unflatten', 'flatten', 'movedim', 'diagonal', 'unfold', 'as_strided_', 'squeeze_',
    'unsqueeze_', 'is_same_size', 'promote_types', 'result_type', 'sym_size', 'sym_stride', 'sym_numel',
    'sym_storage_offset', '_local_scalar_dense', 'item', 'resize_', 'set_', 'device', '_to_copy_free', 'lift',
    '_record_function_enter_new', '_record_function_exit', 'record_stream', 'is_nonzero', 'equal', 'dim'}
REDUCTIONS = {
    'sum', 'mean', 'amax', 'amin', 'max', 'min', 'linalg_vector_norm', 'norm', 'var', 'var_mean', 'std', 'prod',
    'any', 'all', '_log_softmax', '_softmax', '_log_softmax_backward_data', '_softmax_backward_data',
    'nll_loss_forward', 'nll_loss_backward', 'native_group_norm', 'linalg_vecdot', 'logsumexp'}
GEMMS = {'mm', 'addmm', 'bmm', 'baddbmm', 'addmm_', 'addbmm', 'mv', 'addmv', 'addmv_', 'dot', 'linear', 'matmul'}
POOLS = {'max_pool2d_with_indices', 'max_pool2d_with_indices_backward'}
ACTIVATIONS = {'relu', 'relu_', 'gelu', 'gelu_', 'silu', 'silu_', 'threshold_backward', 'gelu_backward',
               'silu_backward', 'hardswish', 'hardswish_backward', 'clamp_min', 'clamp_min_'}
CASTS = {'_to_copy', 'copy_', 'clone', 'contiguous'}
FILLS = {'copy_', 'fill_', 'zero_', 'new_zeros', 'zeros', 'zeros_like', 'ones_like', 'full', 'new_full', 'full_like',
         'scalar_tensor', 'ones', 'masked_fill_', 'index_put_'}


def op_name(func) -> str:
    """An operator's name without its namespace and overload: `convolution` for `aten::convolution.default`."""
    return op_schema(func).name.split('::')[-1]


def _gemm_flops(func, args, kwargs, out) -> float:
    """FLOPs of a matrix product or convolution: torch's `flop_registry`, with the few it lacks."""
    name = op_name(func)
    if name in ('mv', 'addmv', 'addmv_'):
        matrix = args[0] if name == 'mv' else args[1]
        return 2. * matrix.numel()
    if name == 'addmm_':
        return 2. * args[1].shape[0] * args[1].shape[1] * args[2].shape[1]
    if name == 'dot':
        return 2. * args[0].numel()
    if name in ('linear', 'matmul'):  # seen whole inside a custom op's body, below autograd
        return 2. * out.numel() * args[0].shape[-1]
    formula = flop_registry.get(func.overloadpacket)
    return float(formula(*args, **kwargs, out_val=out)) if formula else 0.


def _math(tensors: Sequence[torch.Tensor]) -> str:
    return 'fp32' if any(t.dtype == torch.float32 for t in tensors if t.is_floating_point()) else 'bf16'


def conv_flops(grad_or_out: torch.Tensor, weight: torch.Tensor) -> float:
    """FLOPs of a convolution's GEMM (its forward, or either gradient): 2 x output elements x the weight's fan-in,
    `2 N C_out H_out W_out (C_in / groups) k_h k_w`."""
    return 2. * grad_or_out.numel() * weight[0].numel()


def _conv_launches(name: str, operands: Sequence[torch.Tensor], out: torch.Tensor, x: torch.Tensor,
                   weight: torch.Tensor, flops: float, groups: int) -> List[Launch]:
    """ One GEMM of a convolution (forward, data gradient or weight gradient) reading `operands` and writing `out`:
    on tensor cores, a depthwise one on CUDA cores. cuDNN runs a k x k map of NCHW activations `x` on transposed
    copies (its tensor-core kernels take NHWC): each activation operand and the output pay a transpose (read and
    write)."""
    depthwise = groups > 1 and weight.shape[1] == 1
    engine = 'gemm'
    if depthwise:
        engine = 'depthwise_fp32' if x.dtype == torch.float32 else 'depthwise' + {
            'convolution': '', 'convolution_backward:input': '_dgrad', 'convolution_backward:weight': '_wgrad'}[name]
    launches = [Launch(name, engine, sum(map(dram_bytes, operands)), dram_bytes(out), flops,
                       math='fp32' if depthwise else ('tf32' if x.dtype == torch.float32 else 'bf16'))]
    nchw = x.shape[1] > 1 and x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last)
    if nchw and not depthwise:
        activations = [t for t in (*operands, out) if t.dim() == 4 and t is not weight and t.shape[0] == x.shape[0]]
        launches += [Launch('nchw_to_nhwc', 'transpose', dram_bytes(t), dram_bytes(t)) for t in activations]
    return launches


class Op:
    """ One ATen operation as a cost rule sees it: its name, overload, arguments and result, and the tensors it reads
    (`ins`, every tensor argument) and writes (`outs`)."""

    def __init__(self, func, args: tuple, kwargs: dict, out):
        self.name, self.func, self.args, self.kwargs, self.out = op_name(func), func, args, kwargs, out

    @functools.cached_property
    def ins(self) -> List[torch.Tensor]:
        return _tensors((self.args, self.kwargs))

    @functools.cached_property
    def outs(self) -> List[torch.Tensor]:
        return _tensors(self.out)


def moved(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes a kernel moves to read (or write) each of `tensors` once."""
    return sum(dram_bytes(t) for t in tensors)


def _free(op: Op) -> List[Launch]:
    return []


def _batch_norm(op: Op) -> List[Launch]:
    """Inference: the transform pass; training: the statistics pass, the running stats' update, then the transform."""
    x, training, ins, outs = op.args[0], op.args[5], op.ins, op.outs
    transform = Launch(op.name + ':transform', 'bn_transform', moved([x]) + moved(ins[1:3]), dram_bytes(outs[0]))
    if not training:
        return [transform]
    stats = Launch(op.name + ':statistics', 'bn_statistics', dram_bytes(x), moved(outs[1:]))
    update = Launch(op.name + ':running stats', 'stream', moved(ins[3:5]) * 2, moved(ins[3:5]))
    return [stats, update, transform]


def _batch_norm_backward(op: Op) -> List[Launch]:
    """A reduction pass (the parameters' gradients) and an elementwise pass (the input's), each reading `g` and `x`."""
    g, x = op.args[0], op.args[1]
    return [Launch(op.name + ':reduce', 'bn_backward_reduce', dram_bytes(g) + dram_bytes(x), moved(op.outs[1:])),
            Launch(op.name + ':elementwise', 'bn_backward_elementwise', dram_bytes(g) + dram_bytes(x),
                   dram_bytes(op.outs[0]))]


def _layer_norm(op: Op) -> List[Launch]:
    return [Launch(op.name, 'layer_norm', moved(op.ins), moved(op.outs))]


def _layer_norm_backward(op: Op) -> List[Launch]:
    """The input-gradient kernel and the parameter-gradient kernel, each reading `g` and `x`."""
    g, x = op.args[0], op.args[1]
    parameter_grads = [t for t in op.outs[1:] if t is not None]
    return [Launch(op.name + ':input', 'layer_norm_backward', dram_bytes(g) + dram_bytes(x), dram_bytes(op.outs[0])),
            Launch(op.name + ':parameters', 'layer_norm_backward', dram_bytes(g) + dram_bytes(x),
                   moved(parameter_grads))]


def _convolution(op: Op) -> List[Launch]:
    x, weight, groups = op.args[0], op.args[1], op.args[8]
    return _conv_launches(op.name, [x, weight], op.out, x, weight, conv_flops(op.out, weight), groups)


def _convolution_backward(op: Op) -> List[Launch]:
    """The data-gradient and weight-gradient GEMMs, and the bias gradient's reduction, as the output mask asks."""
    g, x, weight, mask, groups = op.args[0], op.args[1], op.args[2], op.args[10], op.args[9]
    flops, launches, out = conv_flops(g, weight), [], op.out
    if mask[0]:
        launches += _conv_launches(op.name + ':input', [g, weight], out[0], x, weight, flops, groups)
    if mask[1]:
        launches += _conv_launches(op.name + ':weight', [g, x], out[1], x, weight, flops, groups)
    if mask[2]:
        launches.append(Launch(op.name + ':bias', _reduce_engine(g, out[2]), dram_bytes(g), dram_bytes(out[2])))
    return launches


def _foreach(op: Op) -> List[Launch]:
    """One launch per 48 tensors of the lists; an in-place one writes its first list."""
    lists = [a for a in op.args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    written = moved(lists[0]) if op.name.endswith('_') else moved(op.outs)
    return [Launch(op.name, 'stream', moved([t for lst in lists for t in lst]), written,
                   count=math.ceil(len(lists[0]) / 48))]


def _fill(op: Op) -> List[Launch]:
    """A fill writes its output; a copy or a masked write also reads its source (a broadcast one is unvectorised)."""
    sources = [t for t in op.ins[1:] if t.numel() > 1] if op.name in ('copy_', 'masked_fill_', 'index_put_') else []
    return [Launch(op.name, _layout_engine(sources, op.outs[:1]) if sources else 'stream', moved(sources),
                   dram_bytes(op.outs[0]) if op.outs else 0)]


def _flash_attention(op: Op) -> List[Launch]:
    """The CPU's flash attention stands for CUDA's kernel: 4 FLOPs a query-key pair and channel, 2.5x in backward."""
    backward = op.name.endswith('_backward')
    q, k = op.args[1:3] if backward else op.args[:2]
    flops = 4. * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
    return [Launch(op.name, 'gemm', moved(op.ins), moved(op.outs), flops * (2.5 if backward else 1.))]


def _gemm(op: Op) -> List[Launch]:
    """A matrix product on tensor cores; one with a dimension of 1 as the matrix-vector or row-dot kernel it is."""
    unit = any(1 in t.shape[-2:] for t in op.ins if t.dim() >= 2)
    engine = 'gemm'
    if op.name in ('bmm', 'baddbmm') and unit:
        engine = 'batched_dot'
    elif op.name in ('mv', 'addmv', 'addmv_', 'dot') or unit:
        engine = 'gemv'
    return [Launch(op.name, engine, moved(op.ins), moved(op.outs), _gemm_flops(op.func, op.args, op.kwargs, op.out),
                   math=_math(op.ins))]


def _pool(op: Op) -> List[Launch]:
    return [Launch(op.name, 'pool', moved(op.ins), moved(op.outs))]


def _reduction(op: Op) -> List[Launch]:
    return [Launch(op.name, _reduce_engine(op.ins[0], op.outs[0]), moved(op.ins), moved(op.outs))]


def _elementwise(op: Op) -> List[Launch]:
    """Reads every tensor argument, writes its outputs (an in-place operation without one writes its first)."""
    arguments = op_schema(op.func).arguments
    inplace = arguments and arguments[0].alias_info is not None and arguments[0].alias_info.is_write
    written = moved(op.outs) if op.outs else (dram_bytes(op.ins[0]) if inplace else 0)
    return [Launch(op.name, _layout_engine(op.ins, op.outs), moved(op.ins), written)]


Rule = Callable[[Op], List[Launch]]

#: The kernels each ATen operation launches, by its name: an operation's price is its rule. Operations named by a
#: prefix of `PREFIX_RULES` take its rule, other `*_backward_data` ones are reductions, and the rest elementwise
#: kernels (`_elementwise`); a view launches nothing whatever its name.
RULES: Dict[str, Rule] = {
    **dict.fromkeys(FREE, _free),
    'native_batch_norm': _batch_norm,
    'native_batch_norm_backward': _batch_norm_backward,
    'native_layer_norm': _layer_norm,
    'native_layer_norm_backward': _layer_norm_backward,
    'convolution': _convolution,
    'convolution_backward': _convolution_backward,
    **dict.fromkeys(FILLS, _fill),
    **dict.fromkeys(GEMMS, _gemm),
    **dict.fromkeys(POOLS, _pool),
    **dict.fromkeys(REDUCTIONS, _reduction),
}
PREFIX_RULES: Tuple[Tuple[str, Rule], ...] = (
    ('_foreach_', _foreach), ('_scaled_dot_product_flash_attention', _flash_attention))


def cost_rule(name: str) -> Rule:
    """The rule that prices the ATen operation `name` (see `RULES`)."""
    rule = RULES.get(name) or next((rule for prefix, rule in PREFIX_RULES if name.startswith(prefix)), None)
    if rule is not None:
        return rule
    return _reduction if name.endswith('_backward_data') else _elementwise


def aten_launches(func, args, kwargs, out) -> List[Launch]:
    """The kernels a GPU launches for one ATen operation, with what each moves (see the module's docstring)."""
    if func.is_view:
        return []
    op = Op(func, args, kwargs, out)
    return cost_rule(op.name)(op)


# --- the Triton launches ------------------------------------------------------------------------------------------

def _map_bytes(n: int, groups: int, positions: int) -> int:
    return n * groups * positions * 4  # the float32 maps (q, b, t), one channel per group


def _affine_bytes(named: Dict, constexprs: Dict, channels: int) -> int:
    """The per-channel bias, gain and post-bias a launch reads, those its constants say it has."""
    return sum(channels * named[p].element_size() for p, flag in (
        ('bias_ptr', 'HAS_BIAS'), ('gain_ptr', 'HAS_GAIN'), ('pb_ptr', 'HAS_PB')) if constexprs[flag])


def _channel_sq_norm(named: Dict, constexprs: Dict) -> Tuple[int, int, float]:
    """Reads `x`, writes the group's float32 map."""
    x = named['x_ptr']
    n, _, h, w = x.shape
    return dram_bytes(x), _map_bytes(n, named['G'], h * w), 0.


def _scale(named: Dict, constexprs: Dict) -> Tuple[int, int, float]:
    """ The output pass (or the `dx` update): reads `y`, the affine, `base` if any and the map (or, with a box
    filter, the norms' source once, its window's taps issued as instructions); writes the output, the map if it
    stores it, and the parameters' gradients if it sums them."""
    y = named['y_ptr']
    n, c, h, w = y.shape
    groups, positions = named['G'], h * w
    read, written = dram_bytes(y), dram_bytes(named['out_ptr'])
    read += _affine_bytes(named, constexprs, c)
    if constexprs['HAS_BASE']:
        read += dram_bytes(named['base_ptr'])
    instructions = 0.
    if constexprs['BOX'] == 0:
        read += _map_bytes(n, groups, positions)
    else:
        read += dram_bytes(named['b_ptr'])
        instructions = box_instructions(y.numel(), constexprs['BOX'], constexprs['KH'], constexprs['KW'],
                                        constexprs.get('ONE_GROUP', False))
    if constexprs['STORE_M']:
        written += _map_bytes(n, groups, positions)
    if constexprs['SUM']:
        read += named['part_ptr'].numel() * 4
        written += named['sums_ptr'].numel() * 4
    return read, written, instructions


def _box_filter(named: Dict, constexprs: Dict) -> Tuple[int, int, float]:
    """A window's rows (its first pass): reads the map, writes the rows' float32 map."""
    r = named['r_ptr']
    return dram_bytes(named['map_ptr']), dram_bytes(r), box_instructions(
        r.numel(), 'rows', constexprs['KH'], constexprs['KW'], False)


def _scale_backward(named: Dict, constexprs: Dict) -> Tuple[int, int, float]:
    """ The backward pass: reads the gradient, `y`, the map and the affine; writes `dL/dy`, `t` and the partial sums
    (a grouped tile long in channels carries `t` over its blocks of channels: a read and a write a block more)."""
    g, y = named['g_ptr'], named['y_ptr']
    n, c, h, w = y.shape
    groups, positions = named['G'], h * w
    read = dram_bytes(g) + dram_bytes(y) + _map_bytes(n, groups, positions)
    read += _affine_bytes(named, constexprs, c)
    written = dram_bytes(named['gy_ptr']) + _map_bytes(n, groups, positions)
    if constexprs['GROUPED'] and not constexprs['UNITS_OUTER']:
        blocks = math.ceil(named['CPG'] / constexprs['BC'])
        read += _map_bytes(n, groups, positions) * (blocks - 1)
        written += _map_bytes(n, groups, positions) * (blocks - 1)
    partial_rows = sum(constexprs[f] for f in ('WRITE_PB', 'WRITE_GAIN', 'WRITE_BIAS'))
    written += partial_rows * math.ceil(named['UNITS'] / named['S']) * c * 4
    return read, written, 0.


#: What one launch of each of `_triton`'s kernels moves and issues: `(bytes read, bytes written, instructions)` read
#: off its arguments by name (`named`) and its constants.
TRITON_RULES: Dict[str, Callable[[Dict, Dict], Tuple[int, int, float]]] = {
    '_channel_sq_norm_kernel': _channel_sq_norm,
    '_scale_kernel': _scale,
    '_box_filter_kernel': _box_filter,
    '_scale_backward_kernel': _scale_backward,
}


def triton_launch(kernel, args: Sequence, constexprs: Dict) -> Launch:
    """ What one launch of `_triton`'s kernels moves, read off its arguments as the launcher passes them (pointer
    arguments the constants say are unused move nothing), and the instructions its box filter issues."""
    name = kernel.__name__
    if name not in TRITON_RULES:
        raise ValueError(f'no byte count for the Triton kernel {name}')
    read, written, instructions = TRITON_RULES[name](dict(zip(kernel.arg_names, args)), constexprs)
    return Launch(name, 'triton', read, written, instructions=instructions)


#: Instructions issued per element and window tap by a box filter, by `BOX` (1: a convolution's window, 2: its
#: adjoint) and `ONE_GROUP` (a one-channel map: the window once a position, shared by the channels a thread holds;
#: otherwise once an element, as a depthwise map's), and for the first pass of a window split in two
#: (`_box_filter_kernel`, 'rows'): from the SASS of the sm_90a specialisations a 64 px step launches
#: (`cuobjdump -sass`): the window's instructions a thread issues over the taps and the 4 elements it holds (for the
#: split pass, all its instructions: an upper bound).
INSTRUCTIONS_PER_TAP = {(1, True): 2.7, (1, False): 5.4, (2, True): 5.0, (2, False): 5.2, ('rows', False): 9.0}


def box_instructions(elements: int, box, kh: int, kw: int, one_group: bool) -> float:
    """Instructions the box filter of a `_scale_kernel` launch issues over `elements` output elements."""
    return elements * kh * kw * INSTRUCTIONS_PER_TAP[(box, one_group)]


def lower_bound(op: str, args: Sequence, out) -> int:
    """ The bytes a PatchNorm op must move at least (the bar of docs/results/performance.md): what BatchNorm would
    also read and write in its place (the output pass: read `y`, write the output; the backward: read the gradient
    and `y`, write `dL/dy`) plus the input's squared norms (one read of `x`, forward and backward). The maps (one
    channel per group) and the `dx` update's read-modify-write (which the convolution's input-gradient epilogue could
    take) are not in it."""
    if op in ('patchnorm_conv2d', 'affine_div_linear'):
        return dram_bytes(args[0]) + 2 * dram_bytes(out[1])
    if op in ('patchnorm_conv2d_backward', 'affine_div_linear_backward'):
        return dram_bytes(args[1]) + 3 * dram_bytes(args[3])
    if op == 'l2_normalise_channels':
        return 2 * dram_bytes(args[0])
    if op == 'l2_normalise_channels_backward':
        return 3 * dram_bytes(args[1])
    return 0


# --- labels: which layer kind a launch belongs to -----------------------------------------------------------------

NORM_CLASSES = ('Norm', 'AffineDiv', 'PatchNorm', 'L2Norm')


def module_kind(module: nn.Module) -> str:
    """The layer kind a module's own operations count under."""
    cls = type(module).__name__
    if any(part in cls for part in NORM_CLASSES):
        return 'norm'
    if 'Pool' in cls:
        return 'pool'
    if cls in ('ReLU', 'GELU', 'SiLU', 'Tanh', 'Sigmoid', 'Hardswish'):
        return 'activation'
    if cls in ('Conv2d', 'Linear'):
        return 'conv/matmul'
    if 'Attention' in cls:
        return 'attention'
    if any(part in cls for part in ('Block', 'Bottleneck', 'DropPath', 'Mlp')):
        return 'block (residual, scale)'
    return 'other'


def op_kind(name: str, module_kind_: str) -> str:
    """An operation's layer kind: the matrix products, activations and casts by what they are, the rest by their
    module's kind."""
    if name in GEMMS or name.startswith('convolution') or name == 'nchw_to_nhwc':
        return 'conv/matmul'
    if name in ACTIVATIONS:
        return 'activation'
    if name in CASTS:
        return 'cast/copy'
    return module_kind_


class Recorder(TorchDispatchMode):
    """ Prices every ATen operation it sees (`aten_launches`) and takes the Triton launches `record_triton` gives it,
    under the current layer kind and phase; runs the Triton path's custom ops' bodies (`bodies`) under itself."""

    def __init__(self, bodies: Dict):
        super().__init__()
        self.launches: List[Launch] = []
        self.kind, self.phase, self.paused = 'other', 'forward', False
        self.bodies = bodies

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        body = self.bodies.get(func)
        if body is not None:
            with self:
                out = body(*args, **kwargs)
            self.add(Launch(op_name(func), 'host', 0, 0, count=0, cpu=CPU_COSTS['custom_op'],
                            bound=lower_bound(op_name(func), args, out)))
            return out
        out = func(*args, **kwargs)
        launches = aten_launches(func, args, kwargs, out)
        for i, launch in enumerate(launches):
            launch.cpu = 0. if i else CPU_COSTS.get(op_name(func), CPU_COSTS['default'])
            self.add(launch)
        return out

    def add(self, launch: Launch) -> None:
        launch.kind, launch.phase = op_kind(launch.op.split(':')[0], self.kind), self.phase
        self.launches.append(launch)

    def record_triton(self, kernel, args, constexprs) -> None:
        launch = triton_launch(kernel, args, constexprs)
        launch.cpu = CPU_COSTS['triton_launch']
        self.add(launch)

    @contextlib.contextmanager
    def hidden(self) -> Iterator[None]:
        """Operations not to price (the torch twins that stand in for the Triton kernels' values)."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False


class Labels:
    """ The current layer kind for the recorder: in the forward the innermost module's; in the backward the kind of
    the module whose forward made the autograd node that runs (a pre-hook on every node, set once the module
    returns)."""

    def __init__(self, recorder: Recorder):
        self.recorder = recorder
        self.stack: List[str] = []
        self.labelled = set()
        self.handles = []

    def __enter__(self) -> 'Labels':
        self.handles = [nn.modules.module.register_module_forward_pre_hook(self._enter),
                        nn.modules.module.register_module_forward_hook(self._leave)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()

    def _enter(self, module, args):
        self.stack.append(module_kind(module))
        self.recorder.kind = self.stack[-1]

    def _leave(self, module, args, output):
        kind = self.stack.pop()
        self.label(output, kind)
        self.recorder.kind = self.stack[-1] if self.stack else 'other'

    def label(self, output, kind: str) -> None:
        """Give the autograd nodes that made `output` and have no kind yet `kind`."""
        todo = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or node in self.labelled:
                continue
            self.labelled.add(node)
            node.register_prehook(lambda grads, kind=kind: setattr(self.recorder, 'kind', kind))
            todo.extend(next_node for next_node, _ in node.next_functions)


# --- one step -----------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Step:
    """What is traced: a model with its native norm or patchnorm (on the `triton` or `torch` path), a train or an
    inference step, a batch, an image size and a layout."""
    model: str
    norm: str  # 'native' or 'patchnorm'
    path: str  # 'triton' or 'torch' (patchnorm's)
    mode: str  # 'train' or 'inference'
    batch: int
    size: int
    layout: str  # 'channels_last' or 'nchw'

    @property
    def label(self) -> str:
        return 'native' if self.norm == 'native' else f'patchnorm ({self.path})'


@contextlib.contextmanager
def kernel_path(path: str, recorder: Recorder) -> Iterator[Dict]:
    """ The layers' path for CPU tensors: torch's operations, or (`triton`) the custom ops, whose bodies the recorder
    runs and whose launchers record their Triton launches (`_triton`'s launchers, their launches recorded instead of
    run, then `_torch`'s for the values, out of the count). Yields the custom ops' bodies by operator."""
    from timm_affinediv.layers.kernels import kernels_mode, set_kernels
    if path == 'torch':
        mode = kernels_mode()
        set_kernels('torch')
        try:
            yield {}
        finally:
            set_kernels(mode)
        return
    from timm_affinediv.layers.kernels.recording import custom_ops, recorded_launches
    with recorded_launches(recorder.record_triton, recorder.hidden):
        yield {custom_op_overload(op): custom_op_body(op) for op in custom_ops()}


def trace(step: Step) -> List[Launch]:
    """The launches of one step, traced under `FakeTensorMode` (see the module's docstring)."""
    torch.manual_seed(0)
    kwargs = {'norm_layer': 'patchnorm'} if step.norm == 'patchnorm' else {}
    model = timm.create_model(step.model, **kwargs)
    memory_format = torch.channels_last if step.layout == 'channels_last' else torch.contiguous_format
    model = model.to(memory_format=memory_format).train(step.mode == 'train')
    recorder = Recorder({})
    with kernel_path(step.path if step.norm == 'patchnorm' else 'torch', recorder) as bodies, \
            FakeTensorMode(allow_non_fake_inputs=True), CudaAutocast() as autocast:
        recorder.bodies = bodies
        x = torch.randn(step.batch, 3, step.size, step.size).to(memory_format=memory_format)
        target = torch.randint(0, 1000, (step.batch,))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=True)

        def train_step(labels: Optional[Labels]):
            autocast.new_region()
            with torch.autocast('cpu', dtype=torch.bfloat16):
                out = model(x)
                loss = F.cross_entropy(out, target)
            if labels is not None:
                labels.label(loss, 'loss')
                recorder.phase = 'backward'
            loss.backward()
            recorder.phase, recorder.kind = 'optimizer', 'optimizer'
            opt.step()
            opt.zero_grad(set_to_none=True)

        def inference_step(labels: Optional[Labels]):
            autocast.new_region()
            with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):
                model(x)

        run = train_step if step.mode == 'train' else inference_step
        if step.mode == 'train':
            run(None)  # the warm-up step, not recorded: SGD's momentum buffers exist from the second step on
        with recorder, Labels(recorder) as labels:
            recorder.phase = 'forward'
            run(labels)
    return recorder.launches


# --- pricing ------------------------------------------------------------------------------------------------------

def launch_seconds(launch: Launch, gpu: Gpu) -> float:
    """max(bytes / (bandwidth x fraction), FLOPs / (peak x fraction), instructions / issue rate) + the floor."""
    if launch.count == 0:
        return 0.
    fraction = FRACTIONS[launch.engine][0]
    seconds = launch.bytes / (gpu.bandwidth * fraction)
    if launch.flops:
        if launch.engine.startswith('depthwise'):
            peak = gpu.fp32_peak
        else:
            peak = {'bf16': gpu.bf16_peak, 'tf32': gpu.tf32_peak, 'fp32': gpu.fp32_peak}[launch.math]
        seconds = max(seconds, launch.flops / (peak * fraction))
    if launch.instructions:
        seconds = max(seconds, launch.instructions / (gpu.issue_rate * FRACTIONS['issue'][0]))
    return seconds + FLOOR_S * launch.count


@dataclasses.dataclass
class Prediction:
    """A step's predicted time on one GPU: the GPU's sum, the CPU's, and the GPU's split by layer kind and phase."""
    step: Step
    gpu: str
    gpu_s: float
    cpu_s: float
    launches: int
    bytes: int
    flops: float
    by_kind: Dict[str, float]
    by_phase: Dict[str, float]
    by_op: Dict[str, float]
    by_kind_bytes: Dict[str, int]
    triton_bytes: int
    bound_bytes: int

    @property
    def seconds(self) -> float:
        return max(self.gpu_s, self.cpu_s)


def predict(step: Step, launches: List[Launch], gpu_key: str) -> Prediction:
    gpu = GPUS[gpu_key]
    by_kind, by_phase, by_op = collections.Counter(), collections.Counter(), collections.Counter()
    by_kind_bytes = collections.Counter()
    total = 0.
    for launch in launches:
        seconds = launch_seconds(launch, gpu)
        total += seconds
        by_kind[launch.kind] += seconds
        by_phase[launch.phase] += seconds
        by_op[launch.op] += seconds
        by_kind_bytes[launch.kind] += launch.bytes
    return Prediction(step, gpu_key, total, sum(launch.cpu for launch in launches),
                      sum(launch.count for launch in launches), sum(launch.bytes for launch in launches),
                      sum(launch.flops for launch in launches), dict(by_kind), dict(by_phase), dict(by_op),
                      dict(by_kind_bytes), sum(launch.bytes for launch in launches if launch.engine == 'triton'),
                      sum(launch.bound for launch in launches))


# --- the command --------------------------------------------------------------------------------------------------

VARIANTS = (('native', 'torch'), ('patchnorm', 'triton'), ('patchnorm', 'torch'))


def _ms(seconds: float) -> str:
    return f'{seconds * 1e3:.2f}'


def _cell(p: Prediction, native: Prediction) -> str:
    bound = ' CPU-bound' if p.cpu_s > p.gpu_s else ''
    return f'{_ms(p.seconds)} ({p.seconds / native.seconds:.2f}x{bound})'


def predictions(steps: List[Step], gpus: List[str], log: Callable[[str], None] = print) -> List[Prediction]:
    """Every step traced once, priced on every GPU."""
    rows = []
    for step in steps:
        start = time.perf_counter()
        launches = trace(step)
        log(f'  traced {step.model} {step.label} {step.mode} {step.layout}: {len(launches)} launches in '
            f'{time.perf_counter() - start:.1f} s')
        rows += [predict(step, launches, gpu) for gpu in gpus]
    return rows


def _variants(rows: List[Prediction]) -> Dict[Tuple, Dict[str, Prediction]]:
    """Predictions by (model, mode, layout, GPU), then by variant label."""
    table: Dict[Tuple, Dict[str, Prediction]] = collections.defaultdict(dict)
    for p in rows:
        table[(p.step.model, p.step.mode, p.step.layout, p.gpu)][p.step.label] = p
    return table


def print_step_times(rows: List[Prediction]) -> None:
    """The predicted step times of every model, step, layout and GPU, each variant beside the native model."""
    table = _variants(rows)
    labels = [Step('', n, p, '', 0, 0, '').label for n, p in VARIANTS]
    present = [label for label in labels if any(label in v for v in table.values())]
    print('\n**Predicted** step time, ms (ratio to native):\n')
    print('| model | step | layout | GPU | ' + ' | '.join(present) + ' |')
    print('|---|---|---|---|' + '---:|' * len(present))
    for (model, mode, layout, gpu), variants in table.items():
        native = variants['native']
        cells = [_cell(variants[label], native) if label in variants else '-' for label in present]
        print(f'| {model} | {mode} | {layout} | {GPUS[gpu].name} | ' + ' | '.join(cells) + ' |')


def print_bytes(rows: List[Prediction]) -> None:
    """What the Triton kernels move in each step on the H200 against PatchNorm's lower bound."""
    fused = [p for p in rows if p.gpu == 'h200' and p.step.label == 'patchnorm (triton)' and p.bound_bytes]
    if not fused:
        return
    print("\nGB the Triton kernels move in a step against PatchNorm's lower bound (**predicted**, H200 trace):\n")
    print('| model | step | layout | Triton kernels GB | lower bound GB | ratio |')
    print('|---|---|---|---:|---:|---:|')
    for p in fused:
        print(f'| {p.step.model} | {p.step.mode} | {p.step.layout} | {p.triton_bytes / 1e9:.1f} | '
              f'{p.bound_bytes / 1e9:.1f} | {p.triton_bytes / p.bound_bytes:.2f}x |')


def print_predictions(rows: List[Prediction], top: int) -> None:
    table = _variants(rows)
    print_step_times(rows)
    shown = 'h200' if any(p.gpu == 'h200' for p in rows) else rows[0].gpu
    for (model, mode, layout, gpu), variants in table.items():
        if gpu != shown:
            continue
        kinds = collections.Counter()
        for p in variants.values():
            kinds.update({k: v for k, v in p.by_kind.items()})
        print(f'\n{model} {mode} {layout}, **predicted** GPU ms by layer kind on the {GPUS[gpu].name} (top {top}):\n')
        print('| kind | ' + ' | '.join(variants) + ' |')
        print('|---|' + '---:|' * len(variants))
        for kind, _ in kinds.most_common(top):
            print(f'| {kind} | ' + ' | '.join(_ms(p.by_kind.get(kind, 0.)) for p in variants.values()) + ' |')
        print('| GB moved / launches | ' + ' | '.join(f'{p.bytes / 1e9:.1f} / {p.launches}'
                                                    for p in variants.values()) + ' |')
        print("| the norm's GB | " + ' | '.join(f"{p.by_kind_bytes.get('norm', 0) / 1e9:.1f}"
                                               for p in variants.values()) + ' |')
        fused = variants.get('patchnorm (triton)')
        if fused is not None and fused.bound_bytes:
            print(f'\nThe Triton kernels move {fused.triton_bytes / 1e9:.2f} GB where PatchNorm must move '
                  f'{fused.bound_bytes / 1e9:.2f} GB ({fused.triton_bytes / fused.bound_bytes:.2f}x its lower bound).')


def print_calibration(rows: List[Prediction], measured_steps: Optional[Dict[Tuple[str, str, str], Tuple]] = None
                      ) -> None:
    """The torch path's predicted ratios on the H200 beside the measured ones (`MEASURED_H200` unless given)."""
    measured_steps = MEASURED_H200 if measured_steps is None else measured_steps
    print('\nThe torch path on the H200, **predicted** against **measured** (ms a step; ratio patchnorm / native):\n')
    print('| model | step | layout | native predicted / measured | patchnorm predicted / measured | '
          'ratio predicted | ratio measured | agreement |')
    print('|---|---|---|---:|---:|---:|---:|---:|')
    for (model, mode, layout, gpu), variants in _variants(rows).items():
        measured = measured_steps.get((model, mode, layout))
        if gpu != 'h200' or measured is None or 'patchnorm (torch)' not in variants:
            continue
        native, patch = variants['native'], variants['patchnorm (torch)']
        ratio = patch.seconds / native.seconds
        print(f'| {model} | {mode} | {layout} | {_ms(native.seconds)} / {_ms(measured[0])} | '
              f'{_ms(patch.seconds)} / {_ms(measured[1])} | {ratio:.2f}x | {measured[1] / measured[0]:.2f}x | '
              f'{100 * (ratio / (measured[1] / measured[0]) - 1):+.0f}% |')


def _as_json(p: Prediction) -> dict:
    return dict(step=dataclasses.asdict(p.step), variant=p.step.label, gpu=p.gpu, predicted_ms=p.seconds * 1e3,
                gpu_ms=p.gpu_s * 1e3, cpu_ms=p.cpu_s * 1e3, launches=p.launches, bytes=p.bytes, flops=p.flops,
                by_kind_ms={k: v * 1e3 for k, v in p.by_kind.items()},
                by_phase_ms={k: v * 1e3 for k, v in p.by_phase.items()}, by_kind_bytes=p.by_kind_bytes,
                triton_bytes=p.triton_bytes, lower_bound_bytes=p.bound_bytes,
                by_op_ms={k: v * 1e3 for k, v in p.by_op.items()})


def _from_json(row: dict) -> Prediction:
    """A prediction as `_as_json` wrote it."""
    seconds = lambda times: {k: v / 1e3 for k, v in times.items()}  # noqa: E731
    return Prediction(Step(**row['step']), row['gpu'], row['gpu_ms'] / 1e3, row['cpu_ms'] / 1e3, row['launches'],
                      row['bytes'], row['flops'], seconds(row['by_kind_ms']), seconds(row['by_phase_ms']),
                      seconds(row['by_op_ms']), row['by_kind_bytes'], row['triton_bytes'], row['lower_bound_bytes'])


def print_record(path: str) -> None:
    """The tables of a record `--json` wrote: step times, the Triton kernels' bytes, the calibration."""
    record = json.loads(pathlib.Path(path).read_text())
    rows = [_from_json(row) for row in record['predictions']]
    measured = {tuple(k.split('/')): tuple(v) for k, v in record['measured_h200_s'].items()}
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_step_times(rows)
        print_bytes(rows)
        if any(p.gpu == 'h200' and p.step.label == 'patchnorm (torch)' and
               (p.step.model, p.step.mode, p.step.layout) in measured for p in rows):
            print_calibration(rows, measured)
    print(text.getvalue().strip('\n'))


def _names(text: str, allowed: Sequence[str], flag: str) -> List[str]:
    names = [n for n in text.split(',') if n]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ValueError(f'{flag} takes a comma-separated list of {", ".join(allowed)}; got {text!r}')
    return names


def main(argv=None) -> int:
    parser = command_parser('gpu_model', __doc__, prog='scripts/gpu_model.py')
    parser.add_argument('--models', default='resnet50,convnext_tiny', help='comma-separated timm model names')
    parser.add_argument('--gpus', default='h100,h200', help=f'comma-separated, of {", ".join(GPUS)}')
    parser.add_argument('--layouts', default='channels_last,nchw', help='channels_last and/or nchw')
    parser.add_argument('--modes', default='train,inference', help='train and/or inference')
    parser.add_argument('--paths', default='triton,torch', help="patchnorm's paths to predict: triton and/or torch")
    parser.add_argument('--batch-train', type=positive_int, default=128)
    parser.add_argument('--batch-infer', type=positive_int, default=256)
    parser.add_argument('--img-size', type=positive_int, default=224)
    parser.add_argument('--top', type=positive_int, default=8, help='layer kinds listed per step')
    parser.add_argument('--calibration', action='store_true',
                        help='the torch path on the H200 in the measured configurations, beside the measurements')
    parser.add_argument('--json', default=None, metavar='OUT', help='also write the predictions here')
    parser.add_argument('--table-only', action='store_true',
                        help='trace nothing: print the tables of the record --json names')
    args = parser.parse_args(argv)
    if args.table_only:
        if not args.json or not pathlib.Path(args.json).is_file():
            parser.error('--table-only reads the record that --json names: give an existing file')
        print_record(args.json)
        return 0
    try:
        models = [m for m in args.models.split(',') if m]
        unknown = [m for m in models if not timm.is_model(m)]
        if unknown or not models:
            raise ValueError(f'--models: {", ".join(unknown) or "none given"} is not a timm model name')
        gpus = _names(args.gpus, list(GPUS), '--gpus')
        layouts = _names(args.layouts, ['channels_last', 'nchw'], '--layouts')
        modes = _names(args.modes, ['train', 'inference'], '--modes')
        paths = _names(args.paths, ['triton', 'torch'], '--paths')
    except ValueError as error:
        parser.error(str(error))
    if args.calibration:
        configurations = [(model, mode, layout) for model, mode, layout in MEASURED_H200 if model in models]
        if not configurations:
            parser.error(f'--calibration: no H200 measurement of {", ".join(models)} (measured: resnet50, '
                         'convnext_tiny)')
        variants, gpus = [('native', 'torch'), ('patchnorm', 'torch')], ['h200']
    else:
        configurations = [(m, mode, layout) for m in models for layout in layouts for mode in modes]
        variants = [('native', 'torch')] + [('patchnorm', p) for p in paths]
    steps = [Step(model, norm, path, mode, args.batch_train if mode == 'train' else args.batch_infer, args.img_size,
                  layout) for model, mode, layout in configurations for norm, path in variants]
    rows = predictions(steps, gpus)
    print_predictions(rows, args.top)
    if args.calibration:
        print_calibration(rows)
    if args.json:
        parameters = dict(gpus={k: dataclasses.asdict(g) for k, g in GPUS.items()},
                          fractions={k: dict(fraction=f, source=src) for k, (f, src) in FRACTIONS.items()},
                          floor_s=FLOOR_S, cpu_costs_s=CPU_COSTS,
                          instructions_per_tap={f'box {box}, one group {one}': v
                                                for (box, one), v in INSTRUCTIONS_PER_TAP.items()})
        atomic_write(args.json, json.dumps(dict(
            torch=torch.__version__, timm=timm.__version__, parameters=parameters,
            measured_h200_s={'/'.join(k): v for k, v in MEASURED_H200.items()},
            predictions=[_as_json(p) for p in rows]), indent=1))
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))
