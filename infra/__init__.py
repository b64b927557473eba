"""Infrastructure edges: settings, the local service stack, clients for MLflow/S3/Ray."""
