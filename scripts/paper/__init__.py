""" Experiments on Fashion-MNIST that test the affine divergence paper's claims, with its protocol

1. `mlp`: the fully connected ablation. Parameterless variants (no learnable affine in any norm) of
   one MLP, on a grid of widths x depths x activations (Tanh, Leaky-ReLU):
   `linear` (no norm), `batchnorm` / `layernorm` / `rmsnorm` (`Linear -> norm -> act`, the norm
   without weight or bias), `l2normlinear` (the paper's norm-like layer: every affine map, the head
   included, is `L2NormLinear`, its input L2-normalised) and `affinediv` (the affine-like layer:
   every affine map is `AffineDivLinear`). The paper's claim is a ranking, affine-like >= norm-like >
   the others, with the gap growing with width and depth.
2. `batch`: batch-size sweeps of four of those MLPs, at a fixed number of epochs (a larger batch
   takes fewer updates) and at a fixed number of updates (a larger batch sees more data); the paper
   predicts that larger batches hurt the divergence-correcting layers, not BatchNorm or plain layers.
   Each variant's slope of test accuracy against log2(batch size) is taken per seed and reported
   with a 95% t-interval over seeds.
3. `conv`: a narrow timm `resnet10t` with BatchNorm, GroupNorm, LayerNorm2d, no norm and `patchnorm`,
   and a narrow timm `convnext_atto` with its native LayerNorm, RMSNorm and `patchnorm`.
4. `families`: one model of every README family (`models.FAMILIES`, narrow where timm's smallest is large) from
   scratch with its own norm and with `patchnorm` (and GroupNorm for ResNet-18), each trained by the optimiser a
   timm user would pick for it (`runs.RECIPES`: SGD with Nesterov momentum, or AdamW; warm-up, then a cosine),
   its rate swept as multiples of the optimiser's and the grid grown past an edge holding the best; the families
   whose norms differ by more than 2 points are trained 4 times as long at the chosen rates.

Protocol, the same for every variant: SGD with momentum 0.9, cosine learning-rate decay per step,
no weight decay or augmentation (`families`: its optimisers, as above; no augmentation). For every
setting (cell, variant, batch size) the learning rate is
tuned on a validation split held out from Fashion-MNIST's training set, with the first seed; the
best one is then run with every seed and reported as test accuracy. Every run is determined by its
seed and writes its own JSON record, so an interrupted grid resumes where it stopped; runs go to a
pool of worker processes with one torch thread each.

Modules: `models` (the MLP and conv variants), `data` (Fashion-MNIST in memory), `runs` (budgets, grids, one
training run, the worker pool), `analysis` (tables, t-intervals, plots), `experiments` (`run_experiment`).
Run them with `python scripts/experiments.py`.
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
