"""Cost-model measurements on torch: the machine profile (``calibrate``) and the model profile."""

from gradsync_torch.cost.machine import calibrate, calibrate_local
from gradsync_torch.cost.model import profile_model

__all__ = ["calibrate", "calibrate_local", "profile_model"]
