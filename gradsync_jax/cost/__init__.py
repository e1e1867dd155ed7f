"""Cost-model measurements on JAX: the machine profile (``calibrate``) and the model profile."""
