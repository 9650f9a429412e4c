"""The kinds of a VM execution plan's steps (``remat.runtime.vm``), shared with the straight-line runs
generated from such plans (``remat.runtime.straight``)."""
from __future__ import annotations

K_KERNEL, K_CALL, K_FREE, K_BR, K_COND_BR, K_RETURN = range(6)

__all__ = ["K_BR", "K_CALL", "K_COND_BR", "K_FREE", "K_KERNEL", "K_RETURN"]
