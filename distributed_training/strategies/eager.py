"""`eager_only`: a method torch.compile must not trace (collectives, hooks' Python state).

Under ``torch.compile(wrapper)`` dynamo graph-breaks at such a method and runs it eagerly. It is
`torch.compiler.disable` applied lazily: importing torch._dynamo costs about a second, which every
``import distributed_training`` (a ``dtrain --help``) would pay; this way only the first call does.
"""

from __future__ import annotations

import torch

# torch's own lazy form (its optimizers use it); older or newer versions without it get the plain one.
eager_only = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable

__all__ = ["eager_only"]
