"""All op declarations. Importing this package registers every op in ``remat.ir.opdef.OPS``."""
from . import attention, control, elementwise, nn, optim, random, shape  # noqa: F401
