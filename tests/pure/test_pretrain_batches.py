"""How the session's pretrain() jobs are cut into batches that run side by side (tests/support/pretrain_runs.py):
jobs that must share a process never land in two batches, a world's jobs never mix with another world's."""
from tests.support.pretrain_runs import FIRST, SPLIT_ABOVE, Job, batches


def _job(name, *argv, world=2, order=1):
    return Job(name, "launch", ("--cpu", "script.py", *argv), world, order)


def _where(parts):
    return {j.name: i for i, part in enumerate(parts) for j in part}


def test_a_small_world_is_one_batch_and_worlds_never_mix():
    jobs = [_job(f"a{i}", str(i)) for i in range(SPLIT_ABOVE)] + [_job("p", "x", world=4)]
    parts = batches(jobs)
    assert [len(p) for p in parts] == [SPLIT_ABOVE, 1] and [p[0].world for p in parts] == [2, 4]


def test_a_large_world_splits_in_two_keeping_saves_with_loads_and_a_command_with_its_repeat():
    jobs = [_job("fresh", "same", order=FIRST), _job("save", "--save", "{tmp}/ckpt", "--save-interval", "3")]
    jobs += [_job(f"row{i}", str(i)) for i in range(SPLIT_ABOVE)]
    jobs += [_job("load", "--load", "{tmp}/ckpt/iter_3"), _job("again", "same"),
             _job("yaml-a", "--flash-overlap-config", "{tmp}/c.yaml"), _job("yaml-b", "--flash-overlap-config",
                                                                             "{tmp}/c.yaml", "--bf16")]
    parts = batches(jobs)
    where = _where(parts)
    assert len(parts) == 2 and all(parts) and sorted(where) == sorted(j.name for j in jobs)
    assert where["save"] == where["load"] and where["fresh"] == where["again"] and where["yaml-a"] == where["yaml-b"]
    assert abs(len(parts[0]) - len(parts[1])) <= 3  # whole units, about half each
    for part in parts:  # declaration order within a batch (run_batch then sorts by Job.order)
        assert [jobs.index(j) for j in part] == sorted(jobs.index(j) for j in part)
