"""Write the glossary tables of docs/design-names-and-layout.md (§13): ``python docs/gen_names.py``.

One word per concept across the API. ``GLOSSARY`` is the list of record: each word, what it
means, and the spellings it retired, per package. ``LONG_SIGNATURES`` names the exported
functions that keep more than eight parameters without an options record, with the reason.
The old spellings still accepted are not listed here but found: every function of the three
packages declares its own (``gradsync_core.deprecation``: ``renamed_keywords``,
``deprecated_keywords``, ``deprecated_alias``), and ``aliases()`` collects them.

The three tables sit between markers in the page; ``--check`` exits 1 when they differ from
what this script writes (tests/test_vocabulary.py runs the same comparison, and walks every
exported signature for a retired word or an undeclared long list), so the glossary cannot
drift from the code, as docs/api.md cannot drift from ``__all__``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pathlib
import pkgutil
import sys
from collections.abc import Callable, Iterator
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
NAMES_MD = ROOT / "docs" / "design-names-and-layout.md"
# The API: each package's top level (and the core's two public layers, for executors).
PACKAGES = (
    "gradsync_core",
    "gradsync_core.plan",
    "gradsync_core.checkpoint",
    "gradsync_torch",
    "gradsync_jax",
)
TOP = ("gradsync_core", "gradsync_torch", "gradsync_jax")
ALL = TOP
MAX_PARAMETERS = 8


@dataclasses.dataclass(frozen=True)
class Term:
    """One word of the API: what it means, and the spellings it replaced in ``packages``."""

    word: str
    meaning: str
    retired: tuple[str, ...] = ()
    packages: tuple[str, ...] = ALL


GLOSSARY = (
    Term(
        "path",
        "where a checkpoint is: the directory a save writes and a load reads (a `str` or "
        "`os.PathLike`), in both executors and the core",
        ("directory",),
    ),
    Term(
        "allow_dtype_conversion",
        "a load may convert a tensor stored in another floating dtype instead of refusing it; "
        "one of the `allow_*` family with `allow_nonfinite` and `allow_resize`",
        ("cast",),
    ),
    Term(
        "tx",
        "an Optax transformation (`optax.adamw(...)`, a `shard_optimizer`), in every JAX signature",
        ("optimizer",),
        ("gradsync_jax",),
    ),
    Term(
        "optimizer_name",
        "an optimizer's name as a checkpoint records it (`\"adamw\"`; the manifest's "
        "`optimizer` field), in JAX, where `tx` is the object",
        ("optimizer",),
        ("gradsync_jax",),
    ),
    Term(
        "optimizer",
        "torch: a `torch.optim.Optimizer`; core: the optimizer a planner or check is about, "
        'described without a framework (a name such as `"adam"`, or state bytes per '
        "element), as the manifest's `optimizer` field records it",
        packages=("gradsync_torch", "gradsync_core"),
    ),
    Term(
        "axis_name",
        "JAX: a mesh axis, or a tuple of them, as `jax.lax` collectives and `shard_map` "
        "take it; a mesh axis with a role is `<role>_axis_name` (`replicate_axis_name`)",
        ("replicate_axis", "replicate"),
        ("gradsync_jax",),
    ),
    Term(
        "axis",
        "JAX mappings and layers: a model-parallel group (a mesh axis, a tuple, or a gradsync "
        'group name such as `"tp-cp"`, resolved with `group_axes`); core `Topology`: one of '
        "its axes (`tp`, `dp_shard`, ...)",
        packages=("gradsync_jax", "gradsync_core"),
    ),
    Term(
        "data_axes",
        "the mesh axes the model's input is split over (the tokens' axes): torch a tuple of "
        'names (`("cp",)`), JAX the input\'s `PartitionSpec` or such a tuple',
        ("data_spec",),
        ("gradsync_jax", "gradsync_torch"),
    ),
    Term(
        "reshard_after_forward",
        "ZeRO-3: drop a gathered parameter after its forward use (FSDP2's word)",
        ("reshard",),
        ("gradsync_jax",),
    ),
    Term(
        "accumulate_steps",
        "micro-batches per step, their gradients summed before the update",
        ("accumulate",),
        ("gradsync_jax",),
    ),
    Term(
        "process_group",
        "torch: a `torch.distributed.ProcessGroup` a wrapper or optimizer reduces over "
        "(DDP's and torch ZeRO's word)",
        packages=("gradsync_torch",),
    ),
    Term(
        "group",
        'torch: one named group of a `ProcessGroups` (`groups["tp"]`, a `Group`) that a '
        "layer or mapping runs its collectives over (the mappings also take a "
        "`ProcessGroup`, as `torch.distributed`'s collectives call theirs `group=`); core: "
        'a group\'s name in a plan (`"tp-cp"`)',
        packages=("gradsync_torch", "gradsync_core"),
    ),
    Term(
        "groups",
        "torch: gradsync's `ProcessGroups`, every group of a `Topology`",
        packages=("gradsync_torch",),
    ),
    Term(
        "mesh",
        "torch: a `DeviceMesh` (FSDP2's word); JAX: a `jax.sharding.Mesh`",
        packages=("gradsync_torch", "gradsync_jax"),
    ),
    Term(
        "options",
        "the record that holds a function's options (`DataParallelOptions`, `Zero3Options`), "
        "taken instead of its keywords, never with them",
    ),
)

# Exported signatures of more than MAX_PARAMETERS parameters that take no options record.
LONG_SIGNATURES = {
    "gradsync_core.Configuration": "a record itself: one configuration the cost model and the "
    "search compare",
    "gradsync_core.MachineProfile": "a record itself: one machine's measurements (each "
    "collective's fit, copy bandwidth, slowdown, host overheads, scratch), read from the "
    "versioned JSON `gradsync calibrate` writes",
    "gradsync_core.configurations": "the search space: each keyword is one dimension of it "
    "(ZeRO stages, bucket caps, HSDP shapes, pp sizes, schedules, microbatches, overlap)",
    "gradsync_core.predict": "a planner of plain data, every argument after the "
    "`Configuration` record keyword-only: each is a fact of the model, the machine or the "
    "batch, none an option to set once and pass on",
    "gradsync_core.predict_data_parallel": "as `predict`, for one data-parallel plan: the "
    "plans and the facts they are costed with",
    "gradsync_core.predict_zero3": "as `predict`, for one parameter-shard plan",
    "gradsync_core.simulate_pipeline": "a simulator of plain data, every argument after the "
    "plan keyword-only and 0 or None by default (the closed forms): each is one measured "
    "duration of the timeline (a compute, a post, a trip, a reduction) or the machine's "
    "cores the ranks share, none an option to set once",
    "gradsync_core.search_configurations": "as `predict`, over the candidates: the model, the "
    "machine, the memory limit and the batch are facts, the candidates a list of records",
    "gradsync_jax.profile_model": "the blocks, an input and the loss to time, plus the mesh, "
    "the optimizer and the timing's two counts; `gradsync_torch.profile_model` takes the "
    "same, as a function of plain data",
    "gradsync_core.Manifest": "a record itself: its fields are the manifest's JSON keys",
    "gradsync_torch.DataParallelOptions": "a record itself: the options `DataParallel` takes "
    "as `options=`",
    "gradsync_core.Topology.create": "the constructor of the `Topology` record, one keyword "
    "per axis size",
    "gradsync_core.plan_pipeline": "a planner of plain data, every argument keyword-only: "
    "each is a fact of the pipeline (schedule, microbatches, topology, the layers or their "
    "specs and weights, ZeRO-3), none an option to set once and pass on",
    "gradsync_jax.ColumnParallelLinear": "`nnx.Linear`'s own keywords (`use_bias`, "
    "`kernel_init`, `param_dtype`, `rngs`) plus the split axis and sequence parallelism",
    "gradsync_jax.RowParallelLinear": "as `ColumnParallelLinear`",
    "gradsync_torch.ResumableSampler": "`DistributedSampler`'s list (`num_replicas`, `rank`, "
    "`shuffle`, `seed`, `drop_last`) plus the position's three",
    "gradsync_jax.save_optimizer_state": "four things to save (path, tx, state, params) and "
    "six keyword-only extras of different kinds (the step, the optimizer's name, the module "
    "renames, the weights, the data position, `blocking`), as torch's `opt.save(path, "
    "model=, data=, blocking=)`; no record holds them, and one made up for a single function "
    "would be one more import",
    "gradsync_jax.save_boxes": "as `save_optimizer_state`: four things to save (path, "
    "parameters, state, tx) and keyword-only extras (the step, the layout, the module renames, "
    "the optimizer's name, the data position, `blocking`)",
    "gradsync_jax.save_pipeline": "as `save_optimizer_state`, which it calls: the pipeline, "
    "its parameters and state, and the same keyword-only extras",
}


def _user_functions(obj: Any, package: str) -> Iterator[tuple[str, Callable[..., Any]]]:
    """(``name``, function) for ``obj`` and, for a class, its constructor and public methods
    (inherited ones included) written in ``package``'s top-level package."""
    top = package.split(".")[0]
    if not inspect.isclass(obj):
        if callable(obj):
            yield "", obj
        return
    for attr in ["__init__", *sorted(a for a in dir(obj) if not a.startswith("_"))]:
        try:
            member = inspect.getattr_static(obj, attr)
        except AttributeError:
            continue
        if isinstance(member, staticmethod | classmethod):
            member = member.__func__
        if not inspect.isfunction(member):
            continue
        if not (getattr(member, "__module__", None) or "").startswith(top):
            continue  # torch's, flax's or the standard library's own
        yield ("" if attr == "__init__" else f".{attr}"), member


