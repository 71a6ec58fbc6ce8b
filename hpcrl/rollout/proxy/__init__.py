"""The per-episode OpenAI endpoint of plug-in workflows, and what it records.

    server.py        Proxy: one HTTP server per process that runs episodes (loopback only, a port of the
                     process's slice); each episode has its own URL; answers are generated through hpcrl's
                     InferenceClient and recorded token for token
    records.py       Completion (one recorded answer) and EpisodeLog (an episode's, with its rewards)
    trajectories.py  rewards propagated back with workflow.turn_discount; turns joined into trajectories where
                     a prompt extends the trajectory so far token for token; the samples the trainer takes

Uses ``inference/`` (the client, the OpenAI protocol shared with the CPU server), never the reverse.
"""
