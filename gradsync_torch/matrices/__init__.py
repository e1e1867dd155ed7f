"""Per-tensor optimizers (Muon) stepped exactly under every sharding (docs/matrix-optimizers.md)."""

from gradsync_torch.matrices._optimizer import MatrixOptimizer

__all__: list[str] = ["MatrixOptimizer"]
