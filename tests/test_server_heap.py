"""The server freezes the heap it built at start-up: a full garbage collection, which holds the GIL, then walks only
what came after, not the ~0.5 M objects of its modules and app (0.2-0.4 s in which no request was answered, the
status p99 of bench/service.py (c) before the freeze)."""

from __future__ import annotations

import gc

from fastapi.testclient import TestClient

from opentinker.infra.settings import Settings
from opentinker.server.app import create_app


def test_start_up_leaves_the_collector_a_small_heap(tmp_path):
    gc.unfreeze()
    try:
        with TestClient(create_app(Settings(data_dir=tmp_path), jobs=False)) as client:
            assert client.get("/healthz").status_code == 200
            frozen, walked = gc.get_freeze_count(), len(gc.get_objects())
            assert frozen > 100_000  # the modules and the app, MLflow's store among them
            assert walked < frozen / 4
    finally:
        gc.unfreeze()
