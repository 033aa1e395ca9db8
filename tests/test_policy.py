"""FlushPolicy: which tokens a query sees in full precision, against hand-written tables."""

import torch

from kvcal.methods.base import FlushPolicy


def test_kivi_residual_flushes_whole_groups():
    policy = FlushPolicy(sink=0, residual=2, block=2)
    assert [policy.compressed_count(n) for n in range(1, 9)] == [0, 0, 0, 2, 2, 4, 4, 6]
    fp = policy.full_precision_mask(6).int()
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],  # 4 cached: tokens 0,1 flushed as one group
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ])
    # entries above the diagonal are never attended; compare the causal part only
    causal = torch.ones(6, 6).tril().bool()
    assert torch.equal(fp[causal], expected[causal].int())


def test_sinks_and_window():
    policy = FlushPolicy(sink=1, residual=2, block=1)
    fp = policy.full_precision_mask(5)
    # query 4 (5 cached): sink 0 and the 2 most recent (3, 4) are full precision
    assert fp[4].tolist() == [True, False, False, True, True]
    assert fp[2].tolist()[:3] == [True, True, True]


def test_rtn_compresses_everything_and_prefill_rows_are_full_precision():
    policy = FlushPolicy()
    assert not policy.full_precision_mask(4).tril().any()
    fp = policy.full_precision_mask(4, prompt_len=2)
    assert fp[:2].all() and not fp[2:].tril().any()
