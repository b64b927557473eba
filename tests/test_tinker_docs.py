"""docs/tinker_api.md's table of SDK calls names every public method of the installed ``tinker`` SDK's clients, so a
new SDK's methods (or a method left out) fail here instead of going unanswered in the docs."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import tinker

DOCS = Path(__file__).resolve().parents[1] / "docs" / "tinker_api.md"
CLIENTS = (tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient, tinker.RestClient, tinker.AdminClient)


def _documented() -> set[str]:
    """Every identifier inside backticks in the first column of the "Every SDK call" table."""
    section = DOCS.read_text().split("## Every SDK call", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    names: set[str] = set()
    for row in rows[1:]:  # after the header
        first = row.split(" | ", 1)[0]
        for span in re.findall(r"`([^`]+)`", first):
            names.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", span))
    return names


def test_every_public_sdk_client_method_is_in_the_docs_table():
    documented = _documented()
    assert {"create_lora_training_client", "forward_backward", "sample"} <= documented  # the table was found
    missing = []
    for client in CLIENTS:
        for name, member in inspect.getmembers(client):
            if name.startswith("_") or not callable(member):
                continue
            call = name.removesuffix("_async")  # the same call, awaited
            if call not in documented:
                missing.append(f"{client.__name__}.{name}")
    assert not missing, f"SDK {tinker.__version__} methods missing from {DOCS.name}'s table: {missing}"
