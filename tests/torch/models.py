"""Reference MLP models for the torch model-parallel tests (not public API).

They live beside the example that trains them (``examples/tp_models.py``), so the example and
the tests compare against one serial model.
"""

from examples.tp_models import MLPBlock, MLPTransformer, ParallelMLPBlock, ParallelMLPTransformer

__all__ = ["MLPBlock", "MLPTransformer", "ParallelMLPBlock", "ParallelMLPTransformer"]
