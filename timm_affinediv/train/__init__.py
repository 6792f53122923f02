"""Training and fine-tuning timm models (PatchNorm or any other): `Trainer` runs the epochs, the rest is its parts."""
from .trainer import (
    CheckpointError, ConfigError, DistillationLoss, NonFiniteLossError, TrainConfig, Trainer, TrainingError,
    TrainingInterrupted, TrainResult, create_teacher, create_train_model, evaluate, plot_history, resolve_checkpoint)
