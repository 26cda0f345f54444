"""Meshes, logical-axis rules and the collectives of parallel training; no model knowledge.

    mesh = sharding.make_mesh({"data": 2, "expert": -1})
    spec = sharding.logical_to_spec(("layers", "expert", "embed", "mlp"), shape, mesh, sharding.get_rules("default"))

Modules: mesh (axes, sizes, hybrid ICI/DCN and abstract meshes), rules (the logical-axis table and
presets), expert_parallel (all-to-all dispatch in shard_map), pipeline (GPipe stage schedule with
ppermute), multihost (jax.distributed start-up, per-process batch rows).
"""

from sharding.mesh import AXES, MeshError, abstract_mesh, check_divides, make_mesh, resolve_sizes
from sharding.rules import (BATCH_AXES, PRESETS, STAGE_BATCH_AXES, ShardingRuleError, active_rules, follow_params,
                            get_rules, logical_to_spec, named_sharding, replicated, shards_of, use_rules)
