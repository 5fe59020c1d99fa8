"""--fixed-validation: every evaluation reads the same samples (megatron_tah.pretrain_gpt.RepeatedSamples)."""

import pytest

from megatron_tah.pretrain_gpt import RepeatedSamples


def test_every_evaluation_reads_the_first_period_samples_again():
    samples = [{"id": i} for i in range(10)]
    valid = RepeatedSamples(samples, num_samples=12, period=4)  # 3 evaluations of 4 samples
    assert len(valid) == 12
    reads = [valid[i]["id"] for i in range(len(valid))]
    assert reads == [0, 1, 2, 3] * 3
    with pytest.raises(ValueError, match="needs 11 validation samples"):
        RepeatedSamples(samples, num_samples=22, period=11)
