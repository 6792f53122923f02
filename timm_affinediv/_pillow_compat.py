"""timm's RandAugment / AutoAugment posterize with Pillow 13: zero bits kept, as Pillow before 13 gave it.

timm's increasing-severity posterize (`rand-m9-mstd0.5-inc1`, the `-inc1` policies of the ConvNeXt and DeiT
recipes) keeps `4 - int(4 m / 10)` bits, 0 once a sampled magnitude m reaches 10. Pillow before 13 posterized to
0 bits as `x & ~(2^8 - 1) = 0`, a black image; Pillow 13 refuses 0 (`bits must be between or equal to 1 and 8`),
so such a recipe stops mid-epoch. `install_posterize_shim` puts `posterize` in timm's op table: the black image of
the same mode and size for 0 bits, timm's own op otherwise. `import timm_affinediv` installs it, so train.py's
`--device-modules timm_affinediv` gets it too; the ops of a policy are looked up when it is built
(`AugmentOp.__init__`), so it acts for policies built afterwards.
"""
from PIL import Image
from timm.data import auto_augment

__all__ = ['posterize', 'install_posterize_shim']

_timm_posterize = auto_augment.posterize


def posterize(img: Image.Image, bits_to_keep: int, **kwargs) -> Image.Image:
    """timm's `posterize`, with `bits_to_keep <= 0` giving the black image Pillow before 13 gave."""
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)  # every pixel x & 0
    return _timm_posterize(img, bits_to_keep, **kwargs)


def install_posterize_shim() -> None:
    """Route timm's posterize ops ('Posterize', 'PosterizeIncreasing', 'PosterizeOriginal') through `posterize`
    (idempotent)."""
    for name, op in auto_augment.NAME_TO_OP.items():
        if op is _timm_posterize:
            auto_augment.NAME_TO_OP[name] = posterize
