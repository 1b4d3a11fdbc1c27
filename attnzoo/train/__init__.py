"""Training ViT / OT-ViT with any attention variant: ``attnzoo train CONFIG.yaml``."""
from .checkpoint import CheckpointError, CheckpointNotFoundError, load_checkpoint
from .config import TrainConfig, apply_overrides, from_dict, load_config
from .datasets import DataNotFoundError
from .loop import train

__all__ = ["TrainConfig", "load_config", "from_dict", "apply_overrides", "train", "load_checkpoint",
           "CheckpointError", "CheckpointNotFoundError", "DataNotFoundError"]
