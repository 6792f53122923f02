""" The errors timm-affinediv reports to its user

Every one derives from `AffineDivError`, so `except AffineDivError` catches what the package raises about its
input (a model, file, dataset or setting it cannot use), and each keeps the builtin that fits it as its second base,
so `except ValueError` around a conversion or `except RuntimeError` around a training run works too. The command
line prints any of them as one line and exits with status 2 (`timm_affinediv.cli.run_main`).
"""
__all__ = [
    'AffineDivError', 'ConversionError', 'SlotLayoutError', 'DataError', 'TrainingError', 'ConfigError',
    'CheckpointError', 'NonFiniteLossError', 'HubError', 'ExportError', 'MissingFileError', 'TimmVersionError',
    'DeviceError', 'NormMismatchError', 'OptionError', 'ShapeError', 'UnsupportedTypeError', 'OutputExistsError',
    'BindingError', 'RegistrationError', 'KernelError', 'TorchVersionError']


class AffineDivError(Exception):
    """Base class of every error timm-affinediv reports: bad input, not a bug; the message says what to do."""


class MissingFileError(AffineDivError, FileNotFoundError):
    """A file or folder the caller named does not exist."""


class TimmVersionError(AffineDivError, ImportError):
    """The installed timm is outside the range this release is tested with (`timm_affinediv._timm_compat`)."""


class TorchVersionError(AffineDivError, ImportError):
    """The installed torch lacks a private name the package reaches (`timm_affinediv._torch_compat`)."""


class ConversionError(AffineDivError, ValueError):
    """A model or checkpoint that cannot be converted; the message lists what and why."""


class SlotLayoutError(AffineDivError, ValueError):
    """A `patchnorm` slot whose input does not hold its channels where it normalises them (token layouts)."""


class DataError(AffineDivError, RuntimeError):
    """A dataset that cannot be used: missing, empty, malformed or unreadable."""


class TrainingError(AffineDivError, RuntimeError):
    """Base class of the errors a training run reports to its user."""


class ConfigError(TrainingError, ValueError):
    """Settings that cannot work together (e.g. a head whose class count does not match the dataset)."""


class CheckpointError(TrainingError):
    """A checkpoint that cannot be read, or was written for another model or run."""


class NonFiniteLossError(TrainingError):
    """The training loss became NaN or infinite; the last good checkpoint is left as it was."""


class HubError(AffineDivError, RuntimeError):
    """A Hub folder, repo id or upload that cannot go ahead; the message says what to do."""


class ExportError(AffineDivError, RuntimeError):
    """An export failed, or the exported model does not compute the eager model's numbers."""


class DeviceError(AffineDivError, ValueError):
    """A device that does not exist here (e.g. 'cuda' on a machine without one)."""


class NormMismatchError(AffineDivError, ValueError):
    """A state dict of a model with other norm layers (BatchNorm) loaded into `patchnorm` / `affinediv` slots."""


class OptionError(AffineDivError, ValueError):
    """An argument or environment variable with a value the function does not take (a kernel mode, a layer's
    `scale`, a model with no layer to measure); the message says what it takes."""


class ShapeError(AffineDivError, ValueError):
    """A tensor with other dimensions or channels than the layer or function was built for."""


class UnsupportedTypeError(AffineDivError, TypeError):
    """An object of a type the function does not take (a PackedSequence, a layer with no divergence-corrected form)."""


class OutputExistsError(AffineDivError, FileExistsError):
    """An output path that holds earlier results, which nothing replaces unless told to (`--overwrite`)."""


class BindingError(AffineDivError, RuntimeError):
    """A model whose `patchnorm` slots cannot be bound to their neighbours: torch.fx cannot trace its forward."""


class RegistrationError(AffineDivError, RuntimeError):
    """timm's layer tables already hold another layer under a name this package registers (another plugin's)."""


class KernelError(AffineDivError, RuntimeError):
    """A Triton kernel that failed to build, launch or pass its self-check on this device, or Triton missing where
    the kernels were asked for (`set_kernels('triton')`)."""
