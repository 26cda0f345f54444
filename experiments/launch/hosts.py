"""What every host of a multi-host run executes: the same training command, and the three
variables `sharding.multihost.initialize` reads to join the processes through `jax.distributed`."""

from __future__ import annotations

import dataclasses
import shlex

COORDINATOR_PORT = 8476  # jax.distributed's usual port on TPU pods


@dataclasses.dataclass(frozen=True)
class HostCommand:
    host: str  # where it runs (hostname, IP or a placeholder in dry runs)
    env: dict[str, str]  # JAX_* (and, multi-slice, MEGASCALE_*) variables
    argv: list[str]  # python -m experiments.train ...

    def shell(self, repo_dir: str | None = None) -> str:
        """One shell line: cd REPO && K=V ... python -m experiments.train ..."""
        line = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in self.env.items()), *map(shlex.quote, self.argv)])
        if not repo_dir:
            return line
        home = repo_dir.startswith("~/")  # left unquoted so the remote shell expands it
        return f"cd {'~/' + shlex.quote(repo_dir[2:]) if home else shlex.quote(repo_dir)} && {line}"


def join_env(coordinator: str, num_processes: int, process_id: int) -> dict[str, str]:
    return {"JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": str(num_processes),
            "JAX_PROCESS_ID": str(process_id)}


def train_argv(flags: list[str], python: str = "python") -> list[str]:
    flags = flags[1:] if flags[:1] == ["--"] else flags
    return [python, "-m", "experiments.train", *flags]


def commands(hosts: list[str], flags: list[str], *, port: int = COORDINATOR_PORT, python: str = "python",
             extra_env=lambda process_id: {}) -> list[HostCommand]:
    """Process i runs on hosts[i]; process 0's host is the coordinator."""
    if not hosts:
        raise ValueError("no hosts to launch on")
    coordinator = f"{hosts[0]}:{port}"
    return [HostCommand(h, {**join_env(coordinator, len(hosts), i), **extra_env(i)}, train_argv(flags, python))
            for i, h in enumerate(hosts)]
