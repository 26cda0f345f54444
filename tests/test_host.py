"""dsv3_jax/host.py: the huge-page restart of the CLIs (environment and restart), the heap trim and the CPU tuning."""

import os
import subprocess
import sys

import pytest

from dsv3_jax import host

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tunable_is_added_once_and_keeps_other_tunables():
    env = host.with_tunable({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert host.with_tunable(env) == env
    assert host.with_tunable({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"


def test_not_wanted_when_opted_out_or_already_set():
    assert not host.wanted({host.OPT_OUT: "0"})
    assert not host.wanted({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})


def _child_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", host.OPT_OUT)}
    return dict(env, PYTHONPATH=ROOT, **extra)


def _run(code, *args, **env):
    proc = subprocess.Popen([sys.executable, "-c", code, *args], env=_child_env(**env), cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    return proc.pid, out.split(" ", 2)


@pytest.mark.skipif(not host.wanted(_child_env()), reason="no glibc >= 2.35 with transparent huge pages")
def test_restart_keeps_pid_and_arguments_and_sets_the_tunable():
    code = ("import os, sys; from dsv3_jax import host; host.reexec(); "
            "print(os.getpid(), os.environ.get('GLIBC_TUNABLES'), sys.argv[1:])")
    pid, (child_pid, tunables, args) = _run(code, "a", "--b=1")
    assert (int(child_pid), tunables, args.strip()) == (pid, "glibc.malloc.hugetlb=1", "['a', '--b=1']")
    _, (_, tunables, _) = _run(code, **{host.OPT_OUT: "0"})
    assert tunables == "None"


@pytest.mark.parametrize("platforms,cpu", [("cpu", True), ("CPU", True), ("cpu,cuda", True), ("tpu", False),
                                           ("cuda,cpu", False), ("rocm", False)])
def test_jax_platforms_decides_the_backend(platforms, cpu):
    assert host.runs_on_cpu({"JAX_PLATFORMS": platforms}) is cpu
    if not cpu:
        assert not host.wanted({"JAX_PLATFORMS": platforms})


@pytest.mark.parametrize("node,plugin,cpu", [(False, "json", True), (True, "json", False),
                                             (True, "no_such_jax_plugin_module", True)])
def test_without_jax_platforms_an_accelerator_node_with_its_plugin_means_no_cpu(node, plugin, cpu, tmp_path,
                                                                                monkeypatch):
    """A device node (here a file like /dev/nvidia0) counts only with jax's plugin for it installed
    (here a module that exists, `json`, or one that does not): without one jax runs on CPU."""
    if node:
        (tmp_path / "nvidia0").touch()
    monkeypatch.setattr(host, "_ACCELERATORS", (((str(tmp_path / "nvidia[0-9]*"),), (plugin,)),))
    assert host.runs_on_cpu({}) is cpu


_PRINT = "import os; print(os.getpid(), os.environ.get('GLIBC_TUNABLES'), [])"
_RESTART = "from dsv3_jax import host; host.reexec(); " + _PRINT


@pytest.mark.skipif(not host.wanted(_child_env()), reason="no glibc >= 2.35 with transparent huge pages")
@pytest.mark.parametrize("setup,env", [
    ("import sys; sys.settrace(lambda *a: None); ", {}),  # a tracer (coverage, a debugger)
    ("import sys, types; sys.modules['ipykernel'] = types.ModuleType('ipykernel'); ", {}),  # a kernel's process
    ("", {"JAX_PLATFORMS": "tpu"}),  # not the CPU backend
])
def test_no_restart_under_a_tracer_in_a_kernel_or_off_cpu(setup, env):
    pid, (child_pid, tunables, _) = _run(setup + _RESTART, **env)
    assert (int(child_pid), tunables) == (pid, "None")


@pytest.mark.skipif(not host.wanted(_child_env()), reason="no glibc >= 2.35 with transparent huge pages")
def test_no_restart_under_pdb(tmp_path):
    """`python -m pdb -c continue cmd.py`: pdb stays the process (its prompt comes back at the end)."""
    script = tmp_path / "cmd.py"
    script.write_text(_RESTART.replace("; ", "\n"))
    out = subprocess.run([sys.executable, "-m", "pdb", "-c", "continue", str(script)], env=_child_env(),
                         cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert " None []" in out.stdout and "(Pdb)" in out.stdout, out.stdout + out.stderr


def test_the_unrolled_layer_scan_computes_what_the_rolled_one_does():
    # host.tune_model unrolls short stacks on one CPU device; the loss and its gradient must not change.
    import jax
    import numpy as np
    from flax import nnx

    from dsv3_jax import DeepSeekV3
    from tests.helpers import shrunk_tiny_config

    cfg = shrunk_tiny_config(vocab_size=64)
    tuned = host.tune_model(cfg)
    assert tuned.unroll_max_layers == (host.UNROLL_MAX_LAYERS if jax.device_count() == 1 else 0)
    assert host.tune_model(cfg.replace(unroll_max_layers=2)).unroll_max_layers == 2  # a config's own value wins
    tokens = np.random.RandomState(0).randint(0, 64, (2, 9))

    def loss_and_grad(unroll_max_layers):
        graphdef, state = nnx.split(DeepSeekV3(cfg.replace(unroll_max_layers=unroll_max_layers), rngs=nnx.Rngs(0)))
        loss = lambda s: nnx.merge(graphdef, s)(tokens).var()  # noqa: E731 (the logits)
        return jax.jit(jax.value_and_grad(loss))(state)

    (want, want_grad), (got, got_grad) = loss_and_grad(0), loss_and_grad(host.UNROLL_MAX_LAYERS)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-7)
