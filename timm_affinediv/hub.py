"""Publish timm-affinediv models to the Hugging Face Hub and load them back through timm or transformers.

A Hub folder holds ``model.safetensors`` (contiguous tensors, whatever the model's memory format), timm's own
``config.json`` (written by timm's ``save_config_for_hf``) and ``README.md``, the model card rendered from
``model_cards/``. After ``import timm_affinediv`` it loads with ``timm.create_model("local-dir:DIR", pretrained=True)``
and, once pushed, with ``timm.create_model("hf-hub:org/name", pretrained=True)``; transformers'
``AutoModelForImageClassification``, ``AutoImageProcessor`` and ``pipeline("image-classification")``
load it too (its ``TimmWrapper``), with the class names of ``config.json``'s ``label_names``
(``timm_affinediv.labels``).

Loading without the plugin: timm looks the ``architecture`` of ``config.json`` up in its model
registry before it builds or downloads anything else, and names it verbatim when it is unknown.
So the folder's ``architecture`` is ``timm_affinediv.<arch> (pip install timm-affinediv, then
import timm_affinediv before timm.create_model)``: timm ignores everything after the first ``.``
when it looks a name up, so importing this module (``import timm_affinediv`` does) registers one
entrypoint, ``timm_affinediv``, that builds ``<arch>``, kept in ``pretrained_cfg.architecture``,
with the saved ``model_args``. Without the plugin the user sees
``RuntimeError: Unknown model (timm_affinediv.<arch> (pip install timm-affinediv, then import
timm_affinediv before timm.create_model))`` for every architecture, where a norm name alone
would give ``KeyError: 'patchnorm'`` (ResNet) or an unrelated assertion (ConvNeXt); transformers,
which creates the architecture by that name, turns it into ``ImportError: The model architecture
'timm_affinediv.<arch> (...)' is not supported in your version of timm (...)``.
"""
import glob
import importlib.resources
import json
import os
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import httpx2
import safetensors.torch
import timm
import torch
from huggingface_hub import CommitInfo, EvalResult, HfApi, ModelCard, ModelCardData, constants, get_token
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, RemoteEntryNotFoundError
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, FORBIDDEN_FOLDERS, filter_repo_objects, validate_repo_id
from timm.models import model_entrypoint, register_model
from torch import nn

from ._hub_folder import CONFIG_NAME, WEIGHTS_NAME, check_labels, check_weights_file, missing_weights, read_config
from ._state_dict import check_finite, describe_mismatch
from ._timm_compat import download_from_hf, get_model_input_config, save_config_for_hf
from .errors import HubError, OptionError, OutputExistsError
from .files import atomic_dir, save_safetensors
from .labels import LABEL_KEYS, model_labels
from .layers.binding import fake_eval

__all__ = ['HubError', 'UploadPlan', 'save_hub_folder', 'render_model_card', 'push_to_hub']

#: timm registry name of the entrypoint that builds the architectures of Hub folders.
HUB_ARCH = 'timm_affinediv'
PLUGIN_HINT = 'pip install timm-affinediv, then import timm_affinediv before timm.create_model'
CARD_NAME = 'README.md'
REQUIRED_FILES = (WEIGHTS_NAME, CONFIG_NAME, CARD_NAME)
#: Weight formats that unpickle (and so can run code) when loaded: never published.
PICKLE_SUFFIXES = ('.bin', '.pth', '.pt', '.pkl', '.pickle', '.ckpt', '.pth.tar')
# package data: model_cards/ at the top of the source tree ships as the package timm_affinediv.model_cards
MODEL_CARD_PACKAGE, MODEL_CARD_TEMPLATE = 'timm_affinediv.model_cards', 'patchnorm.md'
CARD_TAGS = ('image-classification', 'timm', 'timm_affinediv')
#: Norm layers whose name is also a card tag: only models that have them are tagged so.
NORM_TAGS = ('patchnorm', 'patchnorm_ws', 'affinediv')
#: Placeholder repo id of a card written before the repo is known.
REPO_PLACEHOLDER = 'YOUR-ORG/YOUR-MODEL'
#: The most class names a card lists (ImageNet's 1000 are in config.json).
CARD_CLASSES = 20
#: The training curves, shown in the card when the folder has them (`extra_files`).
PLOT_NAME = 'metrics.png'
#: `pretrained_cfg` entries that describe the source checkpoint (ImageNet weights: their tag, paper, notes), not
#: the weights of a Hub folder.
SOURCE_CFG_KEYS = ('tag', 'paper_ids', 'paper_name', 'notes', 'origin_url', 'hf_hub_id', 'hf_hub_filename', 'url',
                   'file', 'source')
