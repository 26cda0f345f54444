"""Plans and compiles the train step of a small model on 8 fake CPU devices for several meshes,
in one process: per case, the plan's total bytes per device and XLA's (memory_analysis()), as
one JSON line each, with the plan's rows and memory_analysis()'s fields. Argument: a JSON list of
cases {"name", "mesh": {...}, "model": {...}}."""

import contextlib
import json
import os
import sys

from tests.helpers import fake_device_flags

os.environ.setdefault("XLA_FLAGS", fake_device_flags(8))

from experiments import plan as plan_lib  # noqa: E402
from experiments.configs import tiny  # noqa: E402


def config_for(case: dict):
    config = tiny.get_config()
    for key, value in case.get("model", {}).items():
        config.model[key] = value
    for axis, size in case["mesh"].items():
        config.mesh[axis] = size
    return config


def main():
    for case in json.loads(sys.argv[1]):
        with contextlib.redirect_stdout(sys.stderr):  # the plan's table goes to stderr, results to stdout
            out = plan_lib.plan(config_for(case), plan_lib.Options(check_compiled=True, compile_init=False))
        print(json.dumps({"name": case["name"], "plan": out["total_bytes"], "compiled": out["compiled_bytes"],
                          "rows": out["rows"], "memory": out["compiled_memory"]}), flush=True)


if __name__ == "__main__":
    main()
