"""The checkpoint format and save protocol, for executors (docs/design.md §9).

``gradsync_core``'s top level holds what users call (``Manifest``, ``read_manifest``,
``CheckpointError``, ``COUNTERPARTS``); this module holds what an executor needs to read and
write the format: the switching save (``run_save`` behind ``SaveAgreement``, or its steps
``begin_save`` / ``commit_save`` / ``discard_save``), file and tensor names, the manifest
writer, saves that do not stop training (``start_save``: the save's second half in a background
thread, at most one in flight, ``SaveHandle``, ``wait_for_saves``; ``start_agreed_save`` for a
save that one rank writes), the rank-file writer that
takes tensors' bytes uncopied (``tensor_file``), the key and optimizer checks, the bounded
safetensors header reader, which stored element ranges a load reads (``state_reads``,
``weight_reads``) and the fault points of a save, and the preemption handler the executors
specialize (``PreemptionHandler``: SIGTERM, a save at the next step boundary, exit 143).
``gradsync_torch`` and ``gradsync_jax`` import from here; a new executor would too. Standard
library only, like the rest of the core.
"""

from gradsync_core.checkpoint._atomic import (
    begin_save,
    commit_save,
    discard_save,
    fsync_directory,
    new_save_token,
    resolve_checkpoint,
    staging_directory,
)
from gradsync_core.checkpoint._background import (
    SAVE_FAILED_EXIT,
    WRITER_NICE,
    SaveHandle,
    wait_for_saves,
)
from gradsync_core.checkpoint._boxes import (
    Box,
    Transfer,
    box_windows,
    distinct_boxes,
    plan_box_shards,
    plan_weight_owners,
    shard_region,
    transfers,
)
from gradsync_core.checkpoint._data_position import data_extra, restore_data
from gradsync_core.checkpoint._files import open_checkpoint_file
from gradsync_core.checkpoint._format import (
    FORMAT_VERSION,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    RANK_FILE_RE,
    Manifest,
    rank_file,
    rank_file_metadata,
    tensor_key,
)
from gradsync_core.checkpoint._hyperparams import (
    HYPERPARAMETERS,
    HyperparameterWarning,
    hyperparameter_warning,
)
from gradsync_core.checkpoint._layout import (
    LAYOUT,
    check_layout_record,
    describe_layout,
    layout_record,
)
from gradsync_core.checkpoint._model_weights import (
    MODEL_PARAM,
    WRAPPER_PREFIX,
    check_weight_names,
    is_wrapped,
    model_key,
    model_owners,
    unwrapped_names,
    weight_bytes,
    weight_owners,
)
from gradsync_core.checkpoint._param_shard_state import DIM0, plan_dim0_shards
from gradsync_core.checkpoint._preemption import PREEMPTED_EXIT, PreemptionHandler
from gradsync_core.checkpoint._reads import Window, WindowRead, state_reads, weight_reads
from gradsync_core.checkpoint._safetensors import (
    DTYPE_BYTES,
    MAX_HEADER_BYTES,
    TensorBytes,
    data_range,
    read_header,
    tensor_file,
)
from gradsync_core.checkpoint._save_hooks import SAVE_POINTS, save_hook
from gradsync_core.checkpoint._save_protocol import (
    CheckpointError,
    SaveAgreement,
    SaveSteps,
    error_message,
    run_save,
    start_agreed_save,
    start_save,
    write_rank_file,
)
from gradsync_core.checkpoint._state_keys import (
    COUNTERPARTS,
    LEGACY_OPTIMIZER_NAMES,
    OPTIMIZER_STATE_KEYS,
    canonical_optimizer,
    check_compatible,
    check_optimizer,
    check_state_keys,
    counterpart_keys,
)
from gradsync_core.checkpoint._storage import (
    check_rank_file,
    hash_share,
    read_manifest,
    reading_version,
    sha256_file,
    verify_file_hashes,
    write_atomic,
    write_manifest,
)
from gradsync_core.checkpoint._writer_process import (
    WRITER_SHARE,
    SharedStaging,
    StagedTensor,
    set_writer_share,
    write_staged_rank_file,
    writer_share,
)

__all__ = [
    "COUNTERPARTS",
    "DIM0",
    "DTYPE_BYTES",
    "FORMAT_VERSION",
    "HYPERPARAMETERS",
    "LAYOUT",
    "LEGACY_OPTIMIZER_NAMES",
    "MANIFEST",
    "MAX_HEADER_BYTES",
    "MAX_MANIFEST_BYTES",
    "MODEL_PARAM",
    "OPTIMIZER_STATE_KEYS",
    "PREEMPTED_EXIT",
    "RANK_FILE_RE",
    "SAVE_FAILED_EXIT",
    "SAVE_POINTS",
    "WRAPPER_PREFIX",
    "WRITER_NICE",
    "WRITER_SHARE",
    "Box",
    "CheckpointError",
    "HyperparameterWarning",
    "Manifest",
    "PreemptionHandler",
    "SaveAgreement",
    "SaveHandle",
    "SaveSteps",
    "SharedStaging",
    "StagedTensor",
    "TensorBytes",
    "Transfer",
    "Window",
    "WindowRead",
    "begin_save",
    "box_windows",
    "canonical_optimizer",
    "check_compatible",
    "check_layout_record",
    "check_optimizer",
    "check_rank_file",
    "check_state_keys",
    "check_weight_names",
    "commit_save",
    "counterpart_keys",
    "data_extra",
    "data_range",
    "describe_layout",
    "discard_save",
    "distinct_boxes",
    "error_message",
    "fsync_directory",
    "hash_share",
    "hyperparameter_warning",
    "is_wrapped",
    "layout_record",
    "model_key",
    "model_owners",
    "new_save_token",
    "open_checkpoint_file",
    "plan_box_shards",
    "plan_dim0_shards",
    "plan_weight_owners",
    "rank_file",
    "rank_file_metadata",
    "read_header",
    "read_manifest",
    "reading_version",
    "resolve_checkpoint",
    "restore_data",
    "run_save",
    "save_hook",
    "set_writer_share",
    "sha256_file",
    "shard_region",
    "staging_directory",
    "start_agreed_save",
    "start_save",
    "state_reads",
    "tensor_file",
    "tensor_key",
    "transfers",
    "unwrapped_names",
    "verify_file_hashes",
    "wait_for_saves",
    "weight_bytes",
    "weight_owners",
    "weight_reads",
    "write_atomic",
    "write_manifest",
    "write_rank_file",
    "write_staged_rank_file",
    "writer_share",
]
