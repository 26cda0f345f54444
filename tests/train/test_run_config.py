"""One config story (dsv3_jax/train/run_config.py): a resume keeps the run's model fields and takes the
command line's run fields. (--init_from: tests/train/test_init_from.py; the resume through the CLI:
tests/train/test_train_cli.py.)"""

import pytest

from dsv3_jax.train import run_config
from tests.train.test_init_from import HF_CFG


def test_resume_refuses_a_model_field_and_takes_run_fields():
    record = HF_CFG
    with pytest.raises(run_config.ModelChanged, match=r"config.model.num_routed_experts=32 but the run being "
                                                      r"resumed has num_routed_experts=16"):
        run_config.for_resume(record, record.replace(num_routed_experts=32, remat=True), from_checkpoint=False)
    cfg = run_config.for_resume(record, record.replace(hidden_size=64, remat=True), from_checkpoint=True)
    assert cfg == record.replace(remat=True)  # --init_from runs: the checkpoint's architecture is kept
    assert run_config.differences(record, cfg, run_config.RUN_FIELDS) == [("remat", False, True)]
