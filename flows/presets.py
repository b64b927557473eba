"""Default hyper-parameters per kind of problem, so ``opentinker train ENV`` works without tuning.

The family is picked from the env itself (``ProblemKind``): discrete or continuous actions, observation size,
episode length, and the suite it belongs to (the ALE namespace: Atari; a gymnasium ``MujocoEnv``: MuJoCo). Per-id
entries exist only where the family default was measured to fail or to be slower. A config file's algorithm table
(``[ppo]``, ``[sac]``, ...) and top-level ``num_envs`` (``RunSpec.engine``) override any field; ``resolve_spec``
fills the rest into a run's spec, once. A user's own env (``module:Class``: no registry entry, so no measured preset)
takes PPO's family preset under the row of ``BUDGET_TABLE`` for the run's steps and its measured episode length
(``budget_defaults``). The tables are documented in docs/pipeline.md ("Presets").
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from opentinker.agents.config import CONFIGS
from opentinker.tasks.spec import EngineSpec, RunSpec

PPO_DISCRETE: dict[str, Any] = {
    "num_envs": 64,
    "n_steps": 16,
    "learning_rate": 1e-3,
    "update_epochs": 4,
    "num_minibatches": 4,
}
"""Many short segments: CartPole-v1 passes 475 after ~100–170k steps (docs/pipeline.md)."""
PPO_DISCRETE_LONG: dict[str, Any] = {
    "num_envs": 16,
    "n_steps": 256,
    "learning_rate": 3e-4,
    "gamma": 0.999,
    "gae_lambda": 0.98,
    "update_epochs": 4,
    "num_minibatches": 16,
}
"""Episodes over 500 steps (LunarLander, Acrobot): longer segments and horizon (RL-Zoo's LunarLander family)."""
PPO_CONTINUOUS: dict[str, Any] = {
    "num_envs": 16,
    "n_steps": 128,
    "learning_rate": 3e-4,
    "update_epochs": 10,
    "num_minibatches": 32,
    "ent_coef": 0.0,
    "clip_vloss": False,
    "norm_obs": True,
    "norm_reward": True,
}
"""CleanRL's ppo_continuous_action with SB3 VecNormalize-style observation and reward normalisation."""
DQN_DISCRETE: dict[str, Any] = {
    "num_envs": 4,
    "n_steps": 32,
    "learning_rate": 2.3e-3,
    "batch_size": 64,
    "buffer_size": 100_000,
    "learning_starts": 1_000,
    "target_network_frequency": 10,
    "train_frequency": 2,
    "exploration_fraction": 0.16,
    "end_e": 0.04,
    "hidden_sizes": (256, 256),
    "total_steps": 50_000,
}
"""RL-Zoo's CartPole-v1 DQN (train_freq 256 / gradient_steps 128 = one gradient step per 2 env steps); epsilon decays
over its 50k-step horizon whatever the run's length."""

PPO_ATARI: dict[str, Any] = {
    "num_envs": 8,
    "n_steps": 128,
    "learning_rate": 2.5e-4,
    "gamma": 0.99,
    "gae_lambda": 0.95,
    "num_minibatches": 4,
    "update_epochs": 4,
    "clip_coef": 0.1,
    "ent_coef": 0.01,
    "vf_coef": 0.5,
    "max_grad_norm": 0.5,
    "hidden_sizes": (),
}
"""CleanRL's ppo_atari.py: 8 envs x 128 steps, lr 2.5e-4 annealed, 4 epochs x 4 minibatches, clip 0.1, entropy 0.01;
its network exactly: the Nature CNN (ending in 512 ReLU units) shared by the actor's and critic's linear heads (no
hidden layers after the extractor)."""
SAC_CONTINUOUS: dict[str, Any] = {"num_envs": 1, "learning_rate": 1e-3, "learning_starts": 1_000}
"""SB3's SAC defaults (256x256 ReLU, batch 256, buffer 1M, tau 0.005, one gradient step per env step, learned
temperature) with RL-Zoo's Pendulum learning rate and a 1k-step random warm-up."""
SAC_MUJOCO: dict[str, Any] = {"num_envs": 1, "learning_starts": 10_000}
"""RL-Zoo's SAC for the MuJoCo family (HalfCheetah, Hopper, Walker2d, Ant, ...): SB3's defaults (lr 3e-4, 256x256,
batch 256, buffer 1M, tau 0.005, gamma 0.99, one gradient step per env step, learned temperature) after 10k random
steps."""
TD3_CONTINUOUS: dict[str, Any] = {"num_envs": 1, "learning_rate": 1e-3, "learning_starts": 1_000}
"""CleanRL's TD3 (256x256, lr 1e-3, batch 256, exploration noise 0.1, policy delay 2) after 1k random steps."""
TD3_MUJOCO: dict[str, Any] = {
    "num_envs": 1,
    "learning_starts": 10_000,
    "learning_rate": 1e-3,
    "hidden_sizes": (400, 300),
}
"""RL-Zoo's TD3 for the MuJoCo family: SB3's TD3 (400x300, lr 1e-3, batch 256, Gaussian exploration noise 0.1,
policy delay 2, target smoothing 0.2 clipped at 0.5) after 10k random steps."""

PER_ID: dict[tuple[str, str], dict[str, Any]] = {
    # The family's lr 3e-4 passed 1000 within 100k steps on 1 of 3 seeds (578, 579 at 100k; 90k), lr 1e-3 on all 3
    # (at 50k, 60k, 75k): the critics of Hopper's early-termination returns need the faster rate.
    ("sac", "Hopper-v5"): {**SAC_MUJOCO, "learning_rate": 1e-3},
    # lr 1e-3 (CleanRL's critic rate) reached 1500 after 25k and 20k env steps (seeds 0, 1; 15k and 10k gradient
    # steps), the family's 3e-4 after 35k on both: the same return in 40-60 % of the gradient steps, which are the
    # run's time (docs/benchmarks.md, the zoo). The family keeps RL-Zoo's 3e-4: Walker2d-v5 at 1e-3 stayed at
    # 190-360 up to 60k steps (seed 0), not yet compared with 3e-4 there.
    ("sac", "HalfCheetah-v5"): {**SAC_MUJOCO, "learning_rate": 1e-3},
    ("ppo", "Pendulum-v1"): {
        "num_envs": 16,
        "n_steps": 128,
        "learning_rate": 1e-3,
        "gamma": 0.9,
        "update_epochs": 10,
        "num_minibatches": 8,
        "ent_coef": 0.0,
        "clip_vloss": False,
        "reward_scale": 0.1,
    },
    # Sparse reward: the family's short exploration never reaches the flag (RL-Zoo's MountainCar-v0 DQN, on its one
    # env: with 4 copies the same steps and gradient steps plateaued at -143 within 120k steps, with 1 it reached -108).
    ("dqn", "MountainCar-v0"): {
        "num_envs": 1,
        "n_steps": 16,
        "learning_rate": 4e-3,
        "batch_size": 128,
        "buffer_size": 10_000,
        "learning_starts": 1_000,
        "gamma": 0.98,
        "target_network_frequency": 600,
        "train_frequency": 2,
        "exploration_fraction": 0.2,
        "end_e": 0.07,
        "hidden_sizes": (256, 256),
        "total_steps": 120_000,
    },
}
"""Only where the family default fails: (algorithm, env id) -> the whole preset."""

LONG_EPISODE = 500


@dataclass(frozen=True)
class ProblemKind:
    """What the preset depends on, read from the env and its registry spec."""

    actions: str
    """"discrete", "multi-discrete" (MultiDiscrete / MultiBinary: PPO's discrete presets, no DQN) or "continuous"."""
    obs_dim: int
    episode_steps: int | None
    """The spec's ``max_episode_steps`` (None when unlimited or unknown)."""
    reward_threshold: float | None
    suite: str | None = None
    """"atari" (an id in gymnasium's ALE namespace), "mujoco" (the env is a gymnasium ``MujocoEnv``) or None."""
    registered: bool = True
    """A gymnasium id (its family presets were measured on registered envs); False: a user's ``module:Class``,
    whose PPO defaults follow the run's budget (``budget_defaults``); ``episode_steps`` is then measured."""

    @property
    def family(self) -> str:
        long = self.episode_steps is None or self.episode_steps > LONG_EPISODE
        return self.actions if self.actions == "continuous" or not long else f"{self.actions}-long"

    @property
    def families(self) -> tuple[str, ...]:
        """Where to look for a preset, most specific first: the suite's, then the kind of actions'."""
        return (self.suite, self.family) if self.suite else (self.family,)


def env_suite(env: Any) -> str | None:
    """The family an env belongs to by what it is, not by a list of ids: the ALE namespace, or a MuJoCo env class."""
    from opentinker.envs.atari import ATARI_NAMESPACE

    if getattr(env.spec, "namespace", None) == ATARI_NAMESPACE:
        return "atari"
    if any(cls.__name__ == "MujocoEnv" for cls in type(env.unwrapped).__mro__):
        return "mujoco"
    return None


def action_kind(space) -> str:
    """The presets' kind of action space: one index (Discrete), several (MultiDiscrete, MultiBinary), or continuous."""
    import gymnasium as gym

    if isinstance(space, gym.spaces.Discrete):
        return "discrete"
    if isinstance(space, (gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)):
        return "multi-discrete"
    return "continuous"


@functools.lru_cache(maxsize=64)
def problem_kind(env_ref: str) -> ProblemKind:
    """Build one copy of the env (id or ``module:Class``) and describe it; once per process (the CLI's checks and the
    flow resolve the same params)."""
    import gymnasium as gym

    from opentinker.envs import make_env
    from opentinker.envs.spaces import unsupported_spaces

    env = make_env(env_ref)
    try:
        spec = env.spec
        problem = unsupported_spaces(env.observation_space, env.action_space)
        if problem is not None or isinstance(env.action_space, gym.spaces.Text):
            raise ValueError(problem or f"action_space {env.action_space}: a text env trains with algorithm 'grpo'")
        actions = action_kind(env.action_space)
        obs_dim = int(gym.spaces.flatdim(env.observation_space))
        registered = spec is not None
        episode_steps = getattr(spec, "max_episode_steps", None)
        if not registered:
            episode_steps = probe_episodes(env)
        return ProblemKind(
            actions,
            obs_dim,
            episode_steps,
            getattr(spec, "reward_threshold", None),
            env_suite(env),
            registered,
        )
    finally:
        env.close()


PROBE_STEPS, PROBE_SECONDS = 2_000, 1.0


def probe_episodes(env: Any, seed: int = 0) -> int | None:
    """The longest episode a uniform random policy plays in ``PROBE_STEPS`` steps (at most ``PROBE_SECONDS``): a
    user's env has no ``max_episode_steps``, and the budget table sizes rollouts by it. None when no episode ends
    within the probe (an unlimited or long env: the long family)."""
    import copy
    import time

    space = copy.deepcopy(env.action_space)
    space.seed(seed)
    env.reset(seed=seed)
    longest, length, deadline = None, 0, time.perf_counter() + PROBE_SECONDS
    for _ in range(PROBE_STEPS):
        _, _, terminated, truncated, _ = env.step(space.sample())
        length += 1
        if terminated or truncated:
            longest, length = max(longest or 0, length), 0
            env.reset()
        if time.perf_counter() > deadline:  # a slow env: what it played so far
            break
    return longest


BUDGET_TABLE: tuple[tuple[int, dict[str, Any]], ...] = (
    (
        50_000,
        {
            "batch": 512,
            "update_epochs": 10,
            "num_minibatches": 8,
            "learning_rate": 3e-4,
            "anneal_lr": False,
            "norm_reward": False,
        },
    ),
    (
        500_000,
        {"batch": 2048, "update_epochs": 10, "num_minibatches": 32, "learning_rate": 3e-4, "anneal_lr": False},
    ),
)
"""PPO on a user's env (no registry entry, no per-id preset): (largest budget, settings). A run up to 500k steps
gets its batches reused many times (10 epochs of 64-transition minibatches: 0.16 gradient steps per env step, as
SB3's default PPO; at 100k, 128-transition ones left the Dict bench env below SB3 on 3 of 5 seeds) at a constant
learning rate (annealed to 0 over 100k steps the MultiDiscrete bench env stayed at random,
constant it solved it; the continuous family's return normalisation off: its statistics, still moving, cost the Box
bench env's greedy return on 2 of 7 seeds at 20k: docs/pipeline.md); above the last row, the family's preset
(throughput: many env copies, few updates per sample, the learning rate annealed). ``batch`` is split into env
copies x rollout steps by the episode length (``budget_defaults``)."""
SMALL_BUDGET_FIELDS: dict[str, Any] = {"ent_coef": 0.0, "clip_vloss": False}
"""What every budget row sets besides its own: SB3's PPO defaults (no entropy bonus, unclipped value loss)."""


def budget_defaults(budget: int, kind: ProblemKind) -> dict[str, Any]:
    """The budget table's fields for a run of ``budget`` env steps on an env of ``kind`` ({} above the table: the
    family's preset stands). Rollout steps per env copy: the episode length rounded up to a power of two, between 64
    and half the batch (an unlimited or unmeasured episode: half the batch); env copies: the batch over that."""
    row = next((fields for limit, fields in BUDGET_TABLE if budget <= limit), None)
    if row is None:
        return {}
    fields = {key: value for key, value in row.items() if key != "batch"}
    batch = row["batch"]
    episode = kind.episode_steps or batch
    n_steps = min(max(64, 1 << max(int(episode) - 1, 1).bit_length()), batch // 2)
    return {**SMALL_BUDGET_FIELDS, **fields, "num_envs": batch // n_steps, "n_steps": n_steps}


FAMILIES: dict[tuple[str, str], dict[str, Any] | None] = {
    ("ppo", "discrete"): PPO_DISCRETE,
    ("ppo", "discrete-long"): PPO_DISCRETE_LONG,
    ("ppo", "multi-discrete"): PPO_DISCRETE,
    ("ppo", "multi-discrete-long"): PPO_DISCRETE_LONG,
    ("ppo", "continuous"): PPO_CONTINUOUS,
    ("ppo", "atari"): PPO_ATARI,
    ("dqn", "discrete"): DQN_DISCRETE,
    ("dqn", "discrete-long"): DQN_DISCRETE,
    ("dqn", "atari"): None,  # a replay buffer of 84x84x4 frames is gigabytes: not without a frame-sharing buffer
    ("sac", "continuous"): SAC_CONTINUOUS,
    ("sac", "mujoco"): SAC_MUJOCO,
    ("td3", "continuous"): TD3_CONTINUOUS,
    ("td3", "mujoco"): TD3_MUJOCO,
}
"""(algorithm, family) -> preset; None: the algorithm has no preset for that family (an error names the ones that
do). A MuJoCo env with PPO takes the continuous family's preset (CleanRL's, tuned on MuJoCo)."""


def preset(algorithm: str, env_id: str, kind: ProblemKind, budget: int | None = None) -> dict[str, Any]:
    """The preset for this algorithm and env: the per-id entry, else the most specific family's (a copy: callers may
    update it); PPO on a user's env (not registered, no suite) with ``budget`` env steps: the family's preset under
    the budget table's row (``budget_defaults``)."""
    if (algorithm, env_id) in PER_ID:
        return dict(PER_ID[(algorithm, env_id)])
    family = _family(algorithm, kind)
    if family is None or FAMILIES[(algorithm, family)] is None:
        fits = sorted({a for a, _ in FAMILIES if (f := _family(a, kind)) and FAMILIES[(a, f)] is not None})
        what = f"{kind.actions} actions" if family is None else f"the {family} family"
        raise ValueError(f"algorithm: {algorithm!r} does not handle {what} (env {env_id!r}); use {' or '.join(fits)}")
    table = dict(FAMILIES[(algorithm, family)])
    if algorithm == "ppo" and budget is not None and not kind.registered and kind.suite is None:
        table.update(budget_defaults(budget, kind))
    return table


def _family(algorithm: str, kind: ProblemKind) -> str | None:
    """The most specific of the env's families that has an entry for ``algorithm``."""
    return next((f for f in kind.families if (algorithm, f) in FAMILIES), None)


def resolve_spec(spec: RunSpec) -> RunSpec:
    """``spec`` with every default made concrete, once (a resolved spec comes back as it is), so the run records
    what it trained with: the preset's fields under the user's (``num_envs`` included), the backend, and the gate
    threshold (the env spec's ``reward_threshold`` unless set; None when the env has none: the gate then compares
    with champion or random). GRPO: its config's defaults and a threshold of 0 (held-out success)."""
    if spec.resolved:
        return spec
    engine = spec.engine
    update: dict[str, Any] = {"resolved": True}
    if engine.algorithm in CONFIGS:
        from opentinker.envs.remote_env import resolve_backend

        kind = problem_kind(spec.env_id)
        budget = engine.config_fields().get("total_steps") or spec.steps  # the schedules' horizon, else the run's
        table = {**preset(engine.algorithm, spec.env_id, kind, budget), **engine.config_fields()}
        if table.get("backend", "auto") == "auto":
            table["backend"] = (
                "ray"
                if table.get("workers") is not None
                else resolve_backend(spec.env_id, "auto", table["num_envs"], None, {})
            )
        update["engine"] = type(engine)(algorithm=engine.algorithm, **table)
        if spec.champion_threshold is None:
            update["champion_threshold"] = kind.reward_threshold
    elif engine.algorithm == "grpo":
        update["engine"] = type(engine).of(engine.config(task=spec.env_id), **_run_fields(engine))
        if spec.champion_threshold is None:
            update["champion_threshold"] = 0.0
    return spec.model_copy(update=update)


def _run_fields(engine: EngineSpec) -> dict[str, Any]:
    """A member's fields that are not its config's (GRPO's updates, workers, backend, eval_every)."""
    names = {field.name for field in dataclasses.fields(engine.config_cls)}
    return {key: value for key, value in engine.model_dump(exclude={"algorithm"}).items() if key not in names}


def engine_preset(algorithm: str, env_id: str, steps: int | None = None) -> dict[str, Any]:
    """The preset as trainer keyword arguments (``num_envs`` included): what ``opentinker train ENV --steps STEPS``
    (and ``PPOTrainer(env_id)``) uses."""
    return preset(algorithm, env_id, problem_kind(env_id), steps)
