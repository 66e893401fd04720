"""Callbacks for the training frameworks users already run (optional extras, never
imported by ``import steadfast``): :mod:`steadfast.integrations.lightning` for PyTorch
Lightning (``pip install steadfast[lightning]``) and
:mod:`steadfast.integrations.transformers` for the Hugging Face ``Trainer`` (``pip install
steadfast[transformers]``)."""
