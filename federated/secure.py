"""SecAgg+ (Flower's ``SecAggPlusWorkflow`` + ``secaggplus_mod``) as an option of a FedAvg/FedProx round.

Flower 1.42 implements SecAgg+ only for its legacy API: the server workflow needs a ``LegacyContext`` with a legacy
``flwr.server.strategy`` and exchanges ``FitIns``/``FitRes`` records (unnamed tensors), while this app uses the
Message API. This module bridges the two for one round: the server side runs the four-stage protocol with a legacy
FedAvg whose only job is to hand out the train config and collect the (unmasked) scalar metrics; the site side
translates the protocol's ``FitIns`` into the app's ordinary train message and its reply back into a ``FitRes``.
The server learns only the sample-weighted average of the sites' weights, never one site's weights.
"""

from __future__ import annotations

import json

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common import Code, FitRes, Parameters, Status, bytes_to_ndarray, ndarray_to_bytes
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat

NAMES_KEY = "weight-names"
"""Fit-config key carrying the tensor names in order, as a JSON list (legacy ``Parameters`` have no names and legacy
configs no lists)."""


def secure_aggregate(
    grid,
    run_id: int,
    round_number: int,
    nodes: list[int],
    arrays: ArrayRecord,
    fit_config: dict,
    min_replies: int,
    reconstruction_threshold: float,
    max_weight: float,
    timeout: float,
) -> tuple[ArrayRecord | None, list[dict]]:
    """One SecAgg+ train round over ``nodes``: the sample-weighted mean of the sites' weights (None when the
    protocol halted, e.g. too few sites survived) and each contributing site's reply metrics."""
    from flwr.server.client_manager import SimpleClientManager
    from flwr.server.compat.grid_client_proxy import GridClientProxy
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.strategy import FedAvg as LegacyFedAvg
    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key

    replies: list[dict] = []

    def collect(results: list[tuple[int, dict]]) -> dict:
        replies.extend(dict(metrics) for _, metrics in results)
        return {}

    config = {**fit_config, NAMES_KEY: json.dumps(list(arrays.keys()))}
    strategy = LegacyFedAvg(
        fraction_fit=1.0,
        fraction_evaluate=0.0,
        min_fit_clients=min_replies,
        min_available_clients=min_replies,
        on_fit_config_fn=lambda _: config,
        fit_metrics_aggregation_fn=collect,
    )
    clients = SimpleClientManager()
    for node in nodes:
        clients.register(GridClientProxy(node, grid, run_id))
    context = LegacyContext(
        Context(run_id=run_id, node_id=0, node_config={}, state=RecordDict(), run_config={}),
        strategy=strategy,
        client_manager=clients,
    )
    context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord(dict(arrays.items()))
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({Key.CURRENT_ROUND: round_number})
    workflow = SecAggPlusWorkflow(
        num_shares=1.0, reconstruction_threshold=reconstruction_threshold, max_weight=max_weight, timeout=timeout
    )
    workflow(grid, context)
    if not replies:
        return None, []
    summed = [bytes_to_ndarray(array.data) for array in context.state.array_records[MAIN_PARAMS_RECORD].values()]
    reference = [array.numpy() for array in arrays.values()]
    if len(summed) != len(reference):
        raise ValueError(f"SecAgg+ returned {len(summed)} tensors, the model has {len(reference)}")
    return ArrayRecord(
        {
            name: Array(np.asarray(value, dtype=ref.dtype).reshape(ref.shape))
            for name, value, ref in zip(arrays.keys(), summed, reference)
        }
    ), replies


def secaggplus_site_mod(msg: Message, context: Context, call_next) -> Message:
    """Site side: Flower's ``secaggplus_mod`` for SecAgg+ train messages, other messages pass through unchanged.

    Inside the protocol's masking stage the ``FitIns`` become the app's train message (named arrays + config) and the
    app's reply becomes the ``FitRes`` the mod masks (weights in name order, ``num-steps`` as the weight).
    """
    from flwr.client.mod import secaggplus_mod

    if msg.metadata.message_type != MessageType.TRAIN or RECORD_KEY_CONFIGS not in msg.content.config_records:
        return call_next(msg, context)

    def as_app_message(legacy: Message, ctx: Context) -> Message:
        fitins = compat.recorddict_to_fitins(legacy.content, keep_input=True)
        config = dict(fitins.config)
        names = json.loads(str(config.pop(NAMES_KEY)))
        tensors = [bytes_to_ndarray(t) for t in fitins.parameters.tensors]
        arrays = ArrayRecord({name: Array(t) for name, t in zip(names, tensors, strict=True)})
        reply = call_next(
            Message(RecordDict({"arrays": arrays, "config": ConfigRecord(config)}), metadata=legacy.metadata), ctx
        )
        weights = reply.content["arrays"]
        metrics = dict(reply.content["metrics"])
        parameters = Parameters([ndarray_to_bytes(weights[name].numpy()) for name in names], "numpy.ndarray")
        fitres = FitRes(Status(Code.OK, ""), parameters, int(metrics["num-steps"]), metrics)
        return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=legacy)

    return secaggplus_mod(msg, context, as_app_message)
