from tests.models.conftest import mod10_judge_dir  # noqa: F401  (the session's tiny judge, for the reward-model tests)
