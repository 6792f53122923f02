""" Block-wise reconstruction: the calibrated blocks whose output is still far from the original's, trained towards it

The least-squares fit is the best each layer can do alone, on its own target. Where a corrected layer's function
differs from the BatchNorm'd map it replaces more than one refit can make up for (a depthwise PatchNorm divides each
9-value window of one channel by its own norm), the errors compound with depth. Reconstruction then lets the layers
of a block make up for each other: for every block in forward order (the children of the model's
`nn.Sequential`/`nn.ModuleList` containers that hold a corrected layer: EfficientNet's `blocks.i.j`, ResNet's
`layerN.i`, ViT's `blocks.i`) whose relative squared error after the fit,

    e = |block(x_conv) - block_orig(x_orig)|^2 / |block_orig(x_orig)|^2

averaged over the calibration batches, is above `threshold`, its parameters take Adam steps on `e` (one batch a
step, a new random order each pass over them), `x_conv` the input the converted prefix (already reconstructed) gives
it, `block_orig(x_orig)` the original's output there, until a pass's mean loss falls by less than `tolerance` or
`steps` are taken (a block left worse than the fit left it gets the fit's parameters back). The layers before the
first block (the stem) are fitted the same way to the first block's input, and those after the last (the head) to
the logits. No labels: post-training quantisation's block
reconstruction (BRECQ), with the blocks' own parameters as the unknowns.

Both models are traced with the blocks as leaves and walked over all batches together (`graph.GraphWalk`), so each
block's inputs are computed once, from the converted prefix, and cached; the stem and the head are re-run from the
cached values (`GraphWalk.replay`), never the whole model. Without a block to train, this costs one forward pass of
each model.
"""
import operator
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from ..layers.affine_div import AffineDivLinear, PatchNormConv2d
from .graph import ActivationCache, GraphWalk, trace
from .options import ReconstructOptions

__all__ = ['BlockFit', 'reconstruct_blocks', 'reconstruction_blocks', 'relative_squared_error',
           'restore_parameters']

_CORRECTED = (PatchNormConv2d, AffineDivLinear)


@dataclass
class BlockFit:
    """How close one block's output is to the original's (relative squared error) after the fit and after its
    reconstruction, and the Adam steps it took (0: its error was below the threshold, it was left as fitted)."""
    block: str
    rel_err_before: float
    rel_err_after: float
    steps: int = 0


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


def _parameters(modules: Iterable[nn.Module]) -> List[nn.Parameter]:
    """The modules' own parameters and those of the slots their corrected layers apply (which the model holds)."""
    found: Dict[int, nn.Parameter] = {}
    for module in modules:
        slot = getattr(module, 'fused_slot', None)
        for p in list(module.parameters(recurse=False)) + (list(slot.parameters()) if slot is not None else []):
            if p.requires_grad:
                found.setdefault(id(p), p)
    return list(found.values())


def relative_squared_error(outputs: Iterable[torch.Tensor], targets: List[torch.Tensor]) -> float:
    """`|output - target|^2 / |target|^2`, averaged over the batches."""
    with torch.no_grad():
        return sum(((a - b).square().sum() / b.square().sum()).item() for a, b in zip(outputs, targets)) / len(targets)


def restore_parameters(params: List[nn.Parameter], values: List[torch.Tensor]) -> None:
    """Copy `values` (taken before training) back into `params`: the fit kept where training did not help."""
    with torch.no_grad():
        for p, value in zip(params, values):
            p.copy_(value)


def _relative_error(output: Callable[[int], torch.Tensor], targets: List[torch.Tensor]) -> float:
    return relative_squared_error((output(i) for i in range(len(targets))), targets)


def _train(params: List[nn.Parameter], output: Callable[[int], torch.Tensor], targets: List[torch.Tensor],
           options: ReconstructOptions, generator: torch.Generator) -> int:
    """Adam steps on `params` towards `targets`, one batch a step in a new random order each pass, until a pass's
    mean loss falls by less than `options.tolerance` of the best before it or `options.steps`; the steps taken."""
    optimizer = torch.optim.Adam(params, lr=options.lr)
    best, total, steps = float('inf'), 0., 0
    with torch.enable_grad():
        while steps < options.steps:
            for i in torch.randperm(len(targets), generator=generator).tolist():
                loss = (output(i) - targets[i]).square().sum() / targets[i].square().sum()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total += loss.item()
                steps += 1
                if steps == options.steps:
                    return steps
            mean, total = total / len(targets), 0.
            if mean > best * (1 - options.tolerance):
                return steps
            best = min(best, mean)
    return steps


