"""Backend dispatcher: one place that decides how a `pallas_call` is compiled.

Every kernel in this package is written in two *styles* that share their block math:

- ``"tpu"``: Mosaic TPU. Reductions run over the last grid axis with VMEM scratch
  accumulators, group / length metadata arrives by scalar prefetch (SMEM), so block
  index maps can skip work (clamped indices: no DMA for fully-masked blocks).
- ``"triton"``: Triton on NVIDIA (and ROCm). Triton has no scratch and no scalar prefetch,
  so reductions are in-kernel ``fori_loop``s over a full-length ref and metadata is an
  ordinary input read by pointer.

Mosaic GPU is not used: in jax 0.10 ``pl.pallas_call`` kernels for Mosaic GPU are
deprecated in favour of ``plgpu.kernel`` and need warpgroup layouts; jax's own default for
CUDA is Mosaic GPU, so the Triton route is selected explicitly through
``jax.experimental.pallas.triton.CompilerParams``.

``interpret=True`` runs either style through the Pallas interpreter (the only option on
CPU). Default: CPU -> TPU style interpreted, TPU -> Mosaic TPU, GPU -> Triton.

Beside the dispatcher: the block math the kernels share (fp32 block dots, a TPU scratch
reduction, the online softmax of the three attention kernels, padding to tiles).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

STYLES = ("tpu", "triton")
_NATIVE = {"tpu": "tpu", "gpu": "triton", "cuda": "triton", "rocm": "triton"}  # jax platform -> its style
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # a masked score: finite, so a fully masked row gives no nan
_DOT_FORMS = {"NN": (((1,), (0,)), ((), ())), "NT": (((1,), (1,)), ((), ())), "TN": (((0,), (0,)), ((), ()))}


@dataclasses.dataclass(frozen=True)
class Backend:
    """How to compile: kernel style ("tpu" | "triton") and whether to interpret."""

    style: str
    interpret: bool

    def __post_init__(self):
        if self.style not in STYLES:
            raise ValueError(f"{self.style=} must be one of {STYLES}")


def resolve(backend: str | None = None, interpret: bool | None = None) -> Backend:
    """The kernel style `backend` ("tpu" or "triton"; None: the default device's, "tpu" on CPU).

    `interpret=None` interprets exactly when the chosen style cannot run on the default device
    (e.g. CPU). Forcing `interpret=False` on CPU is only useful for lowering checks with
    `jax.jit(f).trace(...).lower(lowering_platforms=("tpu",))`.
    """
    native = _NATIVE.get(jax.default_backend())  # None on CPU
    style = backend or native or "tpu"
    if interpret is None:
        interpret = style != native
    return Backend(style=style, interpret=bool(interpret))


def pallas_call(be: Backend, kernel, *, name: str, out_shape, **grid):
    """`pl.pallas_call(kernel, ...)(...)`'s callable compiled in `be`'s style; `grid` holds `grid_spec`
    or `grid`, `in_specs`, ... Every TPU kernel here reduces over its last grid axis ("arbitrary", the
    others "parallel"); Triton runs 4 warps and 2 pipeline stages."""
    if be.style == "tpu":
        axes = len(grid["grid_spec"].grid if "grid_spec" in grid else grid["grid"])
        params = pltpu.CompilerParams(dimension_semantics=("parallel",) * (axes - 1) + ("arbitrary",))
    else:
        params = pltriton.CompilerParams(num_warps=4, num_stages=2)
    return pl.pallas_call(kernel, out_shape=out_shape, compiler_params=params, interpret=be.interpret, name=name,
                          **grid)


def accumulate(acc_ref, o_ref, update, *, first, last, active=True) -> None:
    """A TPU reduction over the last grid axis in VMEM scratch: `acc_ref` zeroed where `first`, set to
    update(acc) where `active`, written to `o_ref` where `last` (`first`, `last`, `active` read before
    the `pl.when`s: the interpreter cannot evaluate `pl.program_id` inside one)."""

    @pl.when(first)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(active)
    def _():
        acc_ref[...] = update(acc_ref[...])

    @pl.when(last)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def check_blocks(be: Backend, *, rows: tuple[str, ...] = (), lanes: tuple[str, ...] = (), **blocks: int) -> None:
    """Raises naming the first of `blocks` (name=size) that `be` cannot tile: on TPU the `rows`
    named must be multiples of 8 (sublanes) and the `lanes` of 128; Triton needs powers of two >= 16."""
    for name, b in blocks.items():
        tile = 8 if name in rows else 128 if name in lanes else 1
        if be.style == "tpu" and b % tile:
            raise ValueError(f"TPU needs {name}={b} % {tile} == 0")
        if be.style == "triton" and (b < 16 or b != next_pow2(b)):
            raise ValueError(f"Triton needs {name}={b} to be a power of two >= 16")


def online_softmax_init(rows: int, width: int):
    """The online softmax's empty carry: running max m [rows,1], normaliser l [rows,1], acc [rows,width], fp32."""
    return (jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, width), jnp.float32))


def online_softmax_step(carry, s, visible, pv):
    """One key block of the online softmax: scaled scores s [rows,bk] fp32, of which `visible` count,
    fold into carry (m, l, acc); `pv(p)` is the block's probabilities times its values, [rows,width]."""
    m_prev, l_prev, acc_prev = carry
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.where(visible, jnp.exp(s - m_new), 0.0)  # a block with nothing visible adds nothing
    l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    return m_new, l_new, alpha * acc_prev + pv(p)


def dot_f32(a, b, form: str = "NN"):
    """A 2-D block product accumulated in fp32: a . b ("NN"), a . b^T ("NT") or a^T . b ("TN")."""
    return lax.dot_general(a, b, _DOT_FORMS[form], preferred_element_type=jnp.float32)


def round_up(x, m: int):
    """x rounded up to a multiple of m (an int, or a traced integer array)."""
    return (x + m - 1) // m * m


def next_pow2(x: int) -> int:
    return pl.next_power_of_2(max(int(x), 1))


def pad_feature(be: Backend, d: int) -> int:
    """Feature (lane) width a kernel pads to: Triton tensors must have power-of-2 sizes."""
    return next_pow2(d) if be.style == "triton" else d


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """Zero-pads (or `value`-pads) `axis` of `x` at the end up to `size`."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)
