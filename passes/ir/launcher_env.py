"""The environment a launcher gives a rank, and the environment a process we start may inherit.

torchrun (and :func:`runtime.dist.launch.spawn`) tell a rank who it is through environment variables:
``MASTER_ADDR``/``MASTER_PORT`` (the rendezvous store), ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``
and ``LOCAL_WORLD_SIZE``, and under torchrun's agent ``TORCHELASTIC_*`` (among them
``TORCHELASTIC_USE_AGENT_STORE=True``: "the store is the agent's, connect as a client").
A process started from inside a rank inherits them: its ``init_process_group("env://")`` then
joins the launcher's store as one more client that nobody answers, and waits out the default
30-minute timeout. So every process the project starts gets :func:`scrubbed_env`.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

LAUNCHER_VARS = frozenset({
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "NODE_RANK",
})
"""Variables that say which job a process belongs to (besides every ``TORCHELASTIC_*``)."""


RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
"""What env:// needs: a process with all of them is a rank of a launched job."""


def under_launcher(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``env`` (default ``os.environ``) makes this process a rank of a launched job."""
    env = os.environ if env is None else env
    return all(k in env for k in RENDEZVOUS_VARS)


def is_launcher_var(name: str) -> bool:
    """Whether ``name`` tells a process which job and rank it is (see the module docstring)."""
    return name in LAUNCHER_VARS or name.startswith("TORCHELASTIC_")


def scrubbed_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default ``os.environ``) without the launcher's variables: what a child process
    of a rank gets, so it never joins its parent's job by mistake."""
    return {k: v for k, v in (os.environ if env is None else env).items() if not is_launcher_var(k)}


def scrub_environ() -> None:
    """Remove the launcher's variables from this process's own environment (a process that was
    started by a rank, before it sets up a job of its own)."""
    for name in [k for k in os.environ if is_launcher_var(k)]:
        del os.environ[name]
