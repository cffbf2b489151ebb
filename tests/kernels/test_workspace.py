"""Scratch buffers are reused per purpose and grow when a larger shape is asked for."""

from __future__ import annotations

import threading

import torch

from epdserve.kernels.workspace import release_all, scratch


def test_a_smaller_request_reuses_the_same_memory():
    release_all()
    big = scratch("test", (4, 8), torch.float32, "cpu")
    small = scratch("test", (3, 2), torch.float32, "cpu")
    assert small.shape == (3, 2) and small.data_ptr() == big.data_ptr()


def test_a_larger_request_grows_the_buffer():
    release_all()
    scratch("test", (2,), torch.float32, "cpu")
    grown = scratch("test", (1000,), torch.float32, "cpu")
    assert grown.numel() == 1000 and grown.is_contiguous()


def test_each_thread_gets_its_own_buffers():
    mine = scratch("test", (16,), torch.float32, "cpu")
    theirs = []
    worker = threading.Thread(
        target=lambda: theirs.append(scratch("test", (16,), torch.float32, "cpu"))
    )
    worker.start()
    worker.join()
    assert theirs[0].data_ptr() != mine.data_ptr()
