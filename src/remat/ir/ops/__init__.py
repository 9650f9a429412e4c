"""All op declarations. Importing this package registers every op in ``remat.ir.opdef.OPS``."""
from . import attention, collective, control, convblock, crossentropy, elementwise, fused, nn, norm, optim, random, resize, routing, shape  # noqa: F401
