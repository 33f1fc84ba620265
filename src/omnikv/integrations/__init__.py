"""Adapters between omnikv and the frameworks that produce or consume KV caches.

Each adapter lives in its own module and imports its framework lazily, so ``import omnikv``
never needs it: :mod:`omnikv.integrations.transformers` (``pip install omnikv[transformers]``).
"""
