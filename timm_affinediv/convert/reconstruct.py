""" Block-wise reconstruction: the calibrated model's blocks trained, one after the other, to reproduce the original's

The least-squares fit is the best each layer can do alone, on its own target. Where a corrected layer's function
differs from the BatchNorm'd map it replaces more than one refit can make up for (a depthwise PatchNorm divides each
9-value window of one channel by its own norm), the errors compound with depth. Reconstruction then lets the layers
of a block make up for each other: for every block in forward order (the children of the model's
`nn.Sequential`/`nn.ModuleList` containers that hold a corrected layer: EfficientNet's `blocks.i.j`, ResNet's
`layerN.i`, ViT's `blocks.i`), its parameters take `steps` Adam steps (learning rate decayed on a cosine) on

    |block(x_conv) - block_orig(x_orig)|^2 / |block_orig(x_orig)|^2

over the calibration batches, `x_conv` the input the converted prefix (already reconstructed) gives it, and
`block_orig(x_orig)` the original's output there; the layers before the first block (the stem) are fitted the same
way to the first block's input, and those after the last (the head) to the logits. No labels, as in the
least-squares fit: post-training quantisation's block reconstruction (BRECQ), with the blocks' own parameters as the
unknowns.
"""
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Tuple

import torch
import torch.nn as nn

from ..layers.affine_div import AffineDivLinear, PatchNormConv2d

__all__ = ['BlockFit', 'reconstruct_blocks', 'reconstruction_blocks']

_CORRECTED = (PatchNormConv2d, AffineDivLinear)


@dataclass
class BlockFit:
    """How close one block's output is to the original's (relative squared error), before and after."""
    block: str
    rel_err_before: float
    rel_err_after: float


class _Reached(Exception):
    """Stops a forward once the block of interest has run: the rest of the model is not needed."""


def reconstruction_blocks(model: nn.Module) -> List[str]:
    """The blocks reconstructed, in module order: children of `nn.Sequential`/`nn.ModuleList` containers, not
    containers themselves nor inside another block (ResNet's `layer1.0`, not its `downsample.0`), that hold a
    divergence-corrected layer and apply no slot's affine from outside them (not ConvNeXt's `stem.0`, whose output
    carries the affine of the slot after it: the original's has no norm yet)."""
    paths = {id(m): path for path, m in model.named_modules()}

    def applies_outer_slot(child: nn.Module, child_path: str) -> bool:
        """Whether a layer of `child` applies the affine of a slot outside it: its output is not the original's."""
        slots = (getattr(m, 'fused_slot', None) for m in child.modules())
        return any(not paths[id(slot)].startswith(child_path + '.') for slot in slots if slot is not None)

    blocks: List[str] = []
    for path, container in model.named_modules():
        if isinstance(container, (nn.Sequential, nn.ModuleList)):
            for name, child in container.named_children():
                child_path = f'{path}.{name}' if path else name
                if not isinstance(child, (nn.Sequential, nn.ModuleList)) and \
                        any(isinstance(m, _CORRECTED) for m in child.modules()) and \
                        not any(child_path.startswith(block + '.') for block in blocks) and \
                        not applies_outer_slot(child, child_path):
                    blocks.append(child_path)
    return blocks


