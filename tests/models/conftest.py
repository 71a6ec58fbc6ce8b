import fcntl
import time

import pytest

LOCK_WAIT_S = 600  # another worker training the judge takes about two minutes


@pytest.fixture(scope="session")
def mod10_judge_dir(tmp_path_factory):
    """The mod10 judge of ``hpcrl/models/mod10_judge.py`` (seed 0), made once per test session: a copy from the
    per-user cache of ``tiny_cache.py``, keyed by the maker's source, where the first session trains it (about two
    minutes). A lock beside the cache lets one xdist worker train it while the others wait for its entry."""
    from hpcrl.models import tiny_cache
    from hpcrl.models.mod10_judge import make_judge

    root = tiny_cache.cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".mod10-judge.lock", "w") as lock:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"{root}/.mod10-judge.lock still held after {LOCK_WAIT_S} s")
                time.sleep(1)
        return make_judge(tmp_path_factory.mktemp("mod10-judge"))
