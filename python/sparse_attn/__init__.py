"""sparse_attn: sparse attention kernels (QSA, XAttention) for PyTorch and any DLPack tensors.

The functions keep the names, keywords, defaults, return values and exceptions of the seed
APIs (MATE's ``mate.qsa_*`` and the XAttention reference code), so a script written for them
runs by changing only the import. Tensors may be torch tensors (CPU or CUDA), numpy arrays or
any object with ``__dlpack__``; outputs are allocated with the inputs' framework on the
inputs' device, or written into ``out=`` and returned as that same object. Work is issued
on torch's current CUDA stream.

Errors: ``ValueError`` for a wrong value, shape, layout or option (its subclass
``NotSupportedError`` when the chosen backend does not implement a valid combination),
``TypeError`` for a wrong dtype or argument kind; the message names the argument.
"""

import pkgutil

# The compiled extension lives in the build tree (build/python/sparse_attn/_C*.so) during
# development and next to this file once installed; extend_path finds it in both cases.
__path__ = pkgutil.extend_path(__path__, __name__)

from ._C import NotSupportedError  # noqa: E402
from ._C import built_with_cuda  # noqa: E402
from .qsa import (  # noqa: E402
    qsa_indexer_mqa_score,
    qsa_mqa,
    qsa_mqa_decode,
    qsa_mqa_prefill,
    qsa_sparse_attention,
    qsa_sparse_attention_workspace_size,
)
from .compress import qsa_compress_block_keys  # noqa: E402
from .merge import merge_attention_states  # noqa: E402
from .select import (  # noqa: E402
    QSA_TOPK_BLOCKS,
    qsa_expand_blocks,
    qsa_indexer_select,
    qsa_indexer_select_workspace_size,
    qsa_mqa_decode_select,
    qsa_mqa_decode_select_workspace_size,
    qsa_topk_blocks,
)
from .xattn import (  # noqa: E402
    Xattention_prefill,
    block_sparse_attn_func,
    block_sparse_attn_paged_func,
    find_blocks_chunked,
    xattention_prefill_paged,
    xattn_estimate,
)
from . import _torch_ops  # noqa: E402,F401  (registers torch.ops.sparse_attn.* when torch is present)

__version__ = "0.1.0"

__all__ = [
    "NotSupportedError",
    "QSA_TOPK_BLOCKS",
    "Xattention_prefill",
    "block_sparse_attn_func",
    "block_sparse_attn_paged_func",
    "built_with_cuda",
    "find_blocks_chunked",
    "merge_attention_states",
    "qsa_compress_block_keys",
    "qsa_indexer_mqa_score",
    "qsa_indexer_select",
    "qsa_indexer_select_workspace_size",
    "qsa_mqa",
    "qsa_mqa_decode",
    "qsa_mqa_decode_select",
    "qsa_mqa_decode_select_workspace_size",
    "qsa_mqa_prefill",
    "qsa_expand_blocks",
    "qsa_sparse_attention",
    "qsa_sparse_attention_workspace_size",
    "qsa_topk_blocks",
    "xattention_prefill_paged",
    "xattn_estimate",
]