_METRIC_NAMES = {'top1': 'Top-1 Accuracy', 'top5': 'Top-5 Accuracy'}


@register_model
def timm_affinediv(pretrained: bool = False, pretrained_cfg: dict | str | None = None, **kwargs: Any) -> nn.Module:
    """Build the architecture of a timm-affinediv Hub folder (see the module docstring).

    timm calls this for ``hf-hub:`` and ``local-dir:`` folders written by ``save_hub_folder``; the
    real architecture is ``pretrained_cfg['architecture']``. transformers' ``TimmWrapper`` creates
    the folder's ``architecture`` by name instead (``timm.create_model(architecture, num_classes=...,
    **model_args)``, its own code loading the weights): timm then passes the text after the first
    ``.``, ``<arch> (<hint>)``, as ``pretrained_cfg``, and ``<arch>`` is built with timm's default
    configuration for it.
    """
    if isinstance(pretrained_cfg, str):
        arch = _folder_architecture(pretrained_cfg)
        if arch and not pretrained:
            model = model_entrypoint(arch)(pretrained=False, **kwargs)
            if kwargs.get('in_chans') == 1:
                _read_rgb_as_gray(model)
            return model
    elif pretrained_cfg:
        arch = pretrained_cfg.get('architecture')
        if arch and pretrained and pretrained_cfg.get('source') in ('local-dir', 'hf-hub'):
            return _load_folder(arch, pretrained_cfg, kwargs)
        if arch:
            return model_entrypoint(arch)(pretrained=pretrained, pretrained_cfg=pretrained_cfg, **kwargs)
    raise OptionError(
        f"'{HUB_ARCH}' only loads folders written by timm_affinediv.hub.save_hub_folder"
        " ('hf-hub:org/name' or 'local-dir:DIR'). Create other models by their architecture,"
        " e.g. timm.create_model('resnet18', norm_layer='patchnorm')."
    )


def _load_folder(arch: str, pretrained_cfg: dict, kwargs: dict) -> nn.Module:
    """``arch`` with the weights of the folder ``pretrained_cfg`` names, loaded by timm (which adapts a head or stem
    resized by ``kwargs``) once the folder is known to be whole: its class names match its class count, its
    ``model.safetensors`` (never a pickle beside it) is complete, fits ``arch`` and holds finite values only."""
    if pretrained_cfg['source'] == 'local-dir':
        source = str(pretrained_cfg['file'])
        weights = Path(source) / WEIGHTS_NAME
    else:
        source = f"hf-hub:{pretrained_cfg['hf_hub_id']}"
        try:  # in the cache, timm's own download of the weights reads this file
            weights = Path(download_from_hf(pretrained_cfg['hf_hub_id'], WEIGHTS_NAME))
        except RemoteEntryNotFoundError as e:
            raise missing_weights(source) from e
    check_labels(pretrained_cfg, source)
    check_weights_file(weights)
    build = model_entrypoint(arch)
    try:
        model = build(pretrained=True, pretrained_cfg=pretrained_cfg, **kwargs)
    except RuntimeError as e:  # timm's strict load: missing or unexpected keys, other shapes
        mismatch = describe_mismatch(build(pretrained=False, pretrained_cfg=pretrained_cfg, **kwargs),
                                     safetensors.torch.load_file(weights))
        raise HubError(f"{source}'s {WEIGHTS_NAME} does not fit {arch}: "
                       f"{mismatch or ' '.join(str(e).split())}. Download the folder again, or write it again with "
                       'timm_affinediv.hub.save_hub_folder.') from e
    check_finite(model.state_dict(), f"{source}'s {WEIGHTS_NAME}", HubError)
    return model


