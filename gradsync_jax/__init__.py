"""gradsync_jax: executes gradsync_core plans with jax."""

__all__: list[str] = []
