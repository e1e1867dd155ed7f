"""The alias machinery every old spelling goes through (gradsync_core.deprecation, .options).

A renamed keyword is the same call under the new name, warns once per process at the
caller's line, and refuses both spellings at once; the signature shows only the new name.
An options record and its fields as keywords are never taken together. Each API alias is
one of these wrappers (tests/test_vocabulary.py checks that each points at a real parameter).
"""

import dataclasses
import inspect
import warnings

import pytest

from gradsync_core import read_manifest
from gradsync_core.deprecation import deprecated_keywords, renamed_keywords
from gradsync_core.options import takes_options


@renamed_keywords(directory="path", cast="allow_dtype_conversion")
def _load(path, *, allow_dtype_conversion=False, allow_nonfinite=False):
    return path, allow_dtype_conversion, allow_nonfinite


def test_an_old_keyword_is_the_same_call_and_warns_once(deprecations):
    assert list(inspect.signature(_load).parameters) == [
        "path",
        "allow_dtype_conversion",
        "allow_nonfinite",
    ]
    assert _load("c", allow_dtype_conversion=True) == ("c", True, False)
    assert deprecations.messages == []
    for _ in range(3):
        assert _load(directory="c", cast=True) == _load("c", allow_dtype_conversion=True)
    assert deprecations.messages == [  # one each, in the order the decorator names them
        "_load(directory=) is deprecated and will be removed: use _load(path=)",
        "_load(cast=) is deprecated and will be removed: use _load(allow_dtype_conversion=)",
    ]


def test_both_spellings_at_once_are_refused():
    with pytest.raises(TypeError, match=r"_load\(\) got path= and its deprecated spelling "):
        _load("a", directory="b")


def test_the_warning_points_at_the_callers_line(deprecations):
    """Through every wrapper of the package: the line that wrote the old spelling."""
    read_manifest_line = inspect.currentframe().f_lineno + 2
    with pytest.raises(ValueError, match=r"has no manifest\.json"):
        read_manifest(directory="no-such-checkpoint")
    [warning] = [w for w in deprecations.caught if w.category is DeprecationWarning]
    assert (warning.filename, warning.lineno) == (__file__, read_manifest_line)
    assert str(warning.message) == (
        "read_manifest(directory=) is deprecated and will be removed: use read_manifest(path=)"
    )


def test_a_method_and_a_constructor_are_named_by_their_class(deprecations):
    class Saver:
        @renamed_keywords(directory="path")
        def __init__(self, path):
            self.path = path

        @renamed_keywords(directory="path")
        def load(self, path):
            return path

    assert Saver(directory="x").load(directory="y") == "y"
    assert deprecations.messages == [
        "Saver(directory=) is deprecated and will be removed: use Saver(path=)",
        "Saver.load(directory=) is deprecated and will be removed: use Saver.load(path=)",
    ]


def test_declarations_stack_and_change_no_call():
    @renamed_keywords(replicate_axis="replicate_axis_name")
    @deprecated_keywords(param_dtype="mp_policy=")
    def step(*, replicate_axis_name=None, param_dtype=None):
        return replicate_axis_name, param_dtype

    assert step.__renamed_keywords__ == {"replicate_axis": "replicate_axis_name"}
    assert step.__deprecated_keywords__ == {"param_dtype": "mp_policy="}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert step(param_dtype="bf16") == (None, "bf16")  # converted by the function itself


@dataclasses.dataclass(frozen=True)
class _Options:
    overlap: bool = True
    bucket_cap_mb: float | None = None


class _Wrapper:
    @takes_options(_Options)
    def __init__(
        self, module, *, process_group=None, options=None, overlap=True, bucket_cap_mb=None
    ):
        self.options = options or _Options(overlap=overlap, bucket_cap_mb=bucket_cap_mb)


def test_options_as_a_record_or_as_keywords_are_the_same():
    assert _Wrapper("m", overlap=False).options == _Wrapper("m", options=_Options(False)).options
    assert _Wrapper("m", process_group="pg", options=_Options()).options == _Options()


@pytest.mark.parametrize(
    "keywords",
    [{"overlap": True}, {"overlap": False, "bucket_cap_mb": 5}],
    ids=["a default value, given", "two fields"],
)
def test_a_record_and_its_fields_at_once_are_refused(keywords):
    first = sorted(keywords)[0]
    with pytest.raises(TypeError) as err:
        _Wrapper("m", options=_Options(), **keywords)
    named = ", ".join(f"{k}=" for k in sorted(keywords))
    assert str(err.value) == (
        f"_Wrapper() got options= and {named}, which it also holds; pass the options in one "
        f"place: the keywords alone, or options=dataclasses.replace(options, {first}=...)"
    )


def test_a_record_field_the_keywords_lack_is_refused_at_definition():
    with pytest.raises(TypeError, match=r"f lacks keywords for \['bucket_cap_mb'\] of _Options"):

        @takes_options(_Options)
        def f(*, options=None, overlap=True):
            return options
