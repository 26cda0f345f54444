"""Pallas kernels with no model knowledge, each beside its plain-jnp `*_reference`.

Backends are picked by `pallas_kernels._backend.resolve`: the Pallas interpreter on CPU,
Mosaic TPU on TPU, Triton on NVIDIA/AMD GPUs; every public kernel takes `backend=` and
`interpret=` to override.
"""

from pallas_kernels._backend import Backend, resolve as resolve_backend
from pallas_kernels.fp8_grouped_matmul import fp8_grouped_matmul, fp8_grouped_matmul_reference
from pallas_kernels.fp8_grouped_wgrad import (fp8_grouped_wgrad, fp8_grouped_wgrad_reference,
                                              group_aligned_rows)
from pallas_kernels.fp8_matmul import BlockSizes as BlockSizesFp8
from pallas_kernels.fp8_matmul import fp8_matmul, fp8_matmul_reference
from pallas_kernels.indexer_topk import BlockSizes as BlockSizesIndexer
from pallas_kernels.indexer_topk import indexer_scores, indexer_scores_reference, topk_indices
from pallas_kernels.mla_decode import BlockSizes as BlockSizesMlaDecode
from pallas_kernels.mla_decode import mla_decode, mla_decode_reference
from pallas_kernels.mla_prefill import BlockSizes as BlockSizesMlaPrefill
from pallas_kernels.mla_prefill import mla_prefill, mla_prefill_reference
from pallas_kernels.sparse_mla_decode import BlockSizes as BlockSizesSparseMlaDecode
from pallas_kernels.sparse_mla_decode import sparse_mla_decode, sparse_mla_decode_reference
from pallas_kernels.quantize import (dequantize_1x128, dequantize_128x128, quantize_1x128,
                                     quantize_128x128)

__all__ = [
    "Backend", "resolve_backend",
    "BlockSizesFp8", "fp8_matmul", "fp8_matmul_reference",
    "fp8_grouped_matmul", "fp8_grouped_matmul_reference",
    "fp8_grouped_wgrad", "fp8_grouped_wgrad_reference", "group_aligned_rows",
    "BlockSizesMlaDecode", "mla_decode", "mla_decode_reference",
    "BlockSizesMlaPrefill", "mla_prefill", "mla_prefill_reference",
    "BlockSizesSparseMlaDecode", "sparse_mla_decode", "sparse_mla_decode_reference",
    "BlockSizesIndexer", "indexer_scores", "indexer_scores_reference", "topk_indices",
    "quantize_1x128", "quantize_128x128", "dequantize_1x128", "dequantize_128x128",
]
