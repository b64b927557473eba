"""One federated round on a Flower Grid, with the guarantees Flower's `Strategy.start` lacks: every wait is bounded,
replies with the wrong tensors are rejected by name, and a round with fewer valid replies than the completion floor
fails loudly instead of averaging whoever survived.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from opentinker.federated import secure, task
from opentinker.federated.client_app import from_record
from opentinker.federated.config import FedConfig


class CompletionFloorError(RuntimeError):
    """Too few sites replied with a valid update (or were connected) for the round to count."""


@dataclass
class RoundStats:
    """What the server measured in one round; logged to MLflow and kept in the checkpoint history."""

    round: int
    sites: list[int] = field(default_factory=list)
    """Site ids whose update was aggregated."""
    failures: list[str] = field(default_factory=list)
    """One line per failed, missing or rejected reply."""
    train_steps: int = 0
    bytes_sent: int = 0
    """Payload bytes of the weights sent to sites (train + evaluate messages)."""
    bytes_received: int = 0
    """Payload bytes of the weights received from sites."""
    train_seconds: float = 0.0
    seconds: float = 0.0
    returns: dict[int, float] = field(default_factory=dict)
    """Return of the global model after this round on each site's env."""

    def metrics(self) -> dict[str, float]:
        out = {f"return/site-{site}": value for site, value in sorted(self.returns.items())}
        if self.returns:
            out["return/mean"] = sum(self.returns.values()) / len(self.returns)
        out.update(
            {
                "round/bytes_sent": float(self.bytes_sent),
                "round/bytes_received": float(self.bytes_received),
                "round/seconds": self.seconds,
                "round/train_seconds": self.train_seconds,
                "round/replies": float(len(self.sites)),
                "round/failures": float(len(self.failures)),
                "round/train_steps": float(self.train_steps),
            }
        )
        return out


class _NodeSnapshot:
    """The node list a strategy samples from, fixed for the round so its sampler never waits unbounded."""

    def __init__(self, node_ids: list[int]) -> None:
        self._node_ids = node_ids

    def get_node_ids(self) -> list[int]:
        return list(self._node_ids)


def payload_bytes(content: RecordDict) -> int:
    return sum(len(array.data) for record in content.array_records.values() for array in record.values())


REPLY_POLL_S = 0.1
"""Seconds between the server's asks for replies. Flower's ``Grid.send_and_receive`` waits a hard-coded 3 s between
asks, which a deployed round pays on every exchange (train and evaluate)."""


def send_and_receive(grid: Grid, messages: list[Message], timeout: float) -> list[Message]:
    """Flower's ``Grid.send_and_receive`` with a ``REPLY_POLL_S`` poll: push, then pull replies until all arrived or
    ``timeout`` passed."""
    pending = set(grid.push_messages(messages))
    deadline = time.monotonic() + timeout
    replies: list[Message] = []
    while pending:
        arrived = list(grid.pull_messages(pending))
        replies += arrived
        pending -= {reply.metadata.reply_to_message_id for reply in arrived}
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(REPLY_POLL_S)
    return replies


def wait_for_sites(grid: Grid, config: FedConfig, round_number: int) -> list[int]:
    """Connected node ids: all `num_sites` if they arrive within `node_wait` seconds, else at least the floor."""
    deadline = time.monotonic() + config.node_wait
    while True:
        nodes = list(grid.get_node_ids())
        if len(nodes) >= config.num_sites or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if len(nodes) < config.min_replies:
        raise CompletionFloorError(
            f"round {round_number}: only {len(nodes)} of {config.num_sites} sites connected "
            f"after {config.node_wait:.0f}s; "
            f"min-completion-rate={config.min_completion_rate} needs {config.min_replies}"
        )
    return nodes


def _site_of(reply: Message) -> str:
    metrics = next(iter(reply.content.metric_records.values()), None) if not reply.has_error() else None
    site = f"site {int(metrics['site-id'])}" if metrics is not None and "site-id" in metrics else "a site"
    return f"{site} (node {reply.metadata.src_node_id})"


