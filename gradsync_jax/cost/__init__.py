"""Cost-model measurements on JAX: the machine profile (``calibrate``) and the model profile."""

from gradsync_jax.cost.machine import calibrate
from gradsync_jax.cost.model import profile_model

__all__ = ["calibrate", "profile_model"]
