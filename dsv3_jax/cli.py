"""The command lines' convention (CONTRIBUTING.md): absl flags, parsed per call, one-line errors.

A command defines its flags in a function `define_flags(fv)` on the `absl.flags.FlagValues` it is
given (`flag_values=fv`; ml_collections' `config_flags.DEFINE_config_file` takes it too) and its
`main(argv=None) -> int` calls `parse(define_flags, argv, __doc__)`. Each call gets fresh flags,
so tests can run several commands, and one command several times, in one process.

An error the user can act on (a bad flag, a damaged or missing checkpoint, a config or data file
that does not fit, a full disk) prints one line on stderr naming the thing and exits 2. Such
errors are OSErrors and ValueErrors (CheckpointError, ConfigError, DataError, MeshError ...).
"""

from __future__ import annotations

import logging
import re
import sys
import types
from typing import Callable, NoReturn, Sequence

from absl import flags
from absl import logging as absl_logging

import sharding

_TS_SPEC = re.compile(r"\s*\[tensorstore_spec='.*'\]", re.S)  # TensorStore appends its whole spec as JSON


def parse(define_flags: Callable[[flags.FlagValues], None], argv: Sequence[str] | None, doc: str,
          rest: bool = False) -> types.SimpleNamespace:
    """Parses `argv` (default: sys.argv[1:]) into flags `define_flags` defines on a fresh FlagValues.

    Returns their values by name, dashes read as underscores (`--hf-dir` -> `.hf_dir`), with `.rest`
    the arguments that are not flags (those after `--`) when `rest`. `--help` prints `doc` and the
    flags and exits 0; an unknown flag, a bad or missing value or an unexpected argument exits 2.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    fv = flags.FlagValues()
    saved = sys.argv
    sys.argv = [saved[0], *argv]  # config_flags reads its `--config.a.b=v` overrides from sys.argv
    try:
        define_flags(fv)
        if {"--help", "-h"} & set(argv[:argv.index("--") if "--" in argv else len(argv)]):
            print(f"{doc.strip()}\n\nflags:\n{fv.get_help(include_special_flags=False)}")
            raise SystemExit(0)
        unparsed = fv(sys.argv)[1:]
    except flags.Error as e:
        usage(str(e))
    finally:
        sys.argv = saved
    if unparsed and not rest:
        usage(f"unexpected arguments {unparsed}; every value is a --flag")
    values = {name.replace("-", "_"): value for name, value in fv.flag_values_dict().items() if "." not in name}
    return types.SimpleNamespace(**values, **({"rest": unparsed} if rest else {}))


def define_mesh_flags(fv: flags.FlagValues, what: str) -> None:
    """--mesh / --rules, for the commands that load a model onto a mesh; `with_mesh` reads --mesh."""
    flags.DEFINE_string("mesh", None, f"{what}, e.g. fsdp=2,expert=4 (axes: {', '.join(sharding.AXES)})",
                        flag_values=fv)
    flags.DEFINE_string("rules", "default", "sharding/rules.py preset for --mesh", flag_values=fv)


def define_weight_flags(fv: flags.FlagValues) -> None:
    """--weights / --quantize / --quant_group: load_pretrained's arguments."""
    flags.DEFINE_enum("weights", None, ["fp8", "int8", "int4"],
                      "hold the projections quantized (default: dense, in --dtype)", flag_values=fv)
    flags.DEFINE_enum("quantize", None, ["experts", "all"], "with --weights: the routed experts or every projection "
                      "(default: all for fp8, else experts)", flag_values=fv)
    flags.DEFINE_integer("quant_group", 128, "with --weights=int8|int4: rows per scale", flag_values=fv)


def define_expert_flags(fv: flags.FlagValues, counted: str) -> None:
    """--expert_placement / --redundant_experts (load_pretrained's) and --record_expert_load."""
    flags.DEFINE_string("expert_placement", None, "EPLB placement file of the routed experts (python -m "
                        "experiments.eplb)", flag_values=fv)
    flags.DEFINE_integer("redundant_experts", None, "redundant physical experts (alone: placed for a uniform load)",
                         flag_values=fv)
    flags.DEFINE_string("record_expert_load", None, f"write the {counted} routed per (MoE layer, expert) here "
                        "(.json or .npz), the input of experiments.eplb", flag_values=fv)
    flags.DEFINE_boolean("offload_experts", False, "hold the routed experts in host memory behind a device cache of "
                         "--expert_cache experts per MoE layer (one device)", flag_values=fv)
    flags.DEFINE_integer("expert_cache", None, "with --offload_experts: experts per MoE layer kept on the device "
                         "(top_k .. num_routed_experts)", flag_values=fv)
    flags.DEFINE_enum("expert_cache_policy", "lru", ["lru", "lfu"], "with --offload_experts: eviction",
                      flag_values=fv)