def _hub_architecture(arch: str) -> str:
    return f'{HUB_ARCH}.{arch} ({PLUGIN_HINT})'


def _read_rgb_as_gray(model: nn.Module) -> None:
    """Let a 1-channel model built for transformers take the RGB images its pipelines make of every image
    (``transformers.image_utils.load_image``): its first convolution reads 3-channel input as its luma, with PIL's
    ``convert('L')`` weights (ITU-R 601-2), ``Y = 0.299 R + 0.587 G + 0.114 B``. 1-channel input passes unchanged."""
    first_conv = model.pretrained_cfg.get('first_conv')
    first_conv = first_conv[0] if isinstance(first_conv, (list, tuple)) else first_conv
    if first_conv:
        model.get_submodule(first_conv).register_forward_pre_hook(_luma_of_rgb)


def _luma_of_rgb(module: nn.Module, args: tuple) -> tuple | None:
    x = args[0]
    if x.dim() != 4 or x.shape[1] != 3:
        return None
    r, g, b = x.unbind(1)
    # Y = R + 0.587 (G - R) + 0.114 (B - R): the same weights, and exactly R where R = G = B (a grayscale image)
    return ((r + 0.587 * (g - r) + 0.114 * (b - r)).unsqueeze(1), *args[1:])


def _folder_architecture(tag: str) -> str | None:
    """``<arch>`` of the tag ``<arch> (<hint>)`` of a folder's ``architecture``, None for any other tag."""
    arch, hint, rest = tag.partition(f' ({PLUGIN_HINT})')
    return arch if hint and not rest and timm.is_model(arch) else None


def save_hub_folder(
        model: nn.Module,
        output_dir: str | Path,
        *,
        model_args: dict,
        card: dict | None = None,
        metrics: dict | None = None,
        extra_files: Mapping[str, str | bytes] | None = None,
        data_config: dict | None = None,
        overwrite: bool = False,
) -> Path:
    """Write a timm Hub folder for ``model``, atomically.

    The folder holds ``model.safetensors``, timm's ``config.json`` and ``README.md`` (the model
    card, see ``render_model_card``), plus ``extra_files`` (e.g. ``conversion_report.json``). It
    is written to a temporary sibling directory and renamed into place, so ``output_dir`` is
    either complete or untouched.

    Args:
        model: A timm model (created by ``timm.create_model``).
        output_dir: Folder to create.
        model_args: Arguments that rebuild the architecture, e.g.
            ``{'norm_layer': 'patchnorm', 'num_classes': 10, 'in_chans': 1}``; they supplement
            those timm recorded when it created the model and must be JSON serializable.
        card: Free model card fields (see ``render_model_card``).
        metrics: Measured metrics for the card's ``model-index``, e.g. ``{'top1': 91.2}``.
        extra_files: File name -> text or bytes, written beside the model; a ``metrics.png`` is shown in the card.
        data_config: The preprocessing the weights were trained with (``input_size``, ``mean``, ``std``, ...);
            default: that in the model's ``pretrained_cfg``, at its current input size. ``config.json``'s
            ``pretrained_cfg`` describes these weights: this preprocessing, the class count, the pool size at this
            input size, and none of the source checkpoint's tag, paper or test-time size.
        overwrite: Replace an existing ``output_dir``.

    Returns:
        ``output_dir``.
    """
    output_dir = Path(output_dir)
    if output_dir.exists() and not overwrite:
        raise OutputExistsError(f'{output_dir} already exists; pass overwrite=True (--overwrite) to replace it.')
    extra_files = dict(extra_files or {})
    for name in extra_files:
        _check_extra_file_name(name)

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(output_dir) as tmp_dir:
        data_config = dict(data_config or _data_config(model))
        save_safetensors(model.state_dict(), tmp_dir / WEIGHTS_NAME)
        config_path = tmp_dir / CONFIG_NAME
        save_config_for_hf(model, config_path, model_config=model_labels(model), model_args=model_args,
                           data_config=data_config)
        config = json.loads(config_path.read_text())
        # the top-level entries are those both loaders read: the class count (transformers passes its own
        # num_classes beside model_args) and the class names
        config['model_args'].pop('num_classes', None)
        for key in (*SOURCE_CFG_KEYS, *LABEL_KEYS):
            config['pretrained_cfg'].pop(key, None)
        config['pretrained_cfg']['pool_size'] = _pool_size(model, config['pretrained_cfg']['input_size'])
        arch = config['architecture']
        config['architecture'] = _hub_architecture(arch)
        config['pretrained_cfg']['architecture'] = arch
        if card and card.get('license'):
            config['pretrained_cfg']['license'] = card['license']
        config_path.write_text(json.dumps(config, indent=2))
        render_model_card(config, card=card, metrics=metrics, model_name=output_dir.name,
                          plot=PLOT_NAME if PLOT_NAME in extra_files else None).save(tmp_dir / CARD_NAME)
        for name, content in extra_files.items():
            path = tmp_dir / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(content, encoding='utf-8')
    return output_dir


