"""k3export.ops: the K3 custom ops (``torch.ops.k3.*``), their references and Triton kernels.

Importing this package registers ``k3::kda``, ``k3::situ_glu`` and ``k3::moe_route``. The
functions exported here validate their inputs (OpInputError, a ValueError, naming the argument)
and call the registered ops; the backend (torch / triton / auto) is chosen with ``set_backend``
or ``use_backend``.
"""

from k3export.ops._common import OpInputError
from k3export.ops.backend import BACKENDS, get_backend, resolve, set_backend, triton_available, use_backend
from k3export.ops.kda import kda, kda_chunk_torch, kda_naive
from k3export.ops.moe_route import moe_route, moe_route_naive
from k3export.ops.situ_glu import situ_glu, situ_glu_naive
from k3export.ops import quantile_balance  # noqa: F401  (registers nothing; kept for discovery)

__all__ = [
    "BACKENDS",
    "OpInputError",
    "get_backend",
    "kda",
    "kda_chunk_torch",
    "kda_naive",
    "moe_route",
    "moe_route_naive",
    "quantile_balance",
    "resolve",
    "set_backend",
    "situ_glu",
    "situ_glu_naive",
    "triton_available",
    "use_backend",
]
