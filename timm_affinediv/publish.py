""" A finished training run as a Hub-ready folder: its final weights, and a card with what was measured

`publish_run` ends `timm-affinediv finetune`, the recovery (`timm_affinediv.recover`) and the demo pipeline: the
card gives the run's top-1 and top-5 (`train.final_top1`: of the EMA weights where the run kept some), its
evaluation set, dataset and recipe, and the folder holds the training curves (`metrics.png`).
"""
from pathlib import Path
from typing import Dict, Optional

from ._timm_compat import get_model_args
from .data import is_fashion_mnist, resolve_dataset
from .hub import PLOT_NAME, save_hub_folder
from .model_io import hub_dataset
from .train import TrainResult, final_top1

__all__ = ['publish_run']


def publish_run(
        result: TrainResult,
        folder: Optional[str] = None,
        dataset: Optional[str] = None,
        data_dir: Optional[str] = None,
        recipe: Optional[str] = None,
        extra_files: Optional[Dict[str, str]] = None,
        base_model: Optional[str] = None,
        base_model_description: Optional[str] = None,
        overwrite: bool = False,
) -> Path:
    """ The Hub-ready folder (default `<output>/model`) of a finished run: its measured metrics, the evaluation set
    and the training curves (`metrics.png`, copied into the folder) in the card. `dataset` and `data_dir` are the
    run's (`TrainConfig`'s; one of them is needed), `base_model` is the Hub id of the model it was fine-tuned or
    converted from, `base_model_description` that model in words.
    """
    dataset = resolve_dataset(dataset, data_dir)
    folder = Path(folder or Path(result.output_dir) / 'model')
    model = result.model
    norm_layer = get_model_args(model).get('norm_layer')
    recipe = recipe or (f'Trained with timm-affinediv\'s trainer: {len(result.history)} epochs, '
                        f'see train_config.json in the run folder.')
    dataset_name = 'Fashion-MNIST' if is_fashion_mnist(dataset) else dataset or Path(data_dir or 'images').name
    card = dict(datasets=[hub_dataset(dataset, data_dir)], dataset_name=dataset_name, recipe=recipe,
                norm_layer=norm_layer, eval_set=result.eval_set or None, base_model=base_model,
                base_model_description=base_model_description,
                model_name=f"{result.model_name}-{norm_layer or 'baseline'}-{dataset_name.lower()}")
    extra_files = dict(extra_files or {})
    plot = Path(result.output_dir) / PLOT_NAME
    if plot.is_file():
        extra_files[PLOT_NAME] = plot.read_bytes()
    metrics = dict(top1=round(final_top1(result.metrics), 2), top5=round(final_top1(result.metrics, 5), 2))
    return save_hub_folder(model, folder, model_args=get_model_args(model), card=card, metrics=metrics,
                           extra_files=extra_files, overwrite=overwrite)