def exported() -> Iterator[tuple[str, str, Callable[..., Any]]]:
    """``(package, qualified name, function)`` for every exported function, class
    constructor and public method, each object once."""
    seen: set[tuple[int, str]] = set()  # a class's inherited constructor: once per class
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            for suffix, function in _user_functions(obj, package):
                if (id(obj), suffix) in seen:
                    continue
                seen.add((id(obj), suffix))
                yield package.split(".")[0], f"{package}.{name}{suffix}", function


def parameters(function: Callable[..., Any]) -> list[str]:
    """The parameter names ``inspect.signature`` shows (``self`` and ``cls`` left out)."""
    try:
        names = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return []
    return names[1:] if names[:1] in (["self"], ["cls"]) else names


def retired(package: str) -> dict[str, str]:
    """Each word retired in the top-level ``package``, with the words that replace it."""
    out: dict[str, list[str]] = {}
    for term in GLOSSARY:
        if package in term.packages:
            for word in term.retired:
                out.setdefault(word, []).append(term.word)
    return {word: " or ".join(new) for word, new in out.items()}


def _public_name(function: Callable[..., Any]) -> str:
    """Where a user finds ``function``: its package's top level when that exports it (or its
    class), ``gradsync_jax.Zero3Step`` for a constructor; else its module path without the
    private tail (``gradsync_torch.param_sharding.gradient_divide``)."""
    qualname = function.__qualname__.removesuffix(".__init__")
    module = sys.modules[function.__module__]
    head = qualname.split(".")[0]
    top = function.__module__.split(".")[0]
    if getattr(sys.modules[top], head, None) is getattr(module, head, None):
        return f"{top}.{qualname}"
    parts = function.__module__.split(".")
    while parts[-1].startswith("_"):
        parts.pop()
    return ".".join([*parts, qualname])


