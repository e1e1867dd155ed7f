"""The names a checkpoint stores for a model's weights (issue 22 item 4): never a wrapper's,
and a mismatch names both sides."""

import pytest

from gradsync_core.checkpoint import check_weight_names, is_wrapped, unwrapped_names


@pytest.mark.parametrize(
    "names, expected",
    [
        (["module.fc.weight", "module.fc.bias"], ["fc.weight", "fc.bias"]),  # DDP's
        (["module.module.fc.weight"], ["fc.weight"]),  # DataParallel(DDP(net))
        (["fc.weight", "module.fc.bias"], ["fc.weight", "module.fc.bias"]),  # a child "module"
        (["fc.weight"], ["fc.weight"]),
        ([], []),
    ],
    ids=["ddp", "nested", "partly", "bare", "empty"],
)
def test_unwrapped_names(names, expected):
    assert unwrapped_names(names) == expected
    assert is_wrapped(names) == (names != expected)


def test_a_mismatch_names_both_sides():
    with pytest.raises(ValueError) as e:
        check_weight_names(
            ["blocks.1.mlp.proj.bias", "w"], ["blocks.1.down.bias", "w"], fix="load the same"
        )
    assert "lacks 'blocks.1.down.bias' (1 missing, 1 unexpected)" in str(e.value)
    assert "the checkpoint's unmatched names start with 'blocks.1.mlp.proj.bias'" in str(e.value)
