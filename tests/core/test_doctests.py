"""The examples in gradsync_core's docstrings run and print what they claim."""

import doctest
import importlib
import pkgutil

import pytest

import gradsync_core

MODULES = [
    m.name
    for m in pkgutil.walk_packages(gradsync_core.__path__, "gradsync_core.")
    if m.name != "gradsync_core.__main__"
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, extraglobs=vars(gradsync_core), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