def _block_io(model: nn.Module, path: str, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The input and output of `model`'s block at `path` in a forward of `x` (stopped there; still attached to the
    autograd graph where it is recorded); raises `LookupError` where the block is not called with one tensor
    returning one."""
    seen = []

    def hook(module, args, output):
        seen.append((args, output))
        raise _Reached

    handle = model.get_submodule(path).register_forward_hook(hook)
    try:
        model(x)
    except _Reached:
        pass
    finally:
        handle.remove()
    if not seen:
        raise LookupError(f'{path} is not called')
    args, output = seen[0]
    if len(args) != 1 or not isinstance(args[0], torch.Tensor) or not isinstance(output, torch.Tensor):
        raise LookupError(f'{path} does not map one tensor to one tensor')
    return args[0], output


@contextmanager
def _output_replaced(module: nn.Module, value: torch.Tensor) -> Iterator[None]:
    """`module` returns `value` (its own computation still runs, outside the autograd graph that matters)."""
    handle = module.register_forward_hook(lambda m, args, output: value)
    try:
        yield
    finally:
        handle.remove()


def _call_order(model: nn.Module, x: torch.Tensor) -> Dict[str, int]:
    """Each module's place in the order of first calls in a forward of `x`."""
    order: Dict[str, int] = {}

    def record(path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            order.setdefault(path, len(order))
        return hook
    handles = [m.register_forward_pre_hook(record(path)) for path, m in model.named_modules()]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for handle in handles:
            handle.remove()
    return order


def _parameters(modules: Iterable[nn.Module]) -> List[nn.Parameter]:
    """The modules' own parameters and those of the slots their corrected layers apply (which the model holds)."""
    found: Dict[int, nn.Parameter] = {}
    for module in modules:
        slot = getattr(module, 'fused_slot', None)
        for p in list(module.parameters(recurse=False)) + (list(slot.parameters()) if slot is not None else []):
            if p.requires_grad:
                found.setdefault(id(p), p)
    return list(found.values())


def _relative_error(output: Callable[[int], torch.Tensor], targets: List[torch.Tensor]) -> float:
    with torch.no_grad():
        return sum(((output(i) - y).square().sum() / y.square().sum()).item()
                   for i, y in enumerate(targets)) / len(targets)


def _fit(name: str, params: List[nn.Parameter], output: Callable[[int], torch.Tensor], targets: List[torch.Tensor],
         steps: int, lr: float, generator: torch.Generator) -> BlockFit:
    """`steps` Adam steps on `params` towards `targets`, the learning rate decayed to 0 on a cosine, over the batches
    in a new random order each pass; the error before and after."""
    before = _relative_error(output, targets)
    optimizer = torch.optim.Adam(params, lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    passes = -(-steps // len(targets))
    order = torch.cat([torch.randperm(len(targets), generator=generator) for _ in range(passes)])[:steps]
    with torch.enable_grad():
        for i in order.tolist():
            loss = (output(i) - targets[i]).square().sum() / targets[i].square().sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    return BlockFit(name, before, _relative_error(output, targets))


def reconstruct_blocks(original: nn.Module, converted: nn.Module, batches: List[torch.Tensor],
                       original_logits: List[torch.Tensor], steps: int, lr: float,
                       generator: torch.Generator) -> List[BlockFit]:
    """ Reconstruct `converted` in forward order (module docstring): the layers before the first block (the stem) on
    the first block's input, each block on its output, the layers after the last one (the head) on the logits,
    `steps` Adam steps each, every batch as often. Both models in eval mode; only `converted`'s parameters
    change. A block's inputs and targets on every batch are held in memory while it is reconstructed."""
    blocks = []
    with torch.no_grad():
        for path in reconstruction_blocks(converted):
            try:
                _block_io(converted, path, batches[0])
                blocks.append(path)
            except LookupError:  # called otherwise: its layers stay as the fit left them
                continue
    if not blocks:
        return []
    order = _call_order(converted, batches[0])
    outside = [(path, m) for path, m in converted.named_modules() if path in order
               and not any(path == b or path.startswith(b + '.') for b in blocks)]
    fits = []
    stem = _parameters(m for path, m in outside if order[path] < order[blocks[0]])
    try:
        with torch.no_grad():
            targets = [_block_io(original, blocks[0], x)[0] for x in batches] if stem else []
    except (LookupError, AttributeError):  # not a block of the original
        targets = []
    if targets:
        fits.append(_fit('(stem)', stem, lambda i: _block_io(converted, blocks[0], batches[i])[0], targets, steps,
                         lr, generator))
    for path in blocks:
        try:
            with torch.no_grad():
                inputs = [_block_io(converted, path, x)[0] for x in batches]
                targets = [_block_io(original, path, x)[1] for x in batches]
        except (LookupError, AttributeError):  # not a block of the original
            continue
        block = converted.get_submodule(path)
        if targets[0].shape == block(inputs[0]).shape:
            fits.append(_fit(path, _parameters(block.modules()), lambda i: block(inputs[i]), targets, steps, lr,
                             generator))
    head = _parameters(m for path, m in outside if order[path] > order[blocks[-1]])
    if head:
        last = converted.get_submodule(blocks[-1])
        with torch.no_grad():
            inputs = [_block_io(converted, blocks[-1], x)[1] for x in batches]

        def logits(i: int) -> torch.Tensor:
            with _output_replaced(last, inputs[i]):
                return converted(batches[i])
        fits.append(_fit('(head)', head, logits, original_logits, steps, lr, generator))
    return fits
