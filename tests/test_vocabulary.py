"""One word per concept: every exported signature speaks the glossary of docs/design.md §13.

docs/gen_names.py holds the glossary (``GLOSSARY``: each word and the spellings it retired)
and the long signatures allowed without an options record (``LONG_SIGNATURES``); it finds
the old spellings still accepted on the functions themselves. These tests walk every
exported signature (each package's ``__all__``, constructors and public methods of exported
classes included) and fail on a retired word, on more than eight parameters without
``options=`` or a listed reason, on an alias that points at no parameter, and on a §13 table
that differs from what the generator writes.
"""

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _gen_names():
    spec = importlib.util.spec_from_file_location("gen_names", ROOT / "docs" / "gen_names.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_names"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


GEN = _gen_names()
EXPORTED = list(GEN.exported())


def test_no_exported_signature_shows_a_retired_word():
    found = [
        f"{name}({word}=): write {GEN.retired(package)[word]}="
        for package, name, function in EXPORTED
        for word in GEN.parameters(function)
        if word in GEN.retired(package)
    ]
    assert not found, (
        "retired words in exported signatures (docs/design.md §13; keep the old spelling as "
        f"an alias with gradsync_core.deprecation.renamed_keywords): {found}"
    )


def test_the_walk_sees_every_package_and_methods_and_nnx_constructors():
    """A walk that missed a package, the methods or an nnx constructor would pass vacuously."""
    names = {name: GEN.parameters(function) for _, name, function in EXPORTED}
    assert {package.split(".")[0] for package, _, _ in EXPORTED} == set(GEN.TOP)
    assert "path" in names["gradsync_torch.ZeroRedundancyOptimizer.load"]
    assert "axis" in names["gradsync_jax.ColumnParallelLinear"]  # nnx.Module's __init__
    assert "verify_files" in names["gradsync_core.read_manifest"]
    assert "options" in names["gradsync_torch.DataParallel"]
    assert len(names) > 300


def test_every_renamed_keyword_retires_its_word_and_points_at_a_parameter():
    """The wrapper passes ``old=v`` on as ``new=v`` (tests/core/test_deprecation.py): so the
    old spelling acts as the new one exactly when ``new`` is a parameter the signature shows
    and ``old`` is not; and the word it retires is in the glossary."""
    checked = 0
    for function in GEN._every_function():
        renames = getattr(function, "__renamed_keywords__", {})
        shown = GEN.parameters(function)
        top = function.__module__.split(".")[0]
        for old, new in renames.items():
            where = f"{function.__module__}.{function.__qualname__}"
            assert new in shown, f"{where}: {old}= is renamed to {new}=, which it does not take"
            assert old not in shown, f"{where} still shows its old keyword {old}="
            assert old in GEN.retired(top), f"{where}: {old}= is not retired in §13's GLOSSARY"
            checked += 1
    assert checked >= 20


def test_every_converted_keyword_is_one_the_function_still_takes():
    for function in GEN._every_function():
        for old in getattr(function, "__deprecated_keywords__", {}):
            assert old in GEN.parameters(function), (function.__qualname__, old)


def test_long_signatures_take_a_record_or_are_listed_with_a_reason():
    long = {
        name
        for _, name, function in EXPORTED
        if len(GEN.parameters(function)) > GEN.MAX_PARAMETERS
        and "options" not in GEN.parameters(function)
    }
    assert long == set(GEN.LONG_SIGNATURES), (
        f"unlisted: {sorted(long - set(GEN.LONG_SIGNATURES))} (take an options record, or "
        f"list the reason in docs/gen_names.py); listed but not long: "
        f"{sorted(set(GEN.LONG_SIGNATURES) - long)}"
    )


def test_the_glossary_tables_are_what_the_generator_writes():
    assert GEN.NAMES_MD.read_text() == GEN.render(), (
        "docs/design-names-and-layout.md is stale: run python docs/gen_names.py"
    )


@pytest.mark.parametrize("block", list(GEN.BLOCKS))
def test_a_page_without_the_markers_is_refused(block, tmp_path, monkeypatch):
    page = tmp_path / "names.md"
    begin, _ = GEN._markers(block)
    page.write_text(GEN.NAMES_MD.read_text().replace(begin, ""))
    monkeypatch.setattr(GEN, "NAMES_MD", page)
    with pytest.raises(ValueError, match="lacks the markers"):
        GEN.render()
