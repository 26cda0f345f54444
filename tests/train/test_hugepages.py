"""The huge-page restart of the CLIs (experiments/hugepages.py): environment and restart."""

import os
import subprocess
import sys

import pytest

from experiments import hugepages

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tunable_is_added_once_and_keeps_other_tunables():
    env = hugepages.with_tunable({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert hugepages.with_tunable(env) == env
    assert hugepages.with_tunable({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"


def test_not_wanted_when_opted_out_or_already_set():
    assert not hugepages.wanted({hugepages.OPT_OUT: "0"})
    assert not hugepages.wanted({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})


def _child_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hugepages.OPT_OUT)}
    return dict(env, PYTHONPATH=ROOT, **extra)


def _run(code, *args, **env):
    proc = subprocess.Popen([sys.executable, "-c", code, *args], env=_child_env(**env), cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    return proc.pid, out.split(" ", 2)


@pytest.mark.skipif(not hugepages.wanted(_child_env()), reason="no glibc >= 2.35 with transparent huge pages")
def test_restart_keeps_pid_and_arguments_and_sets_the_tunable():
    code = ("import os, sys; from experiments import hugepages; hugepages.reexec(); "
            "print(os.getpid(), os.environ.get('GLIBC_TUNABLES'), sys.argv[1:])")
    pid, (child_pid, tunables, args) = _run(code, "a", "--b=1")
    assert (int(child_pid), tunables, args.strip()) == (pid, "glibc.malloc.hugetlb=1", "['a', '--b=1']")
    _, (_, tunables, _) = _run(code, **{hugepages.OPT_OUT: "0"})
    assert tunables == "None"
