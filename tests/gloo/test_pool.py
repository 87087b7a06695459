"""The test pool (tests/support/pool.py): a job that leaves process groups behind gets its
workers reset in place, not respawned, and the reset workers still run collectives."""
from tests.support.pool import MAX_THREADS, Pool

BODY = "tests.gloo.mp_pool"


def test_groups_left_behind_reset_the_workers_in_place():
    pool = Pool(2)  # its own pool: the job floods its workers with groups
    try:
        before = pool.run(f"{BODY}:state")
        assert [s[2] for s in before] == [1, 1] and [s[3] for s in before] == [2.0, 2.0]
        flood = pool.run(f"{BODY}:groups_left_behind", MAX_THREADS // 2)
        assert min(threads for _, threads, _ in flood) > MAX_THREADS, flood  # the job did cross the limit
        assert [s[2] for s in flood] == [2.0, 2.0]
        after = pool.run(f"{BODY}:state")
        assert [s[0] for s in after] == [s[0] for s in before], "the workers were respawned, not reset"
        assert [s[2] for s in after] == [1, 1], "only the default group is left"
        assert max(s[1] for s in after) < MAX_THREADS // 2, after
        assert [s[3] for s in after] == [2.0, 2.0]
        again = pool.run(f"{BODY}:groups_left_behind", 1)  # a new group after the reset works
        assert [s[2] for s in again] == [2.0, 2.0]
    finally:
        pool.close()


def test_a_jobs_environment_ends_with_it(pools):
    """Megatron sets NVTE_FLASH_ATTN / NVTE_FUSED_ATTN for the attention backend a model asks for and then
    refuses a model asking another in the same process: a job's variables must not reach the next job."""
    pool = pools(2)
    assert pool.run(f"{BODY}:set_environment", "FLASHOVERLAP_POOL_PROBE", "1") == [None, None]
    assert pool.run(f"{BODY}:set_environment", "FLASHOVERLAP_POOL_PROBE", "2") == [None, None]


def test_megatrons_inference_mode_ends_with_the_job(pools):
    """The dynamic engine sets Megatron's InferenceMode process-wide and leaves it set; a training job after it
    in the same worker would take inference paths ('Inference must always gather TP logits')."""
    pool = pools(2)
    assert pool.run(f"{BODY}:set_inference_mode") == [False, False]
    assert pool.run(f"{BODY}:set_inference_mode") == [False, False]
