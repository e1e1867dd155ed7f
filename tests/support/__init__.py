"""What the test suites share, one copy each (a test module imports from here, never from
another ``test_*.py``).

- ``harness``: gloo ranks for torch tests (``run_workers``, ``run_checks``, ``one_rank_group``);
- ``asserts``: tree, dict and tensor comparisons (``assert_close``, ``assert_tree_close``, ...);
- ``meshes``: the JAX meshes of the first ``n`` devices (``mesh_of``, ``dp_mesh``);
- ``models``: the Flax MLP twins of tests/parity/torch_worker.py, random parameter trees;
- ``batches``: a rank's slice of a batch under a ``Topology`` (any array type);
- ``checkpoints``: a gradsync checkpoint written with the standard library;
- ``ports``: a free TCP port on 127.0.0.1;
- ``xla``: the compiler options of the tests' large JAX programs (``FAST_COMPILE``).

Each module imports only the framework it is about (``batches``, ``checkpoints``, ``ports``,
``xla`` and ``asserts`` none at import), so a torch rank or a core test imports what it needs
without JAX.
A problem that several test files share (a model, its data, its reference run) is a non-test
module beside them instead: ``tests/jax/zero3_problem.py``, ``tests/parity/mlp_twin.py``, ...
"""
