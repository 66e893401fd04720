"""Callbacks for the training frameworks users already run (optional extras, never
imported by ``import steadfast``): :mod:`steadfast.integrations.lightning` for PyTorch
Lightning (``pip install steadfast[lightning]``)."""
