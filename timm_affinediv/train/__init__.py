"""Training and fine-tuning timm models (PatchNorm or any other): `Trainer` runs the epochs, the rest is its parts."""
from .checkpoint import resolve_checkpoint
from .config import (
    EVAL_METRICS,
    CheckpointError,
    ConfigError,
    NonFiniteLossError,
    TrainConfig,
    TrainingError,
    TrainingInterrupted,
    TrainResult,
    load_timm_args,
)
from .distill import DistillationLoss, create_teacher
from .metrics import evaluate, final_top1, plot_history
from .trainer import Trainer, create_train_loss, create_train_model, plateau_reached
