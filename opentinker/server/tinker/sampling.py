"""Sampler adapters: a sampling client reads an adapter loaded on the shared base model, one per checkpoint (shared by
every sampler of it, freed with the last one) or a private copy of a training adapter (``save_weights_and_get_
sampling_client``). The worker owns them: every method but ``sampler_source`` runs on the worker thread.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from opentinker.agents.multi_lora import AdapterShape

from .engine import Engine
from .errors import NotFound
from .sessions import Sampler, TrainingModel
from .store import CheckpointError, CheckpointStore

STATE_FILE = "state.pt"


def sampler_source(store: CheckpointStore, tenant: str, uri: str) -> tuple[str, Path]:
    """(base model, folder) of a checkpoint a sampling client may read: either kind, of the caller's tenant."""
    try:
        _, folder, meta = store.open(tenant, uri)
    except CheckpointError as error:
        raise NotFound(str(error)) from error
    return meta["base_model"], folder


class SamplerAdapters:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._loaded: dict[tuple[str, str], list] = {}
        """(base, folder) -> [adapter name, samplers using it]."""
        self._names = itertools.count()

    def load(self, sampler: Sampler, folder: Path) -> None:
        key = (sampler.base, str(folder))
        if key in self._loaded:
            self._loaded[key][1] += 1
        else:
            name, model = f"c{next(self._names)}", self.engine.model(sampler.base)
            if (folder / STATE_FILE).is_file():
                state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
                model.add(name, AdapterShape(**state["shape"]), seed=0)
                model.load_state(name, state["adapter"])
            else:
                model.load(name, folder)
            self._loaded[key] = [name, 1]
        sampler.adapter = self._loaded[key][0]

    def snapshot(self, sampler: Sampler, source: TrainingModel) -> None:
        model = self.engine.model(source.base)
        model.add(sampler.adapter, source.shape, seed=0)
        model.load_state(sampler.adapter, model.state(source.adapter))
        self._loaded[(sampler.base, sampler.adapter)] = [sampler.adapter, 1]

    def release(self, sampler: Sampler) -> None:
        for key, entry in list(self._loaded.items()):
            if key[0] == sampler.base and entry[0] == sampler.adapter:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._loaded[key]
                    self.engine.model(sampler.base).remove(sampler.adapter)
                return