def train_round(
    grid: Grid,
    strategy: Strategy,
    config: FedConfig,
    round_number: int,
    arrays: ArrayRecord,
    train_config: ConfigRecord,
) -> tuple[ArrayRecord, RoundStats]:
    """Send the global model to every connected site, validate the replies, enforce the floor, aggregate."""
    stats = RoundStats(round=round_number)
    started = time.monotonic()
    nodes = wait_for_sites(grid, config, round_number)
    if config.secure_aggregation:
        return _secure_train_round(grid, config, round_number, arrays, train_config, nodes, stats, started), stats
    messages = list(strategy.configure_train(round_number, arrays, train_config, _NodeSnapshot(nodes)))
    stats.bytes_sent += sum(payload_bytes(m.content) for m in messages)
    replies = send_and_receive(grid, messages, config.round_timeout)
    expected = from_record(arrays)
    valid: list[Message] = []
    for reply in replies:
        if reply.has_error():
            stats.failures.append(f"{_site_of(reply)}: {reply.error.reason.strip()[-400:]}")
            continue
        stats.bytes_received += payload_bytes(reply.content)
        try:
            task.check_shapes(expected, from_record(reply.content["arrays"]), f"reply from {_site_of(reply)}")
        except (task.WeightShapeError, KeyError) as err:
            stats.failures.append(f"rejected: {err}")
            continue
        valid.append(reply)
    answered = {r.metadata.src_node_id for r in replies}
    stats.failures += [
        f"node {m.metadata.dst_node_id}: no reply within {config.round_timeout:.0f}s"
        for m in messages
        if m.metadata.dst_node_id not in answered
    ]
    if len(valid) < config.min_replies:
        raise CompletionFloorError(
            f"round {round_number}: {len(valid)} valid replies from {len(messages)} sites; "
            f"min-completion-rate={config.min_completion_rate} of {config.num_sites} sites needs {config.min_replies}. "
            "Failures: " + " | ".join(stats.failures)
        )
    new_arrays, _ = strategy.aggregate_train(round_number, valid)
    for reply in valid:
        metrics = reply.content["metrics"]
        stats.sites.append(int(metrics["site-id"]))
        stats.train_steps += int(metrics["num-steps"])
    stats.train_seconds = time.monotonic() - started
    return new_arrays, stats


def _secure_train_round(
    grid: Grid,
    config: FedConfig,
    round_number: int,
    arrays: ArrayRecord,
    train_config: ConfigRecord,
    nodes: list[int],
    stats: RoundStats,
    started: float,
) -> ArrayRecord:
    """SecAgg+ instead of plain replies: no per-site shape check is possible (the server never sees one site's
    weights; a mismatched site breaks the masked sum and fails the round), the floor still applies."""
    fit_config = dict(train_config)
    if config.strategy == "fedprox":
        fit_config["proximal-mu"] = config.proximal_mu
    stats.bytes_sent += payload_bytes(RecordDict({"arrays": arrays})) * len(nodes)
    new_arrays, replies = secure.secure_aggregate(
        grid,
        grid.run.run_id,
        round_number,
        nodes,
        arrays,
        fit_config,
        min_replies=config.min_replies,
        reconstruction_threshold=config.min_completion_rate,
        max_weight=float(config.secagg_max_weight or config.local_steps),
        timeout=config.round_timeout,
    )
    if len(replies) < len(nodes):
        stats.failures.append(f"{len(nodes) - len(replies)} of {len(nodes)} sites did not complete SecAgg+")
    if new_arrays is None or len(replies) < config.min_replies:
        raise CompletionFloorError(
            f"round {round_number}: SecAgg+ aggregated {len(replies)} of {len(nodes)} sites; "
            f"min-completion-rate={config.min_completion_rate} of {config.num_sites} sites needs {config.min_replies}"
        )
    for metrics in replies:
        stats.sites.append(int(metrics["site-id"]))
        stats.train_steps += int(metrics["num-steps"])
    stats.train_seconds = time.monotonic() - started
    return new_arrays


def evaluate_round(
    grid: Grid, config: FedConfig, stats: RoundStats, arrays: ArrayRecord, eval_config: ConfigRecord
) -> None:
    """Score the global model on every connected site's own env; a site that fails to answer is recorded, not fatal."""
    content = RecordDict({"arrays": arrays, "config": eval_config})
    messages = [
        Message(content=content, message_type=MessageType.EVALUATE, dst_node_id=node) for node in grid.get_node_ids()
    ]
    stats.bytes_sent += payload_bytes(content) * len(messages)
    for reply in send_and_receive(grid, messages, config.round_timeout):
        if reply.has_error():
            stats.failures.append(f"evaluate on {_site_of(reply)}: {reply.error.reason.strip()[-400:]}")
            continue
        metrics = reply.content["metrics"]
        stats.returns[int(metrics["site-id"])] = float(metrics["return"])