def _every_function() -> Iterator[Callable[..., Any]]:
    """Every function and method defined in the three packages' modules."""
    for top in TOP:
        package = importlib.import_module(top)
        modules = [top] + [
            m.name
            for m in pkgutil.walk_packages(package.__path__, f"{top}.")
            if "__main__" not in m.name
        ]
        for name in modules:
            module = importlib.import_module(name)
            for obj in vars(module).values():
                if getattr(obj, "__module__", None) != name:
                    continue
                if inspect.isclass(obj):
                    for member in vars(obj).values():
                        if isinstance(member, staticmethod | classmethod):
                            member = member.__func__
                        if inspect.isfunction(member) and member.__module__ == name:
                            yield member
                elif inspect.isfunction(obj):
                    yield obj


@dataclasses.dataclass(frozen=True, order=True)
class Alias:
    """An old spelling still accepted: ``old`` at ``where``, and what replaces it."""

    where: str
    old: str
    new: str
    how: str


def aliases() -> list[Alias]:
    """Every old spelling the packages declare, sorted by where it is."""
    found: set[Alias] = set()
    for function in _every_function():
        where = _public_name(function)
        for old, new in getattr(function, "__renamed_keywords__", {}).items():
            found.add(Alias(where, f"{old}=", f"{new}=", "renamed"))
        for old, new in getattr(function, "__deprecated_keywords__", {}).items():
            found.add(Alias(where, f"{old}=", new, "converted"))
        target = getattr(function, "__deprecated_alias_of__", None)
        if target is not None:
            where = where.rpartition(".")[0]
            found.add(Alias(where, function.__name__, target, "alias"))
    return sorted(found)


