""" Converting a trained BatchNorm/LayerNorm timm model to PatchNorm without losing what it learned

`convert_model(model, norm="patchnorm", calibration=batches)` rebuilds the architecture with
`timm.create_model(arch, norm_layer=norm)`, carries every weight over and maps each norm onto its slot analytically.
With BatchNorm `z = gamma (W x + b - mu) / sigma + beta`, the slot gets `gamma / sigma` and `beta`, and the
convolution keeps `W` with the pre-division bias `b - mu`: exact wherever the patch's root mean square `s(P)` is 1.
With LayerNorm the slot takes `gamma` and `beta` as they are.

With calibration data, each divergence-corrected layer is then fitted in forward order, on the inputs the converted
prefix gives it, to reproduce the original's output at the same place (the norm's output for a producer, the
layer's own output for a consumer). Each fit is a ridge-regularised least squares problem, linear in `(v_o, beta_o)`:

    z_o,p = v_o . u_p + beta_o,     u_p = [P_p; 1] / s(P_p)

for output channel `o` and position `p` (`v_o = g_o [W_o, b_o]`, the slot's gain folded in). Its normal equations
are accumulated over the calibration batches and solved in closed form with a penalty `lambda |v_o - v_o^0|^2`
towards the analytic map; `v_o` is split back into the slot's gain and the layer's weight and bias. Both models are
traced (torch.fx) and walked over all batches together, node by node, so each node runs once per batch whatever the
depth; the values a later node needs stay cached within `calib_memory` bytes and spill to a folder beyond it.

Modules, one job each: `rebuild` (the architecture rebuilt, the weights carried over and mapped), `graph` (the
traced walk and its cache), `features` (the fit's rows), `solver` (the normal equations), `reconstruct` (block
reconstruction), `distill` (logit distillation), `options` (`ConvertOptions`), `api` (`convert_model`, the report).
"""
from ..errors import ConversionError
from .api import ConversionReport, LayerFit, convert_model, positions_per_batch_for
from .distill import Agreement, DistillationFit
from .options import ConvertOptions, DistillOptions, FitOptions, ReconstructOptions
from .rebuild import CONVERSION_NORMS, build_converted, model_in_chans

__all__ = ['convert_model', 'ConversionError', 'ConversionReport', 'LayerFit', 'ConvertOptions', 'FitOptions',
           'ReconstructOptions', 'DistillOptions', 'Agreement', 'DistillationFit', 'CONVERSION_NORMS',
           'build_converted', 'model_in_chans', 'positions_per_batch_for']
