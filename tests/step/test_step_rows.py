"""Select → compute → scatter (:func:`datc.step.rows.on_rows`), the zero-advantage skip's one helper."""

from __future__ import annotations

import torch

from datc.step.rows import on_rows


def _double(x):
    def compute(rows):
        part = x if rows is None else x[rows]
        return {"y": part * 2, "label": "computed", "none": None}

    return compute


def test_every_row_computes_the_whole_batch_without_copies():
    x = torch.arange(4.0)
    out = on_rows(torch.arange(4), 4, _double(x), {"y": torch.zeros(4), "label": "rest", "none": torch.ones(4)})
    assert out["y"].tolist() == [0.0, 2.0, 4.0, 6.0] and out["label"] == "computed" and out["none"] is None


def test_some_rows_are_scattered_into_the_rest():
    x = torch.arange(5.0)
    rest = {"y": torch.full((5,), -1.0), "label": "rest", "none": torch.ones(5)}
    out = on_rows(torch.tensor([1, 3]), 5, _double(x), rest)
    assert out["y"].tolist() == [-1.0, 2.0, -1.0, 6.0, -1.0]
    assert out["label"] == "rest" and torch.equal(out["none"], torch.ones(5))  # non-tensors keep rest's


def test_no_row_computes_nothing():
    called = []
    out = on_rows(torch.tensor([], dtype=torch.long), 3, lambda rows: called.append(rows) or {}, {"y": torch.zeros(3)})
    assert not called and torch.equal(out["y"], torch.zeros(3))


def test_a_missing_rest_and_a_wider_dtype_are_taken_from_the_computed_rows():
    x = torch.arange(3, dtype=torch.float64)
    out = on_rows(torch.tensor([2]), 3, lambda rows: {"y": x[rows], "z": x[rows]}, {"y": torch.zeros(3), "z": None})
    assert out["y"].dtype == torch.float64 and out["y"].tolist() == [0.0, 0.0, 2.0]
    assert out["z"].shape == (3,) and out["z"][2] == 2.0  # other rows uninitialized: the caller's to ignore
