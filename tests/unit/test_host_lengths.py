"""rnnt/host_lengths.py: the host-length checks the fused and apex loss backends share."""

import pytest
import torch

from rnnt.host_lengths import check_host_lens, to_device


def test_valid_lengths_come_back_as_int_lists():
    got = check_host_lens((torch.tensor([3, 1]), (2, 0)), bsz=2, t_max=3, u_max=2)
    assert got == ([3, 1], [2, 0])
    assert all(type(x) is int for lens in got for x in lens)


@pytest.mark.parametrize(
    "host_lens, message",
    [
        (([3], [2, 0]), "expected 2 frame and 2 label lengths, got 1 and 2"),
        (([3, 0], [2, 0]), r"utterance 1 has \(T, U\) = \(0, 0\)"),
        (([4, 1], [2, 0]), r"utterance 0 has \(T, U\) = \(4, 2\); the inputs allow T in \[1, 3\]"),
        (([3, 1], [2, 3]), r"utterance 1 has \(T, U\) = \(1, 3\).*U in \[0, 2\]"),
        (([3, 1], [-1, 0]), r"utterance 0 has \(T, U\) = \(3, -1\)"),
    ],
)
def test_bad_lengths_name_the_argument_and_the_utterance(host_lens, message):
    with pytest.raises(ValueError, match=f"host_lens: {message}"):
        check_host_lens(host_lens, bsz=2, t_max=3, u_max=2)


def test_to_device_copies_the_values():
    out = to_device([5, -2, 7], torch.device("cpu"), torch.int64)
    assert out.dtype == torch.int64 and out.tolist() == [5, -2, 7]
