"""Model-card templates: package data, installed as `timm_affinediv.model_cards` (see pyproject.toml)."""
