"""``python -m hpcrl.doctor [overrides]``: does this config work on this cluster, before a run finds out?

    overrides -> checks.load_config (the config hpcrl.main would run) -> checks.run_checks:
        local.py      run root writable, advertised address, port range, setup timeouts vs model size
        gpu.py        nvidia-smi, torch CUDA, sglang (here on cluster.kind=local; skipped on CPU clusters)
        testonly.py   sbatch --test-only of each role's job, the hetjob, the controller's job
        nodes.py      probe jobs (jobs.py) running probe.py on a compute node: network both ways,
                      run root shared, GPUs
    -> report.Result per check -> one line each -> exit 1 when any failed

Every check has a deadline, and every probe job is cancelled by id when the doctor ends, however it ends.
"""
