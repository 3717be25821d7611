"""The canary inside real engines, attached from the outside.

Each submodule integrates one engine and imports it only when used:

- :mod:`kvcanary_cupy.integrations.transformers`: Hugging Face transformers' continuous batching
  (``attach(model_or_manager, **options)``).

What every integration shares (the options, the attach/detach lifecycle, the report and stats
shape, request-id labelling) lives in :mod:`kvcanary_cupy.integrations._base`; docs/engines.md
says what each integration verifies.
"""