def _segment(name: str, params: List[nn.Parameter], output: Callable[[int], torch.Tensor],
             targets: List[torch.Tensor], options: ReconstructOptions, generator: torch.Generator) -> BlockFit:
    """One stretch of the converted model brought towards `targets` if its error is above the threshold."""
    before = _relative_error(output, targets)
    if before <= options.threshold or not params or not options.steps:
        return BlockFit(name, before, before)
    fitted = [p.detach().clone() for p in params]
    steps = _train(params, output, targets, options, generator)
    after = _relative_error(output, targets)
    if after >= before:  # a few large first Adam steps can leave it worse: the fit's parameters are kept then
        restore_parameters(params, fitted)
        after = before
    return BlockFit(name, before, after, steps)


def _single_input(node: fx.Node) -> Optional[fx.Node]:
    """The one tensor a block's node is called with, or None (other arguments: not reconstructed)."""
    return node.args[0] if len(node.args) == 1 and not node.kwargs and isinstance(node.args[0], fx.Node) else None


def reconstruct_blocks(original: nn.Module, converted: nn.Module, batches: List[torch.Tensor],
                       cache: ActivationCache, options: ReconstructOptions, seed: int = 0
                       ) -> Tuple[List[BlockFit], List]:
    """ Reconstruct `converted` in forward order (module docstring): the stem on the first block's input, each block
    on its output, the head on the logits, each only where its error is above `options.threshold`. Both models in
    eval mode; only `converted`'s parameters change. Returns the fits (every block's, trained or not) and the
    converted model's outputs on the batches (after its reconstruction). `cache` holds the walks' activations (the
    caller closes it)."""
    generator = torch.Generator().manual_seed(seed)
    blocks = reconstruction_blocks(converted)
    walk = GraphWalk(trace(converted, blocks), batches, cache)
    reference = GraphWalk(trace(original, blocks), batches, cache)
    blocks = [b for b in blocks if len(walk.calls(b)) == 1 and len(reference.calls(b)) == 1
              and _single_input(walk.node(b)) is not None and _single_input(reference.node(b)) is not None]
    blocks.sort(key=lambda b: walk.index[walk.node(b)])
    fits: List[BlockFit] = []
    modules = dict(converted.named_modules())

    def stretch_params(start: int, stop: int) -> List[nn.Parameter]:
        """The parameters a stretch of the converted graph uses: its modules' and those it reads (ViT's pos_embed)."""
        nodes = walk.nodes[start:stop]
        attrs = [operator.attrgetter(n.target)(walk.traced) for n in nodes if n.op == 'get_attr']
        return _parameters(modules[n.target] for n in nodes if n.op == 'call_module') + [
            p for p in attrs if isinstance(p, nn.Parameter) and p.requires_grad]

    if blocks:
        first = walk.index[walk.node(blocks[0])]
        result = _single_input(walk.node(blocks[0]))
        reference.run_until(reference.node(blocks[0]))
        targets = [reference.value(_single_input(reference.node(blocks[0])), b) for b in range(len(batches))]
        fits.append(_segment('(stem)', stretch_params(0, first),
                             lambda i: walk.replay(0, first, i, result), targets, options, generator))
    for path in blocks:
        node, target = walk.node(path), reference.node(path)
        walk.run_until(node)
        reference.run_until(target, inclusive=True)
        inputs = [walk.value(node.args[0], b) for b in range(len(batches))]
        targets = [reference.value(target, b) for b in range(len(batches))]
        block = converted.get_submodule(path)
        with torch.no_grad():
            output = block(inputs[0])
        if isinstance(output, torch.Tensor) and isinstance(targets[0], torch.Tensor) and \
                output.shape == targets[0].shape:
            fits.append(_segment(path, _parameters(block.modules()), lambda i: block(inputs[i]), targets, options,
                                 generator))
        walk.run_until(node, inclusive=True)
    reference.run_until(None)
    start = walk.position
    fits.append(_segment('(head)', stretch_params(start, len(walk.nodes)),
                         lambda i: walk.replay(start, len(walk.nodes), i), reference.outputs, options, generator))
    walk.run_until(None)
    return fits, walk.outputs
