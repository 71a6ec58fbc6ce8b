"""Rewards: functions named in config, resolved by import in each reward process, run with a timeout.

``registry`` resolves ``"package.module:function"`` and defines the reward signature; ``pool`` runs
calls in worker processes (``worker`` is their entry point); ``policy`` turns failed calls into dropped
groups, zeros or an error; ``builtin`` holds the rewards hpcrl ships.

Import from those modules; this package imports none of them: ``python -m hpcrl.reward.worker`` imports this
package first, and a package that imported ``pool`` (which imports ``worker``) would have the worker module loaded
before runpy runs it as ``__main__``, with runpy's RuntimeWarning in every reward process.
"""
