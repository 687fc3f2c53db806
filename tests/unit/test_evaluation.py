import threading

import pytest
import torch

from rnnt.evaluation import _fetched_while_decoding

CPU = torch.device("cpu")


def test_later_batches_are_fetched_while_the_caller_decodes():
    started = [threading.Event() for _ in range(4)]
    fetched_on: dict[int, str] = {}

    def loader():
        for i in range(4):
            started[i].set()
            fetched_on[i] = threading.current_thread().name
            yield i

    got = []
    for batch, waited in _fetched_while_decoding(loader(), CPU):
        if batch == 0:
            assert not started[1].is_set()  # the first decode (graph capture) runs alone
        elif batch < 3:
            assert started[batch + 1].wait(timeout=10)  # fetched while this one decodes
        assert waited >= 0
        got.append(batch)
    assert got == [0, 1, 2, 3]
    assert fetched_on[0] == threading.current_thread().name
    assert all(fetched_on[i].startswith("eval-ahead") for i in (1, 2, 3))


def test_a_loader_error_reaches_the_caller_and_an_empty_loader_yields_nothing():
    def loader():
        yield 0
        yield 1
        raise FileNotFoundError("dev-wav/x.wav")

    got = []
    with pytest.raises(FileNotFoundError, match="x.wav"):
        for batch, _ in _fetched_while_decoding(loader(), CPU):
            got.append(batch)
    assert got == [0, 1]
    assert list(_fetched_while_decoding(iter([]), CPU)) == []
