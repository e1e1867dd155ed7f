"""gradsync_torch: executes gradsync_core plans with torch."""

__all__: list[str] = []
