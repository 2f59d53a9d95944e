"""``launch_rank_scripts`` (tests/conftest.py): a group gloo aborts on a mismatched message size is launched once
more; any other failure fails the calling test at once. The rank script is this file: it fails as asked by its
output folder's name and otherwise hands back its rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import GLOO_SIZE_MISMATCH, launch_rank_scripts


def test_a_group_gloo_aborted_on_a_message_size_is_launched_again(tmp_path, capsys):
    (tmp_path / "mismatch").touch()
    (group,) = launch_rank_scripts(__file__, (2,), tmp_path, label="planted").values()
    assert group == {0: {"rank": 0}, 1: {"rank": 1}}
    assert "launching the group again" in capsys.readouterr().out


def test_any_other_failure_fails_at_once(tmp_path):
    (tmp_path / "broken").touch()
    with pytest.raises(pytest.fail.Exception, match="planted failure"):
        launch_rank_scripts(__file__, (2,), tmp_path, label="planted")
    assert not (tmp_path / "world2-again").exists()


def _rank(world: int, rank: int, out: Path) -> None:
    import torch

    first = not out.name.endswith("-again")
    if first and (out.parent / "mismatch").exists():
        print(f"terminate called after throwing gloo::EnforceNotMet: {GLOO_SIZE_MISMATCH}")
        sys.exit(134)
    if (out.parent / "broken").exists():
        print("planted failure")
        sys.exit(1)
    torch.save({"rank": rank}, out / f"rank{rank}.pt")


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
