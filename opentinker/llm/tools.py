"""The agent's tools: sandboxed Python, document/web search, and a served RL policy.

Each is a LangChain ``BaseTool`` so any chat model that supports tool calling can use it. Tools report
failures as text (the model reads them and carries on) instead of raising.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from langchain_core.tools import BaseTool, ToolException
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from .sandbox import SandboxLimits, run_python
from .search import LocalDocsBackend, SearchBackend


class _CodeInput(BaseModel):
    code: str = Field(description="Python source to run; the value of a trailing expression is printed.")


class PythonREPL(BaseTool):
    """Runs Python in a fresh bubblewrap sandbox per call (no state kept between calls; see ``sandbox.py``).

    Raises ``SandboxUnavailable`` instead of running code when the isolation cannot be set up.
    """

    name: str = "python_repl"
    description: str = "Run Python code in a sandbox and return what it prints."
    args_schema: type[BaseModel] = _CodeInput
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    model_config = ConfigDict(arbitrary_types_allowed=True)

    def _run(self, code: str, **_: Any) -> str:
        return run_python(code, self.limits).report()


class _QueryInput(BaseModel):
    query: str = Field(min_length=1, max_length=500, description="What to search for.")


class WebSearch(BaseTool):
    """Search with a pluggable backend; the default searches the project's own docs, offline."""

    name: str = "web_search"
    description: str = "Search the documentation and return the most relevant passages."
    args_schema: type[BaseModel] = _QueryInput
    k: int = Field(default=3, ge=1, le=20)
    _backend: SearchBackend = PrivateAttr()

    def __init__(self, backend: SearchBackend | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        if backend is not None and not isinstance(backend, SearchBackend):
            raise TypeError(f"backend: expected an object with search(query, k), got {type(backend).__name__}")
        self._backend = backend if backend is not None else LocalDocsBackend()

    @property
    def backend(self) -> SearchBackend:
        return self._backend

    def _run(self, query: str, **_: Any) -> str:
        hits = self._backend.search(query, self.k)
        if not hits:
            return f"No results for {query!r}."
        return "\n".join(f"[{i}] {h.title} ({h.source}): {h.snippet}" for i, h in enumerate(hits, 1))


class _ObservationInput(BaseModel):
    observation: list[float] | list[list[float]] = Field(
        description="One observation of the environment, as a flat list of numbers (e.g. CartPole: 4 floats)."
    )


class PolicyTool(BaseTool):
    """Ask a served RL policy which action it takes for an observation.

    Give either ``predict`` (e.g. ``serving.deploy.Deployment.predict``, which carries the URL and API key)
    or ``url`` + ``api_key`` for a policy service reached over HTTP.
    """

    name: str = "policy"
    description: str = "Ask the trained RL policy which action to take for an observation; returns the action."
    args_schema: type[BaseModel] = _ObservationInput
    url: str | None = None
    endpoint: str = "/act"
    timeout_s: float = 10.0
    _predict: Callable[[Any], Any] | None = PrivateAttr(default=None)
    _api_key: str | None = PrivateAttr(default=None)

    def __init__(
        self,
        predict: Callable[[Any], Any] | None = None,
        *,
        url: str | None = None,
        api_key: str | None = None,
        **kwargs: Any,
    ):
        if (predict is None) == (url is None):
            raise ValueError("PolicyTool: give exactly one of predict (a Deployment's predict) or url")
        if url is not None and not api_key:
            raise ValueError("PolicyTool.api_key: required with url (the policy service answers 401 without it)")
        super().__init__(url=url.rstrip("/") if url else None, **kwargs)
        self._predict, self._api_key = predict, api_key

    def _run(self, observation: list, **_: Any) -> str:
        result = self._predict(observation) if self._predict else self._post(observation)
        return json.dumps(_plain(result))

    def _post(self, observation: list) -> Any:
        import httpx

        response = httpx.post(
            f"{self.url}{self.endpoint}",
            json={"obs": observation},
            timeout=self.timeout_s,
            headers={"Authorization": f"Bearer {self._api_key}"},
        )
        if response.status_code != 200:
            raise ToolException(f"policy service answered {response.status_code}: {response.text[:300]}")
        return response.json()["action"]


def _plain(value: Any) -> Any:
    """numpy arrays/scalars to JSON-friendly lists/numbers."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


TASK_TOOL_WALL_TIME_S = 5.0
"""``python_repl``'s wall time in the shipped text tasks (a rollout waits on it)."""


def task_python_repl() -> PythonREPL:
    """``python_repl`` as the shipped text tasks run it (entry point ``opentinker.text_tools``, see pyproject.toml)."""
    return PythonREPL(limits=SandboxLimits(wall_time_s=TASK_TOOL_WALL_TIME_S))
