"""Env SDK: declare envs (``BaseEnv``), build them (``make_env``), check them (``validate_env``), run many
copies in-process or on Ray (``RemoteEnv``), ship functions to Ray (``remote``), compress observations
(``encode_observations``). Importing this package does not import Ray."""

from opentinker.envs.base import BaseEnv, make_env
from opentinker.envs.errors import EnvAPIWarning, EnvSpecError, EnvValidationError, WorkerOutOfMemoryError
from opentinker.envs.remote import remote
from opentinker.envs.remote_env import RemoteEnv
from opentinker.envs.rollout import Rollout
from opentinker.envs.state_diff import decode_observations, encode_observations
from opentinker.envs.validation import validate_env

__all__ = [
    "BaseEnv",
    "EnvAPIWarning",
    "EnvSpecError",
    "EnvValidationError",
    "RemoteEnv",
    "Rollout",
    "WorkerOutOfMemoryError",
    "decode_observations",
    "encode_observations",
    "make_env",
    "remote",
    "validate_env",
]
