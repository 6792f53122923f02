""" Experiments on Fashion-MNIST that test the affine divergence paper's claims, with its protocol

1. `mlp`: the fully connected ablation. Parameterless variants (no learnable affine in any norm) of one MLP, on a
   grid of widths x depths x activations (Tanh, Leaky-ReLU): `linear` (no norm), `batchnorm` / `layernorm` /
   `rmsnorm` (`Linear -> norm -> act`), `l2normlinear` (the paper's norm-like layer: every affine map, the head
   included, is `L2NormLinear`) and `affinediv` (the affine-like layer: every affine map is `AffineDivLinear`). The
   paper's claim is a ranking, affine-like >= norm-like > the others, the gap growing with width and depth.
2. `batch`: batch-size sweeps of four of those MLPs, at a fixed number of epochs and at a fixed number of updates;
   the paper predicts that larger batches hurt the divergence-correcting layers, not BatchNorm or plain layers. Each
   variant's slope of test accuracy against log2(batch size) is taken per seed, with a 95% t-interval over seeds.
3. `conv`: a narrow timm `resnet10t` with BatchNorm, GroupNorm, LayerNorm2d, no norm and `patchnorm`, and a narrow
   timm `convnext_atto` with its native LayerNorm, RMSNorm and `patchnorm`.
4. `families`: one model of every README family (`models.FAMILIES`) from scratch with its own norm and with
   `patchnorm` (and GroupNorm for ResNet-18), each trained by the optimiser a timm user would pick for it
   (`runs.RECIPES`: SGD with Nesterov momentum, or AdamW; warm-up, then a cosine), its rate swept as multiples of the
   optimiser's and the grid grown past an edge holding the best; families whose norms differ by more than 2 points
   are trained 4 times as long at the chosen rates.

Protocol: SGD with momentum 0.9, a cosine decay per step, no weight decay or augmentation (`families`: its own
optimisers). For every setting the learning rate is tuned on a validation split held out from the training set,
with the first seed, and the best is run with every seed and reported as test accuracy. Every run is determined by
its seed and writes its own JSON record, so an interrupted grid resumes where it stopped; runs go to a pool of
worker processes with one torch thread each. Modules: `models`, `data` (Fashion-MNIST in memory), `runs` (budgets,
grids, one run, the pool), `analysis` (tables, t-intervals, plots), `experiments`; run with scripts/experiments.py.
"""
from .analysis import slope_interval, t_quantile
from .data import Splits, load_fashion_mnist
from .experiments import run_experiment
from .models import CONV_MODELS, MLP_VARIANTS, conv_model, mlp_model
from .runs import EXPERIMENTS, FULL, QUICK, RECIPES, Config, RunResult, Setting, settings, train_run

__all__ = [
    'EXPERIMENTS', 'FULL', 'QUICK', 'RECIPES', 'Config', 'RunResult', 'Setting', 'Splits', 'CONV_MODELS',
    'MLP_VARIANTS', 'conv_model', 'load_fashion_mnist', 'mlp_model', 'run_experiment', 'settings', 'slope_interval',
    't_quantile', 'train_run']
