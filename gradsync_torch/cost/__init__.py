"""Cost-model measurements on torch: the machine profile (``calibrate``) and the model profile."""
