"""``python -m hpcrl.launch.slurm PICKLE``: how a hetjob component's task runs its pickled ``WorkerTask``.

PICKLE is a submitit ``DelayedSubmission`` (what submitit's own ``python -m submitit.core._submit FOLDER``
loads for a ``per_role`` job); calling it execs the worker, so this never returns on success.
"""

import sys

from submitit.core.utils import DelayedSubmission


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python -m hpcrl.launch.slurm PICKLE (a DelayedSubmission of a WorkerTask)")
    DelayedSubmission.load(argv[0]).result()


if __name__ == "__main__":
    main(sys.argv[1:])