def _data_config(model: nn.Module) -> dict:
    """The preprocessing recorded with the model (`pretrained_cfg`, where the Trainer and `convert_to_folder` put
    theirs), at the model's current input size."""
    cfg = getattr(model, 'pretrained_cfg', {})
    input_size = get_model_input_config(model)['input_size']
    config = {k: cfg[k] for k in ('interpolation', 'crop_pct', 'crop_mode') if cfg.get(k) is not None}
    # per-channel statistics of other channels (ImageNet's 3 for a 1-channel model) are left to timm, which averages
    config.update({k: cfg[k] for k in ('mean', 'std') if cfg.get(k) is not None and len(cfg[k]) == input_size[0]})
    return dict(config, input_size=input_size)


def _pool_size(model: nn.Module, input_size) -> list[int] | None:
    """The spatial size of `model`'s final feature map at `input_size` (what timm's `pool_size` records), from a
    forward on fake tensors (shapes only); None for models whose features are not (N, C, H, W)."""
    try:
        with fake_eval(model):
            features = model.forward_features(torch.empty(1, *input_size, device=_device(model)))
    except Exception:  # a model without forward_features, or one fake tensors cannot run: no size is recorded
        return None
    return list(features.shape[-2:]) if features.dim() == 4 else None


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters(), torch.empty(0)).device


def _check_extra_file_name(name: str) -> None:
    path = Path(name)
    if path.is_absolute() or '..' in path.parts or not path.parts:
        raise OptionError(f'extra file {name!r}: give a relative path inside the folder.')
    if name in REQUIRED_FILES:
        raise OptionError(f'extra file {name!r} would replace the {name} that save_hub_folder writes.')
    if name.endswith(PICKLE_SUFFIXES):
        raise OptionError(f'extra file {name!r} is a pickle format; Hub folders publish safetensors only.')


def model_card_template() -> str:
    """The model-card template, read from the installed package's data."""
    try:
        return (importlib.resources.files(MODEL_CARD_PACKAGE) / MODEL_CARD_TEMPLATE).read_text(encoding='utf-8')
    except (ModuleNotFoundError, FileNotFoundError) as e:  # a source tree on sys.path, not an installed package
        raise HubError(f'the model-card template {MODEL_CARD_PACKAGE}/{MODEL_CARD_TEMPLATE} is missing ({e}): '
                       'install the package (pip install timm-affinediv, or pip install -e . in a checkout).') from e


