"""Port slots: every process of a run that listens draws its ports from a slice of the port range of its own.

``PortAllocator`` cuts one port range into ``world_size`` disjoint slices, one per rank. A run has
several roles whose ranks all start from 0, so ranks alone would collide: ``PortSlots`` numbers
every listener of the run instead. Slot 0 is the controller's (torchrun rendezvous ports and
whatever else it listens on), then each role's workers in order::

    PortSlots({"server": 2, "trainer": 4})
    slot:   0           1  2        3  4  5  6
            controller  server 0-1  trainer 0-3      world = 7

A scheduler hands each worker its role's first slot and the world size in the environment
(``HPCRL_PORT_SLOT_BASE``, ``HPCRL_PORT_WORLD``); the worker adds its rank (``worker_ports``).

A torchrun role that spans nodes on Slurm has its c10d rendezvous on the first node of its step, with a
port chosen there (``launch/slurm/rendezvous.py``); ``rendezvous=("trainer",)`` gives it a slot of its
own after every worker's, so that port never races a worker's on that node::

    PortSlots({"server": 2, "trainer": 4}, rendezvous=("trainer",))    # slot 7: the trainers' rendezvous

A worker outside its role's numbering (a server that joined a running run, ``hpcrl.inference.join``, whose rank
is past the role's workers) is handed its slot itself (``HPCRL_PORT_SLOT``), one of the run's slots.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence

from hpcrl.net import PortAllocator

SLOT_BASE_ENV = "HPCRL_PORT_SLOT_BASE"  # the first port slot of this worker's role
PORT_WORLD_ENV = "HPCRL_PORT_WORLD"  # how many slots the run's port range is cut into
SLOT_ENV = "HPCRL_PORT_SLOT"  # this worker's slot itself, instead of HPCRL_PORT_SLOT_BASE + its rank
RANK_ENV = "HPCRL_RANK"  # this worker's rank in its role (under torchrun, also RANK)
TORCHRUN_RANK_ENV = "RANK"

CONTROLLER_SLOT = 0


class PortSlots:
    """The port slot of every listener of a run: the controller, then each role's workers in ``counts`` order."""

    def __init__(self, counts: Mapping[str, int], rendezvous: Sequence[str] = ()):
        self.counts = dict(counts)  # role -> workers of that role
        self.rendezvous_roles = tuple(rendezvous)  # with counts, all it takes to build the same slots again
        self._bases: dict[str, int] = {}
        self._rendezvous: dict[str, int] = {}  # torchrun role -> the slot of its rendezvous port
        next_slot = CONTROLLER_SLOT + 1
        for role, count in self.counts.items():
            if not isinstance(role, str) or not role:
                raise ValueError(f"PortSlots: role names must be non-empty strings, got {role!r} in {self.counts}")
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"PortSlots: {role} needs an integer count of workers >= 1, got {count!r}")
            self._bases[role] = next_slot
            next_slot += count
        for role in rendezvous:
            self.base(role)  # an unknown role is an error here too
            self._rendezvous[role] = next_slot
            next_slot += 1
        self._world = next_slot

    @property
    def world(self) -> int:
        """Slots in all: one per worker of every role, plus the controller's."""
        return self._world

    @property
    def controller(self) -> int:
        return CONTROLLER_SLOT

    def base(self, role: str) -> int:
        """The slot of ``role``'s rank 0; rank r has ``base + r``."""
        if role not in self._bases:
            raise ValueError(
                f"no port slots for role {role!r}: PortSlots was made for {', '.join(self._bases) or 'no roles'}; "
                "add the role to the counts the run's PortSlots is built from"
            )
        return self._bases[role]

    def rendezvous(self, role: str) -> int:
        """The slot of ``role``'s torchrun rendezvous port, chosen on the first node of its step."""
        if role not in self._rendezvous:
            raise ValueError(
                f"no rendezvous slot for role {role!r}: a torchrun role on Slurm needs one; build the run's "
                f"PortSlots with rendezvous=({role!r},)"
            )
        return self._rendezvous[role]

    def slot(self, role: str, rank: int) -> int:
        count = self.counts.get(role, 0)
        if not 0 <= rank < count:
            base = self.base(role)  # an unknown role is the clearer error
            raise ValueError(f"{role} rank {rank} has no port slot: {role} has {count} workers (slots {base}..)")
        return self.base(role) + rank

    def env(self, role: str) -> dict[str, str]:
        """What a worker of ``role`` needs in its environment to find its slot (with its rank)."""
        return {SLOT_BASE_ENV: str(self.base(role)), PORT_WORLD_ENV: str(self.world)}

    def allocator(self, slot: int, port_range: tuple[int, int] | None = None) -> PortAllocator:
        """A PortAllocator over ``slot``'s slice of ``port_range`` (None: the default range)."""
        return PortAllocator(port_range, rank=slot, world_size=self.world)

    def __repr__(self) -> str:
        rendezvous = f", rendezvous={tuple(self._rendezvous)}" if self._rendezvous else ""
        return f"PortSlots({self.counts}{rendezvous}, world={self.world})"


