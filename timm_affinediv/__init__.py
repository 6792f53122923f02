"""timm-affinediv: the layers of "The Affine Divergence" (ICLR 2026) for timm."""
__version__ = "0.1.0"
