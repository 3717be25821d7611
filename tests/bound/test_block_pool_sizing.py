"""CanaryCapacities.from_block_pool: a canary sized from a paged engine's block pool (issue 23, gap 5)."""

import warnings

import pytest

import kvcanary_cupy as kc


def test_capacities_come_from_the_block_pool_and_the_batch_limit():
    caps = kc.CanaryCapacities.from_block_pool(num_blocks=64, block_size=32, max_num_seqs=8)
    assert (caps.verify_capacity, caps.write_req_capacity) == (3 * 64 * 32, 8)
    # No batch of 8 requests of at most 100 tokens reads more than 800 slots.
    caps = kc.CanaryCapacities.from_block_pool(num_blocks=64, block_size=32, max_num_seqs=8, max_model_len=100)
    assert caps.verify_capacity == 800


def test_a_large_canary_warns_with_its_size():
    # vLLM's default CPU KV space for a small model: ~1.4 M slots; 256 sequences of 32k tokens.
    with pytest.warns(kc.CanaryCapacityWarning, match=r"45000 blocks x 32 slots \(1440000 slots.* takes 231 MiB"):
        kc.CanaryCapacities.from_block_pool(num_blocks=45000, block_size=32, max_num_seqs=256, max_model_len=32768,
                                            warn_bytes=200 * 2**20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kc.CanaryCapacities.from_block_pool(num_blocks=45000, block_size=32, max_num_seqs=256, max_model_len=32768)


def test_session_bytes_match_what_a_session_allocates():
    caps = kc.CanaryCapacities.from_block_pool(num_blocks=8, block_size=4, max_num_seqs=2, max_model_len=16)
    session = kc.CanarySession(32, max_batch_size=2, verify_capacity=caps.verify_capacity, same_step_reads=True)
    big = (session.head_canary.nbytes + session.tail_canary.nbytes + session.same_step.written_at.nbytes
           + 4 * session.planner.verify_plan.verify_slot_indices.nbytes)
    assert big <= kc.CanaryCapacities.session_bytes(32, caps) <= big + 32 * 2 + 4096


@pytest.mark.parametrize("name,value", [("num_blocks", -1), ("block_size", 0), ("max_num_seqs", 0)])
def test_bad_numbers_name_the_argument(name, value):
    kwargs = dict(num_blocks=4, block_size=4, max_num_seqs=1)
    kwargs[name] = value
    with pytest.raises(ValueError, match=name):
        kc.CanaryCapacities.from_block_pool(**kwargs)