def worker_ports(
    net_port_range: tuple[int, int] | None = None, environ: Mapping[str, str] | None = None
) -> PortAllocator:
    """This worker's PortAllocator: slot ``HPCRL_PORT_SLOT_BASE + rank`` of ``HPCRL_PORT_WORLD``, or
    ``HPCRL_PORT_SLOT`` where that is set (a worker that joined a running run).

    The rank is ``HPCRL_RANK``, else torchrun's ``RANK``. A process started by hand (not by a
    scheduler) must set the three variables itself, so that it cannot silently share a slice.
    """
    env = os.environ if environ is None else environ
    world = _int_env(env, PORT_WORLD_ENV)
    if SLOT_ENV in env:
        slot = _int_env(env, SLOT_ENV)
        if not 0 <= slot < world:
            raise ValueError(f"port slot {SLOT_ENV}={slot} is outside 0..{world - 1} ({PORT_WORLD_ENV}={world})")
        return PortAllocator(net_port_range, rank=slot, world_size=world)
    base = _int_env(env, SLOT_BASE_ENV)
    rank_name = RANK_ENV if RANK_ENV in env else TORCHRUN_RANK_ENV
    rank = _int_env(env, rank_name)
    slot = base + rank
    if rank < 0 or not 0 <= slot < world:
        raise ValueError(
            f"port slot {slot} ({SLOT_BASE_ENV}={base} + {rank_name}={rank}) is outside 0..{world - 1} "
            f"({PORT_WORLD_ENV}={world}); the scheduler's PortSlots must count every worker of this role"
        )
    return PortAllocator(net_port_range, rank=slot, world_size=world)


def _int_env(env: Mapping[str, str], name: str) -> int:
    value = env.get(name)
    if value is None:
        raise RuntimeError(
            f"{name} is not set: hpcrl schedulers set {SLOT_BASE_ENV}, {PORT_WORLD_ENV} and {RANK_ENV} for "
            "every worker; to run a worker by hand, set them (e.g. 0, 1 and 0)"
        )
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def parse_worker_args(
    prog: str,
    description: str,
    what: str,
    argv: list[str] | None = None,
    add_arguments: Callable[[argparse.ArgumentParser], object] | None = None,
) -> argparse.Namespace:
    """``--run-dir`` and ``--rank`` of a worker process, by default from what its scheduler set in the
    environment (HPCRL_RUN_DIR, HPCRL_RANK); ``what`` names the role's workers in the help; ``add_arguments``
    adds a worker's own options (the inference worker's ``--role``)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    if add_arguments is not None:
        add_arguments(p)
    p.add_argument("--run-dir", default=os.environ.get("HPCRL_RUN_DIR"), help="run directory (HPCRL_RUN_DIR)")
    p.add_argument("--rank", type=int, default=os.environ.get(RANK_ENV), help=f"rank among {what} (HPCRL_RANK)")
    args = p.parse_args(argv)
    if args.run_dir is None or args.rank is None:
        p.error("needs the run directory and the rank: pass --run-dir and --rank, or set HPCRL_RUN_DIR and HPCRL_RANK")
    return args
