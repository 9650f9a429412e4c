"""Integrations of remat's training step with the training loops of other libraries.

Each submodule imports its library when it is imported itself, never from ``import remat``:

- :mod:`remat.integrations.transformers`: :class:`RematTrainer`, a ``transformers.Trainer`` whose
  forward and backward run as a remat step under a byte budget.
"""
