""" Converting a pretrained BatchNorm/LayerNorm timm model to PatchNorm without losing what it learned

`convert_model(model, norm="patchnorm", calibration=batches)` rebuilds the model's architecture with
`timm.create_model(arch, norm_layer=norm)`, carries every weight over, and maps each norm onto
its slot analytically. Swapping a normaliser changes every activation, so the analytic map alone
loses most of the accuracy; with calibration data the divergence-corrected layers are then fitted,
one after the other in forward order, each on the inputs the converted prefix gives it, so that its
output reproduces the original model's at the same place (the norm's output for a producer, the
layer's own output for a consumer).

The calibration costs a fixed number of forward passes, whatever the depth: both models are traced
(torch.fx) and walked over all calibration batches together, node by node in graph order, pausing at
each corrected layer to fit it on the values cached there (the converted model's input to the layer, the
original's output at its target); the values a later node still needs (a residual block's input, read by
its shortcut) stay cached, within `calib_memory` bytes, and spill to a temporary folder beyond it. Each
node thus runs once per batch: one pass of each model, plus one of the converted model for the analytic
map's agreement, plus the fits.

Each fit is a ridge-regularised least squares problem, exact and closed form: a corrected layer
computes, for each output channel `o` and position `p`,

    z_o,p = v_o . u_p + beta_o,     u_p = [P_p; 1] / s(P_p)

(`v_o = g_o [W_o, b_o]` with the slot's gain `g_o` folded in, `beta_o` the slot's shift, present
only where a slot follows), linear in `(v_o, beta_o)`. The normal equations are accumulated over
the calibration batches (a random subset of positions per batch), and solved with a penalty
`lambda |v_o - v_o^0|^2` pulling towards the analytic map, as post-training quantisation methods do.
The fitted `v_o` is split back into the slot's gain (the ratio of `|v_o|` to the original
convolution's row norm, so that the weights keep their scale) and the layer's weight and bias.

The analytic map (also the starting point of the fit): with BatchNorm `z = gamma (W x + b - mu) /
sigma + beta`, the slot gets `gamma / sigma` and `beta`, the convolution keeps `W` and gets the
pre-division bias `b - mu`: exact wherever the patch's root mean square `s(P)` is 1. With
LayerNorm the slot takes `gamma` and `beta` as they are.

The package's modules, one job each: `rebuild` (the architecture rebuilt, the weights carried over and mapped),
`graph` (the traced walk and its activation cache), `features` (the fit's rows gathered from the activations),
`solver` (the normal equations and their solve), `reconstruct` (block reconstruction), `distill` (logit
distillation), `options` (`ConvertOptions` and its groups), `api` (`convert_model`, the report).
"""
from ..errors import ConversionError
from .api import ConversionReport, LayerFit, convert_model, positions_per_batch_for
from .distill import Agreement, DistillationFit
from .options import ConvertOptions, DistillOptions, FitOptions, ReconstructOptions
from .rebuild import CONVERSION_NORMS, build_converted, model_in_chans

__all__ = ['convert_model', 'ConversionError', 'ConversionReport', 'LayerFit', 'ConvertOptions', 'FitOptions',
           'ReconstructOptions', 'DistillOptions', 'Agreement', 'DistillationFit', 'CONVERSION_NORMS',
           'build_converted', 'model_in_chans', 'positions_per_batch_for']