def render_model_card(
        config: dict,
        *,
        card: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
        model_name: str,
        plot: str | None = None,
) -> ModelCard:
    """Render the model card (``README.md``) of a Hub folder from ``model_cards/patchnorm.md``.

    Args:
        config: The folder's ``config.json`` content.
        card: Free fields. Used in the card: ``repo_id`` (for the loading snippet and the title; unknown: a
            placeholder the card says to replace), ``model_name``, ``base_model`` (Hub id of the model this one was
            converted or fine-tuned from: the card's ``base_model`` metadata), ``base_model_description`` (the base
            model in words, e.g. a local folder not on the Hub), ``datasets`` (Hub dataset ids), ``dataset_name``
            (pretty name), ``dataset_split`` (default ``test``), ``eval_set`` (the evaluation set in words, with its
            size), ``license`` (default: the weights' ``pretrained_cfg`` license, else ``apache-2.0``), ``recipe``
            (conversion and training text), ``norm_layer`` (default ``model_args['norm_layer']``), ``tags`` (added
            to the standard ones). Other fields go to the card's metadata as they are.
        metrics: Metric name -> value for the ``model-index``; ``top1``/``top5`` are accuracies in %.
        model_name: Default model name (the folder name), when neither ``model_name`` nor ``repo_id`` is given.
        plot: File name of the training curves in the folder, shown in the card.

    Returns:
        The card, parsed back by ``ModelCard`` so that its metadata is known to be valid.
    """
    fields = dict(card or {})
    repo_id = fields.pop('repo_id', None)
    model_name = fields.pop('model_name', None) or (repo_id.split('/')[-1] if repo_id else model_name)
    recipe = fields.pop('recipe', 'Not recorded.')
    dataset_name = fields.pop('dataset_name', None)
    dataset_split = fields.pop('dataset_split', 'test')
    eval_set = fields.pop('eval_set', None)
    base_model_description = fields.pop('base_model_description', None)
    datasets = fields.pop('datasets', None)
    datasets = [datasets] if isinstance(datasets, str) else datasets
    model_args = config.get('model_args', {})
    norm_layer = fields.pop('norm_layer', None) or model_args.get('norm_layer')
    norm_tags = [norm_layer] if norm_layer in NORM_TAGS else []
    tags = list(dict.fromkeys([*CARD_TAGS, *norm_tags, *fields.pop('tags', [])]))

    eval_results = None
    if metrics:
        if not datasets:
            raise OptionError("metrics need the evaluation dataset: pass card={'datasets': [...], ...}.")
        eval_results = [
            EvalResult(
                task_type='image-classification',
                task_name='Image Classification',
                dataset_type=datasets[0],
                dataset_name=dataset_name or datasets[0],
                dataset_split=dataset_split,
                metric_type=key,
                metric_name=_METRIC_NAMES.get(key, key),
                metric_value=value,
            )
            for key, value in metrics.items()
        ]
    data = ModelCardData(
        library_name='timm',
        pipeline_tag='image-classification',
        license=fields.pop('license', config['pretrained_cfg'].get('license', 'apache-2.0')),
        tags=tags,
        base_model=fields.pop('base_model', None),
        datasets=datasets,
        model_name=model_name,
        eval_results=eval_results,
        **fields,
    )
    if not eval_set:
        eval_set = f'the {dataset_split} split of {dataset_name or datasets[0]}' if datasets else 'not recorded'
    results = '\n'.join(f'| {r.metric_name} | {eval_set} | {r.metric_value} |' for r in eval_results or [])
    base_model = ' '.join(filter(None, [f'[{data.base_model}](https://huggingface.co/{data.base_model})'
                                        if data.base_model else None, base_model_description]))
    body = string.Template(model_card_template()).substitute(
        model_name=model_name,
        repo_id=repo_id or REPO_PLACEHOLDER,
        repo_note='' if repo_id else (
            f'\n`{REPO_PLACEHOLDER}` stands for the repo this folder is pushed to: replace it with that repo id '
            '(`timm-affinediv push FOLDER --repo-id ORG/NAME`).\n'),
        architecture=config['pretrained_cfg']['architecture'],
        norm_description=_norm_description(norm_layer),
        model_args=json.dumps(model_args),
        base_model=base_model or 'none (trained from scratch)',
        datasets=', '.join(datasets or []) or 'not recorded',
        input_size='x'.join(str(s) for s in config['pretrained_cfg']['input_size']),
        recipe=recipe,
        eval_set=eval_set,
        results=results or '| not measured | | |',
        plot=f'\n![Training curves: loss and top-1 per epoch]({plot})\n' if plot else '',
        plugin_hint=PLUGIN_HINT,
        classes=_classes_text(config),
    )
    return ModelCard(f'---\n{data.to_yaml()}\n---\n{body}', ignore_metadata_errors=False)


