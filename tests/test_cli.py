"""The command line's process-wide settings."""

import pytest
import torch

from tinyserve.cli import _set_threads, main


def test_threads_sets_torchs_pool_and_refuses_nonsense(capsys):
    before = torch.get_num_threads()
    try:
        _set_threads(1)
        assert torch.get_num_threads() == 1
        _set_threads(None)  # not given: left as it is
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert main(["generate", "--threads", "0", "hi"]) == 1
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--threads", "two", "hi"])
