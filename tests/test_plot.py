"""experiments.plot: the heatmap's rows carry the model's layer numbers."""

import json

import numpy as np
import pytest

from experiments import plot


def _workdir(tmp_path, num_dense_layers: int, num_moe_layers: int):
    (tmp_path / "model_config.json").write_text(json.dumps({"num_dense_layers": num_dense_layers}))
    load_LxE = np.full((num_moe_layers, 4), 0.25).tolist()
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(5):
            f.write(json.dumps({"step": step, "expert_load": load_LxE}) + "\n")
    return str(tmp_path)


def test_heatmap_rows_are_labelled_with_real_layer_numbers(tmp_path):
    workdir = _workdir(tmp_path, num_dense_layers=3, num_moe_layers=2)
    records = plot.load_records(workdir)
    layers = plot.moe_layer_numbers(workdir, len(records[0]["expert_load"]))
    ax = plot.expert_load_figure(records, layers).axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["3", "4"]
    assert list(ax.get_yticks()) == [0, 1]  # one label per row, on the row


def test_heatmap_rejects_layer_numbers_that_do_not_match_the_rows(tmp_path):
    records = plot.load_records(_workdir(tmp_path, num_dense_layers=1, num_moe_layers=2))
    with pytest.raises(ValueError, match="3 layer numbers for 2 rows"):
        plot.expert_load_figure(records, [1, 2, 3])
