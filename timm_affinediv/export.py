""" ONNX export, checked against the eager model

`export_onnx(model, path)` writes an ONNX file with a dynamic batch axis, through either of PyTorch's
exporters (`dynamo=True`, the `torch.export`-based one, or the TorchScript-based one), and by default
validates it: ONNX Runtime runs the file on random batches of two sizes and its outputs must match the eager
model's to `tolerance`, measured as the relative error

    max |y_onnx - y_eager| / max |y_eager|

An export whose numbers differ raises `ExportError` and leaves nothing at `path`: the file is written to a
temporary path beside it and renamed into place only once validated, so no export can silently change a result.
"""
from pathlib import Path
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from .errors import ExportError
from .files import atomic_write

__all__ = ['ExportError', 'export_onnx', 'validate_onnx', 'relative_error']

DEFAULT_OPSET = 18


def relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    """`max |output - reference| / max |reference|`, in float64."""
    output, reference = output.double(), reference.double()
    return float((output - reference).abs().max() / reference.abs().max().clamp_min(torch.finfo(torch.float64).tiny))


def _random_batches(input_size: Tuple[int, ...], batch_sizes: Sequence[int], seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn((b,) + tuple(input_size), generator=generator) for b in batch_sizes]


@torch.no_grad()
def validate_onnx(
        model: nn.Module,
        path: Union[str, Path],
        inputs: Sequence[torch.Tensor],
) -> float:
    """ The worst relative error (see the module docstring) of ONNX Runtime running `path` against `model`
    (in eval mode) over `inputs`, on the CPU.
    """
    import onnxruntime as ort  # an optional dependency, needed here only

    session = ort.InferenceSession(str(path), providers=['CPUExecutionProvider'])
    input_name = session.get_inputs()[0].name
    was_training = model.training
    model.eval()
    try:
        worst = 0.
        for x in inputs:
            reference = model(x)
            (output,) = session.run(None, {input_name: x.numpy()})
            if tuple(output.shape) != tuple(reference.shape):
                raise ExportError(f'{path} returns shape {tuple(output.shape)} for input {tuple(x.shape)}, '
                                  f'the model {tuple(reference.shape)}')
            worst = max(worst, relative_error(torch.from_numpy(output), reference))
        return worst
    finally:
        model.train(was_training)


def _export(model: nn.Module, x: torch.Tensor, path: str, opset: int, dynamo: bool) -> None:
    names = dict(input_names=['input'], output_names=['output'])
    if dynamo:
        torch.onnx.export(
            model, (x,), path, dynamo=True, opset_version=opset, external_data=False,
            dynamic_shapes=({0: torch.export.Dim.DYNAMIC},), **names)
    else:
        torch.onnx.export(
            model, (x,), path, dynamo=False, opset_version=opset,
            dynamic_axes={'input': {0: 'batch'}, 'output': {0: 'batch'}}, **names)


def export_onnx(
        model: nn.Module,
        path: Union[str, Path],
        input_size: Tuple[int, ...] = (3, 224, 224),
        *,
        opset: int = DEFAULT_OPSET,
        dynamo: bool = True,
        validate: bool = True,
        tolerance: float = 1e-5,
        batch_sizes: Sequence[int] = (2, 3),
) -> Optional[float]:
    """ Export `model` (in eval mode) to the ONNX file `path`, with a dynamic batch axis; returns the worst
    relative error against eager over random batches of `batch_sizes` (None with `validate=False`).

    `input_size` is one sample's (C, H, W). `dynamo` picks PyTorch's `torch.export`-based exporter, else the
    TorchScript-based one. Raises `ExportError` (and writes nothing) if exporting fails or the error exceeds
    `tolerance`.
    """
    path = Path(path)
    if path.is_dir():
        raise ExportError(f'{path} is a folder: give the path of the .onnx file to write.')
    path.parent.mkdir(parents=True, exist_ok=True)
    was_training = model.training
    model.eval()
    inputs = _random_batches(input_size, batch_sizes)
    error = None

    def export_and_validate(tmp: str) -> None:
        nonlocal error
        try:
            _export(model, inputs[0], tmp, opset, dynamo)
        except Exception as e:
            raise ExportError(f"{'dynamo' if dynamo else 'TorchScript-based'} ONNX export (opset {opset}) "
                              f'failed: {type(e).__name__}: {e}') from e
        if validate:
            error = validate_onnx(model, tmp, inputs)
            if not error <= tolerance:
                raise ExportError(
                    f'the exported model differs from eager by {error:.3g} relative (tolerance {tolerance:g}) '
                    f'on batches of {list(batch_sizes)}: not written to {path}.')

    try:
        atomic_write(path, export_and_validate)
        return error
    finally:
        model.train(was_training)
