"""A paged latent cache on a mesh: each batch shard reads and writes only the pages it holds.

The pool's page axis N is split over the mesh's token axes (data x fsdp x expert x pipeline,
`sharding.expert_parallel.TOKEN_AXES`), as the slot cache's rows are: shard i holds the pages
[i N/s, (i + 1) N/s). The page table holds these global ids, and the host gives a row pages of the
shard its step row falls in (rows split over the shards in equal blocks, as the pool is). Under
`jax.shard_map` over those axes each device then gathers and scatters its own pages, their ids made
local: no page crosses devices, whatever XLA would make of a gather over a split axis. Heads stay
split over `tensor` as the weights are (the shard_map leaves that axis to XLA).

A call whose rows the shards do not divide (the server's one-row prefill chunk) runs with its rows
whole on every shard: each shard reads the pages it holds (on all but the row's own shard, none),
and the partial softmaxes are merged across the shards by log-sum-exp (exact: the others weigh 0),
or a read that is zero where the page is another shard's (a gather of entries, the indexer's
scores of zero keys) by their sum.
Writes go to the shard holding the page, the other shards drop them. Without a mesh, or on a mesh
without token axes, the call runs as it is.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sharding.expert_parallel import TOKEN_AXES


def _axes(mesh) -> tuple[str, ...]:
    """The context mesh's token axes that split the pool (none inside a shard_map over them)."""
    if mesh.empty:
        return ()
    return tuple(a for a in TOKEN_AXES if mesh.shape.get(a, 1) > 1 and a not in mesh.manual_axes)


def _split(a: jax.Array, dim: int, axes) -> P:
    return P(*([None] * dim), axes, *([None] * (a.ndim - dim - 1)))


def _localize(page_table_BxM: jax.Array, pages: int, axes) -> jax.Array:
    """Global page ids -> this shard's (of `pages` pages), -1 where another shard holds the page."""
    local = page_table_BxM - jax.lax.axis_index(axes) * pages
    return jnp.where((page_table_BxM >= 0) & (local >= 0) & (local < pages), local, -1)


def _merge_shards(out_BxWxHxV: jax.Array, lse_BxWxH: jax.Array, axes):
    """Each shard's (out, lse) over its own pages -> over all of them (-inf where none has any)."""
    m = jax.lax.pmax(lse_BxWxH, axes)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse_BxWxH - m_safe)
    total = jax.lax.psum(w, axes)
    out = jax.lax.psum(out_BxWxHxV * w[..., None], axes) / jnp.where(total > 0, total, 1.0)[..., None]
    return out, jnp.where(total > 0, m_safe + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)


def _on_shards(fn, cache, page_table, layer, rows, row_dims, shared, *, out_rows: bool, merge: str | None = None):
    """fn(cache, page_table, layer, *rows, *shared) on each shard of the context mesh's token axes."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = () if page_table is None else _axes(mesh)
    if not axes:
        return fn(cache, page_table, layer, *rows, *shared)
    shards = math.prod(mesh.shape[a] for a in axes)
    pages = cache.latent.shape[-3]
    if pages % shards:
        raise ValueError(f"a paged cache's {pages} pages must split evenly over the mesh's {shards} batch shards")
    split = page_table.shape[0] % shards == 0
    if out_rows and not split and merge is None:
        raise ValueError(f"a paged read of {page_table.shape[0]} rows on {shards} batch shards: the rows must split "
                         "evenly over them")
    traced = isinstance(layer, jax.Array)

    def body(cache, table, layer_arg, rows, shared):
        out = fn(cache, _localize(table, cache.latent.shape[-3], axes), layer_arg if traced else layer, *rows, *shared)
        if not out_rows or split:
            return out
        return _merge_shards(*out, axes) if merge == "lse" else jax.tree.map(lambda a: jax.lax.psum(a, axes), out)

    pool_spec = jax.tree.map(lambda a: _split(a, a.ndim - 3, axes), cache)
    row_specs = tuple(jax.tree.map(lambda a, d=d: _split(a, d, axes) if split else P(), r)
                      for r, d in zip(rows, row_dims))
    out_specs = (P(axes) if split else P()) if out_rows else pool_spec
    run = jax.shard_map(body, mesh=mesh, in_specs=(pool_spec, P(axes) if split else P(), P(), row_specs, P()),
                        out_specs=out_specs, axis_names=set(axes), check_vma=False)
    return run(cache, page_table, layer if traced else 0, rows, shared)


def read(fn, cache, page_table, layer, *rows, shared=(), merge: str | None = None):
    """fn(cache, local page_table, layer, *rows, *shared) -> [B, ...] outputs, each shard over its own
    pages. Rows whole on every shard are merged by `merge`: "lse", fn's pair (out [B, W, H, V],
    lse [B, W, H]) by log-sum-exp; "sum", fn's outputs (zero where a page is another shard's) summed.
    rows: [B, ...] arrays (or tuples of them); shared: whole on every shard."""
    return _on_shards(fn, cache, page_table, layer, rows, (0,) * len(rows), shared, out_rows=True, merge=merge)


def write(fn, cache, page_table, layer, entries, positions_BxW):
    """fn(cache, local page_table, layer, entries, positions) -> the pool, each shard writing the
    entries [(L,) B, W, ...] whose pages it holds."""
    dim = entries.latent.ndim - 3
    return _on_shards(fn, cache, page_table, layer, (entries, positions_BxW), (dim, 0), (), out_rows=False)