def _classes_text(config: Mapping[str, Any]) -> str:
    """The card's list of the classes: every name (with its description where the folder has one) up to
    ``CARD_CLASSES``, the first ones beyond."""
    names, descriptions = config.get('label_names'), config.get('label_descriptions') or {}
    count = config['num_classes']
    if not names:
        return (f'{count} classes, not named: the dataset it was trained on names none, so the outputs are numbers '
                f'(`LABEL_0` ... `LABEL_{count - 1}` in transformers).')
    shown = [f'`{name}` ({descriptions[name]})' if name in descriptions else f'`{name}`'
             for name in names[:CARD_CLASSES]]
    rest = f', ... ({count} in all)' if count > CARD_CLASSES else ''
    where = '`label_names` in `config.json`' + (', with their descriptions in `label_descriptions`'
                                                 if descriptions else '')
    return f"{count} classes, by output index ({where}; the labels of transformers' pipeline): " \
           f"{', '.join(shown)}{rest}."


def _norm_description(norm_layer: str | None) -> str:
    if norm_layer == 'patchnorm':
        return ('Norm layer: `patchnorm`. timm-affinediv\'s PatchNorm divides each convolution\'s output at every '
                'position by the root mean square of the input patch it reads (plus one for the bias), so that a '
                'gradient step moves every sample and position by the same factor: the affine divergence is removed.')
    if norm_layer == 'patchnorm_ws':
        return ('Norm layer: `patchnorm_ws`. PatchNorm, as `patchnorm`, with each convolution\'s weight standardised '
                'per output channel (`(W - mean W) / sqrt(n (var W + 1e-6))`, timm\'s `ScaledStdConv2d`), so its '
                'output does not grow with the weight\'s scale.')
    if norm_layer == 'affinediv':
        return ('Norm layer: `affinediv`. Every convolution and linear layer is divergence corrected '
                '(`(W x + b) / s(x)`), with no normaliser: the paper\'s alternative to normalisation.')
    name = f'`{norm_layer}`' if norm_layer else "the architecture's own"
    return (f'Norm layer: {name}. This model has no PatchNorm: it is a baseline (e.g. the model a PatchNorm version '
            'is converted from), published with timm-affinediv.')


@dataclass(frozen=True)
class UploadPlan:
    """What ``push_to_hub`` uploads: the folder's files and sizes, and where they go."""
    folder: Path
    files: tuple[tuple[str, int], ...]
    endpoint: str
    repo_id: str
    revision: str
    private: bool
    create_pr: bool
    token_source: str | None  # where the token comes from; None: no token

    def describe(self) -> str:
        """Human readable plan, one file a line (never shows the token itself)."""
        target = 'a pull request against' if self.create_pr else 'branch'
        lines = [
            f'endpoint: {self.endpoint}',
            f"repo:     {self.repo_id} ({'private' if self.private else 'public'} model repo if created)",
            f'revision: {target} {self.revision}',
            f"token:    {self.token_source or 'none found (pass --token, set HF_TOKEN or run `hf auth login`)'}",
            f'files from {self.folder}:',
            *(f'  {size:>12,d}  {name}' for name, size in self.files),
            f'  {sum(size for _, size in self.files):>12,d}  total, {len(self.files)} files',
        ]
        return '\n'.join(lines)


