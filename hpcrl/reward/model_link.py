"""A reward pool's link to the reward-model servers: their addresses (``use``), and a ``RewardModelClient`` made in the
event loop that first needs it (made again for a later loop or new addresses) and closed by ``close`` in whichever
state its loop is, with the seconds waited on the servers (``wait_s``) kept across the clients it made."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from hpcrl.net import parse_hostport
from hpcrl.reward.model_client import RewardModel, RewardModelClient

log = logging.getLogger(__name__)

NO_REWARD_MODEL = (
    "needs the reward-model servers, and the pool was given none (RewardPool.use_reward_model was not called: "
    "allocation.reward_model.workers and reward.model.path set the role that serves them)"
)
_CLIENT_CLOSE_S = 10.0  # how long close() waits for the client's session to close


class RewardModelLink:
    """The servers a pool's model rewards ask, and the client of the loop that asks them (the module docstring)."""

    def __init__(self, timeout_s: float, judge: Any = None, kind: str = "generative"):
        self.timeout_s = timeout_s  # each batched request's deadline
        self.judge, self.kind = judge, kind  # reward.judge (None: its defaults) and reward.model.kind
        self.addresses: list[str] | None = None
        self.client: RewardModelClient | None = None  # the client now in use; None before the first, after close
        self._waited_before = 0.0  # wait_s of clients already closed

    def use(self, addresses: list[str]) -> None:
        """The servers (``host:port``, ready) to ask from now on; ``ValueError`` for none or a malformed address."""
        if not addresses:
            raise ValueError("RewardPool.use_reward_model: no addresses; expected the reward-model servers' host:port")
        for address in addresses:
            parse_hostport(address)  # ValueError naming the expected form
        self.addresses = list(addresses)

    @property
    def wait_s(self) -> float:
        """Seconds spent waiting on the reward model, cumulative over every client made (0 with none)."""
        return self._waited_before + (self.client.wait_s if self.client is not None else 0.0)

    def reward_model(self) -> RewardModel:
        """The model rewards' argument, its client of the running loop; ``RuntimeError`` before ``use``."""
        if self.addresses is None:
            raise RuntimeError(NO_REWARD_MODEL)
        loop = asyncio.get_running_loop()
        client = self.client
        if client is not None and (client.addresses != self.addresses or client.loop not in (None, loop)):
            self.close()
            client = None
        if client is None:
            client = self.client = RewardModelClient(self.addresses, self.timeout_s)
        return RewardModel(client, self.judge if self.judge is not None else _default_judge(), self.kind)

    def close(self) -> None:
        """Close the client's session in its loop: awaited from another thread, run in a loop that is not running,
        scheduled from inside the loop itself; a closed loop's session is closed in a loop of its own."""
        client, self.client = self.client, None
        if client is None:
            return
        self._waited_before += client.wait_s
        loop = client.loop
        try:
            if loop is None or loop.is_closed():
                _run_apart(client.close())
            elif not loop.is_running():
                loop.run_until_complete(client.close())
            elif _running_loop() is loop:
                loop.create_task(client.close())
            else:
                asyncio.run_coroutine_threadsafe(client.close(), loop).result(_CLIENT_CLOSE_S)
        except Exception:  # closing is best effort: the run is ending
            log.warning("closing the reward-model client failed", exc_info=True)


def _default_judge() -> Any:
    from hpcrl.config.schema import JudgeConfig  # here: the config package imports the reward registry

    return JudgeConfig()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _run_apart(coro: Any) -> None:
    """Run ``coro`` to its end in a loop of its own, on a thread of its own if this one is running a loop."""
    if _running_loop() is None:
        asyncio.run(coro)
        return
    thread = threading.Thread(target=asyncio.run, args=(coro,), name="reward-model-close", daemon=True)
    thread.start()
    thread.join(_CLIENT_CLOSE_S)
