"""Tracking and registry, a plain library (no Prefect): MLflow setup, the per-iteration metrics callback, the model
registry with its one model-reference type, plots and the model card. ``tasks/``, ``serving/`` and ``federated/``
import it."""