def _plan_upload(
        folder: str | Path,
        repo_id: str,
        *,
        private: bool = False,
        revision: str | None = None,
        create_pr: bool = False,
        token: str | None = None,
) -> UploadPlan:
    """Check a Hub folder and a repo id, and list what ``push_to_hub`` would upload where.

    Raises:
        HubError: the folder is not a complete safetensors Hub folder that loads with timm, holds pickle weight
            files or a symbolic link out of it, the repo id is invalid, or ``create_pr`` is combined with a
            ``revision``.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise HubError(f'{folder} is not a directory; write a Hub folder with timm_affinediv.hub.save_hub_folder.')
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise HubError(f"invalid repo id {repo_id!r}: {e} Use 'org/name', e.g. 'my-org/resnet18-patchnorm'.") from e
    if create_pr and revision not in (None, constants.DEFAULT_REVISION):
        raise HubError(
            f'create_pr (--create-pr) opens a pull request against {constants.DEFAULT_REVISION};'
            ' do not also give a revision (--revision).'
        )

    _refuse_links_out(folder)
    # the files upload_folder takes: every file but those its default ignore patterns skip
    paths = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob('*')) if p.is_file()}
    names = list(filter_repo_objects(paths, ignore_patterns=DEFAULT_IGNORE_PATTERNS))
    forbidden = [n for n in names if set(FORBIDDEN_FOLDERS) & set(n.split('/'))]
    if forbidden:
        raise HubError(f"{folder} holds {', '.join(forbidden)}, under a name the Hub takes no files in "
                       f"({', '.join(sorted(FORBIDDEN_FOLDERS))}): remove or move them before pushing.")
    missing = [n for n in REQUIRED_FILES if n not in paths]
    if missing:
        # a training run's folder holds its Hub folder in model/ (finetune.py, pipeline.py)
        inner = next((p for p in sorted(folder.glob(f'*/{CONFIG_NAME}')) if (p.parent / WEIGHTS_NAME).is_file()), None)
        to_do = f'Push its Hub folder {inner.parent} instead.' if inner is not None else \
            'Write one with timm_affinediv.hub.save_hub_folder.'
        raise HubError(f"{folder} is not a Hub model folder: missing {', '.join(missing)}. {to_do}")
    _check_config(paths[CONFIG_NAME])
    pickles = [n for n in names if n.lower().endswith(PICKLE_SUFFIXES)]
    if pickles:
        raise HubError(
            f"{folder} holds pickle weight files ({', '.join(pickles)}), which can run code when loaded;"
            f' only safetensors are published. Remove them (the weights belong in {WEIGHTS_NAME}).'
        )
    _check_loads(folder)

    if token is not None:
        token_source = 'given (hidden)'
    elif get_token() is not None:
        token_source = 'HF_TOKEN or saved login (hidden)'
    else:
        token_source = None
    return UploadPlan(
        folder=folder,
        files=tuple((n, paths[n].stat().st_size) for n in names),
        endpoint=_endpoint(),
        repo_id=repo_id,
        revision=revision or constants.DEFAULT_REVISION,
        private=private,
        create_pr=create_pr,
        token_source=token_source,
    )


def _refuse_links_out(folder: Path) -> None:
    """Refuse a symbolic link in ``folder`` to a file or folder outside it: ``upload_folder`` reads through links, so
    it would publish the target (a token file, a home folder). Links inside the folder publish the folder's own
    files; hard links are files of the folder."""
    root = os.path.realpath(folder)
    links = {p.relative_to(folder).as_posix(): p for p in folder.rglob('*') if p.is_symlink()}
    for name in filter_repo_objects(sorted(links), ignore_patterns=DEFAULT_IGNORE_PATTERNS):
        path, target = links[name], os.path.realpath(links[name])
        if os.path.commonpath([root, target]) != root:
            raise HubError(f'{path} is a symbolic link to {target}, outside {folder}, and push would upload what it '
                           'points to: copy the file into the folder (cp -L) if it is meant to be published, or '
                           'remove the link.')


def _check_config(path: Path) -> None:
    """Refuse a ``config.json`` that is not a timm-affinediv folder's (``read_config``, and an architecture that
    names the plugin), or that transformers cannot load: ``num_classes`` in ``model_args`` (a folder of an earlier
    timm-affinediv), which transformers passes again beside them."""
    config = read_config(path)
    arch = config.get('pretrained_cfg', {}).get('architecture')
    if not isinstance(arch, str) or config['architecture'] != _hub_architecture(arch):
        raise HubError(f"{path} names the architecture {config['architecture']!r}, not a timm-affinediv Hub folder's "
                       f"({_hub_architecture('<arch>')!r}, with <arch> in pretrained_cfg): write the folder with "
                       'timm_affinediv.hub.save_hub_folder.')
    if 'num_classes' in config.get('model_args', {}):
        raise HubError(
            f"{path} has num_classes in model_args, where transformers' AutoModel and pipeline cannot load it "
            '(they pass their own): write the folder again with timm_affinediv.hub.save_hub_folder, or move it to '
            "config.json's top-level num_classes.")


def _check_loads(folder: Path) -> None:
    """Refuse a folder that does not load as its users will load it, ``timm.create_model('local-dir:...',
    pretrained=True)``: weights that are cut short, do not fit the architecture or are not finite."""
    try:
        timm.create_model(f'local-dir:{folder}', pretrained=True)
    except HubError:  # the plugin's loader refused it, in a line of its own
        raise
    except (RuntimeError, ValueError) as e:  # timm's own refusals (an architecture it lacks, a stem it cannot adapt)
        raise HubError(f"{folder} does not load with timm ({' '.join(str(e).split())}): write it again with "
                       'timm_affinediv.hub.save_hub_folder.') from e


def _endpoint() -> str:
    """The Hub endpoint: ``HF_ENDPOINT`` as it is now, else huggingface_hub's default."""
    return (os.environ.get('HF_ENDPOINT') or constants.ENDPOINT).rstrip('/')