HOW = {
    "renamed": "the same call under the new name",
    "converted": "converted to the new spelling",
    "alias": "the same function",
}


def _glossary_table() -> list[str]:
    lines = ["| word | meaning | retired spellings |", "|---|---|---|"]
    for term in GLOSSARY:
        scope = "" if term.packages == ALL else f" ({', '.join(term.packages)})"
        old = ", ".join(f"`{w}`" for w in term.retired) or "—"
        lines.append(f"| `{term.word}`{scope} | {term.meaning} | {old} |")
    return lines


def _aliases_table() -> list[str]:
    lines = [
        "| where | old spelling | new spelling | the old one, after one `DeprecationWarning` |",
        "|---|---|---|---|",
    ]
    for alias in aliases():
        lines.append(f"| `{alias.where}` | `{alias.old}` | `{alias.new}` | {HOW[alias.how]} |")
    return lines


def _long_table() -> list[str]:
    lines = ["| signature | why it keeps its keywords |", "|---|---|"]
    for name, why in sorted(LONG_SIGNATURES.items()):
        lines.append(f"| `{name}` | {why} |")
    return lines


BLOCKS = {
    "glossary": _glossary_table,
    "aliases": _aliases_table,
    "long signatures": _long_table,
}


def _markers(block: str) -> tuple[str, str]:
    begin = f"<!-- {block}: generated by docs/gen_names.py; do not edit -->"
    return begin, f"<!-- {block}: end -->"


def render() -> str:
    """The full text of docs/design-names-and-layout.md with the three tables regenerated.

    Raises:
        ValueError: the page lacks a table's markers.
    """
    text = NAMES_MD.read_text()
    for block, table in BLOCKS.items():
        begin, end = _markers(block)
        head, found_begin, rest = text.partition(begin)
        _, found_end, tail = rest.partition(end)
        if not (found_begin and found_end):
            raise ValueError(f"{NAMES_MD.name} lacks the markers {begin!r} ... {end!r}")
        text = head + "\n".join([begin, "", *table(), "", end]) + tail
    return text


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if NAMES_MD.read_text() != text:
            print(f"{NAMES_MD.name} is stale: run `python docs/gen_names.py` and commit it")
            return 1
        return 0
    NAMES_MD.write_text(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main(sys.argv[1:]))