def check_offload_flags(args) -> None:
    """--offload_experts / --expert_cache / --mesh, checked before a model loads; a bad one raises ValueError
    (the policy is an enum flag, the cache size's range is checked by `ExpertOffload` against the model)."""
    if args.expert_cache is not None and not args.offload_experts:
        raise ValueError("--expert_cache sizes the offloaded experts' cache: add --offload_experts")
    if args.offload_experts and args.expert_cache is None:
        raise ValueError("--offload_experts needs --expert_cache=C (experts per MoE layer on the device)")
    if args.offload_experts and args.mesh:
        raise ValueError("--offload_experts runs on one device: drop --mesh")


def expert_slots_note(offload, chunk_flag: str) -> str | None:
    """The line that says how many experts per MoE layer the device may hold during a step, when a
    step's tokens can need more than --expert_cache (None otherwise, or without an offload)."""
    if offload is None or offload.max_slots <= offload.capacity:
        return None
    fits = offload.capacity // offload.top_k  # tokens whose top-k experts fit in C slots
    chunk = 1 << (fits.bit_length() - 1)  # a power of two, as a prefill chunk is
    return (f"expert cache: a step may hold up to {offload.max_slots} of {offload.num_experts} experts per MoE "
            f"layer on the device (--expert_cache={offload.capacity}); {chunk_flag}={chunk} keeps one row's "
            f"prefill within it")


def with_mesh(args):
    """`args` with --mesh AXIS=N,... read into {axis: size} (None without it); a bad one exits 2."""
    if not args.mesh:
        args.mesh = None
        return args
    try:
        sizes = {k.strip(): int(v) for k, v in (part.split("=") for part in args.mesh.split(","))}
    except ValueError:
        usage(f"--mesh {args.mesh!r}: expected AXIS=N[,AXIS=N...], e.g. fsdp=2,expert=4")
    unknown = sorted(set(sizes) - set(sharding.AXES))
    if unknown:
        usage(f"--mesh {args.mesh!r}: unknown axes {unknown}; axes are {list(sharding.AXES)}")
    args.mesh = sizes
    return args


def log_info() -> None:
    """absl's log lines, INFO and up, on stderr as absl.app.run sets them up: for the commands whose
    progress the library logs through absl.logging (training)."""
    flags.FLAGS.mark_as_parsed()  # absl's own flags (--verbosity ...) at their defaults
    absl_logging.use_absl_handler()
    absl_logging.set_verbosity(absl_logging.INFO)


def numbers(args: types.SimpleNamespace, name: str, kind: type = int) -> None:
    """Reads the comma list flag `name` (`flags.DEFINE_list`) as numbers in place; a bad item exits 2."""
    try:
        setattr(args, name, [kind(item) for item in getattr(args, name)])
    except ValueError:
        usage(f"--{name}={','.join(getattr(args, name))}: expected comma-separated {kind.__name__} values")


def usage(message: str) -> NoReturn:
    """Flags that cannot run together (or a bad value): one line on stderr, exit 2."""
    print(f"error: {message}".replace("\n", " "), file=sys.stderr, flush=True)
    raise SystemExit(2)


def fail(e: Exception, path: str | None = None) -> int:
    """Prints `e` as one line (an OSError that names no file, such as a full disk's, gets `path`);
    returns the exit code 2."""
    text = f"{path}: {e.strerror or e}" if isinstance(e, OSError) and e.filename is None and path else str(e)
    print(f"error: {_TS_SPEC.sub('', text)}".replace("\n", " "), file=sys.stderr, flush=True)
    return 2


def exit_with(code: int) -> NoReturn:
    """Ends a command's process with `code` (`python -m x` runs `cli.exit_with(main())`).

    After an error, the reads abandoned with the failed one (Orbax's other coroutines over a
    damaged file) would print their own tracebacks at exit, as "Exception ignored" (unraisable) or
    as asyncio's "Task exception was never retrieved" (its logger): the one-line error already says
    it. Done here, at exit, so that a test calling `main` in-process keeps its hooks."""
    if code:
        sys.unraisablehook = lambda unraisable: None
        logging.getLogger("asyncio").disabled = True
    sys.exit(code)