def push_to_hub(
        folder: str | Path,
        repo_id: str,
        *,
        private: bool = False,
        revision: str | None = None,
        create_pr: bool = False,
        commit_message: str | None = None,
        token: str | None = None,
        dry_run: bool = False,
) -> CommitInfo | UploadPlan:
    """Upload a Hub folder written by ``save_hub_folder`` to ``repo_id``.

    The repo is created if needed, a missing ``revision`` branch is created from ``main``, and
    the folder is uploaded in one commit (``huggingface_hub.HfApi.upload_folder``); unchanged
    files are skipped, so pushing the same folder twice commits nothing the second time.

    Args:
        folder: The Hub folder.
        repo_id: ``org/name`` (or ``name`` in the token owner's namespace).
        private: Create the repo private (an existing repo keeps its visibility).
        revision: Branch to push to (default ``main``).
        create_pr: Open a pull request against ``main`` instead of committing to it.
        commit_message: Commit title.
        token: Hub token; default ``HF_TOKEN`` or the saved login. Never printed or logged.
        dry_run: Only check and plan (``UploadPlan.describe`` shows it): upload nothing and
            contact no server.

    Returns:
        The plan when ``dry_run``, else the ``CommitInfo`` of the commit (or of the current head
        when nothing changed).

    Raises:
        HubError: bad folder or repo id (before any request), no or rejected token, the
            endpoint cannot be reached or answered with an error.
    """
    plan = _plan_upload(folder, repo_id, private=private, revision=revision, create_pr=create_pr, token=token)
    if dry_run:
        return plan

    api = HfApi(endpoint=plan.endpoint, token=token, library_name='timm', library_version=timm.__version__)
    try:
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        if revision not in (None, constants.DEFAULT_REVISION) and not create_pr:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=plan.folder,
            # the files checked and listed, not whatever the folder holds by now
            allow_patterns=[glob.escape(name) for name, _ in plan.files],
            revision=revision,
            create_pr=create_pr,
            commit_message=commit_message or f'Upload {plan.folder.name} with timm-affinediv',
        )
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status == 401 and plan.token_source is None:
            raise HubError(
                f'{plan.endpoint} requires a Hub token and none was found: pass --token (token=),'
                ' set HF_TOKEN or run `hf auth login`. Nothing was committed.'
            ) from e
        if status in (401, 403):
            raise HubError(
                f'{plan.endpoint} refused the token ({status}) for {repo_id}: check that it is valid and has'
                ' write access to the namespace. Nothing was committed.'
            ) from e
        summary = str(e).strip().splitlines()[0]
        raise HubError(f'{plan.endpoint} answered {status} for {repo_id}: {summary}') from e
    except httpx2.TransportError as e:
        raise HubError(
            f'cannot reach the Hub at {plan.endpoint} ({e}); check HF_ENDPOINT and the network.'
        ) from e
