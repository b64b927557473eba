"""The OpenTinker server: an authenticated, multi-tenant API that takes training jobs (docs/service.md).

Importing this package imports nothing else: the client (``opentinker.server.client``) and the shared request and
response models (``opentinker.server.schemas``) stay free of the app (FastAPI, Prefect), which
``opentinker.server.app.create_app`` builds.
"""
